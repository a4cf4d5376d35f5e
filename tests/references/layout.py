"""Readable references of the runtime's layouts (tests only): each block of pairs placed
with host-sized ``arange`` ranges, one block at a time."""

from __future__ import annotations

import torch
from torch import Tensor

from lrmoe.policy.plan import Plan


def excl_cumsum(x: Tensor) -> Tensor:
    return x.cumsum(0) - x


def ranges(starts: Tensor, lengths: Tensor, device="cpu") -> Tensor:
    """Concatenation of ``arange(starts[k], starts[k] + lengths[k])`` over k."""
    parts = [torch.arange(int(s), int(s) + int(n)) for s, n in zip(starts, lengths)]
    out = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return out.to(device)


def to_device(t: Tensor, device) -> Tensor:
    return t.to(device)


def home_layout_reference(plan: Plan, me: int, idx_P: Tensor, gate_P: Tensor, E: int) -> dict:
    """The send layout built block by block from host ranges (the readable reference of
    :func:`lrmoe.parallel.stages.home_layout`): a dict of its fields."""
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
    dropped_any = plan.dropped_GE is not None and bool(plan.dropped_GE[me].any())
    if all_retained and not dropped_any:
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
    return dict(send_pos_P=send_pos, send_row_P=send_row, dropped=dropped,
                retained_pos=retained_pos, src_pair=src_pair, block_of=block_of,
                j_in_block=j_in_block, splits=assign.reshape(G, S).sum(1).tolist())


def block_ids(sizes_B: Tensor, device="cpu") -> Tensor:
    """``b`` repeated ``sizes_B[b]`` times."""
    return torch.repeat_interleave(torch.arange(sizes_B.numel()), sizes_B.cpu()).to(device)


def send_blocks(plan: Plan, me: int, device="cpu") -> Tensor:
    """Global instance index of each of home rank ``me``'s send rows."""
    return block_ids(plan.assign_GGS[me].reshape(-1), device)


def pair_rows(row_P: Tensor, n: int, T: int, K: int) -> tuple[Tensor, Tensor | None]:
    """Rows ``[T, K]`` into an ``n``-row buffer, rows ``>= n`` clamped, with their 0/1
    weight mask (``None`` when every row is valid): how the runtime masked dropped pairs
    before its combine kernel took rows past the buffer as weighing 0."""
    row = row_P.view(T, K)
    if n == T * K or n == 0:
        return (row, None) if n else (row.clamp(max=0), torch.zeros(T, K, device=row.device))
    return row.clamp(max=n - 1), (row < n).float()
