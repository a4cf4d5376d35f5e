"""Dispatch -> experts -> combine as one autograd Function, with an explicit backward.

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
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from lrmoe.ops.experts import gate_up, offsets, prefix_counts, swiglu_backward_owned, swiglu_forward
from lrmoe.ops.fused import fused, gathered_dot, weighted_gather_sum
from lrmoe.parallel.comm import EPComm
from lrmoe.parallel.layout import (
    HomeLayout,
    RecvLayout,
    block_ids,
    excl_cumsum,
    permute_rows,
    ranges,
    recv_layout,
    to_device,
    unpermute_rows,
)
from lrmoe.policy.plan import Plan
from lrmoe.timing import timed


# ----------------------------------------------------------------------------- metric
# A metric scores each candidate pair from the output gradient at its home rank:
# ``metric(dout_TH, tok_N, gate_N) -> [N]`` for pairs (tok_N[n], gate_N[n]).
def metric_grad_norm(dout_TH: Tensor, tok_N: Tensor, gate_N: Tensor) -> Tensor:
    """``g[t,e]*||dy[t]||``: the norm of the pair's output gradient, which bounds its
    contribution to the expert's weight gradient. Norms are taken per token (T rows,
    not T*k pairs) in fp32."""
    tn = torch.linalg.vector_norm(dout_TH, dim=1, dtype=torch.float32)
    return gate_N.float().abs() * tn[tok_N]


def metric_gate(dout_TH: Tensor, tok_N: Tensor, gate_N: Tensor) -> Tensor:
    """Gate weight alone (ignores the gradient): a cheap, gradient-blind baseline."""
    return gate_N.float()


METRICS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "grad_norm": metric_grad_norm,
    "gate": metric_gate,
}


@dataclass
class BackwardOptions:
    """How the backward selects and ships pairs (LRMoE knobs; inert for exact plans)."""

    metric: str = "grad_norm"
    estimator: str = "topk"  # or "sampled"
    compaction: bool = True
    fidelity: bool = False  # also compute the exact weight gradient and compare
    # "experts": on an exact plan the expert backward computes each pair's router gradient
    # <dout[t], y[t,k]> as <dout[t] @ w2, silu(g)*u> and ships it home beside dx, so the
    # combined expert outputs (y_send) are not kept for backward (the ledger's combine_rows
    # term is then 0 for exact plans: Ledger(router_grad_at_experts=True)). "home": keep them.
    router_grad: str = "home"
    # under an activation checkpoint of the whole block: the kept rows are saved through
    # save_for_backward (so the checkpoint drops them and its re-run restores them), not
    # held by the Function until their last use in backward
    checkpointed: bool = False


# -------------------------------------------------------------------------- selection
def select_topk_idx(metric_N: Tensor, size_B: Tensor, quota_B: Tensor) -> Tensor:
    """Indices of the ``quota[b]`` highest-metric rows of each block.

    Rows come grouped by block (block b holds ``size_B[b]`` consecutive rows, sizes on
    the host). One stable sort on ``block + 0.5*(1 - metric/max)`` orders every block by
    descending metric; the kept rows are each block's prefix, whose length is known on
    the host, so no device-to-host sync is needed. Returned indices are ascending (so
    block-grouped, and in send order inside each block).
    """
    dev = metric_N.device
    n = metric_N.numel()
    B = size_B.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=dev)
    blk = torch.repeat_interleave(torch.arange(B, device=dev), to_device(size_B, dev), output_size=n)
    m = metric_N.double().clamp(min=0)
    key = blk.double() + 0.5 * (1 - m / (m.max() + 1e-300))
    order = torch.argsort(key, stable=True)
    kept = order[ranges(excl_cumsum(size_B), torch.minimum(quota_B, size_B), dev)]
    # ascending = send order: the receiver relies on rows arriving in saved (j) order
    # when a block is shipped whole
    return torch.sort(kept).values


def inclusion_probs(metric_N: Tensor, block_N: Tensor, quota_B: Tensor,
                    size_B: Tensor | None = None) -> Tensor:
    """Probabilities ``pi ∝ metric`` capped at 1 with ``sum(pi) = quota`` per block.

    Water-filling in closed form (no loop). With a block's metrics sorted descending,
    ``m_0 >= m_1 >= ...``, and ``R_r`` the mass from rank ``r`` on, rank ``r`` is capped
    iff ``(q - r) * m_r > R_r``; that test holds for a prefix of the block (``(q - r) *
    m_r - R_r`` does not increase with ``r`` while ``r < q``, and is ``<= 0`` from
    ``r = q`` on), so the capped count ``c`` is how many rows pass it, and the free rows
    get ``(q - c) * m / M`` with ``M`` their mass: the unique fixed point of capping
    every row whose share reaches 1 (a row whose share is exactly 1 is left free, with
    the same result). Free rows with no metric mass share the rest of the quota
    uniformly. Negative metrics count as 0; rows need not come grouped by block; equal
    metrics of a block rank in row order (so the result, to the last bit, does not hang
    on a sort's tie order). ``size_B`` (rows per block, host) spares a device count when
    the caller knows it.

    Built for few kernels (the select stage is host-bound: each op costs ~30 us of launch
    on the H200's host against ~0.5 ms of device work in all, RESULTS.md): one sort for
    a float32 metric (:func:`_block_order`). The suffix test is one global scan of
    metrics normalised per block (a light block's sums do not round against a heavy
    block's mass): with ``C`` that inclusive scan, ``(q - r) u_r > R_r`` reads
    ``(q + first - 1 - i) u_i + C_i > C_last`` per row ``i``.
    Block quantities stay on the device: no host wait.
    Only sorts, searches, gathers, scans and segmented reductions: none of the ops that
    ``torch.use_deterministic_algorithms`` switches to slower kernels (``index_add_``,
    ``index_put_``, ``index_copy_``, ``scatter``).
    """
    dev = metric_N.device
    N = metric_N.numel()
    if N == 0:
        return metric_N.double()
    B = quota_B.numel()
    blk = block_N.to(dev).long()
    rows = torch.arange(N, device=dev)
    m, order, inverse = _block_order(metric_N, blk, rows, B)
    m_s, b_s = m[order], blk[order]
    n_B = (torch.bincount(b_s, minlength=B) if size_B is None else size_B).cpu().numpy()
    if n_B.size != B or int(n_B.sum()) != N:  # host values: no sync
        raise ValueError(f"inclusion_probs: block sizes {n_B.size} summing to "
                         f"{int(n_B.sum())}, for {B} blocks and {N} rows")
    first = np.cumsum(n_B) - n_B
    q = quota_B.cpu().double().numpy()
    # one copy of the per-block constants (float64 holds the counts exactly)
    tab = to_device(torch.from_numpy(np.stack((n_B, np.maximum(first + n_B - 1, 0), q + first - 1, q))
                                     .astype(np.float64)), dev)
    nl, last_B = tab[:2].long()
    u_s = m_s / torch.segment_reduce(m_s, "sum", lengths=nl, unsafe=True).clamp(min=1e-300)[b_s]
    C_s = torch.cumsum(u_s, 0)
    capped_s = torch.addcmul(C_s, tab[2][b_s] - rows, u_s) > C_s[last_B][b_s]
    c = torch.segment_reduce(capped_s.double(), "sum", lengths=nl, unsafe=True)
    mass = torch.segment_reduce(torch.where(capped_s, 0.0, m_s), "sum", lengths=nl, unsafe=True)
    # per block, on the device (no host wait): free rows get rem * m / M, or rem / n_free
    # when the block's free rows carry no metric mass (a scalar fill goes in place on a
    # fresh tensor: one kernel)
    rem = (tab[3] - c).clamp(min=0.0)
    has = mass > 0
    per_mass = torch.where(has, rem / mass, 0.0)
    uniform = (rem / (tab[0] - c).clamp(min=1.0)).masked_fill_(has, 0.0)
    fg = torch.stack((per_mass, uniform), 1)[b_s]
    pi_s = torch.addcmul(fg[:, 1], fg[:, 0], m_s).masked_fill_(capped_s, 1.0).clamp_(0.0, 1.0)
    return pi_s[inverse]  # back to the input's row order (a gather)


def _block_order(metric_N: Tensor, blk: Tensor, rows: Tensor, B: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(m, order, inverse)``: the metric clamped at 0 in float64; the rows ordered by
    block (ascending), then metric (descending), then row (ascending); and the inverse
    permutation (``order[inverse] = rows``, with ``rows = arange(N)``).

    A float32 (or narrower) metric takes one sort, on a unique int64 key: the bits of a
    non-negative float32 read as an int32 grow with its value, so ``N * (2^31 * block -
    bits) + row`` orders the rows as wanted while ``B * N < 2^32``; the inverse is where
    each row's key falls among the sorted keys (a search, no scatter). Another metric
    takes two stable sorts and an ``argsort`` of the order.
    """
    N = rows.numel()
    if metric_N.dtype in (torch.float32, torch.bfloat16, torch.float16) and B * N < 2**32:
        # a negative metric (and -0.0) reads as +0.0: the clamp at 0, on the bits
        bits = metric_N.float().view(torch.int32).clamp(min=0)
        key = torch.add(torch.sub(rows, bits, alpha=N), blk, alpha=N << 31)
        key_s, order = torch.sort(key)
        return bits.view(torch.float32).double(), order, torch.searchsorted(key_s, key)
    m = metric_N.double().clamp(min=0)
    order = torch.sort(m, descending=True, stable=True).indices
    order = order[torch.sort(blk[order], stable=True).indices]
    return m, order, torch.argsort(order)


def ht_weight(pi: Tensor) -> Tensor:
    """The Horvitz-Thompson weight ``1/pi`` of a kept row (``pi`` of a kept row is > 0;
    the floor only guards the division)."""
    return 1.0 / pi.clamp(min=1e-12)


def poisson_keep(pi: Tensor, generator: torch.Generator | None) -> Tensor:
    """Each row kept with probability ``pi``, independently (``u < pi`` with ``u`` uniform
    on [0, 1): a row with ``pi = 0`` is never kept)."""
    return torch.rand(pi.shape, dtype=pi.dtype, device=pi.device, generator=generator) < pi


# --------------------------------------------------------------------------- exchange
@dataclass
class ExchangeState:
    """Everything one layer's exchange needs for one step (plain Python, not autograd)."""

    comm: EPComm
    plan: Plan
    home: HomeLayout | None  # set by the caller once the plan is known
    recv: RecvLayout | None
    top_k: int
    num_tokens: int
    opts: BackwardOptions
    gate_P: Tensor
    stats: dict = field(default_factory=dict)
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


def _timed(stats: dict, key: str, device: torch.device):
    """Accumulate a region's expert time in ``stats[key]`` (CUDA: events in ``_events``)."""
    return timed(device, lambda ms: stats.__setitem__(key, stats.get(key, 0.0) + ms),
                 lambda ev_a, ev_b: stats.setdefault("_events", []).append((key, ev_a, ev_b)))


def select_and_compact(dout_TH: Tensor, tok_c: Tensor, g_c: Tensor, gate_c: Tensor,
                       home: HomeLayout, opts: BackwardOptions, generator, exact: bool,
                       exchange_counts: Callable[[Tensor], Tensor] | None = None):
    """One home rank's backward **select** and **compact** stages.

    Candidates are the retained rows in send order (token ``tok_c``, output-gradient scale
    ``g_c``, gate ``gate_c``): block-major, ``home.retain_I`` of them per block. Returns
    ``(tok_s, scale, sent_I, recv_GS, keep, sel_idx)``: the token and scale of every row
    to ship (in send order), rows per block (host), the rows each (source, slot) block
    sends this rank (host; only for the sampled estimator, whose counts are known only
    here, else ``None``), the keep mask over the candidates (``None`` for an exact plan)
    and the shipped candidates' indices (``None`` when every candidate is shipped: exact
    plan, or the compaction-off ablation, which ships all retained rows with the
    unselected ones' scale zeroed).

    No host wait but one: the sampled estimator's kept rows per block, exchanged with
    the peers on the device (``exchange_counts``, sent ``[G, S]`` -> received ``[G, S]``)
    and read together with them in one copy: the split sizes of the backward exchange.
    """
    pi = keep = sel_idx = None
    if not exact:
        m = METRICS[opts.metric](dout_TH, tok_c, gate_c)
        if opts.estimator == "sampled":
            # the candidates are each block's retained rows: retain_I of them
            blocks = block_ids(home.retain_I, dout_TH.device)
            pi = inclusion_probs(m, blocks, home.select_I, home.retain_I)
            keep = poisson_keep(pi, generator)
        else:
            sel_idx = select_topk_idx(m, home.retain_I, home.select_I)
            # a scalar fill: ``keep[sel_idx] = True`` would copy a host tensor (a sync on CUDA)
            keep = torch.zeros(m.numel(), dtype=torch.bool, device=m.device).index_fill_(
                0, sel_idx, True)
    if keep is None:
        return tok_c, g_c, home.retain_I, None, None, None
    if not opts.compaction:
        w = keep.float() if pi is None else torch.where(keep, ht_weight(pi), 0.0).float()
        return tok_c, g_c * w, home.retain_I, None, keep, None
    sent_I, recv_GS = home.select_I, None
    if sel_idx is None:  # sampled: count the kept rows, then compact them
        sent_I, recv_GS = kept_counts(keep, home, exchange_counts)
        # the kept count is on the host now: compacting needs no second wait
        sel_idx = torch.nonzero_static(keep, size=int(sent_I.sum())).view(-1)
    scale = g_c[sel_idx]
    if pi is not None:
        scale = scale * ht_weight(pi[sel_idx]).float()
    return tok_c[sel_idx], scale, sent_I, recv_GS, keep, sel_idx


def kept_counts(keep: Tensor, home: HomeLayout,
                exchange_counts: Callable[[Tensor], Tensor] | None) -> tuple[Tensor, Tensor | None]:
    """``(sent_I, recv_GS)``: the kept rows of each block and, with ``exchange_counts``,
    the rows each (source, slot) block sends this rank (else ``None``), both on the host.
    Counted and exchanged on the device, then read in one copy: the select stage's one
    host wait."""
    lengths = to_device(home.retain_I, keep.device)
    sent_dev = torch.segment_reduce(keep.double(), "sum", lengths=lengths, unsafe=True).long()
    recv_dev = (exchange_counts(sent_dev.reshape(home.splits_shape)) if exchange_counts
                else sent_dev.new_zeros(0))
    both = torch.cat((sent_dev, recv_dev.reshape(-1))).cpu()  # the one host wait
    B = sent_dev.numel()
    return both[:B], both[B:].reshape(home.splits_shape) if exchange_counts else None


def send_blocks(plan: Plan, me: int, device: torch.device) -> Tensor:
    """Global instance index of each of home rank ``me``'s send rows
    (``HomeLayout.send_blocks``)."""
    return block_ids(plan.assign_GGS[me].reshape(-1), device)


def backward_home(home: HomeLayout) -> HomeLayout:
    """The part of a send layout the backward reads: ``send_pos_P`` (equal to
    ``send_row_P`` where the backward looks) is dropped, so it is not kept alive between
    forward and backward."""
    return dataclasses.replace(home, send_pos_P=home.send_row_P)


def occupied_counts(counts_S: list[int], plan: Plan, me: int, n_weights: int) -> list[int]:
    """Rows per slot for the grouped GEMMs, over the slots that have weights: all ``S``
    slots, or only the occupied ones when the instance weights leave out the empty
    slots (:func:`lrmoe.parallel.weights.instance_weights`; empty slots hold no rows)."""
    if n_weights == len(counts_S):
        return counts_S
    occ = (plan.inst_expert_GS[me] >= 0).tolist()
    return [c for c, o in zip(counts_S, occ) if o]


class ExpertExchange(torch.autograd.Function):
    """``(x_TH, gate_TK, w13_S, w2_S) -> out_TH``: dispatch, experts, combine.

    The combine (gate-weighted sum over a token's k pairs) is done here, as a batched
    ``[1, K] x [K, H]`` product per token, so the pair outputs never leave this Function
    in pair order and no broadcast multiply or atomic scatter is needed. The router
    gradient ``dL/dg[t,k] = <dout[t], y[t,k]>`` is exact for every pair given ``dout``
    (pairs dropped in the MoE layers above this one change ``dout`` itself).
    """

    @staticmethod
    def forward(ctx, x_TH: Tensor, gate_TK: Tensor, w13_S: Tensor, w2_S: Tensor,
                st: ExchangeState) -> Tensor:
        home, recv, comm, plan = st.home, st.recv, st.comm, st.plan
        me, K, H = comm.rank, st.top_k, x_TH.shape[1]
        T = x_TH.shape[0]
        es = x_TH.element_size()
        counts = occupied_counts(recv.counts, plan, me, w13_S.shape[0])
        dev = x_TH.device
        # Transients are dropped as soon as they are consumed (Ledger.forward_points
        # prices what is left alive at each point).
        with st.stage("local", dev):
            x_send = x_TH[home.src_pair // K]
        n_send = x_send.shape[0]
        x_recv = comm.all_to_all(x_send, home.splits, recv.splits)
        del x_send
        n_recv = x_recv.shape[0]
        with st.stage("local", dev):
            x_inst = permute_rows(x_recv, recv.to_inst)
        del x_recv
        with _timed(st.stats, "expert_fwd_ms", x_TH.device):
            y_inst, gu_inst = swiglu_forward(x_inst, w13_S, w2_S, counts)

        # Retention: keep activations of retained rows only, in (s, g, j) order. On a
        # fidelity step of an approximate plan every row is kept (a monitoring cost), so
        # the exact gradient over all pairs can be computed beside the selected one.
        ret_GS = plan.retain_GGS[:, me, :]
        full_save = st.opts.fidelity and not plan.exact
        # Recompute (a budget): the first n_rec saved rows keep only their input row; their
        # gate_up output is recomputed in backward. A fidelity step saves everything.
        n_rec = 0 if plan.recompute_G is None or full_save else int(plan.recompute_G[me])
        with st.stage("gather", dev):
            if full_save or torch.equal(ret_GS, plan.assign_GGS[:, me, :]):
                saved_x, saved_gu = x_inst, gu_inst
                saved_SG = plan.assign_GGS[:, me, :].t().reshape(-1)
                if n_rec:
                    saved_gu = gu_inst[n_rec:].clone()
            else:
                saved_SG = ret_GS.t().reshape(-1)
                inst_start = excl_cumsum(plan.assign_GGS[:, me, :].t().reshape(-1))
                keep_rows = ranges(inst_start, ret_GS.t().reshape(-1), x_TH.device)
                saved_x, saved_gu = x_inst[keep_rows], gu_inst[keep_rows[n_rec:]]
                del keep_rows
            del gu_inst, x_inst

        with st.stage("local", dev):
            y_recv = unpermute_rows(y_inst, recv.to_inst)
        del y_inst
        y_send = comm.all_to_all(y_recv, recv.splits, home.splits)
        del y_recv
        with st.stage("local", dev):
            # combine: dropped pairs (capacity policy) get weight 0 on a clamped row
            row_TK, valid_TK = pair_rows(home.send_row_P, y_send.shape[0], T, K)
            w_TK = gate_TK if valid_TK is None else gate_TK * valid_TK
            if y_send.shape[0] == 0:
                out = x_TH.new_zeros(T, H)
            else:
                out = fused("combine", weighted_gather_sum, y_send)(y_send, row_TK, w_TK)

        st.stats.update(
            fwd_rows=n_recv, retained_rows=int(ret_GS.sum()),
            fwd_dispatch_bytes_sent=n_send * H * es, fwd_dispatch_bytes_recv=n_recv * H * es,
            fwd_combine_bytes_sent=n_recv * H * es, fwd_combine_bytes_recv=n_send * H * es,
            saved_act_bytes=saved_x.numel() * saved_x.element_size()
            + saved_gu.numel() * saved_gu.element_size())
        # Keep for backward only what it reads (Ledger: retained_acts, combine_rows,
        # pair_index): the receive layout, the retained send positions and each send
        # row's block are rebuilt from the plan there.
        st.recv, st.home = None, backward_home(home)
        ctx.st, ctx.saved_SG, ctx.n_rec = st, saved_SG, n_rec
        ctx.dgate_at_experts = st.opts.router_grad == "experts" and plan.exact
        if ctx.dgate_at_experts:
            y_send = y_send.new_empty(0, H)  # not kept (a fresh empty tensor, no storage)
        # The kept rows are the Function's own intermediates (never its inputs or output,
        # so no reference cycle): held in a plain dict rather than save_for_backward,
        # whose tensors live until backward returns, so backward can drop each one at its
        # last use (Ledger.rows_buffer_bytes, docs/design.md §5).
        if st.opts.checkpointed:
            ctx.save_for_backward(w13_S, w2_S, w_TK, row_TK, saved_x, saved_gu, y_send)
        else:
            ctx.kept = {"x": saved_x, "gu": saved_gu, "y_send": y_send}
            ctx.save_for_backward(w13_S, w2_S, w_TK, row_TK)
        return out

    @staticmethod
    def backward(ctx, dout_TH: Tensor):
        st: ExchangeState = ctx.st
        w13_S, w2_S, w_TK, row_TK, *rows = ctx.saved_tensors
        if rows:  # checkpointed: restored by the checkpoint's re-run
            ctx.kept = dict(zip(("x", "gu", "y_send"), rows))
            del rows
        if not hasattr(ctx, "kept"):
            raise RuntimeError("ExpertExchange's backward frees the rows its forward kept as it "
                               "goes, so it runs once per forward (no retain_graph=True); run "
                               "the forward again for a second backward")
        kept = ctx.kept  # from here on the kept rows live only in ``kept`` ...
        del ctx.kept
        y_send = kept.pop("y_send")  # ... and each is dropped at its last use
        home, comm, plan, opts = st.home, st.comm, st.plan, st.opts
        me, K, dev = comm.rank, st.top_k, dout_TH.device
        G, S = plan.G, plan.S
        T, H = dout_TH.shape
        dout_TH = dout_TH.to(w13_S.dtype).contiguous()
        es = dout_TH.element_size()

        with st.stage("local", dev):
            # --- combine^-1: exact router gradient (zero for dropped pairs) ...
            dgate = router_grad_home(y_send, row_TK, w_TK, dout_TH, home, ctx.dgate_at_experts)
            del y_send
            # ... and, per retained pair, the rows that carry its output gradient g*dout[t]:
            # the unscaled dout[t] row plus the scale g (folded into the expert backward's
            # elementwise kernels on the receiver, so no scaled copy of the rows is made).
            ret_pos = home.retained_positions(dev)
            pairs = home.src_pair if ret_pos is None else home.src_pair[ret_pos]
            tok_c, g_c = pairs // K, w_TK.reshape(-1)[pairs].float()

        # --- select and compact (global exactness: every rank takes the same collectives;
        # the sampled estimator's count exchange is inside)
        exact = torch.equal(plan.select_GGS, plan.retain_GGS)
        with st.stage("select", dev):
            tok_s, scale, sent_I, recv_GS, keep, sel_idx = select_and_compact(
                dout_TH, tok_c, g_c, st.gate_P[pairs], home, opts, st.generator, exact,
                comm.exchange_counts)
        sent_GS = sent_I.reshape(G, S)
        if recv_GS is None:  # known from the plan (else: the sampled rows' counts, exchanged)
            full = keep is None or not opts.compaction
            recv_GS = (plan.retain_GGS if full else plan.select_GGS)[:, me, :]
        cand_pos = ret_pos if ret_pos is not None else torch.arange(home.src_pair.numel(), device=dev)
        sel_pos = cand_pos if sel_idx is None else cand_pos[sel_idx]
        # the rows to ship and the saved rows are handed over (each dies at its last use);
        # a fidelity step reads the saved rows twice and hands over a copy of the dict
        fidelity = opts.fidelity and not plan.exact
        rows = dict(kept) if fidelity else kept
        with st.stage("local", dev):
            rows["dy"] = dout_TH[tok_s]
        n_out = rows["dy"].shape[0]
        dx_back, dw13, dw2, n_in, dg_back = _experts_backward(
            st, home.j_in_block[sel_pos], rows, scale, sent_GS, recv_GS, ctx.saved_SG, w13_S,
            w2_S, timed=True, recompute_rows=ctx.n_rec, rowdot=dgate is None)
        if dgate is None:  # exact: every send row came back, in send order
            with st.stage("local", dev):
                dgate = torch.zeros(T * K, dtype=torch.float32, device=dev)
                dgate[home.src_pair] = dg_back
                dgate = dgate.view(T, K).to(w_TK.dtype)
        if fidelity:
            # the exact gradient: every pair (retained or not), unweighted
            kept["dy"] = dout_TH[home.src_pair // K]
            _, e13, e2, _, _ = _experts_backward(
                st, home.j_in_block, kept, w_TK.reshape(-1)[home.src_pair].float(),
                plan.assign_GGS[me], plan.assign_GGS[:, me, :], ctx.saved_SG, w13_S, w2_S,
                recompute_rows=ctx.n_rec)
            # compare per expert (replicas on this rank summed), as the optimizer sees them
            ie = plan.inst_expert_GS[me]
            ie = ie if w13_S.shape[0] == ie.numel() else ie[ie >= 0]
            idx = to_device(ie.clamp(min=0), dev)
            E = int(ie.max()) + 1

            def per_expert(g13: Tensor, g2: Tensor) -> Tensor:
                z13 = g13.new_zeros((E,) + g13.shape[1:]).index_add_(0, idx, g13)
                z2 = g2.new_zeros((E,) + g2.shape[1:]).index_add_(0, idx, g2)
                return torch.cat([z13.flatten(), z2.flatten()]).float()
            a, b = per_expert(dw13, dw2), per_expert(e13, e2)
            st.stats["fidelity_cosine"] = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
            st.stats["fidelity_rel_err"] = float((a - b).norm() / b.norm().clamp(min=1e-30))

        # --- dx: shipped rows back to pair order (others weigh 0), summed over k.
        n_rows = dx_back.shape[0]
        with st.stage("local", dev):
            if ret_pos is None and sel_idx is None and not home.dropped:
                row, valid = row_TK, None
            else:
                row_of_pair = torch.full((T * K,), n_rows, dtype=torch.long, device=dev)
                row_of_pair[home.src_pair[sel_pos]] = torch.arange(n_rows, device=dev)
                row, valid = pair_rows(row_of_pair, n_rows, T, K)
            if n_rows == 0:
                dx_TH = dout_TH.new_zeros(T, H)
            else:
                ones = torch.ones(T, K, device=dev) if valid is None else valid
                dx_TH = fused("combine", weighted_gather_sum, dx_back)(dx_back, row, ones)

        st.stats.update(
            bwd_rows=n_in, selected_rows=int(recv_GS.sum()) if keep is None or opts.compaction
            else int(plan.select_GGS[:, me, :].sum()),
            bwd_dispatch_bytes_sent=n_out * (H * es + 12), bwd_dispatch_bytes_recv=n_in * (H * es + 12),
            bwd_combine_bytes_sent=n_in * (H * es + 4 * (dg_back is not None)),
            bwd_combine_bytes_recv=n_out * (H * es + 4 * (dg_back is not None)),
            # what the exact backward would send: every assigned row out and back
            bwd_exact_bytes=int(plan.assign_GGS[me].sum()) * (2 * H * es + 12),
            bwd_flops=6 * n_in * H * w2_S.shape[-1] * 2)
        return dx_TH, dgate, dw13, dw2, None


def router_grad_home(y_send: Tensor, row_TK: Tensor, w_TK: Tensor, dout_TH: Tensor,
                     home: HomeLayout, at_experts: bool) -> Tensor | None:
    """combine^-1 on home rank's side: the exact router gradient ``dL/dg[t,k] =
    <dout[t], y[t,k]>`` from the kept combined rows (zero for dropped pairs), in
    ``w_TK``'s dtype; ``None`` when ``at_experts`` (``router_grad="experts"`` on an exact
    plan: the expert backward computes it instead)."""
    if at_experts:
        return None
    T, K = w_TK.shape
    if y_send.shape[0] == 0:
        return w_TK.new_zeros(T, K)
    dgate = fused("combine_bwd", gathered_dot, y_send)(y_send, row_TK, dout_TH)
    _, valid_TK = pair_rows(home.send_row_P, y_send.shape[0], T, K)
    if valid_TK is not None:  # dropped pairs contributed nothing
        dgate = dgate * valid_TK
    return dgate.to(w_TK.dtype)


def pair_rows(row_P: Tensor, n: int, T: int, K: int) -> tuple[Tensor, Tensor | None]:
    """Rows ``[T, K]`` into an ``n``-row buffer; rows ``>= n`` mean "no row": they are
    clamped and a 0/1 weight mask is returned (``None`` when every row is valid)."""
    row = row_P.view(T, K)
    if n == T * K or n == 0:
        return (row, None) if n else (row.clamp(max=0), torch.zeros(T, K, device=row.device))
    valid = (row < n).float()
    return row.clamp(max=n - 1), valid


def _experts_backward(st: ExchangeState, j_send: Tensor, rows: dict[str, Tensor], scale: Tensor,
                      sent_GS: Tensor, recv_GS: Tensor, saved_SG: Tensor, w13_S: Tensor,
                      w2_S: Tensor, timed: bool = False, recompute_rows: int = 0,
                      rowdot: bool = False) -> tuple[Tensor, Tensor, Tensor, int, Tensor | None]:
    """Ship compacted output-gradient rows, run experts^-1 on them, ship ``dx`` back.

    ``rows`` is handed over and emptied: ``rows["dy"]`` are the rows to ship, ordered by
    send position (block-major), carrying the output gradient ``scale[n] * dy[n]`` (gate
    weight, times an importance weight when sampled); ``rows["x"]``, ``rows["gu"]`` are
    the saved rows in (s, g, j) order, ``saved_SG`` each (s, g) block's size. Each tensor
    is dropped at its last use (the shipped rows after their all-to-all, the arrival-order
    rows after their permute, the saved rows once gathered, the rest in
    :func:`swiglu_backward_owned`), so none of them is alive at the dx GEMM (docs/design.md §5).
    ``j_send`` is each row's index inside its block, which locates its saved activations
    on the receiver. With ``recompute_rows = n`` (a plan over a budget) ``gu`` lacks the
    first ``n`` saved rows, recomputed here from their saved inputs.
    Returns ``(dx rows back at home in the same order, dw13, dw2, rows in, dot)``; with
    ``rowdot`` ``dot`` is each row's router gradient ``<dy, y>`` back at home in the same
    order (``None`` otherwise).
    """
    comm, plan, dev = st.comm, st.plan, rows["dy"].device
    S, G = plan.S, plan.G
    with st.stage("local", dev, timed):
        send_splits = sent_GS.sum(1).tolist()
        rl = recv_layout(recv_GS, dev)
    rows["dy"] = comm.all_to_all(rows["dy"].contiguous(), send_splits, rl.splits)
    n_in = rows["dy"].shape[0]
    j_recv = comm.all_to_all(j_send, send_splits, rl.splits)
    scale_recv = comm.all_to_all(scale.float(), send_splits, rl.splits)
    if recompute_rows:  # rebuild the saved rows' gate_up outputs (instance order) first
        _rebuild_gate_up(rows, recompute_rows, saved_SG, st, w13_S, timed)
    with st.stage("local", dev, timed):
        scale_inst = permute_rows(scale_recv, rl.to_inst)
        rows["dy"] = permute_rows(rows["dy"], rl.to_inst)
    if not torch.equal(saved_SG, recv_GS.t().reshape(-1)):
        # gather the saved rows of the arriving ones (else every saved row arrives, in
        # saved order, and they are used as they are)
        with st.stage("gather", dev, timed):
            blk = torch.repeat_interleave(torch.arange(S * G, device=dev),
                                          to_device(recv_GS.t().reshape(-1), dev), output_size=n_in)
            rows_saved = to_device(excl_cumsum(saved_SG), dev)[blk] + permute_rows(j_recv, rl.to_inst)
            rows["x"] = rows["x"][rows_saved]
            rows["gu"] = rows["gu"][rows_saved]
    with st.stage("local", dev, timed):
        counts = occupied_counts(rl.counts, plan, comm.rank, w13_S.shape[0])
        offs = offsets(counts, dev)
    with (_timed(st.stats, "expert_bwd_ms", dev) if timed else contextlib.nullcontext()):
        dx_inst, dw13, dw2, *dot = swiglu_backward_owned(rows, w13_S, w2_S, counts, offs,
                                                         scale=scale_inst, rowdot=rowdot)
    with st.stage("local", dev, timed):
        dx_recv = unpermute_rows(dx_inst, rl.to_inst)
    del dx_inst
    dx_back = comm.all_to_all(dx_recv, rl.splits, send_splits)
    del dx_recv
    dg_back = None
    if rowdot:
        with st.stage("local", dev, timed):
            dot_recv = unpermute_rows(dot[0], rl.to_inst)
        dg_back = comm.all_to_all(dot_recv, rl.splits, send_splits)
    return dx_back, dw13, dw2, n_in, dg_back


def _rebuild_gate_up(rows: dict[str, Tensor], n: int, saved_SG: Tensor, st: ExchangeState,
                     w13_S: Tensor, timed: bool) -> None:
    """Put the gate_up outputs of the first ``n`` saved rows, recomputed from their saved
    inputs, in front of the saved ones in ``rows["gu"]``: one buffer of all ``k`` rows.
    The saved part is copied in and dropped before the recompute GEMM, so at most
    ``max(2k - n, k + n)`` rows of ``2F`` are alive at once (a ``cat`` after the GEMM
    would hold ``2k``)."""
    plan, dev = st.plan, w13_S.device
    per_inst = occupied_counts(saved_SG.reshape(plan.S, plan.G).sum(1).tolist(), plan,
                               st.comm.rank, w13_S.shape[0])
    full = rows["gu"].new_empty(rows["gu"].shape[0] + n, rows["gu"].shape[1])
    full[n:] = rows["gu"]
    rows["gu"] = full  # drops the saved part
    with (_timed(st.stats, "expert_bwd_ms", dev) if timed else contextlib.nullcontext()):
        head = gate_up(rows["x"][:n], w13_S, prefix_counts(per_inst, n))
    full[:n] = head
