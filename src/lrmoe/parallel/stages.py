"""The MoE layer's stages on one rank, written once (docs/design.md §2, §9).

Forward:  home ``dispatch_rows`` -> all-to-all -> receiver ``experts_forward`` ->
all-to-all -> home ``combine``.
Backward: home ``home_backward`` (combine^-1, select, compact) -> all-to-all ->
receiver ``experts_backward`` -> all-to-all -> home ``home_finish``.

Every function works on one rank's plain tensors and layouts; the exchanges between
them belong to the caller: the stage sequence of :mod:`lrmoe.parallel.exchange`, over
a real rank's collectives, one process's identity (:mod:`lrmoe.parallel.local`) or the
emulator's G virtual ranks in memory. Timing wraps regions from outside through
``tm(key)``, a context-manager factory for the buckets ``local``, ``select``, ``gather``
and the expert kernels; it never changes what a stage computes.

Row tensors are handed over and dropped at their last use (the ledger prices what is
alive at each point, ``tests/test_ledger_truth.py``): a rank's rows travel in a dict,
``rows`` (``x``/``gu``: the receiver's kept activations; ``y_send``: the combined
outputs kept at home; ``dy``: the output-gradient rows), which the stages empty as
they go, and big arguments are passed as temporaries the callee frees.

Legend: T tokens, K top-k, P = T*K local pairs, H hidden, G ranks, S slots per rank,
N rows, ``_SG`` per (slot, source) block in instance order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, ContextManager

import numpy as np
import torch
from torch import Tensor

from lrmoe.ops.experts import gate_up, prefix_counts, swiglu_backward_owned, swiglu_forward
from lrmoe.ops.rowops import combine as combine_rows
from lrmoe.ops.rowops import (
    combine_grad_gate,
    gather_pairs,
    gather_pairs_scaled,
    invert_permutation,
    to_device,
)
from lrmoe.parallel.layout import HomeLayout, RecvLayout, permute_rows, runs_many
from lrmoe.parallel.select import BackwardOptions, select_and_compact
from lrmoe.policy.plan import Plan

Timer = Callable[[str], ContextManager]


def untimed(key: str) -> ContextManager:
    return contextlib.nullcontext()


# ------------------------------------------------------------------------- forward
def dispatch_rows(x_TH: Tensor, home: HomeLayout, K: int) -> Tensor:
    """The send buffer: each pair's token row, in send order (one kernel)."""
    return gather_pairs(x_TH, home.src_pair, K)


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
            keep_x, keep_gu = runs_many([(first, keep.retain_SG),
                                         _skip(first, keep.retain_SG, n)], dev)
            rows["x"], rows["gu"] = keep_x.apply(x_inst), keep_gu.apply(gu_inst)
        del gu_inst, x_inst
    with tm("local"):
        y_recv = permute_rows(y_inst, recv.to_arrival)
    return y_recv


def _skip(starts: np.ndarray, lengths: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The chunks ``(starts, lengths)`` without their first ``n`` rows overall."""
    cut = np.minimum(lengths, np.maximum(n - (np.cumsum(lengths) - lengths), 0))
    return starts + cut, lengths - cut


def retention(plan: Plan, me: int, save_all: bool = False) -> Retention:
    """Rank ``me``'s retention of its received rows under ``plan``. ``save_all`` (a
    fidelity step of an approximate plan) keeps every row and recomputes none."""
    assign = plan.assign_GGS.numpy()[:, me, :].T.ravel()
    n_rec = 0 if plan.recompute_G is None or save_all else int(plan.recompute_G[me])
    occupied = (plan.inst_expert_GS.numpy()[me] >= 0).tolist()
    retain = plan.retain_GGS.numpy()[:, me, :].T.ravel()
    if save_all or np.array_equal(retain, assign):
        return Retention(assign, None, n_rec, occupied)
    return Retention(assign, retain, n_rec, occupied)


def occupied_counts(counts_S: list[int], plan: Plan, me: int, n_weights: int) -> list[int]:
    """Rows per slot for the grouped GEMMs, over the slots that have weights: all ``S``
    slots, or only the occupied ones when the instance weights leave out the empty
    slots (:func:`lrmoe.parallel.weights.instance_weight_list`; empty slots hold no rows)."""
    if n_weights == len(counts_S):
        return counts_S
    occ = (plan.inst_expert_GS[me] >= 0).tolist()
    return [c for c, o in zip(counts_S, occ) if o]


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
        # the router gradient <dout[t], y[t,k]> from the kept combined rows ...
        y_send = rows.pop("y_send")
        dgate = None if at_experts else router_grad_home(y_send, comb, dout_TH)
        del y_send
        # ... and the candidates: the retained send rows' pairs and places in their
        # blocks; each ships dout[t] unscaled, its scale g folded into the receiver's
        # elementwise kernels
        ret = home.retained(dev)
        pairs = home.src_pair if ret is None else ret.apply(home.src_pair)
        j = home.j_in_block if ret is None else ret.apply(home.j_in_block)
        sent_GS = home.retain_I.reshape(home.splits_shape)
        if exact:
            rows["dy"], scale = gather_pairs_scaled(dout_TH, pairs, K, w_P)
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


def router_grad_home(y_send: Tensor, comb: Combined, dout_TH: Tensor) -> Tensor:
    """combine^-1 on the home side: ``dL/dg[t,k] = <dout[t], y[t,k]>`` from the kept
    combined rows, zero for dropped pairs, in the gates' dtype."""
    return combine_grad_gate(y_send, comb.row_TK, dout_TH).to(comb.w_TK.dtype)


