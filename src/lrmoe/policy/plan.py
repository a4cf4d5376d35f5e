"""The plan: one layer's placement and pair bookkeeping for one step (docs/design.md §3).

Legend: G ranks in the EP group, S slots per rank, E experts; ``i = r*S + s`` is the
global index of slot ``s`` on rank ``r``. All tensors are int64 on the CPU. Every rank
derives the same plan from the same all-gathered counts, so nothing of it is sent.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lrmoe.errors import LrmoeError, require
from lrmoe.policy.ledger_view import plan_exact_fit


@dataclass(frozen=True)
class Plan:
    """Placement plus per-block pair counts (each field: docs/design.md §3); a *block*
    is the pairs home ``g`` sends to instance ``(r, s)``."""

    inst_expert_GS: Tensor  # expert id held by each slot, -1 for an empty slot
    assign_GGS: Tensor  # [g, r, s] pairs home g sends to instance (r, s)
    retain_GGS: Tensor  # how many of those keep activations for backward (<= assign)
    select_GGS: Tensor  # how many retained pairs enter backward (<= retain)
    dropped_GE: Tensor | None = None  # lowest-gate pairs dropped in forward (capacity)
    recompute_G: Tensor | None = None  # per rank, first retained rows recomputing gate_up
    layer_checkpoint: bool = False  # a whole-layer checkpoint (exact plans only)
    rung: str | None = None  # how it meets the budget (None: the runner decides)
    replicas_given_up: int = 0  # chosen but not placed, for the reason given_up_for
    given_up_for: str | None = None  # memory, link or static

    @property
    def G(self) -> int:
        return self.inst_expert_GS.shape[0]

    @property
    def S(self) -> int:
        return self.inst_expert_GS.shape[1]

    @functools.cached_property
    def exact(self) -> bool:
        """True when every pair is retained and selected (the backward is exact)."""
        return (bool(np.array_equal(self.assign_GGS.numpy(), self.retain_GGS.numpy()))
                and self.all_selected)

    @functools.cached_property
    def all_selected(self) -> bool:
        """Every retained pair enters backward (select = retain)."""
        return bool(np.array_equal(self.retain_GGS.numpy(), self.select_GGS.numpy()))

    def rank_load(self) -> Tensor:
        """Pairs each rank processes in forward, ``[G]``."""
        return torch.from_numpy(self.assign_GGS.numpy().sum(axis=(0, 2)))

    def rank_backward_load(self) -> Tensor:
        """Pairs each rank processes in backward, ``[G]``."""
        return torch.from_numpy(self.select_GGS.numpy().sum(axis=(0, 2)))

    def num_replicas(self) -> int:
        used = self.inst_expert_GS.numpy()
        used = used[used >= 0]
        return int(used.size - np.count_nonzero(np.bincount(used)))  # minus distinct experts

    def check(self, counts_GE: Tensor) -> None:
        """Raise if the plan does not route exactly the counted pairs."""
        G, E = counts_GE.shape
        ie = self.inst_expert_GS
        require(ie.shape[0] == G, f"plan has {ie.shape[0]} ranks, counts have {G}")
        for name, t in (("assign", self.assign_GGS), ("retain", self.retain_GGS),
                        ("select", self.select_GGS)):
            if t.shape != (G, G, self.S):
                raise LrmoeError(f"plan.{name} has shape {tuple(t.shape)}, want {(G, G, self.S)}")
            require(bool((t >= 0).all()), f"plan.{name} has negative entries")
        if (self.retain_GGS > self.assign_GGS).any() or (self.select_GGS > self.retain_GGS).any():
            raise LrmoeError("plan violates select <= retain <= assign")
        if self.recompute_G is not None:
            rec = self.recompute_G
            kept = self.retain_GGS.sum(dim=(0, 2))
            if tuple(rec.shape) != (G,) or (rec < 0).any() or (rec > kept).any():
                raise LrmoeError("plan.recompute must hold, per rank, 0..retained rows")
        if self.layer_checkpoint and (not self.exact or self.recompute_G is not None):
            raise LrmoeError("a layer-checkpointed plan must be exact, with no rows recomputed")
        missing = sorted(set(range(E)) - set(ie[ie >= 0].tolist()))
        require(not missing, f"plan places no instance of experts {missing[:8]}")
        empty = ie < 0
        require(self.assign_GGS[:, empty].sum() == 0, "plan assigns pairs to an empty slot")
        # Pairs of expert e from home g, summed over e's instances, must equal counts[g, e].
        routed = torch.zeros(G, E, dtype=torch.long)
        idx = ie.clamp(min=0).flatten()
        routed.index_add_(1, idx, self.assign_GGS.reshape(G, -1) * (~empty).flatten().long())
        if self.dropped_GE is not None:
            routed = routed + self.dropped_GE.long()
        require(torch.equal(routed, counts_GE.long()), "plan does not route exactly the counted pairs")


def checks_on() -> bool:
    """Whether the runtime checks every plan against its counts (``LRMOE_CHECK_PLANS=1``)."""
    return os.environ.get("LRMOE_CHECK_PLANS") == "1"


def fit_exact(plan: Plan, ledger, what: str) -> Plan:
    """An exact ``plan`` fit to the budget: as is, the fewest rows recomputed, or the layer
    checkpointed; raises when none fits."""
    if ledger is None or ledger.budget_bytes is None:
        return plan
    mode, rec, _ = plan_exact_fit(ledger, plan)  # Ledger.exact_fit, vectorised
    if mode == "fits":
        return plan
    if mode != "over":
        return fitted(plan, mode, rec)
    ledger.raise_if_over(ledger.rank_terms(fitted(plan, "layer", rec)),
                         f"{what}, even with a whole-layer checkpoint,")
    raise AssertionError("unreachable: exact_fit said it does not fit")


def fitted(plan: Plan, mode: str, rec: np.ndarray, **extra) -> Plan:
    """The exact ``plan`` under :meth:`Ledger.exact_fit`'s ``mode`` (``pairs``: ``rec``
    rows recomputed per rank; ``layer``: a whole-layer checkpoint); ``extra``: fields."""
    if mode == "pairs":
        extra["recompute_G"] = torch.from_numpy(rec)
    return dataclasses.replace(plan, layer_checkpoint=mode == "layer", **extra)


def native_plan(counts_GE: Tensor | np.ndarray) -> Plan:
    """Static EP's plan without a budget: natives only, every pair retained and selected."""
    c = counts_GE.detach().cpu().numpy() if isinstance(counts_GE, Tensor) else counts_GE
    G, E = c.shape
    require(E % G == 0, f"number of experts {E} is not divisible by the EP size {G}")
    a = np.asarray(c, dtype=np.int64).reshape(G, G, E // G)
    return Plan(*(torch.from_numpy(x) for x in (np.arange(E, dtype=np.int64).reshape(G, E // G),
                                                a.copy(), a.copy(), a.copy())))


def layer_checkpoint_plan(plan: Plan) -> Plan:
    """``plan``'s placement and assignment as an exact whole-layer-checkpointed plan."""
    a = plan.assign_GGS
    return dataclasses.replace(plan, retain_GGS=a.clone(), select_GGS=a.clone(),
                               recompute_G=None, layer_checkpoint=True)

