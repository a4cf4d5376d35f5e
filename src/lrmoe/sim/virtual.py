"""Virtual EP: one MoE layer's expert-parallel step for G virtual ranks in one process.

docs/design.md §9 ("Cluster time without a cluster"). The emulator runs the same plan code
(the policy objects) and the same building blocks as the real runtime
(:mod:`lrmoe.parallel.exchange`): ``home_layout``/``recv_layout``, permute/unpermute,
``swiglu_forward``/``swiglu_backward``, the metrics and selection functions, the fused
combine helpers. Only the orchestration differs: instead of one rank calling a
collective, every stage is run for all G virtual ranks in turn, and each all-to-all is
an in-memory regrouping of the G send buffers by their splits. So each virtual rank sees
exactly the rows (and computes exactly the numbers) its real counterpart would, and the
bytes of every exchange are known exactly.

Virtual rank g's tokens are rows ``[g*T, (g+1)*T)`` of the global token matrix.
Expert kernels are timed per virtual rank (CUDA events on GPU, ``perf_counter`` on CPU);
link time is modelled from bytes (:mod:`lrmoe.sim.links`, :mod:`lrmoe.sim.cost`). The
results are **emulated**, never measured cluster time.

Legend: G virtual ranks, T tokens per rank, K top-k, H hidden, S slots per rank,
E experts, P = T*K pairs of one rank. ``_G`` suffix: a Python list over virtual ranks.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from lrmoe.errors import OutOfMemory
from lrmoe.model.moe import MoELayer
from lrmoe.model.router import aux_loss
from lrmoe.ops.experts import offsets, swiglu_backward, swiglu_forward
from lrmoe.ops.fused import fused, weighted_gather_sum
from lrmoe.parallel.exchange import (
    BackwardOptions,
    pair_rows,
    router_grad_home,
    select_and_compact,
)
from lrmoe.parallel.layout import (
    HomeLayout,
    RecvLayout,
    excl_cumsum,
    home_layout,
    permute_rows,
    ranges,
    recv_layout,
    to_device,
    unpermute_rows,
)
from lrmoe.parallel.weights import InstanceRoute
from lrmoe.policy.base import PlanInputs, Policy, prepare
from lrmoe.policy.ledger_view import plan_exact_fit, plan_totals
from lrmoe.policy.plan import Plan
from lrmoe.sim.vstats import EXCHANGES as EXCHANGES  # re-exported
from lrmoe.sim.vstats import MEASURED_STAGES, Timers, VirtualStats


# ------------------------------------------------------------------------ all-to-all
def virtual_all_to_all(send_G: list[Tensor], splits_G: list[list[int]]) -> list[Tensor]:
    """In-memory ``all_to_all_single`` over G virtual ranks.

    ``send_G[g]`` is rank g's send buffer, ``splits_G[g][r]`` its rows for rank r.
    Returns each rank's receive buffer: the rows from rank 0, then rank 1, ... (the
    order ``dist.all_to_all_single`` gives).
    """
    G = len(send_G)
    chunks = [list(torch.split(send_G[g], splits_G[g])) for g in range(G)]
    out = []
    for r in range(G):
        parts = [chunks[g][r] for g in range(G)]
        out.append(torch.cat(parts) if len(parts) > 1 else parts[0].clone())
    return out


def _links(send_G: list[Tensor], splits_G: list[list[int]]) -> list[Tensor]:
    """:func:`virtual_all_to_all` inside a ``stage:link`` profiler range: its time is the
    emulator's stand-in for a link, charged by the link model, never measured."""
    with torch.profiler.record_function("stage:link"):
        return virtual_all_to_all(send_G, splits_G)


def _rows_GG(splits_G: list[list[int]]) -> Tensor:
    """``[src, dst]`` rows of one exchange (int64, CPU)."""
    return torch.tensor(splits_G, dtype=torch.long).reshape(len(splits_G), -1)


@dataclass
class _State:
    """Plain-Python state of one emulated step (shared by forward and backward)."""

    plan: Plan
    homes: list[HomeLayout]
    recvs: list[RecvLayout]
    gate_P_G: list[Tensor]
    T: int
    K: int
    opts: BackwardOptions
    timers: Timers
    stats: VirtualStats
    generators: list[torch.Generator | None]
    # the expert ids of each rank's pairs and E: a whole-layer checkpoint's re-run
    # rebuilds the layouts from them
    idx_GP: Tensor | None = None
    E: int = 0


