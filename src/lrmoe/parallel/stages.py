"""The MoE layer's stages on one rank, written once (docs/design.md §2, §9), and the
buffer layouts they read.

Forward:  home ``dispatch_rows`` -> all-to-all -> receiver ``experts_forward`` ->
all-to-all -> home ``combine``.
Backward: home ``home_backward`` (combine^-1, **select**, **compact**) -> all-to-all ->
receiver ``experts_backward`` -> all-to-all -> home ``home_finish``.

Every function works on one rank's plain tensors and layouts; the exchanges between
them belong to the caller (:mod:`lrmoe.parallel.exchange`). Timing wraps regions from
outside through ``tm(key)``, a context-manager factory for the buckets ``local``,
``select``, ``gather`` and the expert kernels; it never changes what a stage computes.

Send buffer (:class:`HomeLayout`): ordered by destination instance i = r*S + s; inside
block (me -> i) the retained pairs first, in descending gate order. Arrival buffer
(:class:`RecvLayout`): ordered by (source g, slot s); the grouped GEMMs' *instance
order* is (s, g). Saved activations are kept for retained rows only, in (s, g, j) order.

Row tensors are handed over and dropped at their last use (the ledger prices what is
alive at each point, ``tests/test_ledger_truth.py``): a rank's rows travel in a dict,
``rows`` (``x``/``gu``: the receiver's kept activations; ``y_send``: the combined
outputs kept at home; ``dy``: the output-gradient rows), which the stages empty as
they go, and big arguments are passed as temporaries the callee frees.

Legend: T tokens, K top-k, P = T*K local pairs, H hidden, G ranks, S slots per rank,
N rows, B blocks, ``_SG`` per (slot, source) block in instance order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, ContextManager

import numpy as np
import torch
from torch import Tensor

from lrmoe.ops.experts import gate_up, swiglu_backward, swiglu_forward
from lrmoe.ops.fused import fused
from lrmoe.ops.rowops import (
    Runs,
    combine_grad_gate,
    home_positions,
    invert_permutation,
    runs,
    runs_many,
    to_device,
    token_norm,
)
from lrmoe.ops.rowops import combine as combine_rows
from lrmoe.ops.selection import ht_weight, select_sampled, select_topk
from lrmoe.parallel.options import BackwardOptions
from lrmoe.policy.plan import Plan

Timer = Callable[[str], ContextManager]


def untimed(key: str) -> ContextManager:
    return contextlib.nullcontext()


# -------------------------------------------------------------------------- layouts
@dataclass
class RecvLayout:
    """Where arriving rows go on the receiving rank, for one exchange.

    Attributes:
        splits: rows arriving from each source rank (list, G).
        counts: rows per local slot in instance order (list, S).
        to_inst: arrival order -> instance order, and ``to_arrival`` the inverse; both
            ``None`` when the two orders coincide (one source rank).
    """

    splits: list[int]
    counts: list[int]
    to_inst: Runs | None
    to_arrival: Runs | None = None


def recv_layout(block_GS: Tensor, device: torch.device | str = "cpu") -> RecvLayout:
    """Layout for rows arriving in (g, s) blocks of sizes ``block_GS[g, s]`` (host)."""
    b = np.asarray(block_GS, dtype=np.int64)
    G, S = b.shape
    to_inst = to_arrival = None
    if G > 1:
        arrival_GS = (np.cumsum(b) - b.ravel()).reshape(G, S)
        inst_SG = (np.cumsum(b.T) - b.T.ravel()).reshape(S, G)
        to_inst, to_arrival = runs_many([(arrival_GS.T.ravel(), b.T.ravel()),
                                         (inst_SG.T.ravel(), b.ravel())], device)
    return RecvLayout(b.sum(1).tolist(), b.sum(0).tolist(), to_inst, to_arrival)


def permute_rows(x: Tensor, order: Runs | None) -> Tensor:
    """``x`` in the order of ``order`` (one kernel), or ``x`` itself when ``None``."""
    return x if order is None else order.apply(x)


@dataclass
class HomeLayout:
    """Send-side layout of one rank's pairs for one plan.

    Attributes:
        send_row_P: position of each local pair in the send buffer; a dropped pair
            points at row ``N_send``, past the buffer.
        dropped: whether any local pair is dropped (capacity policy).
        src_pair: send-buffer position -> local pair index (length N_send).
        j_in_block: send-buffer position -> index inside its block (``None`` on the
            one-process path: only a trimmed backward reads it).
        retain_I, select_I: per block (me -> i) retained count and backward quota.
        assign_I: per block, the rows sent (host; numpy on the one-process path,
            whose one block no torch op touches).
        splits: rows to each destination rank.

    The retained rows' send positions are derived on demand (:meth:`retained`), so they
    are not kept alive between forward and backward.
    """

    send_row_P: Tensor
    dropped: bool
    src_pair: Tensor
    j_in_block: Tensor | None
    retain_I: Tensor
    select_I: Tensor
    assign_I: Tensor
    splits: list[int]

    @property
    def splits_shape(self) -> tuple[int, int]:
        """``(G, S)``: the blocks as destination ranks x slots."""
        return len(self.splits), len(self.assign_I) // len(self.splits)

    def retained(self, device: torch.device) -> Runs | None:
        """The retained rows among the send rows (ascending; each block's retained rows
        come first), or ``None`` when every row is retained."""
        if np.array_equal(np.asarray(self.retain_I), np.asarray(self.assign_I)):
            return None
        return runs(self.assign_I.cumsum(0) - self.assign_I, self.retain_I, device)


def home_layout(plan: Plan, me: int, idx_P: Tensor, gate_P: Tensor, E: int) -> HomeLayout:
    """Assign this rank's pairs to send-buffer positions (see module doc): the host turns
    the plan into one small table of segments, runs of pairs sorted by (expert,
    descending gate) that map linearly onto send rows (docs/design.md §2); the device
    locates every pair with no host wait (:func:`home_positions`)."""
    dev = idx_P.device
    G, S = plan.G, plan.S
    ie = plan.inst_expert_GS.reshape(-1).numpy()
    assign = plan.assign_GGS[me].reshape(-1).numpy()
    retain = plan.retain_GGS[me].reshape(-1).numpy()
    block_start = np.cumsum(assign) - assign
    inst = np.flatnonzero(ie >= 0)
    inst = inst[np.argsort(ie[inst], kind="stable")]  # instances in (expert, index) order
    e_i = ie[inst]
    n_send = int(assign.sum())
    drop_E = (np.zeros(E, dtype=np.int64) if plan.dropped_GE is None
              else plan.dropped_GE[me].numpy().astype(np.int64))
    # segments per expert: retained runs, non-retained runs (instance order), dropped run
    n_i = inst.size
    seg_e = np.concatenate((e_i, e_i, np.arange(E)))
    seg_part = np.repeat(np.arange(3), (n_i, n_i, E))
    seg_ord = np.concatenate((np.arange(n_i), np.arange(n_i), np.zeros(E, dtype=np.int64)))
    seg_len = np.concatenate((retain[inst], assign[inst] - retain[inst], drop_E))
    seg_dest = np.concatenate((block_start[inst], block_start[inst] + retain[inst],
                               np.full(E, n_send)))  # dropped pairs: the row after the last
    seg_j0 = np.concatenate((np.zeros(n_i, dtype=np.int64), retain[inst], np.zeros(E, dtype=np.int64)))
    o = np.lexsort((seg_ord, seg_part, seg_e))
    o = o[seg_len[o] > 0]
    seg_len = seg_len[o]
    tab = np.stack((np.cumsum(seg_len) - seg_len, seg_dest[o], seg_j0[o]))
    dropped = bool(drop_E.any())
    by_gate = dropped or not bool((retain == assign).all())
    tab_dev = to_device(torch.from_numpy(tab), dev)
    # 1-D arguments whose lengths (segments, send rows) are dynamic dimensions of the
    # compiled kernel: no recompile when they change from step to step
    send_row, src_pair, j_in_block = fused("home_positions", home_positions, idx_P)(
        idx_P, gate_P.detach(), tab_dev[0], tab_dev[1], tab_dev[2],
        torch.empty(n_send, dtype=torch.int8, device=dev), by_gate)
    return HomeLayout(send_row, dropped, src_pair, j_in_block,
                      plan.retain_GGS[me].reshape(-1), plan.select_GGS[me].reshape(-1),
                      plan.assign_GGS[me].reshape(-1), assign.reshape(G, S).sum(1).tolist())


# ------------------------------------------------------------------------- forward
def dispatch_rows(x_TH: Tensor, home: HomeLayout, K: int) -> Tensor:
    """The send buffer: each pair's token row, in send order (one kernel: a plain torch
    gather, which on the H200 beat a Triton kernel, launch included)."""
    return x_TH[home.src_pair // K]


@dataclass
class Retention:
    """Which received rows a receiver keeps for backward, in instance (s, g) order.

    Attributes:
        assign_SG: rows per (slot, source) block (host).
        retain_SG: rows kept per block, each block's first ones; ``None``: every row.
        n_rec: the first ``n_rec`` kept rows keep only their input row; their gate_up
            output is recomputed in backward (a memory budget).
        occupied_S: which slots hold an expert (instance weights may leave the empty
            ones out); ``None``: every slot.
    """

    assign_SG: np.ndarray
    retain_SG: np.ndarray | None = None
    n_rec: int = 0
    occupied_S: list[bool] | None = None

    @property
    def saved_SG(self) -> np.ndarray:
        return self.assign_SG if self.retain_SG is None else self.retain_SG

    def weighted(self, counts_S: list[int], n_weights: int) -> list[int]:
        """Rows per slot for the grouped GEMMs, over the slots that have weights: all ``S``
        slots, or only the occupied ones when the instance weights leave out the empty
        slots (:func:`lrmoe.parallel.instances.instance_weight_list`; they hold no rows)."""
        if n_weights == len(counts_S):
            return counts_S
        return [c for c, o in zip(counts_S, self.occupied_S) if o]


def experts_forward(rows: dict, recv: RecvLayout, w13: Tensor, w2: Tensor,
                    counts: Sequence[int] | None, keep: Retention, tm: Timer = untimed,
                    expert: str = "expert_fwd", offs: Tensor | None = None) -> Tensor:
    """Receiver: arrival order -> instance order, the SwiGLU experts, the retention,
    instance order -> arrival order. ``rows["x"]`` holds the received rows (arrival
    order; freed after their permutation) and on return the kept ``x`` and ``gu`` rows
    (saved order). Returns ``y_recv``."""
    x_recv = rows.pop("x")
    dev = x_recv.device
    with tm("local"):
        x_inst = permute_rows(x_recv, recv.to_inst)
    del x_recv
    with tm(expert):
        y_inst, gu_inst = swiglu_forward(x_inst, w13, w2, counts, offs)
    n = keep.n_rec
    with tm("gather"):
        if keep.retain_SG is None:
            rows["x"], rows["gu"] = x_inst, (gu_inst[n:].clone() if n else gu_inst)
        else:  # each block's first retain rows; the first n of them keep x alone
            first = np.cumsum(keep.assign_SG) - keep.assign_SG
            cut = prefix_counts(keep.retain_SG, n)
            keep_x, keep_gu = runs_many([(first, keep.retain_SG),
                                         (first + cut, keep.retain_SG - cut)], dev)
            rows["x"], rows["gu"] = keep_x.apply(x_inst), keep_gu.apply(gu_inst)
        del gu_inst, x_inst
    with tm("local"):
        return permute_rows(y_inst, recv.to_arrival)


def prefix_counts(counts, n: int) -> np.ndarray:
    """Per segment of sizes ``counts`` (in order), how many of the first ``n`` rows it holds."""
    c = np.asarray(counts, dtype=np.int64)
    return np.minimum(c, np.maximum(n - (np.cumsum(c) - c), 0))


def retention(plan: Plan, me: int, save_all: bool = False) -> Retention:
    """Rank ``me``'s retention of its received rows under ``plan``. ``save_all`` (a
    fidelity step of an approximate plan) keeps every row and recomputes none."""
    assign = plan.assign_GGS.numpy()[:, me, :].T.ravel()
    n_rec = 0 if plan.recompute_G is None or save_all else int(plan.recompute_G[me])
    occupied = (plan.inst_expert_GS.numpy()[me] >= 0).tolist()
    retain = plan.retain_GGS.numpy()[:, me, :].T.ravel()
    every = save_all or np.array_equal(retain, assign)
    return Retention(assign, None if every else retain, n_rec, occupied)


@dataclass
class Combined:
    """The home side's combine: the output and what its backward reads.

    Attributes:
        out_TH: ``sum_k w[t,k] * y[row[t,k]]``.
        row_TK: each pair's row in the combined buffer; a row past the buffer is a
            dropped pair (the capacity policy's), which weighs 0.
        w_TK: the gates.
    """

    out_TH: Tensor | None
    row_TK: Tensor
    w_TK: Tensor


def combine(y_send: Tensor, send_row_P: Tensor, gate_TK: Tensor) -> Combined:
    """Home: the gate-weighted sum of each token's expert outputs ``y_send`` (send
    order; ``send_row_P``: each pair's row), in one kernel."""
    row_TK = send_row_P.view(gate_TK.shape)
    return Combined(combine_rows(y_send, row_TK, gate_TK), row_TK, gate_TK)


# ------------------------------------------------------------------------ backward
@dataclass
class Shipped:
    """What a home rank ships in the backward dispatch (``rows["dy"]`` holds the rows).

    Attributes:
        pairs: the shipped rows' pairs; ``None`` when every send row ships, in send
            order (an exact plan).
        j: each shipped row's index inside its block (locates its kept activations).
        scale: each shipped row's output-gradient scale (gate, times 1/pi when sampled).
        sent_GS: rows sent to each (rank, slot) block (host).
        recv_GS: rows this rank receives from each (source, slot) block (host): from the
            plan, or the sampled estimator's exchanged counts.
    """

    pairs: Tensor | None
    j: Tensor
    scale: Tensor
    sent_GS: Tensor
    recv_GS: Tensor


def home_backward(dout_TH: Tensor, comb: Combined, home: HomeLayout, gate_P: Tensor,
                  select_GS_me: Tensor, retain_GS_me: Tensor, exact: bool,
                  opts: BackwardOptions, rows: dict, generator=None, exchange_counts=None,
                  at_experts: bool = False, tm: Timer = untimed) -> tuple[Tensor | None, Shipped]:
    """Home: combine^-1, **select** and **compact**. Returns the exact router gradient
    (``None`` when the experts compute it: ``at_experts``) and what to ship; puts the
    output-gradient rows (unscaled ``dout[t]``) into ``rows["dy"]`` and drops
    ``rows["y_send"]``. ``select_GS_me``, ``retain_GS_me``: the plan's blocks this rank
    receives (``[:, me, :]``), the split sizes when every selected row ships."""
    dev = dout_TH.device
    K = comb.w_TK.shape[1]
    w_P = comb.w_TK.reshape(-1)
    with tm("local"):
        # the router gradient dL/dg[t,k] = <dout[t], y[t,k]> from the kept combined rows
        # (zero for dropped pairs, in the gates' dtype) ...
        y_send = rows.pop("y_send")
        dgate = (None if at_experts
                 else combine_grad_gate(y_send, comb.row_TK, dout_TH).to(comb.w_TK.dtype))
        del y_send
        # ... and the candidates: the retained send rows' pairs and places in their
        # blocks; each ships dout[t] unscaled, its scale g folded into the receiver's
        # elementwise kernels
        ret = home.retained(dev)
        pairs, j = permute_rows(home.src_pair, ret), permute_rows(home.j_in_block, ret)
        sent_GS = home.retain_I.reshape(home.splits_shape)
        if exact:
            rows["dy"], scale = dout_TH[pairs // K], w_P[pairs].float()
            return dgate, Shipped(None if ret is None else pairs, j, scale, sent_GS, retain_GS_me)
    with tm("select"):
        pick = select_and_compact(dout_TH, pairs // K, w_P[pairs].float(), gate_P[pairs], home,
                                  opts, generator, exchange_counts)
    rows["dy"] = pick.dy
    if pick.idx is not None:
        pairs, j = pairs[pick.idx], j[pick.idx]
    recv_GS = (pick.recv_GS if pick.recv_GS is not None
               else select_GS_me if opts.compaction else retain_GS_me)
    return dgate, Shipped(pairs, j, pick.scale, pick.sent_B.reshape(home.splits_shape), recv_GS)


@dataclass
class Picked:
    """The candidates one home rank ships.

    Attributes:
        idx: the shipped candidates' indices (ascending: send order); ``None``: every
            candidate ships (the compaction-off ablation, unselected ones weighing 0).
        scale: each shipped row's output-gradient scale (fp32).
        dy: each shipped row's ``dout[t]`` (unscaled).
        sent_B: rows shipped per block (host).
        recv_GS: with the sampled estimator's count exchange, the rows each (source,
            slot) block sends this rank (host); ``None``: known from the plan.
    """

    idx: Tensor | None
    scale: Tensor
    dy: Tensor
    sent_B: Tensor
    recv_GS: Tensor | None = None


def select_and_compact(dout_TH: Tensor, tok_c: Tensor, g_c: Tensor, gate_c: Tensor,
                       home: HomeLayout, opts: BackwardOptions, generator,
                       exchange_counts: Callable[[Tensor], Tensor] | None = None) -> Picked:
    """LRMoE's backward **select** and **compact** on one home rank: which of its
    candidates (token ``tok_c``, scale ``g_c``, gate ``gate_c``) ship to the experts, with
    what output-gradient scale (docs/design.md §2; the kernels are
    :mod:`lrmoe.ops.selection`'s).

    No host wait but one: the sampled estimator's kept rows per block, exchanged with
    the peers on the device (``exchange_counts``, sent ``[G, S]`` -> received ``[G, S]``)
    and read together with them in one copy: the split sizes of the backward exchange.
    """
    norm_T = token_norm(dout_TH) if opts.metric == "grad_norm" else None
    gather = dout_TH if opts.compaction else None
    if opts.estimator == "sampled":
        sel = select_sampled(opts.metric, norm_T, tok_c, g_c, gate_c, home.retain_I,
                             home.select_I, generator, exchange_counts, home.splits_shape,
                             gather)
    else:
        sel = select_topk(opts.metric, norm_T, tok_c, g_c, gate_c, home.retain_I,
                          home.select_I, gather)
    if not opts.compaction:  # every retained row ships, the unselected ones weighing 0
        w = (sel.keep_N.float() if sel.pi_N is None
             else torch.where(sel.keep_N, ht_weight(sel.pi_N), 0.0).float())
        return Picked(None, g_c * w, dout_TH[tok_c], home.retain_I)
    return Picked(sel.sel_idx_S, sel.scale_S, sel.dy_SH, sel.sent_B, sel.recv_GS)


def experts_backward(rows: dict, j_recv: Tensor, scale_recv: Tensor, recv: RecvLayout,
                     recv_GS: Tensor, keep: Retention, w13: Tensor, w2: Tensor,
                     counts: Sequence[int] | None, offs: Tensor, rowdot: bool = False,
                     tm: Timer = untimed) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Receiver: experts^-1 over the arrived (compacted) rows. Returns ``(dx_recv, dw13,
    dw2, dot_recv)`` with the rows in arrival order; ``dot_recv`` (with ``rowdot``) is
    each row's router gradient ``<dy, y>``. ``rows`` holds the kept ``x`` and ``gu``
    (saved order) and the arrived ``dy`` rows (arrival order), and is emptied.
    ``recv_GS``: the rows each (source, slot) block sent, which locate their kept
    activations with ``j_recv``."""
    dev = rows["dy"].device
    saved_SG = keep.saved_SG
    if keep.n_rec:  # rebuild the kept rows' gate_up outputs (instance order) first
        _rebuild_gate_up(rows, keep, counts, w13, tm)
    with tm("local"):
        scale_inst = permute_rows(scale_recv, recv.to_inst)
        rows["dy"] = permute_rows(rows["dy"], recv.to_inst)
    del scale_recv
    S_G = np.asarray(recv_GS).T.ravel()
    if not np.array_equal(saved_SG, S_G):
        # gather the kept rows of the arriving ones (else every kept row arrives, in
        # saved order, and they are used as they are)
        with tm("gather"):
            n_in = rows["dy"].shape[0]
            blk = torch.repeat_interleave(torch.arange(S_G.size, device=dev),
                                          to_device(torch.from_numpy(S_G), dev), output_size=n_in)
            first = torch.from_numpy(np.cumsum(saved_SG) - saved_SG)
            at = to_device(first, dev)[blk] + permute_rows(j_recv, recv.to_inst)
            rows["x"] = rows["x"][at]
            rows["gu"] = rows["gu"][at]
    with tm("expert_bwd"):
        dx_inst, dw13, dw2, *dot = swiglu_backward(rows, w13, w2, counts, offs,
                                                   scale=scale_inst, rowdot=rowdot)
    with tm("local"):
        dx_recv = permute_rows(dx_inst, recv.to_arrival)
        del dx_inst
        dot_recv = permute_rows(dot[0], recv.to_arrival) if rowdot else None
    return dx_recv, dw13, dw2, dot_recv


def _rebuild_gate_up(rows: dict[str, Tensor], keep: Retention, counts: Sequence[int],
                     w13: Tensor, tm: Timer) -> None:
    """Put the gate_up outputs of the first ``n`` kept rows, recomputed from their kept
    inputs, in front of the kept ones in ``rows["gu"]``: one buffer of all ``k`` rows.
    The kept part is copied in and dropped before the recompute GEMM, so at most
    ``max(2k - n, k + n)`` rows of ``2F`` are alive at once (a ``cat`` after the GEMM
    would hold ``2k``). ``counts``: rows per weighted instance (its length says whether
    the empty slots have weights)."""
    n = keep.n_rec
    kept_S = keep.saved_SG.reshape(len(keep.occupied_S), -1).sum(1).tolist()
    kept_I = keep.weighted(kept_S, len(counts))
    full = rows["gu"].new_empty(rows["gu"].shape[0] + n, rows["gu"].shape[1])
    full[n:] = rows["gu"]
    rows["gu"] = full  # drops the kept part
    with tm("expert_bwd"):
        head = gate_up(rows["x"][:n], w13, prefix_counts(kept_I, n).tolist())
    full[:n] = head


def home_finish(dx_back: Tensor, home: HomeLayout, sh: Shipped, comb: Combined,
                tm: Timer = untimed) -> Tensor:
    """Home: the shipped rows' input gradients back to pair order (pairs not shipped
    weigh 0), summed over each token's k pairs: ``dx_TH``."""
    T, K = comb.w_TK.shape
    with tm("local"):
        ones = torch.ones(T, K, device=dx_back.device)
        if sh.pairs is None and not home.dropped:  # every pair shipped, in send order
            return combine_rows(dx_back, comb.row_TK, ones)
        pairs = home.src_pair if sh.pairs is None else sh.pairs
        row_of_pair = invert_permutation(pairs, T * K, fill=dx_back.shape[0])
        return combine_rows(dx_back, row_of_pair.view(T, K), ones)


def router_grad_experts(dg_back: Tensor, home: HomeLayout, comb: Combined,
                        tm: Timer = untimed) -> Tensor:
    """The router gradient the experts computed (exact plans: every send row came
    back, in send order), in pair order ``[T, K]``; zero for dropped pairs."""
    with tm("local"):
        if home.dropped:
            dg_back = torch.cat((dg_back, dg_back.new_zeros(1)))
        return dg_back[comb.row_TK].to(comb.w_TK.dtype)
