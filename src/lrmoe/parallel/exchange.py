"""Dispatch -> experts -> combine over the EP group as one autograd Function, with an
explicit backward (select, compact, experts^-1: docs/design.md §2): the stages of
:mod:`lrmoe.parallel.stages`, with the exchanges between them.

The stage sequence is written once, :func:`forward_ranks` and :func:`backward_ranks`,
and so is its autograd Function, :class:`ExpertExchange`: each stage runs for every rank
a process plays, and a :class:`Transport` carries the rows between stages and counts
them. A real rank plays itself over the group's collectives (:class:`GroupTransport`,
:func:`run_exchange`); one process plays its one rank for the identity plan, its layouts
built on the device, with no collectives and no host wait (:func:`run_local`,
docs/design.md §2: bitwise the general path); the emulator plays all G ranks in memory,
each timed on its own (:mod:`lrmoe.sim.virtual`).

Legend: T tokens, K top-k, P = T*K local pairs, H hidden, E experts, S local slots, N rows;
``_G``: a list over the ranks the process plays (one on a real rank).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch
from torch import Tensor

from lrmoe.ops.experts import offsets
from lrmoe.ops.rowops import invert_permutation, to_device
from lrmoe.parallel import stages
from lrmoe.parallel.comm import EPComm
from lrmoe.parallel.options import BackwardOptions
from lrmoe.policy.plan import Plan
from lrmoe.timing import timed
from lrmoe.traffic import RowBytes


# -------------------------------------------------------------------------- transport
class Transport(Protocol):
    """How the rows of the ranks one process plays travel between the stages.
    ``all_to_all`` turns each played rank's send buffer (``send_splits[r]`` rows for rank
    r) into its receive buffer (``recv_splits[r]`` rows from rank r, in rank order);
    ``timer(i)`` is the stages' ``tm`` of the i-th played rank; ``received`` gives the
    rows each receives per (source, slot) block in the backward; ``traffic`` counts the
    rows and bytes of one exchange (``fwd_dispatch``, ...), ``rows`` each played rank's
    rows of one stage (``fwd``, ``retained``, ``bwd``, ``selected``)."""

    ranks: Sequence[int]  # the plan's ranks this process plays
    # the sampled estimator's count exchange, inside a home rank's select; ``None``: the
    # receivers' counts are read off every home's (``received``)
    exchange_counts: Callable[[Tensor], Tensor] | None

    def all_to_all(self, send_G: list[Tensor], send_splits_G: list[list[int]],
                   recv_splits_G: list[list[int]]) -> list[Tensor]: ...

    def timer(self, i: int) -> stages.Timer: ...

    def received(self, sh_G: list[stages.Shipped]) -> list[Tensor]: ...

    def traffic(self, name: str, send_splits_G: list[list[int]],
                recv_splits_G: list[list[int]], row_bytes: int) -> None: ...

    def rows(self, name: str, n_G: list[int]) -> None: ...

    def forward_done(self, kept_G: list[int]) -> None:
        """The forward's end: the activation bytes each played rank keeps for backward."""

    def backward_done(self, st: ExchangeState, dout_G: list[Tensor]) -> None:
        """The backward's end, its gradients formed (``dout_G``: each played rank's)."""


