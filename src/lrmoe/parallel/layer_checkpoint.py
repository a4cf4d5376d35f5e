"""Whole-MoE-layer checkpoint: the exchange run without a graph in forward, run again with
one in backward and back-propagated (docs/design.md §3).

Legend: T tokens, K top-k, H hidden, S local slots.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

# what ``run(x_TH, gate_TK, idx_TK, w13_S, w2_S, stats) -> out_TH`` does: build the
# layouts from the plan and apply the exchange, writing its counters into ``stats``
Run = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, dict], Tensor]
_STAGE_MS = ("local_ms", "select_ms", "gather_ms")  # ExchangeState.stage's counters


class LayerCheckpoint(torch.autograd.Function):
    """``(x_TH, gate_TK, idx_TK, w13_S, w2_S) -> out_TH``: ``run`` without a graph in
    forward; in backward ``run`` again with one, then its backward. ``stats`` keeps the
    first forward's counters and gets the re-run's forward ones with a ``recompute_``
    prefix (:func:`_merge`)."""

    @staticmethod
    def forward(ctx, x_TH: Tensor, gate_TK: Tensor, idx_TK: Tensor, w13_S: Tensor,
                w2_S: Tensor, run: Run, stats: dict) -> Tensor:
        out = run(x_TH, gate_TK, idx_TK, w13_S, w2_S, stats)  # autograd records nothing here
        stats.update(saved_act_bytes=0, layer_checkpoint=True)
        ctx.run, ctx.stats = run, stats
        ctx.save_for_backward(x_TH, gate_TK, idx_TK, w13_S, w2_S)
        return out

    @staticmethod
    def backward(ctx, dout_TH: Tensor):
        x_TH, gate_TK, idx_TK, w13_S, w2_S = ctx.saved_tensors
        need = ctx.needs_input_grad
        ins = [t.detach().requires_grad_(bool(need[i]))
               for i, t in ((0, x_TH), (1, gate_TK), (3, w13_S), (4, w2_S))]
        del x_TH, gate_TK, w13_S, w2_S
        rerun: dict = {}
        with torch.enable_grad():
            out = ctx.run(ins[0], ins[1], idx_TK, ins[2], ins[3], rerun)
        fwd_keys = set(rerun) - {"_events"}
        wanted = [t for t in ins if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, dout_TH) if wanted else ())
        del out
        _merge(ctx.stats, rerun, fwd_keys)
        g = [next(grads) if t.requires_grad else None for t in ins]
        return g[0], g[1], None, g[2], g[3], None, None


def _merge(stats: dict, rerun: dict, fwd_keys: set) -> None:
    """The re-run's counters into the step's: its forward's under a ``recompute_``
    prefix, its backward's as they are; timing events likewise."""
    for k, v in rerun.items():
        if k == "_events":
            stats.setdefault("_events", []).extend(
                (("recompute_" + key if key == "expert_fwd_ms" else key), a, b)
                for key, a, b in v)
        elif k in _STAGE_MS:  # control-plane stage timing: forward and backward add up
            stats[k] = stats.get(k, 0.0) + v
        elif k in fwd_keys:
            stats["recompute_" + k] = v
        else:
            stats[k] = v
