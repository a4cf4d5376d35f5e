"""Activation checkpointing of the transformer blocks (``--activation-checkpoint``).

``none`` keeps what autograd saves; ``selective`` checkpoints each block's attention
sub-block (dense per-token work, no collective to repeat); ``full`` the whole block, the
MoE forward included, whose re-run runs with ``recomputing`` set so its step counts, aux
loss and stats stay the first forward's. Why these modes, and what keeps the re-run
identical: docs/design.md §7, "Activation checkpointing".
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.utils.checkpoint

from lrmoe.errors import LrmoeError

MODES = ("none", "selective", "full")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise LrmoeError(f"--activation-checkpoint {mode!r} is not valid; use one of "
                         f"{', '.join(MODES)}")
    return mode


def checkpoint(fn: Callable, *args, moe_layers: Iterable = ()):
    """``fn(*args)`` under a non-reentrant checkpoint; the re-run in backward runs with
    ``recomputing`` set on ``moe_layers``, so each leaves its step as the first forward
    left it (:meth:`lrmoe.model.moe.MoELayer.forward`). Early stop is off: the re-run runs
    to its end on every rank, so the collectives inside an MoE forward match across ranks."""
    moe_layers = list(moe_layers)
    calls = 0

    def run(*a):
        nonlocal calls
        calls += 1
        if calls == 1 or not moe_layers:
            return fn(*a)
        for m in moe_layers:
            m.recomputing = True
        try:
            return fn(*a)
        finally:
            for m in moe_layers:
                m.recomputing = False

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, early_stop=False)