class GroupTransport:
    """This rank alone, over the EP group's collectives: counters into ``stats``, the
    expert kernels timed always, the control plane (``local``, ``select``, ``gather``)
    when ``timing`` (CUDA events around each region, a few microseconds of host time)."""

    def __init__(self, comm: EPComm, stats: dict, device: torch.device, timing: bool = False):
        self.comm, self.stats, self.device, self.timing = comm, stats, device, timing
        self.ranks, self.exchange_counts = [comm.rank], comm.exchange_counts

    def all_to_all(self, send_G, send_splits_G, recv_splits_G) -> list[Tensor]:
        return [self.comm.all_to_all(send_G[0], send_splits_G[0], recv_splits_G[0])]

    def timer(self, i: int) -> stages.Timer:
        return lambda key: (_timed(self.stats, key + "_ms", self.device)
                            if self.timing or key.startswith("expert")
                            else contextlib.nullcontext())

    def received(self, sh_G: list[stages.Shipped]) -> list[Tensor]:
        return [sh.recv_GS for sh in sh_G]

    def traffic(self, name, send_splits_G, recv_splits_G, row_bytes) -> None:
        self.stats[name + "_bytes_sent"] = sum(send_splits_G[0]) * row_bytes
        self.stats[name + "_bytes_recv"] = sum(recv_splits_G[0]) * row_bytes

    def rows(self, name: str, n_G: list[int]) -> None:
        self.stats[name + "_rows"] = n_G[0]

    def forward_done(self, kept_G: list[int]) -> None:
        self.stats["saved_act_bytes"] = kept_G[0]

    def backward_done(self, st: ExchangeState, dout_G: list[Tensor]) -> None:
        H, elt = dout_G[0].shape[1], dout_G[0].element_size()
        b = RowBytes(H * elt, dot=st.at_experts)
        # what the exact backward would send: every assigned row out and back
        self.stats["bwd_exact_bytes"] = int(st.plan.assign_GGS[self.comm.rank].sum()) * (
            b.row + b.bwd_dispatch)


def _timed(stats: dict, key: str, device: torch.device):
    """Accumulate a region's time in ``stats[key]`` (CUDA: events in ``_events``)."""
    return timed(device, lambda ms: stats.__setitem__(key, stats.get(key, 0.0) + ms),
                 lambda ev_a, ev_b: stats.setdefault("_events", []).append((key, ev_a, ev_b)))


# ------------------------------------------------------------------ the stage sequence
@dataclass(frozen=True)
class ExchangeState:
    """Everything one layer's exchange keeps from forward to backward (plain Python,
    not autograd), for the ranks its process plays: the plan, each one's home layout
    (built whole before the exchange runs; the receive layouts are the forward's alone:
    rebuilt in backward), gates (read by selection alone) and sampling generator, and the
    transport. ``offs``: the receiver's rows per expert as device offsets, in place of
    the plan's host counts (the one-process path, whose ``plan`` is
    :class:`OneBlock`). ``num_experts``: what a whole-layer checkpoint's re-run in
    backward builds the layouts again with (``Plan.layer_checkpoint``)."""

    tp: Transport
    plan: Plan
    homes: list[stages.HomeLayout]
    top_k: int
    opts: BackwardOptions
    gate_P_G: list[Tensor | None]
    generators: list[torch.Generator | None]
    offs: Tensor | None = None
    num_experts: int = 0

    @property
    def at_experts(self) -> bool:
        """The expert backward computes the router gradient (``router_grad="experts"``
        on an exact plan), so the combined rows are not kept."""
        return self.opts.router_grad == "experts" and self.plan.exact

    def weight_counts(self, counts_S: list[int], keep: stages.Retention, n_weights: int) -> list[int] | None:
        """Rows per weighted instance for the grouped GEMMs (host), or ``None`` where
        :attr:`offs` holds them on the device."""
        return None if self.offs is not None else keep.weighted(counts_S, n_weights)


