"""The one-process exact path: dispatch -> experts -> combine with no plan and no host wait.

On one process with the static policy's plan within the budget (:func:`runs_locally`:
instance = expert, every pair retained and selected, nothing recomputed) the exchange's
plan, layouts and collectives are identities, and all of them are host data read from
the counts. This path does the same work from device tensors alone: a stable sort of
the pairs by expert (the same order ``home_layout`` builds), int32 offsets from the
device counts, the same expert kernels and the same combine, so its results are
bitwise the exchange's. On CUDA with grouped GEMMs nothing in its forward or backward
waits for the host (``tests/test_local_path.py`` runs it on the meta device, where any
host read fails).

Legend: T tokens, K top-k, P = T*K pairs, R = P expert-sorted rows, H hidden, E experts.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import Tensor

from lrmoe.ops.rowops import gather_pairs, gather_pairs_scaled, invert_permutation
from lrmoe.parallel import stages
from lrmoe.parallel.exchange import BackwardOptions, _timed, kept_rows
from lrmoe.parallel.layout import RecvLayout
from lrmoe.traffic import RowBytes


def expert_counts(idx_P: Tensor, E: int) -> Tensor:
    """Pairs per expert ``[E]`` (int64), without the host sync of CUDA's ``bincount``
    (which reads the largest index to size its output)."""
    return torch.zeros(E, dtype=torch.long, device=idx_P.device).scatter_add_(
        0, idx_P, torch.ones_like(idx_P))


def runs_locally(rt, E: int, P: int) -> bool:
    """The rule of the one-process path (an :class:`lrmoe.model.moe.MoERuntime` ``rt``,
    ``E`` experts, ``P`` pairs): one rank, at least one pair, a policy that plans every
    expert's pairs on its own instance exactly (``plans_natives_exactly()``: plain
    static), the selection knobs at their defaults (inert on an exact plan;
    ``router_grad`` is honoured), and no budget or one the ledger says that plan fits.
    Then the plan is the identity, whatever the counts: the same experts, every pair
    retained and selected, nothing recomputed. Over the budget the exchange runs, where
    the policy recomputes or raises, as on any rank count."""
    if not rt.fast_local or rt.comm.size != 1 or P == 0 or not rt.policy.plans_natives_exactly():
        return False
    if dataclasses.replace(rt.backward, router_grad="home") != BackwardOptions():
        return False
    budget = None if rt.ledger is None else rt.ledger.budget_bytes
    return budget is None or one_rank_total(rt.ledger, E, P) <= budget


def one_rank_total(ledger, E: int, P: int) -> int:
    """The ledger's total for the identity plan on one rank: ``E`` instances, ``P``
    pairs received, home and retained, nothing recomputed."""
    return ledger.terms(E, P, P, P, exact=True)["total"]


def local_stats(ledger, E: int, counts_E: Tensor, P: int) -> dict:
    """The plan's stats of the identity plan (as the exchange's ``_plan_stats`` has
    them); ``counts_E`` stays the device tensor (no host sync): readers resolve it
    (:func:`lrmoe.model.moe.host_stats`)."""
    stats = {"plan_replicas": 0, "count_exchange_ms": 0.0, "plan_ms": 0.0,
             "weight_scatter_bytes": 0, "rank_load": [P], "rank_backward_load": [P],
             "recomputed_rows": 0, "layer_checkpoint": False, "counts_E": counts_E}
    if ledger is not None:
        stats["ledger_total_bytes"] = one_rank_total(ledger, E, P)
    return stats


class LocalExperts(torch.autograd.Function):
    """``(x_TH, gate_TK, w13_E, w2_E, idx_TK, counts_E) -> out_TH``: the exchange's
    stages (:mod:`lrmoe.parallel.stages`) for the trivial one-rank plan, over a layout
    built on the device, in the same order (:class:`lrmoe.parallel.exchange.ExpertExchange`).

    Kept for backward: the ``x`` and ``gu`` rows, the expert outputs (not with
    ``router_grad="experts"``), and per pair its gate (4 bytes) and two int64 indices
    (its row, the pair of each row), plus the ``E`` int32 offsets.
    """

    @staticmethod
    def forward(ctx, x_TH: Tensor, gate_TK: Tensor, w13_E: Tensor, w2_E: Tensor, idx_TK: Tensor,
                counts_E: Tensor, opts: BackwardOptions, stats: dict) -> Tensor:
        T, K = gate_TK.shape
        H, P, dev = x_TH.shape[1], gate_TK.numel(), x_TH.device
        tm = _timer(stats, dev)
        # dispatch: pairs sorted by expert, stably (home_layout's order on one rank)
        pair_R = torch.argsort(idx_TK.reshape(-1), stable=True)
        row_P = invert_permutation(pair_R, P)
        offs_E = counts_E.cumsum(0).to(torch.int32)
        rows = {"x": gather_pairs(x_TH, pair_R, K)}
        # the rows per expert stay on the device (offs_E): the grouped GEMMs read them
        # there; the per-expert loop fallback reads them from offs_E when it runs
        y_R = stages.experts_forward(rows, _IDENTITY, w13_E, w2_E, None, _ALL, tm, offs=offs_E)
        comb = stages.combine(y_R, row_P, gate_TK)
        # the exchange's counters, for its one-rank case (the all-to-all bytes are what
        # it counts for identity exchanges)
        b = RowBytes(H * x_TH.element_size())
        stats.update(fwd_rows=P, retained_rows=P, fwd_dispatch_bytes_sent=P * b.row,
                     fwd_dispatch_bytes_recv=P * b.row, fwd_combine_bytes_sent=P * b.row,
                     fwd_combine_bytes_recv=P * b.row,
                     saved_act_bytes=sum(t.numel() * t.element_size() for t in rows.values()))
        ctx.rowdot = opts.router_grad == "experts"
        rows["y_send"] = y_R.new_empty(0, H) if ctx.rowdot else y_R
        del y_R
        # kept rows in a dict (not save_for_backward) so backward drops each at its last
        # use, as the exchange does (Ledger.rows_buffer_bytes)
        ctx.pair_R, ctx.offs_E, ctx.stats = pair_R, offs_E, stats
        if opts.checkpointed:  # through the checkpoint's hooks (BackwardOptions)
            ctx.save_for_backward(w13_E, w2_E, gate_TK, comb.row_TK, rows["x"], rows["gu"],
                                  rows["y_send"])
        else:
            ctx.kept = rows
            ctx.save_for_backward(w13_E, w2_E, gate_TK, comb.row_TK)
        return comb.out_TH

    @staticmethod
    def backward(ctx, dout_TH: Tensor):
        w13_E, w2_E, gate_TK, row_TK, *saved = ctx.saved_tensors
        rows = kept_rows(ctx, saved, "LocalExperts")
        del saved
        pair_R, offs_E, stats = ctx.pair_R, ctx.offs_E, ctx.stats
        T, K = gate_TK.shape
        H, P, dev = dout_TH.shape[1], gate_TK.numel(), dout_TH.device
        tm = _timer(stats, dev)
        dout_TH = dout_TH.to(w13_E.dtype).contiguous()
        es = dout_TH.element_size()
        comb = stages.Combined(None, row_TK, gate_TK)
        # combine^-1: the router gradient from the kept outputs, and each row's output
        # gradient: dout of its token, scaled by its gate
        y_R = rows.pop("y_send")
        dgate = None if ctx.rowdot else stages.router_grad_home(y_R, comb, dout_TH)
        del y_R
        rows["dy"], scale_R = gather_pairs_scaled(dout_TH, pair_R, K, gate_TK.reshape(-1))
        dx_R, dw13, dw2, dot = stages.experts_backward(rows, None, scale_R, _IDENTITY, None, _ALL,
                                                w13_E, w2_E, None, offs_E,
                                                ctx.rowdot, tm)
        if ctx.rowdot:  # <dout[t], y[t,k]> from the expert backward, back to pair order
            dgate = dot[row_TK].to(gate_TK.dtype)
        dx_TH = stages.combine(dx_R, row_TK.reshape(-1), torch.ones(T, K, device=dev)).out_TH
        b = RowBytes(H * es, dot=ctx.rowdot)
        stats.update(bwd_rows=P, selected_rows=P, bwd_dispatch_bytes_sent=P * b.bwd_dispatch,
                     bwd_dispatch_bytes_recv=P * b.bwd_dispatch,
                     bwd_combine_bytes_sent=P * b.bwd_combine,
                     bwd_combine_bytes_recv=P * b.bwd_combine,
                     bwd_exact_bytes=P * (b.row + b.bwd_dispatch),
                     bwd_flops=6 * P * H * w2_E.shape[-1] * 2)
        return dx_TH, dgate, dw13, dw2, None, None, None, None


# one rank's layouts: the rows arrive in instance order, every one is kept
_IDENTITY = RecvLayout([], [], None)
_ALL = stages.Retention(None)


def _timer(stats: dict, dev: torch.device) -> stages.Timer:
    """The stages' ``tm``: only the expert kernels are timed on this path."""
    return lambda key: (_timed(stats, key + "_ms", dev) if key.startswith("expert")
                        else contextlib.nullcontext())