# ------------------------------------------------------------------------- exchange
class VirtualExchange(torch.autograd.Function):
    """``(x [G*T, H], gate [G*T, K], w13 [G*S, 2F, H], w2 [G*S, H, F]) -> out [G*T, H]``.

    Each rank's slice of the weights is its slots' instance weights. Forward and
    backward follow :class:`lrmoe.parallel.exchange.ExpertExchange` stage by stage for
    every virtual rank; see the module doc.
    """

    @staticmethod
    def forward(ctx, x_NH: Tensor, gate_NK: Tensor, w13_IS: Tensor, w2_IS: Tensor,
                st: _State) -> Tensor:
        plan, G, H = st.plan, st.plan.G, x_NH.shape[1]
        out, kept = _forward_ranks(st, x_NH, gate_NK, w13_IS, w2_IS, recompute=False)
        st.stats.rows["fwd"] = plan.rank_load().tolist()
        st.stats.rows["retained"] = plan.retain_GGS.sum(dim=(0, 2)).tolist()
        rec_G = [0] * G if plan.recompute_G is None else plan.recompute_G.tolist()
        st.stats.saved_act_bytes = [0] * G if plan.layer_checkpoint else [
            sx.numel() * sx.element_size() + (sgu.shape[0] - n) * sgu.shape[1] * sgu.element_size()
            for (sx, sgu, _), n in zip(kept["saved"], rec_G)]
        st.timers.resolve()
        st.stats.expert_ms["fwd"] = st.timers.ms.get("expert_fwd", [0.0] * G)
        # router_grad "experts" on an exact plan: the router gradient comes from the expert
        # backward, so the combined rows are not kept (as ExpertExchange)
        ctx.dgate_at_experts = st.opts.router_grad == "experts" and plan.exact
        ctx.st = st
        if plan.layer_checkpoint:  # nothing of the exchange is kept: backward re-runs it
            ctx.save_for_backward(w13_IS, w2_IS, x_NH, gate_NK)
        else:
            _keep(ctx, kept, H)
            ctx.save_for_backward(w13_IS, w2_IS)
        return out

    @staticmethod
    def backward(ctx, dout_NH: Tensor):
        st: _State = ctx.st
        w13_IS, w2_IS, *inputs = ctx.saved_tensors
        plan, opts, T, K = st.plan, st.opts, st.T, st.K
        G, S = plan.G, plan.S
        dev, H = dout_NH.device, dout_NH.shape[1]
        if inputs:  # whole-layer checkpoint: the forward again, measured in backward
            _keep(ctx, _forward_ranks(st, *inputs, w13_IS, w2_IS, recompute=True)[1], H)
            del inputs
        dout_G = [d.to(ctx.y_send_G[0].dtype).contiguous() for d in dout_NH.split(T)]
        es = dout_G[0].element_size()
        w13_G, w2_G = w13_IS.split(S), w2_IS.split(S)
        exact = torch.equal(plan.select_GGS, plan.retain_GGS)

        # --- per home rank: combine^-1, select, compact (ExpertExchange.backward)
        dgate_G, rows_G, j_G, scale_G, sent_G, sel_pos_G, keep_G = [], [], [], [], [], [], []
        for g in range(G):
            home, y_send, w_TK, row_TK = st.homes[g], ctx.y_send_G[g], ctx.w_TK_G[g], ctx.rows_TK_G[g]
            dout = dout_G[g]
            with st.timers.time("local", g):
                dgate_G.append(router_grad_home(y_send, row_TK, w_TK, dout, home,
                                                ctx.dgate_at_experts))
            with st.timers.time("select", g):
                ret_pos = home.retained_positions(dev)
                pairs = home.src_pair if ret_pos is None else home.src_pair[ret_pos]
                tok_c, g_c = pairs // K, w_TK.reshape(-1)[pairs].float()
                tok_s, scale, sent_I, _, keep, sel_idx = select_and_compact(
                    dout, tok_c, g_c, st.gate_P_G[g][pairs], home, opts, st.generators[g], exact)
                cand_pos = (ret_pos if ret_pos is not None
                            else torch.arange(home.src_pair.numel(), device=dev))
                sel_pos = cand_pos if sel_idx is None else cand_pos[sel_idx]
                rows_G.append(dout[tok_s].contiguous())
                j_G.append(home.j_in_block[sel_pos])
            scale_G.append(scale.float())
            sent_G.append(sent_I.reshape(G, S))
            sel_pos_G.append((sel_pos, sel_idx))
            keep_G.append(keep)

        # --- the reverse exchange (_experts_backward for all ranks at once)
        send_splits_G = [s.sum(1).tolist() for s in sent_G]
        recv_GS_G = [torch.stack([sent_G[g][r] for g in range(G)]) for r in range(G)]
        if keep_G[0] is not None and opts.compaction and opts.estimator == "sampled":
            # the sampled estimator's count exchange (comm.exchange_counts): S int64 per peer
            st.stats.rows_GG["bwd_count_exchange"] = torch.ones(G, G, dtype=torch.long)
            st.stats.bytes_GG["bwd_count_exchange"] = torch.full((G, G), S * 8, dtype=torch.long)
        rls = []
        for r in range(G):
            with st.timers.time("local", r):
                rls.append(recv_layout(recv_GS_G[r], dev))
        dy_recv_G = _links(rows_G, send_splits_G)
        j_recv_G = _links(j_G, send_splits_G)
        sc_recv_G = _links(scale_G, send_splits_G)
        rows = _rows_GG(send_splits_G)
        st.stats.rows_GG["bwd_dispatch"] = rows
        st.stats.bytes_GG["bwd_dispatch"] = rows * (H * es + 12)  # + j (int64), scale (fp32)
        st.stats.rows_GG["bwd_combine"] = rows.t().contiguous()
        # + each row's router gradient (fp32) when the experts compute it
        st.stats.bytes_GG["bwd_combine"] = rows.t() * (H * es + 4 * ctx.dgate_at_experts)
        dx_recv_G, dw13_G, dw2_G, dot_recv_G = [], [], [], []
        for r in range(G):
            rl, recv_GS = rls[r], recv_GS_G[r]
            saved_x, saved_gu, saved_SG = ctx.saved[r]
            with st.timers.time("local", r):
                scale_inst = permute_rows(sc_recv_G[r], rl.to_inst)
                dy_inst = permute_rows(dy_recv_G[r], rl.to_inst)
                offs = offsets(rl.counts, dev)
            with st.timers.time("gather", r):
                if torch.equal(saved_SG, recv_GS.t().reshape(-1)):
                    x_sel, gu_sel = saved_x, saved_gu
                else:
                    n = int(recv_GS.sum())
                    blk = torch.repeat_interleave(torch.arange(S * G, device=dev),
                                                  to_device(recv_GS.t().reshape(-1), dev),
                                                  output_size=n)
                    rows_saved = (to_device(excl_cumsum(saved_SG), dev)[blk]
                                  + permute_rows(j_recv_G[r], rl.to_inst))
                    x_sel, gu_sel = saved_x[rows_saved], saved_gu[rows_saved]
            with st.timers.time("expert_bwd", r):
                dx_inst, dw13, dw2, *dot = swiglu_backward(
                    x_sel, gu_sel, dy_inst, w13_G[r], w2_G[r], rl.counts, offs,
                    scale=scale_inst, rowdot=ctx.dgate_at_experts)
            with st.timers.time("local", r):
                dx_recv_G.append(unpermute_rows(dx_inst, rl.to_inst))
                if dot:
                    dot_recv_G.append(unpermute_rows(dot[0], rl.to_inst))
            dw13_G.append(dw13)
            dw2_G.append(dw2)
        dx_back_G = _links(dx_recv_G, [rl.splits for rl in rls])
        if ctx.dgate_at_experts:  # every send row came back, in send order
            dg_back_G = _links(dot_recv_G, [rl.splits for rl in rls])
            for g in range(G):
                with st.timers.time("local", g):
                    dgate = torch.zeros(T * K, dtype=torch.float32, device=dev)
                    dgate[st.homes[g].src_pair] = dg_back_G[g]
                    dgate_G[g] = dgate.view(T, K).to(ctx.w_TK_G[g].dtype)
        st.stats.rows["bwd"] = [int(d.shape[0]) for d in dy_recv_G]
        st.stats.rows["selected"] = [
            int(recv_GS_G[r].sum()) if keep_G[0] is None or opts.compaction
            else int(plan.select_GGS[:, r, :].sum()) for r in range(G)]

        # --- dx per home rank: shipped rows back to pair order, summed over k
        dx_G = []
        for g in range(G):
            home, dx_back = st.homes[g], dx_back_G[g]
            sel_pos, sel_idx = sel_pos_G[g]
            n_rows = dx_back.shape[0]
            with st.timers.time("local", g):
                if home.all_retained and sel_idx is None and not home.dropped:
                    row, valid = ctx.rows_TK_G[g], None
                else:
                    row_of_pair = torch.full((T * K,), n_rows, dtype=torch.long, device=dev)
                    row_of_pair[home.src_pair[sel_pos]] = torch.arange(n_rows, device=dev)
                    row, valid = pair_rows(row_of_pair, n_rows, T, K)
                if n_rows == 0:
                    dx_G.append(dout_G[g].new_zeros(T, H))
                else:
                    ones = torch.ones(T, K, device=dev) if valid is None else valid
                    dx_G.append(fused("combine", weighted_gather_sum, dx_back)(dx_back, row, ones))
        st.timers.resolve()
        st.stats.expert_ms["bwd"] = st.timers.ms.get("expert_bwd", [0.0] * G)
        if plan.layer_checkpoint:  # the forward's expert kernels again, measured in backward
            st.stats.expert_ms["recompute"] = st.timers.ms.get("expert_recompute", [0.0] * G)
        for k in MEASURED_STAGES[1:]:  # forward and backward together
            st.stats.stage_ms[k] = st.timers.ms.get(k, [0.0] * G)
        # the G ranks' gradients, concatenated (emulator work: inside the MoE wall, so
        # bench ttl does not charge it as non-MoE time)
        grads = torch.cat(dx_G), torch.cat(dgate_G), torch.cat(dw13_G), torch.cat(dw2_G), None
        st.stats.bwd_end_s = _now(dev)
        return grads