def forward_ranks(st: ExchangeState, recvs: list[stages.RecvLayout], x_G: Sequence[Tensor],
                  gate_G: Sequence[Tensor], w13_G: Sequence[Tensor], w2_G: Sequence[Tensor],
                  keep_G: list[stages.Retention], rerun: bool = False
                  ) -> tuple[list[stages.Combined], list[dict]]:
    """Dispatch -> experts -> combine for every played rank: each one's combine (its
    output) and the rows it keeps for backward: ``x``, ``gu`` (its receiver's) and
    ``y_send`` (the combined rows home, empty when :attr:`ExchangeState.at_experts`).
    ``rerun``: a whole-layer checkpoint's forward again in backward, counted as
    ``recompute_dispatch``, ``recompute_combine`` and ``expert_recompute``."""
    tp, K = st.tp, st.top_k
    disp, comb, expert = (("recompute_dispatch", "recompute_combine", "expert_recompute")
                          if rerun else ("fwd_dispatch", "fwd_combine", "expert_fwd"))
    x_send_G = []
    for i, home in enumerate(st.homes):
        with tp.timer(i)("local"):
            x_send_G.append(stages.dispatch_rows(x_G[i], home, K))
    home_splits, recv_splits = [h.splits for h in st.homes], [r.splits for r in recvs]
    rows_G = [{"x": x} for x in tp.all_to_all(x_send_G, home_splits, recv_splits)]
    del x_send_G
    y_recv_G = [stages.experts_forward(
        rows_G[i], recvs[i], w13_G[i], w2_G[i], st.weight_counts(recvs[i].counts, keep, w13_G[i].shape[0]),
        keep, tp.timer(i), expert, st.offs) for i, keep in enumerate(keep_G)]
    y_send_G = tp.all_to_all(y_recv_G, recv_splits, home_splits)
    del y_recv_G
    comb_G = []
    for i, home in enumerate(st.homes):
        with tp.timer(i)("local"):
            comb_G.append(stages.combine(y_send_G[i], home.send_row_P, gate_G[i]))
    row = x_G[0].shape[1] * x_G[0].element_size()
    tp.traffic(disp, home_splits, recv_splits, row)
    tp.traffic(comb, recv_splits, home_splits, row)
    tp.rows("fwd", [sum(s) for s in recv_splits])
    tp.rows("retained", [int(keep.saved_SG.sum()) for keep in keep_G])
    for rows, y_send in zip(rows_G, y_send_G):
        rows["y_send"] = y_send.new_empty(0, y_send.shape[1]) if st.at_experts else y_send
    return comb_G, rows_G


def kept_bytes(rows: dict[str, Tensor]) -> int:
    """Bytes of the activations a receiver keeps for backward (``x``, ``gu``)."""
    return sum(t.numel() * t.element_size() for k, t in rows.items() if k != "y_send")


def backward_ranks(st: ExchangeState, dout_G: list[Tensor], comb_G: list[stages.Combined],
                   rows_G: list[dict], keep_G: list[stages.Retention],
                   w13_G: Sequence[Tensor], w2_G: Sequence[Tensor]
                   ) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    """combine^-1, select, compact -> exchange -> experts^-1 -> exchange -> the input
    gradients home, for every played rank: the gradients of ``x``, the gates and the
    instance weights, ``(dx_G, dgate_G, dw13_G, dw2_G)``. ``rows_G``: each one's kept
    rows, emptied as they are used (global exactness: every rank takes the same
    collectives; the sampled estimator's count exchange is inside the select)."""
    tp, plan = st.tp, st.plan
    dgate_G, sh_G = map(list, zip(*[stages.home_backward(
        dout_G[i], comb_G[i], st.homes[i], st.gate_P_G[i], plan.select_GGS[:, g, :],
        plan.retain_GGS[:, g, :], plan.all_selected, st.opts, rows_G[i], st.generators[i],
        tp.exchange_counts, st.at_experts, tp.timer(i)) for i, g in enumerate(tp.ranks)]))
    recv_GS_G = tp.received(sh_G)
    n_recv_G = [int(r.sum()) for r in recv_GS_G]
    tp.rows("bwd", n_recv_G)
    # without compaction the unselected rows travel too, weighing 0
    tp.rows("selected", [n if plan.all_selected or st.opts.compaction
                         else int(plan.select_GGS[:, g, :].sum())
                         for g, n in zip(tp.ranks, n_recv_G)])
    dx_back_G, dw13_G, dw2_G, dg_back_G = _experts_backward_exchange(
        st, rows_G, sh_G, recv_GS_G, keep_G, w13_G, w2_G, st.at_experts)
    if st.at_experts:  # every send row came back, in send order
        dgate_G = [stages.router_grad_experts(dg_back_G[i], st.homes[i], comb_G[i], tp.timer(i))
                   for i in range(len(sh_G))]
    dx_G = [stages.home_finish(dx_back_G[i], st.homes[i], sh_G[i], comb_G[i], tp.timer(i))
            for i in range(len(sh_G))]
    return dx_G, dgate_G, dw13_G, dw2_G


