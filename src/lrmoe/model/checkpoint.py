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
with ``recomputing`` set, and their step counts, aux loss, last path and the runtime's
stats are put back as the first forward left them (the re-run still computes the same
tensors, collectives included, so every rank stays in step and autograd's saved
tensors match). Torch's RNG states are restored for the re-run by the checkpoint;
planning is a pure function of the counts and the previous step's popularity, which do
not change between a forward and its backward; the runtime's selection generator is
only drawn from in backward.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
import torch.utils.checkpoint

from lrmoe.errors import LrmoeError

MODES = ("none", "selective", "full")
_ABSENT = object()


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise LrmoeError(f"--activation-checkpoint {mode!r} is not valid; use one of "
                         f"{', '.join(MODES)}")
    return mode


@contextlib.contextmanager
def recomputing(moe_layers: Iterable) -> Iterable:
    """Run a re-run forward of ``moe_layers`` and put their per-step state back after."""
    saved = []
    for m in moe_layers:
        rt = m.runtime
        saved.append((m, m.step_counts_E, m.last_aux_loss, m.last_path,
                      rt.stats.get(m.moe_index, _ABSENT)))
        m.recomputing = True
    try:
        yield
    finally:
        for m, counts, aux, path, stats in saved:
            m.recomputing = False
            m.step_counts_E, m.last_aux_loss, m.last_path = counts, aux, path
            if stats is _ABSENT:
                m.runtime.stats.pop(m.moe_index, None)
            else:
                m.runtime.stats[m.moe_index] = stats


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
