"""The policy interface: ``prepare`` off the critical path (from the previous step's
counts, before this step's count all-gather), then ``plan(counts, inputs) -> Plan``, both
pure and collective-free (docs/design.md §4, "Planning off the critical path").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from torch import Tensor

from lrmoe.policy.plan import Plan
from lrmoe.policy.plan_numpy import Slots


@dataclass(frozen=True)
class Prepared:
    """What a policy computed before this step's counts (:func:`prepare`, for the policy
    that plans the step): its placement ``[G, S]`` (-1 empty) and split index."""

    inst_expert_GS: np.ndarray
    slots: Slots | None = None


@dataclass
class PlanInputs:
    """Everything a planner may look at besides the current count matrix (``None``: none
    yet; a ledger of ``None``: no budget; ``micro``: the micro-batch's index in its step)."""

    layer: int = 0
    step: int = 0
    prev_counts_E: Tensor | None = None
    ledger: Any = None
    prepared: Prepared | None = None
    micro: int = 0


class Policy(ABC):
    """What the runtime asks of a planner: only :meth:`plan` must be written, every other
    hook defaults to nothing; ``name`` names it in messages."""

    name: str = "policy"

    @abstractmethod
    def plan(self, counts_GE: Tensor, inputs: PlanInputs) -> Plan:
        """The plan for this step's ``[G, E]`` counts: pure, no collective, no autograd."""

    def prepare(self, prev_counts, G: int, inputs: PlanInputs,
                home_pairs: int | None = None) -> Prepared | None:
        """What can be planned from the previous step's counts (:func:`prepare`)."""
        return None

    def plans_natives_exactly(self) -> bool:
        """True when, without a budget, the plan is always :func:`native_plan`, so a
        one-rank run may take the local path (:func:`lrmoe.model.moe.runs_locally`)."""
        return False

    def observe_fidelity(self, layer: int, cosine: float) -> None:
        """The fidelity monitor's mean cosine for ``layer`` (every rank sees the same)."""
        return None

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the policy's adaptive state."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s result."""
        return None


def prepare(policy: Policy, prev_counts, G: int, inputs: PlanInputs,
            home_pairs: int | None = None) -> PlanInputs:
    """``inputs`` with ``policy``'s prepared part, from ``prev_counts`` (the previous
    step's ``[E]`` or ``[G, E]`` counts) and ``home_pairs`` (this step's tokens × top-k)."""
    return replace(inputs, prepared=policy.prepare(prev_counts, G, inputs, home_pairs))