def _experts_backward_exchange(st: ExchangeState, rows_G: list[dict], sh_G: list[stages.Shipped],
                               recv_GS_G: list[Tensor], keep_G: list[stages.Retention],
                               w13_G, w2_G, rowdot: bool, monitor: bool = False):
    """Ship the compacted output-gradient rows (``rows["dy"]``), run experts^-1 on them,
    ship ``dx`` (and, with ``rowdot``, each row's router gradient) back: ``(dx rows back
    home in send order, dw13, dw2, router gradients back or None)``, per played rank.
    ``monitor``: the fidelity monitor's extra backward, neither timed nor counted."""
    tp, dev = st.tp, rows_G[0]["dy"].device
    tm_G = [stages.untimed if monitor else tp.timer(i) for i in range(len(rows_G))]
    send_G = [sh.sent_GS.sum(1).tolist() for sh in sh_G]
    rls, counts_G, offs_G = [], [], []
    for i, keep in enumerate(keep_G):
        with tm_G[i]("local"):
            rls.append(stages.recv_layout(recv_GS_G[i], dev))
            counts_G.append(st.weight_counts(rls[i].counts, keep, w13_G[i].shape[0]))
            offs_G.append(offsets(counts_G[i], dev) if st.offs is None else st.offs)
    splits_G = [rl.splits for rl in rls]
    if not monitor:
        b = RowBytes(rows_G[0]["dy"].shape[1] * rows_G[0]["dy"].element_size(), dot=rowdot)
        tp.traffic("bwd_dispatch", send_G, splits_G, b.bwd_dispatch)
        tp.traffic("bwd_combine", splits_G, send_G, b.bwd_combine)
    for rows, dy in zip(rows_G, tp.all_to_all([r.pop("dy").contiguous() for r in rows_G],
                                              send_G, splits_G)):
        rows["dy"] = dy
    del dy
    j_G = tp.all_to_all([sh.j for sh in sh_G], send_G, splits_G)
    scale_G = tp.all_to_all([sh.scale.float() for sh in sh_G], send_G, splits_G)
    dx_recv_G, dw13_G, dw2_G, dot_G = map(list, zip(*[stages.experts_backward(
        rows_G[i], j_G[i], scale_G[i], rls[i], recv_GS_G[i], keep_G[i], w13_G[i], w2_G[i],
        counts_G[i], offs_G[i], rowdot, tm_G[i]) for i in range(len(rows_G))]))
    dx_back_G = tp.all_to_all(dx_recv_G, splits_G, send_G)
    del dx_recv_G
    dg_back_G = tp.all_to_all(dot_G, splits_G, send_G) if rowdot else None
    return dx_back_G, dw13_G, dw2_G, dg_back_G


# ------------------------------------------------------------------ the autograd Function
def layouts(tp: Transport, plan: Plan, idx_P_G: Sequence[Tensor], gate_P_G: Sequence[Tensor],
            num_experts: int, dev: torch.device
            ) -> tuple[list[stages.HomeLayout], list[stages.RecvLayout]]:
    """Each played rank's home and receive layout of ``plan``, timed as its ``local``."""
    homes, recvs = [], []
    for i, g in enumerate(tp.ranks):
        with tp.timer(i)("local"):
            homes.append(stages.home_layout(plan, g, idx_P_G[i], gate_P_G[i], num_experts))
            recvs.append(stages.recv_layout(plan.assign_GGS[:, g, :], dev))
    return homes, recvs


