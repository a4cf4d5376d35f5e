"""The planners' torch and loop readings: static's placement, the largest-remainder split
(the runtime's is numpy, :func:`lrmoe.policy.plan_numpy.apportion_rows_np`), the interval
split (the runtime's is numpy, :class:`lrmoe.policy.plan_numpy.Slots`), capacity's plan
in torch (the runtime's is numpy, :func:`lrmoe.policy.capacity.plan_capacity`) and
SYMI's replica counts as a scan (the runtime's use heaps,
:func:`lrmoe.policy.symi.replica_counts_heap`).

Legend: G ranks, S = s slots per rank, E experts. All tensors int64 on the CPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lrmoe.errors import require
from lrmoe.policy.capacity import capacity_per_expert
from lrmoe.policy.plan import Plan
from lrmoe.policy.symi import _floor_counts


def native_placement(G: int, E: int) -> Tensor:
    """``[G, E/G]``: rank r holds experts ``r*E/G .. (r+1)*E/G - 1``."""
    require(E % G == 0, f"number of experts {E} is not divisible by the EP size {G}")
    return torch.arange(E, dtype=torch.long).reshape(G, E // G)


def apportion(total_K: Tensor, weight_NK: Tensor) -> Tensor:
    """Split each column's ``total_K`` over its rows in proportion to ``weight_NK``, int64
    ``[N, K]``: largest remainder, ties to the lower row; exact column sums, no row above
    its weight (``0 <= total <= W``; a zero-weight column takes total 0)."""
    w = weight_NK.long()
    total = total_K.long()
    W = w.sum(0)
    require(bool((total <= W).all()) and bool((total >= 0).all()),
            "apportion: totals must lie between 0 and the column weight")
    Wsafe = W.clamp(min=1)
    num = total[None, :] * w
    base = num // Wsafe
    rem = num - base * Wsafe
    left = total - base.sum(0)
    N = w.shape[0]
    order = torch.argsort(-rem, dim=0, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(0, order, torch.arange(N).unsqueeze(1).expand_as(order).contiguous())
    return base + (rank < left[None, :]).long()


def interval_overlap(counts_GE: Tensor, inst_expert_GS: Tensor, inst_load_GS: Tensor) -> Tensor:
    """``assign_GGS``: each expert's pairs, laid out home by home, split over its instances
    by contiguous intervals in slot order (instance ``i`` takes ``inst_load_GS[i]``)."""
    G, E = counts_GE.shape
    S = inst_expert_GS.shape[1]
    c = counts_GE.long()
    home_hi = c.cumsum(0)  # [G, E] end of home g's interval within expert e
    home_lo = home_hi - c
    ie = inst_expert_GS.flatten()
    load = inst_load_GS.flatten().long() * (ie >= 0).long()
    e_idx = ie.clamp(min=0)
    # Instance interval: cumulative load of earlier instances of the same expert.
    order = torch.argsort(e_idx * (G * S) + torch.arange(G * S), stable=True)
    load_sorted = load[order]
    e_sorted = e_idx[order]
    cum = load_sorted.cumsum(0)
    starts = torch.searchsorted(e_sorted, e_sorted)  # first sorted position of each expert
    inst_hi_sorted = cum - (cum - load_sorted)[starts]
    inst_hi = torch.empty_like(inst_hi_sorted)
    inst_hi[order] = inst_hi_sorted
    inst_lo = inst_hi - load
    lo = torch.maximum(home_lo[:, e_idx], inst_lo[None, :])
    hi = torch.minimum(home_hi[:, e_idx], inst_hi[None, :])
    assign = (hi - lo).clamp(min=0) * (ie >= 0).long()[None, :]
    return assign.reshape(G, G, S)


def even_split(counts_GE: Tensor, inst_expert_GS: Tensor) -> Tensor:
    """Instance loads that split each expert's total evenly (the first ones get +1)."""
    total_E = counts_GE.long().sum(0)
    ie = inst_expert_GS.flatten()
    valid = ie >= 0
    e_idx = ie.clamp(min=0)
    n_E = torch.zeros_like(total_E).index_add_(0, e_idx, valid.long())
    G, S = inst_expert_GS.shape
    # rank of each instance among its expert's instances, in global slot order; empty
    # slots sort after every expert so they never shift an expert's ranks.
    e_key = torch.where(valid, e_idx, torch.full_like(e_idx, total_E.numel()))
    order = torch.argsort(e_key * (G * S) + torch.arange(G * S), stable=True)
    e_sorted = e_key[order]
    pos = torch.arange(G * S)
    k_sorted = pos - torch.searchsorted(e_sorted, e_sorted)
    k = torch.empty_like(k_sorted)
    k[order] = k_sorted
    n = n_E[e_idx].clamp(min=1)
    base = total_E[e_idx] // n
    extra = (k < (total_E[e_idx] % n)).long()
    return ((base + extra) * valid.long()).reshape(G, S)


