"""The policy interface: ``prepare`` off the critical path, then ``plan(counts, inputs)
-> Plan``, both pure and collective-free.

A MoE layer's plan waits on that step's count all-gather: whatever a policy can compute
from earlier data (the previous step's counts) it does in ``prepare``, which the
runtime may call before the all-gather (while the GPU still runs the queued work); only
``plan`` sits between the counts arriving and the dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
from torch import Tensor

from lrmoe.policy.plan import Plan
from lrmoe.policy.plan_numpy import Slots


@dataclass(frozen=True)
class Prepared:
    """What a policy computed before this step's counts: its placement.

    Attributes:
        policy: the name of the policy that made it (another policy ignores it).
        inst_expert_GS: expert per slot, ``-1`` empty (int64 numpy, ``[G, S]``).
        slots: its split index (:class:`lrmoe.policy.plan_numpy.Slots`), also computed
            ahead.
    """

    policy: str
    inst_expert_GS: np.ndarray
    slots: Slots | None = None


@dataclass
class PlanInputs:
    """Everything a planner may look at besides the current count matrix.

    Attributes:
        layer: index of the MoE layer among the model's MoE layers.
        step: optimizer step (0-based).
        prev_counts_E: the previous step's global pairs per expert of this layer
            (``None`` on the first step); SYMI's popularity.
        ledger: the memory ledger (``lrmoe.ledger.Ledger``) or ``None`` when no budget.
        prepared: the policy's :meth:`Policy.prepare` result for this layer and step
            (``None``: not prepared; a policy that needs it prepares inside ``plan``).
        micro: the micro-batch's index in its optimizer step (0-based; a re-run of a
            micro-batch's forward, e.g. under an activation checkpoint, passes its
            index again). A policy that holds one placement for the optimizer step
            (lrmoe's ``placement="step"``) places at micro-batch 0 and reuses that
            placement for the step's later ones; the runtime gathers its weights once
            and reduces its gradients once.
    """

    layer: int = 0
    step: int = 0
    prev_counts_E: Tensor | None = None
    ledger: Any = None
    prepared: Prepared | None = None
    micro: int = 0


class Policy(Protocol):
    name: str

    def plan(self, counts_GE: Tensor, inputs: PlanInputs) -> Plan: ...


def prepare(policy, prev_counts, G: int, inputs: PlanInputs,
            home_pairs: int | None = None) -> PlanInputs:
    """``inputs`` with ``policy``'s prepared part, computed from ``prev_counts`` (the
    previous step's ``[E]`` global or ``[G, E]`` per-home counts) before this step's
    counts exist. ``home_pairs``: the pairs each home rank routes this step (tokens ×
    top-k), known from the batch before any count is exchanged. A policy without a
    ``prepare`` step (or with nothing to prepare) leaves ``inputs`` as they are."""
    fn = getattr(policy, "prepare", None)
    if fn is None:
        return inputs
    return replace(inputs, prepared=fn(prev_counts, G, inputs, home_pairs))
