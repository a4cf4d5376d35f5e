"""Dispatch -> experts -> combine over the EP group as one autograd Function, with an
explicit backward: the stages of :mod:`lrmoe.parallel.stages` with this rank's
collectives between them.

Forward: every pair is computed (the output is exact); activations are saved only for
retained pairs. Backward (LRMoE stages): combine^-1 happens in autograd outside (the
pair output gradient arrives here as ``dy_P``); then **select** (recalibration metric
and per-block backward quota), **compact** (only selected rows and their positions
travel), **experts^-1** over the compacted segments, and the reverse exchange of the
input gradients. Exact plans (select = retain = assign) skip the metric entirely.

Legend: T tokens, K top-k, P = T*K local pairs, H hidden, S local slots, N rows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from lrmoe.ops.experts import offsets
from lrmoe.parallel import stages
from lrmoe.parallel.comm import EPComm
from lrmoe.parallel.layout import HomeLayout, RecvLayout, home_layout, recv_layout, to_device
from lrmoe.parallel.select import BackwardOptions
from lrmoe.policy.plan import Plan
from lrmoe.timing import timed
from lrmoe.traffic import RowBytes


# --------------------------------------------------------------------------- exchange
@dataclass(frozen=True)
class ExchangeState:
    """Everything one layer's exchange keeps from forward to backward (plain Python,
    not autograd): the plan and this rank's home layout of it, built whole before the
    exchange runs (the receive layout is the forward's alone: rebuilt in backward)."""

    comm: EPComm
    plan: Plan
    home: HomeLayout
    top_k: int
    opts: BackwardOptions
    gate_P: Tensor
    stats: dict
    generator: torch.Generator | None = None
    # time the control-plane stages too (``local_ms``, ``select_ms``, ``gather_ms`` in
    # ``stats``): CUDA events around each region, a few microseconds of host time each
    timing: bool = False

    def stage(self, key: str, device: torch.device, on: bool = True):
        """A region of stage ``key`` (``local``, ``select``, ``gather``): timed into
        ``stats[key + "_ms"]`` when :attr:`timing` is on (never around a collective)."""
        if not (on and self.timing):
            return contextlib.nullcontext()
        return _timed(self.stats, key + "_ms", device)

    def timer(self, device: torch.device) -> stages.Timer:
        """The stages' ``tm``: the expert kernels always, the control plane when timing."""
        return lambda key: (_timed(self.stats, key + "_ms", device) if key.startswith("expert")
                            else self.stage(key, device))


def _timed(stats: dict, key: str, device: torch.device):
    """Accumulate a region's expert time in ``stats[key]`` (CUDA: events in ``_events``)."""
    return timed(device, lambda ms: stats.__setitem__(key, stats.get(key, 0.0) + ms),
                 lambda ev_a, ev_b: stats.setdefault("_events", []).append((key, ev_a, ev_b)))


@dataclass(frozen=True)
class ExchangeRun:
    """One layer's exchange on ``plan``: ``(x_TH, gate_TK, idx_TK, w13_S, w2_S, stats)
    -> out_TH``, this rank's layouts built from the plan, then :class:`ExpertExchange`.
    Called in forward, and again in backward under a whole-layer checkpoint
    (:class:`lrmoe.parallel.layer_checkpoint.LayerCheckpoint`)."""

    comm: EPComm
    plan: Plan
    num_experts: int
    top_k: int
    opts: BackwardOptions
    generator: torch.Generator | None
    timing: bool
    dtype: torch.dtype

    def __call__(self, x_TH: Tensor, gate_TK: Tensor, idx_TK: Tensor, w13_S: Tensor,
                 w2_S: Tensor, stats: dict) -> Tensor:
        me, dev = self.comm.rank, x_TH.device
        gate_P = gate_TK.reshape(-1).detach()
        # the layouts' time, as ``local_ms``, when the control plane is timed
        with _timed(stats, "local_ms", dev) if self.timing else contextlib.nullcontext():
            home = home_layout(self.plan, me, idx_TK.reshape(-1), gate_P, self.num_experts)
            recv = recv_layout(self.plan.assign_GGS[:, me, :], dev)
        st = ExchangeState(self.comm, self.plan, home, self.top_k, self.opts, gate_P, stats,
                           self.generator, self.timing)
        return ExpertExchange.apply(x_TH.to(self.dtype), gate_TK, w13_S, w2_S, st, recv)


class ExpertExchange(torch.autograd.Function):
    """``(x_TH, gate_TK, w13_S, w2_S) -> out_TH``: dispatch, experts, combine, composed
    from :mod:`lrmoe.parallel.stages` with this rank's collectives in between.

    The combine (gate-weighted sum over a token's k pairs) is done here, so the pair
    outputs never leave this Function in pair order and no broadcast multiply or atomic
    scatter is needed. The router gradient ``dL/dg[t,k] = <dout[t], y[t,k]>`` is exact
    for every pair given ``dout`` (pairs dropped in the MoE layers above this one change
    ``dout`` itself).
    """

    @staticmethod
    def forward(ctx, x_TH: Tensor, gate_TK: Tensor, w13_S: Tensor, w2_S: Tensor,
                st: ExchangeState, recv: RecvLayout) -> Tensor:
        home, comm, plan = st.home, st.comm, st.plan
        me, K, H = comm.rank, st.top_k, x_TH.shape[1]
        es, tm = x_TH.element_size(), st.timer(x_TH.device)
        counts = stages.occupied_counts(recv.counts, plan, me, w13_S.shape[0])
        # On a fidelity step of an approximate plan every row is kept (a monitoring
        # cost), so the exact gradient over all pairs can be computed beside the
        # selected one.
        keep = stages.retention(plan, me, save_all=st.opts.fidelity and not plan.exact)
        rows: dict[str, Tensor] = {}
        with tm("local"):
            x_send = stages.dispatch_rows(x_TH, home, K)
        n_send = x_send.shape[0]
        rows["x"] = comm.all_to_all(x_send, home.splits, recv.splits)
        del x_send
        n_recv = rows["x"].shape[0]
        y_recv = stages.experts_forward(rows, recv, w13_S, w2_S, counts, keep, tm)
        y_send = comm.all_to_all(y_recv, recv.splits, home.splits)
        del y_recv
        with tm("local"):
            comb = stages.combine(y_send, home.send_row_P, gate_TK)
        row = H * es
        st.stats.update(
            fwd_rows=n_recv, retained_rows=int(keep.saved_SG.sum()),
            fwd_dispatch_bytes_sent=n_send * row, fwd_dispatch_bytes_recv=n_recv * row,
            fwd_combine_bytes_sent=n_recv * row, fwd_combine_bytes_recv=n_send * row,
            saved_act_bytes=sum(t.numel() * t.element_size() for t in rows.values()))
        # Keep for backward only what it reads (Ledger: retained_acts, combine_rows,
        # pair_index): the receive layout, the retained send positions and each send
        # row's block are rebuilt from the plan there.
        ctx.st, ctx.keep = st, keep
        ctx.dgate_at_experts = st.opts.router_grad == "experts" and plan.exact
        rows["y_send"] = y_send.new_empty(0, H) if ctx.dgate_at_experts else y_send
        del y_send
        # The kept rows are the Function's own intermediates (never its inputs or output,
        # so no reference cycle): held in a plain dict rather than save_for_backward,
        # whose tensors live until backward returns, so backward can drop each one at its
        # last use (Ledger.rows_buffer_bytes, docs/design.md §5).
        if st.opts.checkpointed:
            ctx.save_for_backward(w13_S, w2_S, comb.w_TK, comb.row_TK, rows["x"], rows["gu"],
                                  rows["y_send"])
        else:
            ctx.kept = rows
            ctx.save_for_backward(w13_S, w2_S, comb.w_TK, comb.row_TK)
        return comb.out_TH

    @staticmethod
    def backward(ctx, dout_TH: Tensor):
        st: ExchangeState = ctx.st
        w13_S, w2_S, w_TK, row_TK, *saved = ctx.saved_tensors
        rows = kept_rows(ctx, saved, "ExpertExchange")
        del saved
        home, comm, plan, opts, keep = st.home, st.comm, st.plan, st.opts, ctx.keep
        me, dev = comm.rank, dout_TH.device
        T, H = dout_TH.shape
        K = w_TK.shape[1]
        dout_TH = dout_TH.to(w13_S.dtype).contiguous()
        es, tm = dout_TH.element_size(), st.timer(dev)
        comb = stages.Combined(None, row_TK, w_TK)
        # select and compact (global exactness: every rank takes the same collectives;
        # the sampled estimator's count exchange is inside)
        exact = plan.all_selected
        fidelity = opts.fidelity and not plan.exact
        # a fidelity step reads the kept rows twice: the selected backward gets a copy
        kept_all = dict(rows) if fidelity else None
        dgate, sh = stages.home_backward(
            dout_TH, comb, home, st.gate_P, plan.select_GGS[:, me, :], plan.retain_GGS[:, me, :],
            exact, opts, rows, st.generator, comm.exchange_counts, ctx.dgate_at_experts, tm)
        n_out = rows["dy"].shape[0]
        dx_back, dw13, dw2, n_in, dg_back = _experts_backward_exchange(
            comm, plan, me, rows, sh, keep, w13_S, w2_S, tm, rowdot=dgate is None)
        if dgate is None:  # exact: every send row came back, in send order
            dgate = stages.router_grad_experts(dg_back, home, T, K, w_TK.dtype, tm)
        if fidelity:
            _fidelity(st, kept_all, dout_TH, home, w_TK, keep, w13_S, w2_S, dw13, dw2)
        dx_TH = stages.home_finish(dx_back, home, sh, comb, tm)
        b = RowBytes(H * es, dot=dg_back is not None)
        st.stats.update(
            bwd_rows=n_in, selected_rows=int(sh.recv_GS.sum()) if exact or opts.compaction
            else int(plan.select_GGS[:, me, :].sum()),
            bwd_dispatch_bytes_sent=n_out * b.bwd_dispatch,
            bwd_dispatch_bytes_recv=n_in * b.bwd_dispatch,
            bwd_combine_bytes_sent=n_in * b.bwd_combine, bwd_combine_bytes_recv=n_out * b.bwd_combine,
            # what the exact backward would send: every assigned row out and back
            bwd_exact_bytes=int(plan.assign_GGS[me].sum()) * (b.row + b.bwd_dispatch),
            bwd_flops=6 * n_in * H * w2_S.shape[-1] * 2)
        return dx_TH, dgate, dw13, dw2, None, None


def kept_rows(ctx, saved: list[Tensor], name: str) -> dict[str, Tensor]:
    """The rows a forward kept, handed over to its backward: from the dict the Function
    holds (dropped from ``ctx``, so each dies at its last use), or, under an activation
    checkpoint, from ``save_for_backward`` (restored by the checkpoint's re-run)."""
    if saved:
        return dict(zip(("x", "gu", "y_send"), saved))
    if not hasattr(ctx, "kept"):
        raise RuntimeError(f"{name}'s backward frees the rows its forward kept as it goes, "
                           "so it runs once per forward (no retain_graph=True); run the "
                           "forward again for a second backward")
    rows = ctx.kept
    del ctx.kept
    return rows


def _experts_backward_exchange(comm: EPComm, plan: Plan, me: int, rows: dict, sh: stages.Shipped,
                               keep: stages.Retention, w13_S: Tensor, w2_S: Tensor, tm: stages.Timer,
                               rowdot: bool = False):
    """Ship the compacted output-gradient rows, run experts^-1 on them, ship ``dx`` (and,
    with ``rowdot``, each row's router gradient) back: ``(dx rows back at home in send
    order, dw13, dw2, rows in, router gradients back or None)``."""
    dev = rows["dy"].device
    with tm("local"):
        send = sh.sent_GS.sum(1).tolist()
        rl = recv_layout(sh.recv_GS, dev)
        counts = stages.occupied_counts(rl.counts, plan, me, w13_S.shape[0])
        offs = offsets(counts, dev)
    rows["dy"] = comm.all_to_all(rows["dy"].contiguous(), send, rl.splits)
    n_in = rows["dy"].shape[0]
    j_recv = comm.all_to_all(sh.j, send, rl.splits)
    scale_recv = comm.all_to_all(sh.scale.float(), send, rl.splits)
    dx_recv, dw13, dw2, dot_recv = stages.experts_backward(
        rows, j_recv, scale_recv, rl, sh.recv_GS, keep, w13_S, w2_S, counts, offs, rowdot, tm)
    dx_back = comm.all_to_all(dx_recv, rl.splits, send)
    del dx_recv
    dg_back = None if dot_recv is None else comm.all_to_all(dot_recv, rl.splits, send)
    return dx_back, dw13, dw2, n_in, dg_back


def _fidelity(st: ExchangeState, kept: dict, dout_TH: Tensor, home: HomeLayout, w_TK: Tensor,
              keep: stages.Retention, w13_S: Tensor, w2_S: Tensor, dw13: Tensor, dw2: Tensor) -> None:
    """The exact expert weight gradient over every pair (retained or not, unweighted),
    compared per expert with the selected one (replicas on this rank summed, as the
    optimizer sees them): ``fidelity_cosine`` and ``fidelity_rel_err`` in the stats.
    Untimed: a monitoring cost."""
    plan, me, K = st.plan, st.comm.rank, st.top_k
    kept.pop("y_send", None)
    kept["dy"] = dout_TH[home.src_pair // K]
    every = stages.Shipped(None, home.j_in_block, w_TK.reshape(-1)[home.src_pair].float(),
                           plan.assign_GGS[me], plan.assign_GGS[:, me, :])
    _, e13, e2, _, _ = _experts_backward_exchange(st.comm, plan, me, kept, every, keep,
                                                  w13_S, w2_S, stages.untimed)
    ie = plan.inst_expert_GS[me]
    ie = ie if w13_S.shape[0] == ie.numel() else ie[ie >= 0]
    idx = to_device(ie.clamp(min=0), dw13.device)
    E = int(ie.max()) + 1

    def per_expert(g13: Tensor, g2: Tensor) -> Tensor:
        z13 = g13.new_zeros((E,) + g13.shape[1:]).index_add_(0, idx, g13)
        z2 = g2.new_zeros((E,) + g2.shape[1:]).index_add_(0, idx, g2)
        return torch.cat([z13.flatten(), z2.flatten()]).float()
    a, b = per_expert(dw13, dw2), per_expert(e13, e2)
    st.stats["fidelity_cosine"] = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    st.stats["fidelity_rel_err"] = float((a - b).norm() / b.norm().clamp(min=1e-30))
