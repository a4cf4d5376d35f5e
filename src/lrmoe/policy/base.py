"""The policy interface: ``prepare`` off the critical path, then ``plan(counts, inputs)
-> Plan``, both pure and collective-free.

A MoE layer's plan waits on that step's count all-gather: whatever a policy can compute
from earlier data (the previous step's counts) it does in ``prepare``, which the
runtime may call before the all-gather (while the GPU still runs the queued work); only
``plan`` sits between the counts arriving and the dispatch.
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
    """What a policy computed before this step's counts: its placement ``[G, S]`` (-1 empty)
    and split index, tagged with the policy's name (another policy ignores it)."""

    policy: str
    inst_expert_GS: np.ndarray
    slots: Slots | None = None


@dataclass
class PlanInputs:
    """Everything a planner may look at besides the current count matrix: the layer (among the
    MoE layers), the optimizer step, the previous step's global counts (``None`` on the
    first), the ledger (``None``: no budget), what :meth:`Policy.prepare` made (``None``: the
    policy prepares inside ``plan``), and the micro-batch's index in its optimizer step (a
    re-run of its forward passes it again; lrmoe's ``placement="step"`` places at 0)."""

    layer: int = 0
    step: int = 0
    prev_counts_E: Tensor | None = None
    ledger: Any = None
    prepared: Prepared | None = None
    micro: int = 0


class Policy(ABC):
    """What the runtime asks of a planner. Only :meth:`plan` must be written; every other
    hook has a default that does nothing, so a policy overrides just what it uses.

    ``name`` identifies the policy (its :class:`Prepared` results carry it)."""

    name: str = "policy"

    @abstractmethod
    def plan(self, counts_GE: Tensor, inputs: PlanInputs) -> Plan:
        """The plan for this step's ``[G, E]`` counts: pure, no collective, no autograd."""

    def prepare(self, prev_counts, G: int, inputs: PlanInputs,
                home_pairs: int | None = None) -> Prepared | None:
        """What can be planned from the previous step's counts, before this step's
        arrive (see :func:`prepare`); ``None``: nothing (the default)."""
        return None

    def plans_natives_exactly(self) -> bool:
        """True when, without a budget, the plan is always
        :func:`lrmoe.policy.plan.native_plan`, so a one-rank run may take the local path
        (:func:`lrmoe.model.moe.runs_locally`). False by default."""
        return False

    def observe_fidelity(self, layer: int, cosine: float) -> None:
        """The fidelity monitor's mean cosine for ``layer`` on a fidelity step (every
        rank sees the same); a policy that adapts to it overrides this. Ignored by
        default."""
        return None

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the policy's adaptive state (none by default)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s result (nothing to restore by default)."""
        return None


def prepare(policy: Policy, prev_counts, G: int, inputs: PlanInputs,
            home_pairs: int | None = None) -> PlanInputs:
    """``inputs`` with ``policy``'s prepared part, computed from ``prev_counts`` (the
    previous step's ``[E]`` global or ``[G, E]`` per-home counts) before this step's
    counts exist. ``home_pairs``: the pairs each home rank routes this step (tokens ×
    top-k), known from the batch before any count is exchanged."""
    return replace(inputs, prepared=policy.prepare(prev_counts, G, inputs, home_pairs))
