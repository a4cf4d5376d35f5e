"""The policy interface: ``plan(counts, inputs) -> Plan``, pure and collective-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from lrmoe.policy.plan import Plan


@dataclass
class PlanInputs:
    """Everything a planner may look at besides the current count matrix.

    Attributes:
        layer: index of the MoE layer among the model's MoE layers.
        step: optimizer step (0-based).
        prev_counts_E: the previous step's global pairs per expert of this layer
            (``None`` on the first step); SYMI's popularity.
        ledger: the memory ledger (``lrmoe.memory.Ledger``) or ``None`` when no budget.
    """

    layer: int = 0
    step: int = 0
    prev_counts_E: Tensor | None = None
    ledger: Any = None


class Policy(Protocol):
    name: str

    def plan(self, counts_GE: Tensor, inputs: PlanInputs) -> Plan: ...
