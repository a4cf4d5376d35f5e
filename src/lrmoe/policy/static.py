"""static: plain dropless expert parallelism (what Megatron-Core and torchtitan do)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from lrmoe.policy.base import PlanInputs, Policy
from lrmoe.policy.ledger_view import plan_raise_if_over
from lrmoe.policy.plan import Plan, fit_exact, native_plan
from lrmoe.policy.plan_numpy import host_counts


@dataclass
class StaticPolicy(Policy):
    """Natives only, every pair in backward; ``recompute``: fit a budget by
    :func:`fit_exact`'s fallbacks instead of failing."""

    recompute: bool = False
    name: str = "static"

    def plans_natives_exactly(self) -> bool:
        """True for the plain policy (not a subclass)."""
        return type(self) is StaticPolicy

    def plan(self, counts_GE: Tensor, inputs: PlanInputs) -> Plan:
        plan = native_plan(host_counts(counts_GE))
        if self.recompute:
            return fit_exact(plan, inputs.ledger, "static")
        plan_raise_if_over(inputs.ledger, plan)
        return plan