def run_exchange(comm: EPComm, plan: Plan, num_experts: int, top_k: int, opts: BackwardOptions,
                 generator: torch.Generator | None, timing: bool, x_TH: Tensor, gate_TK: Tensor,
                 idx_TK: Tensor, w13_S: Tensor, w2_S: Tensor, stats: dict) -> Tensor:
    """One layer's exchange on ``plan``, ``out_TH`` (``x_TH`` in the compute dtype): this
    rank's layouts built from the plan, then :class:`ExpertExchange` (which, under a
    whole-layer checkpoint, builds them again in backward)."""
    gate_P = gate_TK.reshape(-1).detach()
    tp = GroupTransport(comm, stats, x_TH.device, timing)
    # the layouts' time, when the control plane is timed
    homes, recvs = layouts(tp, plan, [idx_TK.reshape(-1)], [gate_P], num_experts, x_TH.device)
    st = ExchangeState(tp, plan, homes, top_k, opts, [gate_P], [generator], num_experts=num_experts)
    # On a fidelity step of an approximate plan every row is kept (a monitoring
    # cost), so the exact gradient over all pairs can be computed beside the
    # selected one.
    keep = stages.retention(plan, comm.rank, save_all=opts.fidelity and not plan.exact)
    return ExpertExchange.apply(x_TH, gate_TK, w13_S, w2_S, st, recvs, [keep], idx_TK)


