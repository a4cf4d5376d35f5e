"""The planners' torch and loop readings: capacity's plan in torch (the runtime's is
numpy, :func:`lrmoe.policy.capacity.plan_capacity`) and SYMI's replica counts as a scan
(the runtime's use heaps, :func:`lrmoe.policy.symi.replica_counts_heap`).

Legend: G ranks, S = s slots per rank, E experts. All tensors int64 on the CPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lrmoe.errors import require
from lrmoe.policy.capacity import apportion, capacity_per_expert
from lrmoe.policy.plan import Plan, full_plan
from lrmoe.policy.static import native_placement
from lrmoe.policy.symi import _floor_counts


def plan_capacity_reference(counts_GE: Tensor, capacity_factor: float) -> Plan:
    """The torch reading of :func:`lrmoe.policy.capacity.plan_capacity`."""
    require(capacity_factor > 0, f"capacity_factor={capacity_factor} must be > 0")
    G, E = counts_GE.shape
    c = counts_GE.long()
    cap = capacity_per_expert(c, capacity_factor)
    kept_E = c.sum(0).clamp(max=cap)
    kept_GE = apportion(kept_E, c)
    p = full_plan(kept_GE, native_placement(G, E))
    return Plan(p.inst_expert_GS, p.assign_GGS, p.retain_GGS, p.select_GGS,
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