def experts_backward(rows: dict, j_recv: Tensor, scale_recv: Tensor, recv: RecvLayout,
                     recv_GS: Tensor, keep: Retention, w13: Tensor, w2: Tensor,
                     counts: Sequence[int] | None, offs: Tensor, rowdot: bool = False,
                     tm: Timer = untimed, expert: str = "expert_bwd"
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Receiver: experts^-1 over the arrived (compacted) rows. Returns ``(dx_recv, dw13,
    dw2, dot_recv)`` with the rows in arrival order; ``dot_recv`` (with ``rowdot``) is
    each row's router gradient ``<dy, y>``. ``rows`` holds the kept ``x`` and ``gu``
    (saved order) and the arrived ``dy`` rows (arrival order), and is emptied.
    ``recv_GS``: the rows each (source, slot) block sent, which locate their kept
    activations with ``j_recv``; ``None``: every kept row arrived, in saved order."""
    dev = rows["dy"].device
    saved_SG = keep.saved_SG
    if keep.n_rec:  # rebuild the kept rows' gate_up outputs (instance order) first
        _rebuild_gate_up(rows, keep, counts, w13, tm, expert)
    with tm("local"):
        scale_inst = permute_rows(scale_recv, recv.to_inst)
        rows["dy"] = permute_rows(rows["dy"], recv.to_inst)
    del scale_recv
    S_G = None if recv_GS is None else np.asarray(recv_GS).T.ravel()
    if S_G is not None and not np.array_equal(saved_SG, S_G):
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
    with tm(expert):
        dx_inst, dw13, dw2, *dot = swiglu_backward_owned(rows, w13, w2, counts, offs,
                                                         scale=scale_inst, rowdot=rowdot)
    with tm("local"):
        dx_recv = permute_rows(dx_inst, recv.to_arrival)
        del dx_inst
        dot_recv = permute_rows(dot[0], recv.to_arrival) if rowdot else None
    return dx_recv, dw13, dw2, dot_recv


def _rebuild_gate_up(rows: dict[str, Tensor], keep: Retention, counts: Sequence[int],
                     w13: Tensor, tm: Timer, expert: str) -> None:
    """Put the gate_up outputs of the first ``n`` kept rows, recomputed from their kept
    inputs, in front of the kept ones in ``rows["gu"]``: one buffer of all ``k`` rows.
    The kept part is copied in and dropped before the recompute GEMM, so at most
    ``max(2k - n, k + n)`` rows of ``2F`` are alive at once (a ``cat`` after the GEMM
    would hold ``2k``). ``counts``: rows per weighted instance (its length says whether
    the empty slots have weights)."""
    n, occ = keep.n_rec, keep.occupied_S
    kept_S = keep.saved_SG.reshape(len(occ), -1).sum(1).tolist()
    kept_I = kept_S if len(counts) == len(kept_S) else [c for c, o in zip(kept_S, occ) if o]
    full = rows["gu"].new_empty(rows["gu"].shape[0] + n, rows["gu"].shape[1])
    full[n:] = rows["gu"]
    rows["gu"] = full  # drops the kept part
    with tm(expert):
        head = gate_up(rows["x"][:n], w13, prefix_counts(kept_I, n))
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