def plan_capacity_reference(counts_GE: Tensor, capacity_factor: float) -> Plan:
    """The torch reading of :func:`lrmoe.policy.capacity.plan_capacity`."""
    require(capacity_factor > 0, f"capacity_factor={capacity_factor} must be > 0")
    G, E = counts_GE.shape
    c = counts_GE.long()
    cap = capacity_per_expert(c, capacity_factor)
    kept_E = c.sum(0).clamp(max=cap)
    kept_GE = apportion(kept_E, c)
    ie = native_placement(G, E)
    a = interval_overlap(kept_GE, ie, even_split(kept_GE, ie))
    return Plan(ie.long(), a, a.clone(), a.clone(),
                dropped_GE=c - kept_GE)


def replica_counts(pop_E: Tensor | None, E: int, total_slots: int) -> list[int]:
    """SYMI's rounding of ``pop/sum(pop)·total_slots`` to integers >= 1 summing exactly."""
    cnt, diff = _floor_counts(pop_E, E, total_slots)
    _round_to(cnt, diff, total_slots)
    return cnt


def _round_to(cnt: list[int], diff: list[float], target: int) -> None:
    """SYMI's loops, in place: decrement the largest ``diff`` among experts with more
    than one instance, or increment the smallest, until the counts sum to ``target``."""
    E = len(cnt)
    while sum(cnt) > target:
        e = max((e for e in range(E) if cnt[e] > 1), key=lambda e: (diff[e], -e))
        cnt[e] -= 1
        diff[e] -= 1.0
    while sum(cnt) < target:
        e = min(range(E), key=lambda e: (diff[e], e))
        cnt[e] += 1
        diff[e] += 1.0


def contiguous_placement(cnt: list[int], G: int, s: int) -> Tensor:
    """``[G, s]``: expert 0's instances first, then expert 1's, ..., rank by rank."""
    require(sum(cnt) == G * s, f"replica counts sum to {sum(cnt)}, want {G * s}")
    ids = torch.repeat_interleave(torch.arange(len(cnt)), torch.tensor(cnt, dtype=torch.long))
    return ids.reshape(G, s)


def symi_fewer_placement(pop_E: Tensor | None, G: int, s: int, k: int) -> Tensor:
    """SYMI's placement ``[G, s]`` with ``k`` of its ``G·s`` instances given up, as a loop:
    its rounding to ``G·s`` instances, then its own decrement loop run on to ``G·s - k``
    (the largest ``diff`` among experts with more than one instance first); the
    instances laid out contiguously, rank ``r`` holding ``n // G`` of the ``n = G·s - k``
    (the first ``n % G`` ranks one more), its empty slots last."""
    E = pop_E.numel() if pop_E is not None else None
    require(E is not None, "give a popularity")
    total = G * s
    cnt, diff = _floor_counts(pop_E, E, total)
    _round_to(cnt, diff, total)
    _round_to(cnt, diff, total - k)  # the decrement loop run on
    ids = [e for e in range(E) for _ in range(cnt[e])]
    n = total - k
    out = torch.full((G, s), -1, dtype=torch.long)
    at = 0
    for r in range(G):
        m = n // G + (r < n % G)
        out[r, :m] = torch.tensor(ids[at:at + m], dtype=torch.long)
        at += m
    return out
