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
from lrmoe.policy.ledger_view import plan_raise_if_over
from lrmoe.policy.plan import Plan, native_plan
from lrmoe.policy.plan_numpy import apportion_rows_np, host_counts


def capacity_per_expert(counts_GE: Tensor, capacity_factor: float) -> int:
    """``ceil(capacity_factor · pairs_total / E)``, global over the EP group."""
    E = counts_GE.shape[1]
    total = int(counts_GE.long().sum())
    # round() first so that e.g. 1.25 * 800 / 10 is exactly 100, not 100.00000000001
    return math.ceil(round(capacity_factor * total / E, 9))


def plan_capacity(counts_GE: Tensor, capacity_factor: float) -> Plan:
    """Native placement; pairs over each expert's capacity (factor > 0) dropped from every home."""
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
        plan_raise_if_over(inputs.ledger, plan)
        return plan