class ExpertExchange(torch.autograd.Function):
    """``(x, gate, w13, w2) -> out``: :func:`forward_ranks` and :func:`backward_ranks`
    over the ranks its transport (``st.tp``) plays, keeping ``keep_G``'s rows. ``x``,
    ``gate`` and ``out`` hold the played ranks' tokens one rank after the other, ``w13``
    and ``w2`` their slots' instance weights likewise (one rank: its own). Under a
    whole-layer checkpoint (``Plan.layer_checkpoint``, docs/design.md §5) it keeps
    nothing of the exchange but its inputs and the tokens' expert ids ``idx``: backward
    builds the layouts and runs the forward again first, its output kept until the
    backward ends (as :meth:`lrmoe.ledger.Ledger.layer_checkpoint_buffer_bytes` prices).

    The combine (gate-weighted sum over a token's k pairs) is done here, so the pair
    outputs never leave this Function in pair order and no broadcast multiply or atomic
    scatter is needed. The router gradient ``dL/dg[t,k] = <dout[t], y[t,k]>`` is exact
    for every pair given ``dout`` (pairs dropped in the MoE layers above this one change
    ``dout`` itself).
    """

    @staticmethod
    def forward(ctx, x: Tensor, gate: Tensor, w13: Tensor, w2: Tensor, st: ExchangeState,
                recvs: list[stages.RecvLayout], keep_G: list[stages.Retention],
                idx: Tensor | None = None) -> Tensor:
        n = len(keep_G)
        comb_G, rows_G = forward_ranks(st, recvs, _split(x, n), _split(gate, n),
                                       _split(w13, n), _split(w2, n), keep_G)
        layer_checkpoint = st.plan.layer_checkpoint
        st.tp.forward_done([0] * n if layer_checkpoint else [kept_bytes(r) for r in rows_G])
        out = _joined([comb.out_TH for comb in comb_G])
        # Keep for backward only what it reads (Ledger: retained_acts, combine_rows,
        # pair_index): the receive layout, the retained send positions and each send
        # row's block are rebuilt from the plan there.
        ctx.st, ctx.keep_G = st, keep_G
        combs = [t for comb in comb_G for t in (comb.w_TK, comb.row_TK)]
        del comb_G
        # The kept rows are the Function's own intermediates (never its inputs or output,
        # so no reference cycle): a plain list rather than save_for_backward, whose tensors
        # live until backward returns (kept_rows; Ledger.rows_buffer_bytes, docs/design.md §5).
        if layer_checkpoint:  # nothing of the exchange is kept: backward re-runs it
            ctx.st = dataclasses.replace(st, homes=[])  # the layouts too: built again there
            ctx.save_for_backward(w13, w2, x, gate, idx)
        elif st.opts.checkpointed:
            ctx.save_for_backward(w13, w2, *combs,
                                  *[rows[k] for rows in rows_G for k in ("x", "gu", "y_send")])
        else:
            ctx.kept = rows_G
            ctx.save_for_backward(w13, w2, *combs)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        st: ExchangeState = ctx.st
        keep_G, n = ctx.keep_G, len(ctx.keep_G)
        w13, w2, *saved = ctx.saved_tensors
        w13_G, w2_G = _split(w13, n), _split(w2, n)
        if st.plan.layer_checkpoint:  # the forward again (its layouts too), measured in backward
            x, gate, idx = saved
            del saved
            homes, recvs = layouts(st.tp, st.plan, idx.reshape(n, -1), st.gate_P_G, st.num_experts,
                                   dout.device)
            st = dataclasses.replace(st, homes=homes)
            comb_G, rows_G = forward_ranks(st, recvs, _split(x, n), _split(gate, n),
                                           w13_G, w2_G, keep_G, rerun=True)
            del x, gate, idx
        else:
            comb_G = [stages.Combined(None, row_TK, w_TK)
                      for w_TK, row_TK in zip(saved[0:2 * n:2], saved[1:2 * n:2])]
            rows_G = kept_rows(ctx, saved[2 * n:])
            del saved
        dout_G = [d.to(w13.dtype).contiguous() for d in _split(dout, n)]
        fidelity = st.opts.fidelity and not st.plan.exact
        # a fidelity step reads the kept rows twice: the selected backward gets a copy
        kept_all = dict(rows_G[0]) if fidelity else None
        grads_G = backward_ranks(st, dout_G, comb_G, rows_G, keep_G, w13_G, w2_G)
        if fidelity:
            _fidelity(st, kept_all, dout_G[0], comb_G[0].w_TK, keep_G[0], w13, w2,
                      grads_G[2][0], grads_G[3][0])
        # the played ranks' gradients, one after the other (emulator work: inside the MoE
        # wall, so bench ttl does not charge it as non-MoE time)
        dx, dgate, dw13, dw2 = (_joined(g) for g in grads_G)
        st.tp.backward_done(st, dout_G)
        return dx, dgate, dw13, dw2, None, None, None, None


def _split(t: Tensor, n: int) -> list[Tensor]:
    """``t``'s rows per played rank (one rank: ``t`` itself, no view op on its hot path)."""
    return [t] if n == 1 else list(t.tensor_split(n))


def _joined(t_G: list[Tensor]) -> Tensor:
    """The played ranks' tensors one after the other (one rank: its own, not a copy)."""
    return t_G[0] if len(t_G) == 1 else torch.cat(t_G)


def kept_rows(ctx, saved: list[Tensor]) -> list[dict[str, Tensor]]:
    """The rows a forward kept, per played rank, handed over to its backward: from the
    list the Function holds (dropped from ``ctx``, so each dies at its last use), or,
    under an activation checkpoint, from ``save_for_backward`` (restored by the
    checkpoint's re-run)."""
    if saved:
        return [dict(zip(("x", "gu", "y_send"), saved[i:i + 3])) for i in range(0, len(saved), 3)]
    if not hasattr(ctx, "kept"):
        raise RuntimeError("ExpertExchange's backward frees the rows its forward kept as it goes, "
                           "so it runs once per forward (no retain_graph=True); run the "
                           "forward again for a second backward")
    rows_G = ctx.kept
    del ctx.kept
    return rows_G


