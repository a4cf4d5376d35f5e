"""Index arithmetic that turns a plan into buffer layouts for one rank (no communication).

Legend: G ranks, S slots per rank, P local pairs (tokens x top-k), i = r*S + s.

Send buffer (home side): ordered by destination instance i; inside block (me -> i) the
retained pairs come first, in descending gate order. Arrival buffer (receiver side):
ordered by (source g, slot s); the *instance order* used by the grouped GEMMs is
(s, g). Saved activations are kept for retained rows only, in (s, g, j) order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lrmoe.ops.fused import fused
from lrmoe.ops.rowops import gather_runs, to_device
from lrmoe.policy.plan import Plan


def excl_cumsum(x: Tensor) -> Tensor:
    return x.cumsum(0) - x


@dataclass(frozen=True)
class Runs:
    """A row permutation made of contiguous chunks (:func:`lrmoe.ops.rowops.gather_runs`):
    output rows ``[dst_first[k], dst_first[k+1])`` are source rows from ``src_first[k]``
    on. The table lives on the device; ``n`` rows come out."""

    dst_first: Tensor
    src_first: Tensor
    n: int

    def apply(self, x: Tensor) -> Tensor:
        return gather_runs(x, self.dst_first, self.src_first, self.n)


def runs(starts, lengths, device: torch.device | str) -> Runs:
    """The chunks ``[starts[k], starts[k] + lengths[k])`` of a source, concatenated in
    order (host starts and lengths: one pinned copy of the table)."""
    return runs_many([(starts, lengths)], device)[0]


def runs_many(chunks: list[tuple], device: torch.device | str) -> list[Runs]:
    """:func:`runs` of several ``(starts, lengths)`` lists, in one copy to ``device``."""
    rows, n = [], []
    for st, ln in chunks:
        st, ln = np.asarray(st, dtype=np.int64), np.asarray(ln, dtype=np.int64)
        rows += [np.cumsum(ln) - ln, st]
        n.append(int(ln.sum()))
    sizes = [r.size for r in rows]
    flat = to_device(torch.from_numpy(np.concatenate(rows)), device).split(sizes)
    return [Runs(flat[2 * i], flat[2 * i + 1], n[i]) for i in range(len(chunks))]


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

    @property
    def all_retained(self) -> bool:
        return bool(np.array_equal(np.asarray(self.retain_I), np.asarray(self.assign_I)))

    def retained(self, device: torch.device) -> Runs | None:
        """The retained rows among the send rows (ascending; each block's retained rows
        come first), or ``None`` when every row is retained."""
        if self.all_retained:
            return None
        return runs(excl_cumsum(self.assign_I), self.retain_I, device)


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


def sort_key_by_expert_then_gate(idx_P: Tensor, gate_P: Tensor) -> Tensor:
    """An int64 key whose stable ascending sort orders pairs by expert, then by
    descending gate (ties in pair order): the expert in the high 32 bits, the gate's
    float32 bits made order-preserving (and flipped) in the low 32. float32 represents
    bf16/fp16 gates exactly; ``-0.0`` is folded into ``0.0`` so the two tie."""
    b = (gate_P.float() + 0.0).view(torch.int32).long()
    ordered = torch.where(b < 0, b ^ 0x7FFFFFFF, b)  # monotone in the float value
    return idx_P.long() * (1 << 32) + (0x7FFFFFFF - ordered)


def home_positions(idx_P: Tensor, gate_P: Tensor, first_N: Tensor, row0_N: Tensor,
                   j0_N: Tensor, like_send: Tensor,
                   by_gate: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The device part of :func:`home_layout`: ``(send_row_P, src_pair_N, j_in_block_N)``.

    Per segment: its first sorted position (``first``), its first send row (``row0``;
    ``n_send`` for dropped pairs, which all land on that one spare row) and its first
    index inside its block (``j0``); ``n_send`` is ``len(like_send)`` (only its length is
    read). No host wait.
    """
    P, dev, n_send = idx_P.numel(), idx_P.device, like_send.shape[0]
    if by_gate and gate_P.dtype != torch.float64:
        order = torch.argsort(sort_key_by_expert_then_gate(idx_P, gate_P), stable=True)
    elif by_gate:  # float64 gates: two stable sorts keep their full order
        o1 = torch.argsort(gate_P, descending=True, stable=True)
        order = o1[torch.argsort(idx_P[o1], stable=True)]
    else:
        order = torch.argsort(idx_P, stable=True)
    p = torch.arange(P, device=dev)
    k = torch.searchsorted(first_N, p, right=True) - 1
    off, row0 = p - first_N[k], row0_N[k]
    dropped = row0 == n_send
    row = torch.where(dropped, row0, row0 + off)
    send_row = torch.empty_like(order)
    send_row[order] = row
    spare = int(P > n_send)  # dropped pairs all write one spare column, cut off after
    inv = torch.empty(2, n_send + spare, dtype=order.dtype, device=dev)
    inv[:, row] = torch.stack((order, j0_N[k] + off))
    if spare:  # copies: the kept buffers hold no spare entry (the ledger's pair_index)
        return send_row, inv[0, :n_send].clone(), inv[1, :n_send].clone()
    return send_row, inv[0], inv[1]
