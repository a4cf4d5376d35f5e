"""lrmoe: memory-aware replication, retention quotas and backward quotas (our reading).

Legend: G ranks, S slots per rank, E experts; a *block* ``[g, r, s]`` is the pairs home
``g`` sends to instance ``(r, s)``. All tensors int64 on the CPU.

The plan is built in three passes (docs/design.md §4, lrmoe), each deterministic:

1. **Placement.** Start from the natives (rank ``r`` holds experts ``r·E/G ..``) with
   ``max_slots_per_rank - E/G`` empty slots per rank. Repeatedly take the experts that
   have an instance on a rank at the maximum load, in descending per-instance load
   (ties: lower id); for each, find the least-loaded rank (ties: lower id) that has a
   free slot, holds no instance of it yet, and can afford the new instance plus the
   activations its pairs need: after the addition the ledger must leave room on that
   rank to retain ``min(received, max(instances, ceil(min_keep · M), ceil(ρ ·
   received)))`` pairs, where ``M`` is the mean retained pairs per rank (the balanced
   backward load pass 3 aims at) and ``ρ`` the smallest retained fraction of any rank
   (1 when everything is retained). Add the replica if that strictly lowers ``(max
   rank load, number of ranks at the max)``. So when the budget lets every rank
   retain everything, replicas go only where they keep that true (the plan stays
   exact); under a tight budget a replica trades some of its host's retention (one
   instance's bytes plus its buffers) for forward balance, never leaving the host
   worse off than the worst rank already is, nor below ``min_keep`` of a balanced
   rank's backward work (while a rank at the maximum load does not fit at all, a
   destination need only stay feasible: any plan beats none). Stop when no expert
   improves the objective, the slots run out or ``max_replicas_per_step`` is reached.
   Each expert's pairs are split evenly over its instances (re-split after every
   addition; first instances in slot order get +1).
2. **Retention quotas.** Each rank retains ``min(received, affordable)`` pairs, where
   ``affordable`` is what its budget has left after owned state, instances and buffers
   (everything, without a budget). With ``recompute`` a rank short of room retains as
   many pairs as fit when each keeps only its input row, and recomputes the gate_up
   output of the fewest of them (``Plan.recompute_G``). The rank's quota goes first one pair to each
   non-empty instance, then the rest in proportion to the instances' remaining loads;
   an instance's quota goes to its blocks in proportion to their pairs.
3. **Backward quotas.** ``M`` = mean retained pairs per rank. A rank above ``M`` trims its
   selected pairs to ``ceil(M + (1 - balance)·(retained - M))``, never below the floor
   ``min(retain, ceil(min_keep·assign))`` of any block: the cut is shared over its
   instances, and then their blocks, in proportion to how far each is above its floor
   (with every pair retained this scales every instance by the same factor).
   ``selection=False`` selects every retained pair.

All rounding is largest-remainder (:func:`lrmoe.policy.capacity.apportion`), so sums are
exact. The plan never exceeds the ledger's budget; if even the natives with one
retained pair per instance do not fit, :class:`LrmoeError` names the rank and shortfall.

**How it runs fast** (it is on every MoE layer's critical path). The planner works on
the host counts the runtime already has after its count all-gather (no device work, no
extra synchronisation, no collective) and makes exactly the plans of the loop-by-loop
reference, :mod:`lrmoe.policy.lrmoe_reference` (tests/test_planner_fast.py):
placement keeps incremental state (:mod:`lrmoe.policy.lrmoe_place`), byte counts come
from the ledger's vectorised view (:mod:`lrmoe.policy.ledger_view`, which asks the
ledger, re-deriving nothing), and passes 2 and 3 are numpy
(:mod:`lrmoe.policy.lrmoe_quotas`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from lrmoe.errors import LrmoeError, require
from lrmoe.policy.base import PlanInputs
from lrmoe.policy.fastops import host_counts, interval_overlap_np, to_plan
from lrmoe.policy.ledger_view import LedgerView
from lrmoe.policy.lrmoe_place import place_replicas
from lrmoe.policy.lrmoe_quotas import backward_quotas, retention
from lrmoe.policy.plan import Plan

ESTIMATORS = ("topk", "sampled")
RETENTION_ORDERS = ("gate",)


@dataclass
class LrmoeConfig:
    """Knobs of the LRMoE planner and runtime.

    Attributes:
        balance: how far backward quotas trim a rank above the mean backward load
            toward the mean (1 = fully to the mean, 0 = no trimming).
        min_keep: floor on each block's fraction of selected pairs (of its assigned).
        max_replicas_per_step: cap on replicas added per layer and step (None: no cap).
        max_slots_per_rank: slots per rank incl. natives; None means ``E/G + 2``.
        estimator: backward selection of pairs inside a quota (runtime): ``topk`` keeps
            the highest-metric pairs, ``sampled`` samples ``p ∝ metric`` and reweights.
        compaction: runtime ablation: False zeroes unselected rows instead of removing.
        selection: False selects every retained pair (memory-aware placement only).
        retention_order: which pairs fill a retention quota (runtime): ``gate`` keeps
            the highest gate weights.
        keep: ``fixed`` uses ``min_keep`` as given; ``auto`` adapts each layer's floor to
            hold the fidelity monitor's cosine at ``target_cosine``.
        target_cosine: the gradient fidelity ``auto`` aims for.
        fidelity_every: how often the runtime measures fidelity (``auto`` needs > 0).
        recompute: retention may also keep pairs whose gate_up output is recomputed in
            backward (only the input row saved): a rank retains as many pairs as fit
            that way, recomputing the fewest (more pairs in backward, more backward work).
    """

    balance: float = 1.0
    min_keep: float = 0.5
    max_replicas_per_step: int | None = None
    max_slots_per_rank: int | None = None
    estimator: str = "topk"
    compaction: bool = True
    selection: bool = True
    retention_order: str = "gate"
    keep: str = "fixed"
    target_cosine: float = 0.99
    fidelity_every: int = 0
    recompute: bool = False

    def __post_init__(self) -> None:
        require(0.0 <= self.balance <= 1.0, f"lrmoe.balance={self.balance} must be in [0, 1]")
        require(0.0 <= self.min_keep <= 1.0,
                f"lrmoe.min_keep={self.min_keep} must be in [0, 1]")
        require(self.max_replicas_per_step is None or self.max_replicas_per_step >= 0,
                f"lrmoe.max_replicas_per_step={self.max_replicas_per_step} must be >= 0 "
                "or None")
        require(self.max_slots_per_rank is None or self.max_slots_per_rank >= 1,
                f"lrmoe.max_slots_per_rank={self.max_slots_per_rank} must be >= 1 or None")
        require(self.estimator in ESTIMATORS,
                f"lrmoe.estimator={self.estimator!r} is not one of {ESTIMATORS}")
        require(self.retention_order in RETENTION_ORDERS,
                f"lrmoe.retention_order={self.retention_order!r} is not one of "
                f"{RETENTION_ORDERS}")


def plan_lrmoe(counts_GE: Tensor, config: LrmoeConfig | None = None, ledger=None) -> Plan:
    """The LRMoE plan of one layer (see the module docstring); host counts in, a plan of
    host tensors out, no device work and no collective."""
    cfg = config or LrmoeConfig()
    G, E = counts_GE.shape
    require(E % G == 0, f"number of experts {E} is not divisible by the EP size {G}")
    c = host_counts(counts_GE)
    require(bool((c >= 0).all()), "counts must be >= 0")
    n_nat = E // G
    S = cfg.max_slots_per_rank if cfg.max_slots_per_rank is not None else n_nat + 2
    require(S >= n_nat, f"lrmoe.max_slots_per_rank={S} must be >= E/G = {n_nat} "
                        "(each rank holds its native experts)")
    home = c.sum(1)
    view = LedgerView(ledger, home)
    inst, load = place_replicas(c, S, cfg, view)
    assign = interval_overlap_np(c, inst, load)
    n_inst = (inst >= 0).sum(1)
    recv = assign.sum((0, 2))
    # Feasibility after placement: replicas may have taken pairs (and so buffer bytes)
    # off a hot rank that the native placement alone could not fit.
    view.raise_if_over(n_inst, recv, np.minimum(n_inst, recv), None,
                       "the smallest lrmoe plan (its placement, one retained pair per instance)")
    retain, rec = retention(assign, inst, home, view, cfg.recompute)
    select = (backward_quotas(assign, retain, cfg.balance, cfg.min_keep) if cfg.selection
              else retain.copy())
    # the plan never exceeds the budget (the ledger's own message if it ever did)
    if view.over(n_inst, recv, retain.sum((0, 2)), rec):
        ledger.check(to_plan(inst, assign, retain, select, recompute_G=rec))
    return to_plan(inst, assign, retain, select, recompute_G=rec)


@dataclass
class LrmoePolicy:
    config: LrmoeConfig = field(default_factory=LrmoeConfig)
    name: str = "lrmoe"

    min_keep_by_layer: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        c = self.config
        if c.keep not in ("fixed", "auto"):
            raise LrmoeError(f"lrmoe keep={c.keep!r} is not valid; use 'fixed' or 'auto'")
        if c.keep == "auto" and c.fidelity_every <= 0:
            raise LrmoeError("--lrmoe-keep auto needs the fidelity monitor: give "
                             "--lrmoe-fidelity-every N with N > 0")

    def plan(self, counts_GE: Tensor, inputs: PlanInputs) -> Plan:
        cfg = self.config
        if cfg.keep == "auto":
            mk = self.min_keep_by_layer.get(inputs.layer, cfg.min_keep)
            cfg = dataclasses.replace(cfg, min_keep=mk)
        return plan_lrmoe(counts_GE, cfg, inputs.ledger)

    def observe_fidelity(self, layer: int, cosine: float) -> None:
        """Keep-ratio controller (``keep='auto'``): raise the layer's floor when the
        selected gradient drifts below the target cosine, lower it slowly when well above.
        Deterministic, so every rank (which sees the same gathered cosine) agrees."""
        if self.config.keep != "auto":
            return
        mk = self.min_keep_by_layer.get(layer, self.config.min_keep)
        t = self.config.target_cosine
        if cosine < t:
            mk = min(1.0, mk + 0.1)
        elif cosine > t + 0.5 * (1 - t):
            mk = max(0.05, mk - 0.02)
        self.min_keep_by_layer[layer] = round(mk, 6)

    def state_dict(self) -> dict:
        return {"min_keep_by_layer": {str(k): v for k, v in self.min_keep_by_layer.items()}}

    def load_state_dict(self, d: dict) -> None:
        self.min_keep_by_layer = {int(k): float(v) for k, v in d.get("min_keep_by_layer", {}).items()}