def _forward_ranks(st: _State, x_NH: Tensor, gate_NK: Tensor, w13_IS: Tensor, w2_IS: Tensor,
                   recompute: bool) -> tuple[Tensor, dict]:
    """Dispatch -> experts -> combine for every virtual rank (ExpertExchange's forward):
    ``(out, what backward reads)``. ``recompute``: the whole-layer checkpoint's re-run in
    backward: the layouts are rebuilt, the exchanges' bytes go to ``recompute_dispatch``
    and ``recompute_combine`` and the expert kernels are timed as ``expert_recompute``
    (what :mod:`lrmoe.sim.cost` charges as ``bwd_recompute``)."""
    plan, T, K = st.plan, st.T, st.K
    G, S, H = plan.G, plan.S, x_NH.shape[1]
    es = x_NH.element_size()
    dev = x_NH.device
    x_G, gate_G = x_NH.split(T), gate_NK.split(T)
    w13_G, w2_G = w13_IS.split(S), w2_IS.split(S)
    if recompute:  # the runtime's re-run builds its layouts again
        for g in range(G):
            with st.timers.time("local", g):
                st.homes[g] = home_layout(plan, g, st.idx_GP[g], st.gate_P_G[g], st.E)
                st.recvs[g] = recv_layout(plan.assign_GGS[:, g, :], dev)
    disp, comb, expert = (("recompute_dispatch", "recompute_combine", "expert_recompute")
                          if recompute else ("fwd_dispatch", "fwd_combine", "expert_fwd"))

    # dispatch
    x_send_G = []
    for g in range(G):
        with st.timers.time("local", g):
            x_send_G.append(x_G[g][st.homes[g].src_pair // K])
    splits_G = [h.splits for h in st.homes]
    x_recv_G = _links(x_send_G, splits_G)
    rows = _rows_GG(splits_G)
    st.stats.rows_GG[disp] = rows
    st.stats.bytes_GG[disp] = rows * H * es
    st.stats.rows_GG[comb] = rows.t().contiguous()
    st.stats.bytes_GG[comb] = rows.t() * H * es

    # experts, per receiving rank; retention as in ExpertExchange
    y_recv_G, saved = [], []
    for r in range(G):
        recv = st.recvs[r]
        with st.timers.time("local", r):
            x_inst = permute_rows(x_recv_G[r], recv.to_inst)
        with st.timers.time(expert, r):
            y_inst, gu_inst = swiglu_forward(x_inst, w13_G[r], w2_G[r], recv.counts)
        ret_GS, asg_GS = plan.retain_GGS[:, r, :], plan.assign_GGS[:, r, :]
        with st.timers.time("gather", r):
            if torch.equal(ret_GS, asg_GS):
                sx, sgu, sSG = x_inst, gu_inst, asg_GS.t().reshape(-1)
            else:
                sSG = ret_GS.t().reshape(-1)
                keep = ranges(excl_cumsum(asg_GS.t().reshape(-1)), sSG, dev)
                sx, sgu = x_inst[keep], gu_inst[keep]
        saved.append((sx, sgu, sSG))
        with st.timers.time("local", r):
            y_recv_G.append(unpermute_rows(y_inst, recv.to_inst))

    # combine, per home rank
    y_send_G = _links(y_recv_G, [r.splits for r in st.recvs])
    outs, w_TK_G, rows_TK_G = [], [], []
    for g in range(G):
        y_send = y_send_G[g]
        with st.timers.time("local", g):
            row_TK, valid_TK = pair_rows(st.homes[g].send_row_P, y_send.shape[0], T, K)
            w_TK = gate_G[g] if valid_TK is None else gate_G[g] * valid_TK
            if y_send.shape[0] == 0:
                outs.append(x_G[g].new_zeros(T, H))
            else:
                outs.append(fused("combine", weighted_gather_sum, y_send)(y_send, row_TK, w_TK))
        w_TK_G.append(w_TK)
        rows_TK_G.append(row_TK)
    kept = {"saved": saved, "w_TK_G": w_TK_G, "y_send_G": y_send_G, "rows_TK_G": rows_TK_G}
    return torch.cat(outs), kept


def _keep(ctx, kept: dict, H: int) -> None:
    """What the exchange's backward reads, on ``ctx`` (the combined rows only where the
    router gradient needs them)."""
    ctx.saved, ctx.w_TK_G, ctx.rows_TK_G = kept["saved"], kept["w_TK_G"], kept["rows_TK_G"]
    y_send_G = kept["y_send_G"]
    ctx.y_send_G = [y.new_empty(0, H) for y in y_send_G] if ctx.dgate_at_experts else y_send_G


# --------------------------------------------------------------------- instance weights
def virtual_instance_weights(w_E: Tensor, plan: Plan) -> Tensor:
    """All ranks' slot weights ``[G*S, ...]`` from the full experts ``[E, ...]``.

    The math of :func:`lrmoe.parallel.weights.instance_weights` on every rank at once:
    each slot copies its expert's weights (empty slots are zero), and autograd's
    backward of the gather sums every instance's gradient into its expert.
    """
    ie = plan.inst_expert_GS.reshape(-1).to(w_E.device)
    w = w_E[ie.clamp(min=0)]
    if bool((ie < 0).any()):
        w = w * (ie >= 0).to(w.dtype).view(-1, *([1] * (w.dim() - 1)))
    return w


def replica_rows_GG(plan: Plan, E: int) -> Tensor:
    """``[owner, dst]`` expert instances the owners send for the weight scatter (the
    same counts go back in the gradient reduce), from the runtime's own routing."""
    G = plan.G
    return torch.tensor([InstanceRoute(plan, g, E).send_splits for g in range(G)], dtype=torch.long)


# ---------------------------------------------------------------------------- layer
class VirtualEPLayer:
    """Run ``layer`` (a full, unsharded :class:`MoELayer`) as G virtual EP ranks.

    ``forward(x)`` takes the global tokens ``[G*T, H]`` (or ``[B, L, H]`` with
    ``B*L = G*T``; rank g owns flat rows ``[g*T, (g+1)*T)``) and returns the global
    output, differentiable w.r.t. ``x``, the router and the experts (replica gradients
    are summed into their experts, as the real runtime's reduce does). After a backward
    :attr:`stats` holds this step's :class:`VirtualStats`.

    Args:
        layer: the MoE layer (its router, experts and shared experts are used as is).
        G: virtual ranks; must divide the number of experts.
        policy: the planner (the same objects the real runtime uses).
        backward_opts: LRMoE backward options (``fidelity`` is not emulated;
            ``router_grad="experts"`` is, as the runtime does it: on an exact plan the
            expert backward computes the router gradient and ships it home beside ``dx``,
            4 bytes per row, and the combined rows are not kept).
        ledger: memory ledger handed to the planner (``None``: no budget).
        generators: per virtual rank, the generator for the ``sampled`` estimator (as
            ``MoERuntime.generator`` on that rank); ``None`` uses the global RNG.
        check_plans: validate each plan against the counts.
        recompute_ledger: for exact policies under a budget: the ledger that decides
            how many pairs each rank recomputes (``VirtualStats.recompute_rows``), or
            that the layer is checkpointed whole; over even that, the step raises
            :class:`lrmoe.errors.OutOfMemory`.
    """

    def __init__(self, layer: MoELayer, G: int, policy: Policy,
                 backward_opts: BackwardOptions | None = None, ledger=None,
                 generators: list[torch.Generator | None] | None = None, check_plans: bool = True,
                 recompute_ledger=None):
        E = layer.cfg.num_experts
        if E % G:
            raise ValueError(f"G={G} does not divide the number of experts {E}")
        if layer.experts.count != E:
            raise ValueError("VirtualEPLayer needs the full (unsharded) experts")
        self.layer, self.G, self.policy = layer, G, policy
        self.opts = backward_opts or BackwardOptions()
        self.ledger, self.check_plans = ledger, check_plans
        self.recompute_ledger = recompute_ledger
        self.generators = generators or [None] * G
        self.step = 0
        self.stats: VirtualStats | None = None
        self.last_aux_loss: Tensor | None = None

    def __call__(self, x: Tensor) -> Tensor:
        return self.forward(x)

    def forward(self, x: Tensor) -> Tensor:
        layer, G = self.layer, self.G
        shape = x.shape
        H = shape[-1]
        x_NH = x.reshape(-1, H)
        N = x_NH.shape[0]
        if N % G:
            raise ValueError(f"{N} tokens do not split over G={G} virtual ranks")
        T, E, K = N // G, layer.cfg.num_experts, layer.cfg.num_experts_per_tok
        dev = x_NH.device
        timers = Timers(G, dev)
        # what the policy can plan from the previous step's counts: before this step's
        # counts exist, so off the critical path when it overlaps earlier work (charged
        # to no stage; reported as VirtualStats.prepare_ms)
        with torch.profiler.record_function("stage:prepare"):
            t1 = time.perf_counter()
            inputs = prepare(self.policy, layer.prev_counts_E, G,
                             PlanInputs(layer.moe_index, self.step, layer.prev_counts_E,
                                        self.ledger), T * K)
            prepare_ms = (time.perf_counter() - t1) * 1e3
        t0 = _now(dev)
        # route (row-wise, so routing all tokens at once equals routing each shard)
        with torch.profiler.record_function("stage:route"):
            r = layer.router(x_NH)
        dense_s = _now(dev) - t0
        idx_GP = r.idx_TK.reshape(G, T * K)
        gate_GP = r.gate_TK.reshape(G, T * K)
        # count
        counts = []
        for g in range(G):
            with timers.time("local", g):
                counts.append(torch.bincount(idx_GP[g], minlength=E))
        counts_GE = torch.stack(counts).long().cpu()
        glob = counts_GE.sum(0)
        self.last_aux_loss = None
        if r.probs_TE is not None and layer.training:
            # equal-sized shards: the mean of the ranks' losses is the loss on all tokens
            with torch.profiler.record_function("stage:route"):
                t1 = _now(dev)
                self.last_aux_loss = aux_loss(r.probs_TE, glob, N, layer.cfg.router_aux_loss_coef)
                dense_s += _now(dev) - t1
        # plan: every rank computes the same plan, so every rank is charged its time
        with torch.profiler.record_function("stage:plan"):
            plan, stats, plan_ms = self._plan(counts_GE, inputs)
        stats.prepare_ms = prepare_ms
        stats.dense_fwd_s = dense_s
        # the count all-gather (comm.all_gather_counts): E int64 to every peer
        stats.rows_GG["count_allgather"] = torch.ones(G, G, dtype=torch.long)
        stats.bytes_GG["count_allgather"] = torch.full((G, G), E * 8, dtype=torch.long)
        dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else x_NH.dtype
        with torch.profiler.record_function("stage:weight_scatter"):
            w13 = virtual_instance_weights(layer.experts.gate_up_proj.to(dtype), plan)
            w2 = virtual_instance_weights(layer.experts.down_proj.to(dtype), plan)
        rep = replica_rows_GG(plan, E)
        per_inst = (w13[0].numel() + w2[0].numel()) * w13.element_size() if w13.shape[0] else 0
        stats.rows_GG["weight_scatter"] = rep
        stats.bytes_GG["weight_scatter"] = rep * per_inst
        stats.rows_GG["grad_reduce"] = rep.t().contiguous()
        stats.bytes_GG["grad_reduce"] = rep.t() * per_inst
        homes, recvs = [], []
        for g in range(G):
            with timers.time("local", g):
                homes.append(home_layout(plan, g, idx_GP[g], gate_GP[g], E))
                recvs.append(recv_layout(plan.assign_GGS[:, g, :], dev))
        stats.stage_ms["plan"] = [plan_ms] * G
        st = _State(plan, homes, recvs, [gate_GP[g].detach() for g in range(G)], T, K, self.opts,
                    timers, stats, self.generators, idx_GP, E)
        self.stats = stats
        out = VirtualExchange.apply(x_NH.to(dtype), r.gate_TK, w13, w2, st)
        out = out.view(shape).to(x.dtype)
        if layer.shared_experts is not None:
            with torch.profiler.record_function("stage:route"):
                t1 = _now(dev)
                out = out + layer.shared_experts(x)
                stats.dense_fwd_s += _now(dev) - t1
        return out

    def _plan(self, counts_GE: Tensor, inputs: PlanInputs
              ) -> tuple[Plan, VirtualStats, float]:
        """The policy's plan and, for an exact policy under a budget, the rows it
        recomputes (what the runtime needs before its dispatch: charged, in ms, the
        third value); then, uncharged, its check (``check_plans``) and its ledger
        pricing (the stats' bookkeeping, which the runtime need not do on the way).

        A plan that fits no fallback stops the step, as a GPU would: an exact policy
        whose plan is over budget even with a whole-layer checkpoint
        (:meth:`Ledger.exact_fit` mode ``over``) raises :class:`OutOfMemory`, as does a
        planner that finds no plan (lrmoe: every rung of its ladder over)."""
        fit_ledger = self.recompute_ledger
        t0 = time.perf_counter()
        plan = self.policy.plan(counts_GE, inputs)
        fit = None  # a planner's own fallback (recompute_G, layer_checkpoint) is kept
        if plan.recompute_G is None and not plan.layer_checkpoint and fit_ledger is not None:
            fit = plan_exact_fit(fit_ledger, plan)  # Ledger.exact_fit, vectorised
            if fit[0] == "layer":  # run the whole-layer checkpoint
                plan = dataclasses.replace(plan, layer_checkpoint=True)
        plan_ms = (time.perf_counter() - t0) * 1e3
        if fit is not None and fit[0] == "over":
            raise _out_of_memory(fit_ledger, plan, fit[2])
        if self.check_plans:
            plan.check(counts_GE)
        stats = VirtualStats(plan)
        if plan.recompute_G is not None:  # the planner recomputes (real-runtime semantics)
            stats.recompute_mode, stats.recompute_rows = "pairs", plan.recompute_G.tolist()
        elif plan.layer_checkpoint and fit is None:  # the planner checkpoints the layer
            stats.recompute_mode, stats.recompute_rows = "layer", plan.rank_load().tolist()
        elif fit is not None:
            mode, rows, totals = fit
            stats.recompute_mode, stats.recompute_rows = mode, rows.tolist()
            stats.ledger_total_bytes = totals.tolist()
        stats.rung = plan.rung or _EXACT_RUNG[stats.recompute_mode]
        if self.ledger is not None and stats.ledger_total_bytes is None:
            stats.ledger_total_bytes = plan_totals(self.ledger, plan).tolist()
        return plan, stats, plan_ms


# an exact policy's fallback (Ledger.exact_fit's mode) as a rung of the ladder
_EXACT_RUNG = {"fits": "plan", "pairs": "recompute", "layer": "layer"}


def _out_of_memory(ledger, plan: Plan, totals) -> OutOfMemory:
    """The verdict for an exact plan over budget even with a whole-layer checkpoint: the
    ledger's own line for the worst rank's layer-checkpoint terms."""
    counts = ledger._rank_counts(plan, None)
    r = int(totals.argmax())
    n, R, h, _ = counts[r]
    detail = ledger.describe(r, ledger.layer_terms(n, R, h))  # the terms its need counts
    return OutOfMemory(f"the plan does not fit mem_budget even with a whole-layer "
                       f"checkpoint: {detail}", int(totals.max()), ledger.budget_bytes, detail)


def _now(dev: torch.device) -> float:
    """``perf_counter`` after the device's queued work (a wall time of device work)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()
