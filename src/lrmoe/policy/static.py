"""static: plain dropless expert parallelism (what Megatron-Core and torchtitan do)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lrmoe.errors import require
from lrmoe.policy.base import PlanInputs
from lrmoe.policy.plan import Plan, fit_exact, full_plan


def native_placement(G: int, E: int) -> Tensor:
    """``[G, E/G]``: rank r holds experts ``r*E/G .. (r+1)*E/G - 1``."""
    require(E % G == 0, f"number of experts {E} is not divisible by the EP size {G}")
    return torch.arange(E, dtype=torch.long).reshape(G, E // G)


@dataclass
class StaticPolicy:
    """Natives only, every pair in backward; with ``recompute`` a rank over the budget
    recomputes the fewest rows' gate_up outputs instead of failing (:func:`fit_exact`)."""

    recompute: bool = False
    name: str = "static"

    def plan(self, counts_GE: Tensor, inputs: PlanInputs) -> Plan:
        G, E = counts_GE.shape
        plan = full_plan(counts_GE, native_placement(G, E))
        if self.recompute:
            return fit_exact(plan, inputs.ledger, "static")
        if inputs.ledger is not None:
            inputs.ledger.check(plan)
        return plan
