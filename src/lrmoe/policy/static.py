"""static: plain dropless expert parallelism (what Megatron-Core and torchtitan do)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lrmoe.errors import require
from lrmoe.policy.base import PlanInputs, Policy
from lrmoe.policy.ledger_view import LedgerView
from lrmoe.policy.plan import Plan, fit_exact, native_plan
from lrmoe.policy.plan_numpy import host_counts


def native_placement(G: int, E: int) -> Tensor:
    """``[G, E/G]``: rank r holds experts ``r*E/G .. (r+1)*E/G - 1``."""
    require(E % G == 0, f"number of experts {E} is not divisible by the EP size {G}")
    return torch.arange(E, dtype=torch.long).reshape(G, E // G)


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
        c = host_counts(counts_GE)
        plan = native_plan(c)
        if self.recompute:
            return fit_exact(plan, inputs.ledger, "static")
        raise_if_over(plan, c.sum(1), inputs.ledger)
        return plan


def raise_if_over(plan: Plan, home_G: np.ndarray, ledger) -> None:
    """The ledger's own error where a plan on the natives (static's, capacity's) exceeds the
    budget; ``home_G``: the pairs each home routed (dropped ones included)."""
    if ledger is not None and ledger.budget_bytes is not None:
        G, S = plan.inst_expert_GS.shape
        recv = plan.assign_GGS.numpy().sum((0, 2))
        LedgerView(ledger, home_G, exact=plan.exact).raise_if_over(
            np.full(G, S), recv, recv, None, "the plan")
