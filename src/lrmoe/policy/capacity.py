"""capacity: GShard/DeepSpeed-style capacity factor on the native placement; each home
keeps its largest-remainder share of an expert's capacity, dropping its lowest-gate pairs.

Legend: G ranks, E experts, N/K generic row/column counts. All tensors int64, CPU.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lrmoe.errors import require
from lrmoe.policy.base import PlanInputs, Policy
from lrmoe.policy.plan import Plan, native_plan
from lrmoe.policy.plan_numpy import apportion_rows_np, host_counts
from lrmoe.policy.static import raise_if_over


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


def capacity_per_expert(counts_GE: Tensor, capacity_factor: float) -> int:
    """``ceil(capacity_factor · pairs_total / E)``, global over the EP group."""
    E = counts_GE.shape[1]
    total = int(counts_GE.long().sum())
    # round() first so that e.g. 1.25 * 800 / 10 is exactly 100, not 100.00000000001
    return math.ceil(round(capacity_factor * total / E, 9))


def plan_capacity(counts_GE: Tensor, capacity_factor: float) -> Plan:
    """Native placement; pairs over each expert's capacity dropped from every home."""
    require(capacity_factor > 0, f"capacity_factor={capacity_factor} must be > 0")
    c = host_counts(counts_GE)  # native_plan refuses an EP size that does not divide E
    cap = capacity_per_expert(counts_GE, capacity_factor)
    kept_GE = apportion_rows_np(np.minimum(c.sum(0), cap), c.T).T
    return dataclasses.replace(native_plan(kept_GE),
                               dropped_GE=torch.from_numpy(c - kept_GE))


@dataclass
class CapacityPolicy(Policy):
    capacity_factor: float = 1.25
    name: str = "capacity"

    def __post_init__(self) -> None:
        require(self.capacity_factor > 0,
                f"capacity_factor={self.capacity_factor} must be > 0 (GShard uses 1.0-2.0)")

    def plan(self, counts_GE: Tensor, inputs: PlanInputs) -> Plan:
        plan = plan_capacity(counts_GE, self.capacity_factor)
        raise_if_over(plan, host_counts(counts_GE).sum(1), inputs.ledger)
        return plan
