"""static: plain dropless expert parallelism (what Megatron-Core and torchtitan do)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lrmoe.errors import require
from lrmoe.policy.base import PlanInputs, Policy
from lrmoe.policy.ledger_view import LedgerView
from lrmoe.policy.plan import Plan, fit_exact
from lrmoe.policy.plan_numpy import host_counts, to_plan


def native_placement(G: int, E: int) -> Tensor:
    """``[G, E/G]``: rank r holds experts ``r*E/G .. (r+1)*E/G - 1``."""
    require(E % G == 0, f"number of experts {E} is not divisible by the EP size {G}")
    return torch.arange(E, dtype=torch.long).reshape(G, E // G)


@dataclass
class StaticPolicy(Policy):
    """Natives only, every pair in backward; with ``recompute`` a rank over the budget
    recomputes the fewest rows' gate_up outputs instead of failing, or, where that cannot
    fit, the layer is checkpointed whole (:func:`fit_exact`)."""

    recompute: bool = False
    name: str = "static"

    def plans_natives_exactly(self) -> bool:
        """True for the plain policy (not a subclass): without a budget its plan is
        :func:`lrmoe.policy.plan.native_plan`, which the one-rank local path runs in its place."""
        return type(self) is StaticPolicy

    def plan(self, counts_GE: Tensor, inputs: PlanInputs) -> Plan:
        G, E = counts_GE.shape
        require(E % G == 0, f"number of experts {E} is not divisible by the EP size {G}")
        c = host_counts(counts_GE)
        # one instance per expert: block [g, r, s] is home g's pairs of expert r·E/G + s
        # (full_plan on the natives, without its interval arithmetic)
        a = c.reshape(G, G, E // G)
        plan = to_plan(np.arange(E).reshape(G, E // G), a, a.copy(), a.copy())
        if self.recompute:
            return fit_exact(plan, inputs.ledger, "static")
        led = inputs.ledger
        if led is not None and led.budget_bytes is not None:
            recv = c.sum(0).reshape(G, E // G).sum(1)
            LedgerView(led, c.sum(1), exact=True).raise_if_over(
                np.full(G, E // G), recv, recv, None, "the plan")
        return plan
