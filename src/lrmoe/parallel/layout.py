"""Index arithmetic that turns a plan into buffer layouts for one rank (no communication).

Legend: G ranks, S slots per rank, P local pairs (tokens x top-k), i = r*S + s.

Send buffer (home side): ordered by destination instance i; inside block (me -> i) the
retained pairs come first, in descending gate order. Arrival buffer (receiver side):
ordered by (source g, slot s); the *instance order* used by the grouped GEMMs is
(s, g). Saved activations are kept for retained rows only, in (s, g, j) order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lrmoe.policy.plan import Plan


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """Copy a small host tensor to ``device`` without a stream sync.

    A copy from pageable host memory makes CUDA drain the stream first; staging it in
    pinned memory lets the copy queue behind the running kernels instead.
    """
    device = torch.device(device)
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def excl_cumsum(x: Tensor) -> Tensor:
    return x.cumsum(0) - x


def ranges(starts: Tensor, lengths: Tensor, device: torch.device | str = "cpu") -> Tensor:
    """Concatenation of ``arange(starts[k], starts[k] + lengths[k])`` over k.

    ``starts`` and ``lengths`` are small CPU tensors (one entry per block); the result
    is built on ``device`` without a host sync (its size is known on the host).
    """
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    base = to_device(starts - excl_cumsum(lengths), device)
    base = torch.repeat_interleave(base, to_device(lengths, device), output_size=total)
    return base + torch.arange(total, device=device)


@dataclass
class RecvLayout:
    """Where arriving rows go on the receiving rank, for one exchange.

    Attributes:
        splits: rows arriving from each source rank (list, G).
        counts: rows per local slot in instance order (list, S).
        to_inst: instance-order position -> arrival position, or ``None`` when the two
            orders coincide (one source rank): callers then skip the permutation.
    """

    splits: list[int]
    counts: list[int]
    to_inst: Tensor | None


def recv_layout(block_GS: Tensor, device: torch.device | str = "cpu") -> RecvLayout:
    """Layout for rows arriving in (g, s) blocks of sizes ``block_GS[g, s]``."""
    G, S = block_GS.shape
    to_inst = None
    if G > 1:
        start_GS = excl_cumsum(block_GS.reshape(-1)).reshape(G, S)
        to_inst = ranges(start_GS.t().reshape(-1), block_GS.t().reshape(-1), device)
    return RecvLayout(block_GS.sum(1).tolist(), block_GS.sum(0).tolist(), to_inst)


def permute_rows(x: Tensor, idx: Tensor | None) -> Tensor:
    """``x[idx]``, or ``x`` itself when ``idx`` is None (identity)."""
    return x if idx is None else x[idx]


def unpermute_rows(x: Tensor, idx: Tensor | None) -> Tensor:
    """The inverse of :func:`permute_rows`: ``out[idx] = x``."""
    if idx is None:
        return x
    out = torch.empty_like(x)
    out[idx] = x
    return out


@dataclass
class HomeLayout:
    """Send-side layout of one rank's pairs for one plan.

    Attributes:
        send_pos_P: position of each local pair in the send buffer, -1 if dropped.
        send_row_P: like ``send_pos_P`` but dropped pairs point at row ``N_send`` (a zero
            row the caller appends), so gathers need no mask.
        dropped: whether any local pair is dropped (capacity policy).
        retained_pos: send positions of the retained rows (ascending), or ``None`` when
            every row is retained.
        src_pair: send-buffer position -> local pair index (length N_send).
        block_of: send-buffer position -> global instance index i.
        j_in_block: send-buffer position -> index inside its block.
        retain_I, select_I: per block (me -> i) retained count and backward quota.
        splits: rows to each destination rank.
    """

    send_pos_P: Tensor
    send_row_P: Tensor
    dropped: bool
    retained_pos: Tensor | None
    src_pair: Tensor
    block_of: Tensor
    j_in_block: Tensor
    retain_I: Tensor
    select_I: Tensor
    splits: list[int]


def home_layout(plan: Plan, me: int, idx_P: Tensor, gate_P: Tensor, E: int) -> HomeLayout:
    """Assign this rank's pairs to send-buffer positions (see module doc)."""
    dev = idx_P.device
    G, S = plan.G, plan.S
    I = G * S
    ie = plan.inst_expert_GS.reshape(-1)
    assign = plan.assign_GGS[me].reshape(-1)
    retain = plan.retain_GGS[me].reshape(-1)
    valid = ie >= 0
    block_start = excl_cumsum(assign)
    # Instances in expert order; their retained and non-retained position ranges.
    e_key = torch.where(valid, ie, torch.full_like(ie, E))
    inst_order = torch.argsort(e_key * I + torch.arange(I), stable=True)
    pos_ret = ranges(block_start[inst_order], retain[inst_order], dev)
    pos_non = ranges(block_start[inst_order] + retain[inst_order], (assign - retain)[inst_order],
                     dev)
    e_c = ie.clamp(min=0)
    R_E = torch.zeros(E, dtype=torch.long).index_add_(0, e_c, retain * valid)
    A_E = torch.zeros(E, dtype=torch.long).index_add_(0, e_c, assign * valid)
    ret_start, non_start = excl_cumsum(R_E), excl_cumsum(A_E - R_E)

    # Local pairs sorted by (expert, descending gate): retained pairs are the top gates.
    # When every pair is retained the gate order is irrelevant: one sort suffices.
    P = idx_P.numel()
    all_retained = torch.equal(retain, assign)
    if all_retained:
        order = torch.argsort(idx_P, stable=True)
    else:
        o1 = torch.argsort(gate_P.detach(), descending=True, stable=True)
        o2 = torch.argsort(idx_P[o1], stable=True)
        order = o1[o2]
    e_sorted = idx_P[order]
    rk = torch.arange(P, device=dev) - torch.searchsorted(e_sorted, e_sorted)
    small = to_device(torch.stack([R_E, A_E, ret_start, non_start]), dev)  # one copy
    R, A = small[0][e_sorted], small[1][e_sorted]
    is_ret = rk < R
    pos_ret_d, pos_non_d = pos_ret, pos_non
    ret_i = (small[2][e_sorted] + rk).clamp(max=max(pos_ret.numel() - 1, 0))
    non_i = (small[3][e_sorted] + rk - R).clamp(min=0, max=max(pos_non.numel() - 1, 0))
    pos_sorted = torch.where(
        is_ret, pos_ret_d[ret_i] if pos_ret.numel() else rk,
        pos_non_d[non_i] if pos_non.numel() else rk)
    pos_sorted = torch.where(rk < A, pos_sorted, torch.full_like(pos_sorted, -1))
    send_pos = torch.empty_like(pos_sorted)
    send_pos[order] = pos_sorted

    n_send = int(assign.sum())
    dropped = n_send < P
    src_pair = torch.empty(n_send, dtype=torch.long, device=dev)
    if dropped:
        kept = send_pos >= 0
        src_pair[send_pos[kept]] = torch.arange(P, device=dev)[kept]
        send_row = torch.where(kept, send_pos, torch.full_like(send_pos, n_send))
    else:
        src_pair[send_pos] = torch.arange(P, device=dev)
        send_row = send_pos
    retained_pos = None if all_retained else ranges(block_start, retain, dev)
    ab = to_device(torch.stack([assign, block_start]), dev)
    block_of = torch.repeat_interleave(torch.arange(I, device=dev), ab[0], output_size=n_send)
    j_in_block = torch.arange(n_send, device=dev) - ab[1][block_of]
    return HomeLayout(send_pos, send_row, dropped, retained_pos, src_pair, block_of, j_in_block, retain,
                      plan.select_GGS[me].reshape(-1), assign.reshape(G, S).sum(1).tolist())
