"""Activation checkpointing of the transformer blocks (``--activation-checkpoint``).

Modes, as torchtitan offers them, with ``torch.utils.checkpoint`` (non-reentrant):

* ``none``: every block keeps what autograd saves.
* ``selective``: each block's attention sub-block (input norm, q/k/v, rotary, SDPA, output
  projection) is checkpointed; the MoE layer keeps its own activations. Attention is
  per-token dense work that is cheap to re-run and needs no communication, while
  re-running an MoE layer repeats its count exchange, plan and both all-to-alls; the
  MoE layer's own activations are what the memory ledger and the policies already trim
  (retention quotas, per-row recompute). So selective frees the dense activations for
  one attention forward per block, with no extra collective.
* ``full``: the whole block, the MoE layer's forward included (route, count, plan,
  dispatch, experts, combine): backward re-runs it. Its expert rows then go through
  autograd's saved-tensor hooks (``BackwardOptions.checkpointed``), so the checkpoint
  drops them after forward and the re-run restores them.

A re-run forward must not count twice: the MoE layers of the block run their re-run
with ``recomputing`` set, and a layer does not take the step its re-run returns
(:class:`lrmoe.model.moe.MoEStep`): its step counts, aux loss and stats stay the first
forward's (the re-run still computes the same tensors, collectives included, so every
rank stays in step and autograd's saved tensors match). Torch's RNG states are
restored for the re-run by the checkpoint; planning is a pure function of the counts
and the previous step's popularity, which do not change between a forward and its
backward; the runtime's selection generator is only drawn from in backward.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def recomputing(moe_layers: Iterable) -> Iterable:
    """Run a re-run forward of ``moe_layers``: each leaves its step as the first forward
    left it (:meth:`lrmoe.model.moe.MoELayer.forward`)."""
    moe_layers = list(moe_layers)
    for m in moe_layers:
        m.recomputing = True
    try:
        yield
    finally:
        for m in moe_layers:
            m.recomputing = False


def checkpoint(fn: Callable, *args, moe_layers: Iterable = ()):
    """``fn(*args)`` under a non-reentrant checkpoint; the re-run in backward runs under
    :func:`recomputing` for ``moe_layers``. Early stop is off: the re-run runs to its
    end on every rank, so the collectives inside an MoE forward match across ranks."""
    moe_layers = list(moe_layers)
    calls = 0

    def run(*a):
        nonlocal calls
        calls += 1
        if calls == 1 or not moe_layers:
            return fn(*a)
        with recomputing(moe_layers):
            return fn(*a)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, early_stop=False)