def _fidelity(st: ExchangeState, kept: dict, dout_TH: Tensor, w_TK: Tensor,
              keep: stages.Retention, w13_S: Tensor, w2_S: Tensor, dw13: Tensor, dw2: Tensor) -> None:
    """The exact expert weight gradient over every pair (retained or not, unweighted),
    compared per expert with the selected one (replicas on this rank summed, as the
    optimizer sees them): ``fidelity_cosine`` and ``fidelity_rel_err`` in the stats.
    Untimed: a monitoring cost."""
    plan, me, K, home = st.plan, st.tp.ranks[0], st.top_k, st.homes[0]
    kept.pop("y_send", None)
    kept["dy"] = dout_TH[home.src_pair // K]
    every = stages.Shipped(None, home.j_in_block, w_TK.reshape(-1)[home.src_pair].float(),
                           plan.assign_GGS[me], plan.assign_GGS[:, me, :])
    _, (e13,), (e2,), _ = _experts_backward_exchange(st, [kept], [every], [every.recv_GS], [keep],
                                                     [w13_S], [w2_S], rowdot=False, monitor=True)
    ie = plan.inst_expert_GS[me]
    ie = ie if w13_S.shape[0] == ie.numel() else ie[ie >= 0]
    idx = to_device(ie.clamp(min=0), dw13.device)
    E = int(ie.max()) + 1

    def per_expert(g13: Tensor, g2: Tensor) -> Tensor:
        sums = [g.new_zeros((E,) + g.shape[1:]).index_add_(0, idx, g) for g in (g13, g2)]
        return torch.cat([z.flatten() for z in sums]).float()
    a, b = per_expert(dw13, dw2), per_expert(e13, e2)
    st.tp.stats["fidelity_cosine"] = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    st.tp.stats["fidelity_rel_err"] = float((a - b).norm() / b.norm().clamp(min=1e-30))


# ------------------------------------------------------------------- one process
@dataclass(frozen=True)
class OneBlock:
    """The plan as the one-process path's stage sequence reads it: one rank, one slot
    (the ``E`` experts' grouped weights, cut per expert on the device by
    ``ExchangeState.offs``) receiving all ``P`` pairs from itself, every one retained and
    selected: the :class:`~lrmoe.policy.plan.Plan` attributes an exact one-rank exchange
    reads, in numpy rather than torch, so no op touches them."""

    P: int
    exact = all_selected = True
    layer_checkpoint = False
    recompute_G = None

    @property
    def assign_GGS(self) -> np.ndarray:
        return np.full((1, 1, 1), self.P)

    retain_GGS = select_GGS = assign_GGS


def run_local(x_TH: Tensor, gate_TK: Tensor, w13_E: Tensor, w2_E: Tensor, idx_TK: Tensor,
              counts_E: Tensor, opts: BackwardOptions, stats: dict) -> Tensor:
    """``out_TH``: :class:`ExpertExchange` on one process for the identity plan, its
    layouts built on the device. Kept for backward: the exchange's rows, per pair two
    int64 indices (its row, the pair of each row; no row-in-block: only selection reads
    it) and the ``E`` int32 offsets."""
    T, K = gate_TK.shape
    P = T * K
    # dispatch order: the pairs sorted by expert, stably (home_layout's order on one rank)
    pair_R = torch.argsort(idx_TK.reshape(-1), stable=True)
    one = np.array([P])
    home = stages.HomeLayout(invert_permutation(pair_R, P), False, pair_R, None, one, one, one, [P])
    # the one-process group: no collectives, every buffer stays where it is. The rows
    # per expert stay on the device: the grouped GEMMs read them there; the per-expert
    # loop fallback reads them from the offsets where it runs
    st = ExchangeState(GroupTransport(EPComm(), stats, x_TH.device), OneBlock(P), [home], K, opts,
                       [None], [None], offs=counts_E.cumsum(0).to(torch.int32))
    return ExpertExchange.apply(x_TH, gate_TK, w13_E, w2_E, st, [stages.RecvLayout([P], [P], None)],
                                [stages.Retention(one)])
