"""lrmoe: memory-aware replication, retention quotas and backward quotas (our reading;
docs/design.md §4). It makes exactly the plans of ``tests/references/lrmoe_planner.py``.

Legend: G ranks, S slots per rank, E experts; a *block* ``[g, r, s]`` is the pairs home
``g`` sends to instance ``(r, s)``. All tensors int64 on the CPU.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from lrmoe.errors import OutOfMemory, require
from lrmoe.policy.base import PlanInputs, Policy, Prepared
from lrmoe.policy.ledger_view import LedgerView
from lrmoe.policy.link_cost import LinkCost
from lrmoe.policy.lrmoe_ladder import Trimmed, climb
from lrmoe.policy.lrmoe_link import no_slower_than_static, worth_their_link
from lrmoe.policy.lrmoe_place import MoveLog, natives_GS, place_replicas
from lrmoe.policy.lrmoe_quotas import backward_quotas, retention
from lrmoe.policy.plan import Plan
from lrmoe.policy.plan_numpy import Slots, blocks_to_GGS, full_plan, host_counts, to_plan

PLACEMENTS = ("current", "previous", "step", "step-previous")
KEEPS = ("fixed", "auto")


@dataclass
class LrmoeConfig:
    """Knobs of the LRMoE planner (their flags' help: :data:`lrmoe.cli_flags.KNOBS`).
    Without a flag: ``max_replicas_per_step`` (None: no cap), ``link`` (the link-cost
    rules' rates, :mod:`.lrmoe_link`; None: no rule), ``whole_layer=False`` (the ladder
    stops before its whole-layer rung). ``max_slots_per_rank`` None means ``E/G + 2``."""

    balance: float = 1.0
    min_keep: float = 0.5
    max_replicas_per_step: int | None = None
    max_slots_per_rank: int | None = None
    selection: bool = True
    select_from: int = 0
    keep: str = "fixed"
    target_cosine: float = 0.99
    recompute: bool = False
    placement: str = "current"
    whole_layer: bool = True
    link: LinkCost | None = None

    def __post_init__(self) -> None:
        require(0.0 <= self.balance <= 1.0, f"lrmoe.balance={self.balance} must be in [0, 1]")
        require(0.0 <= self.min_keep <= 1.0,
                f"lrmoe.min_keep={self.min_keep} must be in [0, 1]")
        require(self.max_replicas_per_step is None or self.max_replicas_per_step >= 0,
                f"lrmoe.max_replicas_per_step={self.max_replicas_per_step} must be >= 0 "
                "or None")
        require(self.max_slots_per_rank is None or self.max_slots_per_rank >= 1,
                f"lrmoe.max_slots_per_rank={self.max_slots_per_rank} must be >= 1 or None")
        require(self.select_from >= 0,
                f"lrmoe.select_from={self.select_from} must be >= 0")
        require(self.placement in PLACEMENTS,
                f"lrmoe.placement={self.placement!r} is not one of {PLACEMENTS}")
        require(self.keep in KEEPS, f"lrmoe keep={self.keep!r} is not valid; use 'fixed' "
                                    "or 'auto'")


def slots_per_rank(cfg: LrmoeConfig, G: int, E: int) -> int:
    require(E % G == 0, f"number of experts {E} is not divisible by the EP size {G}")
    n_nat = E // G
    S = cfg.max_slots_per_rank if cfg.max_slots_per_rank is not None else n_nat + 2
    require(S >= n_nat, f"lrmoe.max_slots_per_rank={S} must be >= E/G = {n_nat} "
                        "(each rank holds its native experts)")
    return S


def place_lrmoe(total_E: np.ndarray, home_G: np.ndarray, cfg: LrmoeConfig,
                ledger=None) -> np.ndarray:
    """Pass 1 alone: the placement ``[G, S]`` for experts' total pairs ``total_E`` and
    home ranks' pairs ``home_G`` (``placement="previous"``'s prepared part)."""
    G, E = len(home_G), len(total_E)
    return _place(np.asarray(total_E, dtype=np.int64), slots_per_rank(cfg, G, E), cfg,
                  LedgerView(ledger, home_G))[0]


def _place(total_E: np.ndarray, S: int, cfg: LrmoeConfig, view: LedgerView,
           c: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int, Slots] | Trimmed:
    """Pass 1 and the link-cost rule: ``(inst_expert_GS, inst_load_GS, replicas given up,
    its split index)``, or (given the counts ``c``) the :class:`Trimmed` record where its
    minimum does not fit."""
    G, log = len(view.home), MoveLog() if cfg.link is not None else None
    # no log argument unless logging: tests/references/lrmoe_place_numpy.py stands in here
    inst, load = (place_replicas(total_E, G, S, cfg, view) if log is None
                  else place_replicas(total_E, G, S, cfg, view, log))
    if c is not None:
        over = _over(view, c, inst, load)
        if over is not None:
            return over
    fewer = None if log is None else worth_their_link(log, cfg, view, total_E, S)
    return (inst, load, 0, Slots(inst, len(total_E))) if fewer is None else fewer


@dataclass(frozen=True)
class Planned:
    """What :func:`plan_lrmoe` made: the plan, and whether it stands on the
    ``placement`` it was given (False when none was, or when it was made again)."""

    plan: Plan
    kept_placement: bool


def plan_lrmoe(counts_GE: Tensor, config: LrmoeConfig | None = None, ledger=None,
               placement: np.ndarray | None = None, slots: Slots | None = None, *,
               hold: bool = False, ladder: bool = True, decide: bool = True) -> Planned:
    """The LRMoE plan of one layer from host counts, no device work or collective (§4 of
    docs/design.md). ``placement`` (``slots``: its split index): a prepared one, made again
    where its minimum does not fit these counts unless ``hold``; ``ladder``: climb the
    ladder, else raise; ``decide``: with ``config.link``, :func:`no_slower_than_static`."""
    cfg = config or LrmoeConfig()
    trimmed = _trimmed(counts_GE, cfg, ledger, placement, slots, hold)
    if not ladder:
        if trimmed.plan is None:
            raise trimmed.over
        return Planned(trimmed.plan, trimmed.kept)
    G, E = counts_GE.shape
    cap = math.inf if cfg.max_replicas_per_step is None else cfg.max_replicas_per_step
    plan = climb(counts_GE, trimmed, ledger, slots_per_rank(cfg, G, E), cap, cfg.whole_layer)
    if cfg.link is not None and decide and plan.rung == "plan":
        plan = no_slower_than_static(counts_GE, cfg, ledger, plan, lambda inst: (
            _trimmed(counts_GE, cfg, ledger, inst, None, True).plan))
    return Planned(plan, trimmed.kept)


def _trimmed(counts_GE: Tensor, cfg: LrmoeConfig, ledger, placement: np.ndarray | None,
             slots: Slots | None, hold: bool) -> Trimmed:
    """The trimmed plan (passes 1 to 3), or the :class:`Trimmed` record of its misfit."""
    G, E = counts_GE.shape
    S = slots_per_rank(cfg, G, E)
    c = host_counts(counts_GE)
    require(bool((c >= 0).all()), "counts must be >= 0")
    view = LedgerView(ledger, c.sum(1))
    if placement is not None:
        require(tuple(placement.shape) == (G, S),
                f"lrmoe: a prepared placement of shape {tuple(placement.shape)} does not "
                f"match EP {G} with {S} slots per rank")
        idx = slots if slots is not None else Slots(placement, E)
        load = idx.even_split(c.sum(0))
        over = _over(view, c, placement, load)
        if over is None:
            return _quotas(c, placement, load, idx, cfg, view, 0, kept=True)
        if hold:
            return over
    placed = _place(c.sum(0), S, cfg, view, c)
    if isinstance(placed, Trimmed):
        return placed
    inst, load, given_up, idx = placed
    return _quotas(c, inst, load, idx, cfg, view, given_up, kept=False)


def _quotas(c: np.ndarray, inst: np.ndarray, load: np.ndarray, idx: Slots, cfg: LrmoeConfig,
            view: LedgerView, given_up: int, kept: bool) -> Trimmed:
    """Passes 2 and 3 on a placement whose minimum fits (``idx``: its split index): the
    trimmed plan."""
    G, S = inst.shape
    assign = idx.overlap_ig(c, load)
    retain, rec, kept_G = retention(assign, inst, view, cfg.recompute, load)
    select = (backward_quotas(assign, retain, G, cfg.balance, cfg.min_keep) if cfg.selection
              else retain)
    # retain (select) is the very array assign (retain) when nothing was trimmed
    a_GGS = blocks_to_GGS(assign, G, S)
    r_GGS = a_GGS.copy() if retain is assign else blocks_to_GGS(retain, G, S)
    s_GGS = r_GGS.copy() if select is retain else blocks_to_GGS(select, G, S)
    plan = to_plan(inst, a_GGS, r_GGS, s_GGS, recompute_G=rec)
    if given_up:
        plan = dataclasses.replace(plan, replicas_given_up=given_up, given_up_for="link")
    # the plan never exceeds the budget (the ledger's own message if it ever did)
    n_inst = (inst >= 0).sum(1)
    if view.over(n_inst, load.sum(1), kept_G, rec):
        view.ledger.check(plan)
    return Trimmed(plan, kept)


def _over(view: LedgerView, c: np.ndarray, inst: np.ndarray, load: np.ndarray
          ) -> Trimmed | None:
    """``None`` when ``inst``'s instances with one retained pair each fit the budget;
    else the exact plan on it with the ledger's own error (the ladder goes on from it)."""
    n_inst, recv = (inst >= 0).sum(1), load.sum(1)
    try:
        view.raise_if_over(n_inst, recv, np.minimum(n_inst, recv), None,
                           "the smallest lrmoe plan (its placement, one retained pair "
                           "per instance)")
    except OutOfMemory as e:
        return Trimmed(None, False, full_plan(c, inst, load), e)
    return None


def previous_totals(prev_counts, G: int, home_pairs: int | None = None
                    ) -> tuple[np.ndarray, np.ndarray] | None:
    """``(total_E, home_G)`` from the previous step's ``[G, E]`` or ``[E]`` counts (None: none
    or all zero); ``[E]`` ones scaled to ``G · home_pairs`` pairs by largest remainder (ties
    to the lower expert), each home routing ``home_pairs`` (without it: an equal share)."""
    if prev_counts is None:
        return None
    p = host_counts(prev_counts)
    if p.ndim == 2:
        require(p.shape[0] == G, f"previous counts have {p.shape[0]} ranks, want {G}")
        return p.sum(0), p.sum(1)
    P = int(p.sum())
    if P <= 0:
        return None
    if home_pairs is None:
        return p, P // G + (np.arange(G) < P % G)
    T = G * int(home_pairs)
    num = T * p
    total = num // P
    left = T - int(total.sum())
    if left:
        total[np.lexsort((np.arange(p.size), -(num - total * P)))[:left]] += 1
    return total, np.full(G, int(home_pairs), dtype=np.int64)


HELD = ("step", "step-previous")  # placements held for the optimizer step


@dataclass(frozen=True)
class Held:
    """A layer's placement held for one optimizer step (``placement`` in :data:`HELD`)."""

    step: int
    inst_expert_GS: np.ndarray
    slots: Slots


@dataclass
class LrmoePolicy(Policy):
    """The LRMoE planner; with ``placement`` ``step`` or ``step-previous`` it holds
    micro-batch 0's placement for the optimizer step (:attr:`held`; docs/design.md §4)."""

    config: LrmoeConfig = field(default_factory=LrmoeConfig)
    name: str = "lrmoe"

    min_keep_by_layer: dict[int, float] = field(default_factory=dict)
    # plans whose prepared placement did not fit the budget on the step's counts and was
    # made again from them (placement="previous")
    replaced_placements: int = 0
    # plans per rung of the ladder (lrmoe_ladder.RUNGS) that met the budget
    rungs: dict[str, int] = field(default_factory=dict)
    # per MoE layer, the placement held for its current optimizer step
    held: dict[int, Held] = field(default_factory=dict)

    def _layer_config(self, layer: int, step: int) -> LrmoeConfig:
        """The knobs for ``layer`` at optimizer step ``step``: the auto keep's floor, and
        selection off through the first ``select_from`` steps (the fast descent, where a
        dropped pair's gradient is worth most)."""
        cfg = self.config
        if step < cfg.select_from:
            cfg = dataclasses.replace(cfg, selection=False)
        if cfg.keep != "auto":
            return cfg
        return dataclasses.replace(cfg, min_keep=self.min_keep_by_layer.get(layer, cfg.min_keep))

    def prepare(self, prev_counts, G: int, inputs: PlanInputs,
                home_pairs: int | None = None) -> Prepared | None:
        """With ``placement="previous"``: pass 1 on the previous step's counts
        (:func:`previous_totals`); ``None`` otherwise or on the first step."""
        if self.config.placement not in ("previous", "step-previous") or self._holding(inputs):
            return None
        prev = previous_totals(prev_counts, G, home_pairs)
        if prev is None:
            return None
        cfg = self._layer_config(inputs.layer, inputs.step)  # the link rule weighs selection
        inst = place_lrmoe(prev[0], prev[1], cfg, inputs.ledger)
        return Prepared(inst, Slots(inst, len(prev[0])))

    def _holding(self, inputs: PlanInputs) -> Held | None:
        """The placement held for this step, at a later micro-batch of a held step."""
        h = self.held.get(inputs.layer)
        ok = (self.config.placement in HELD and inputs.micro > 0 and h is not None
              and h.step == inputs.step)
        return h if ok else None

    def plan(self, counts_GE: Tensor, inputs: PlanInputs) -> Plan:
        cfg = self._layer_config(inputs.layer, inputs.step)
        held = self._holding(inputs)
        if held is not None:  # the step's placement; the decision to hold it was made
            plan = plan_lrmoe(counts_GE, cfg, inputs.ledger, held.inst_expert_GS,
                              held.slots, hold=True, decide=False).plan
            if not np.array_equal(plan.inst_expert_GS.numpy(), held.inst_expert_GS[
                    :, :plan.S]) or (held.inst_expert_GS[:, plan.S:] >= 0).any():
                self.replaced_placements += 1  # a rung placed otherwise, this micro-batch
            self.rungs[plan.rung] = self.rungs.get(plan.rung, 0) + 1
            return plan
        prep = None
        if cfg.placement in ("previous", "step-previous"):
            prep = inputs.prepared
            if prep is None:  # not prepared: do it here
                G = counts_GE.shape[0]
                prep = self.prepare(inputs.prev_counts_E, G, inputs,
                                    int(counts_GE.sum()) // G)
        placement = None if prep is None else prep.inst_expert_GS
        planned = plan_lrmoe(counts_GE, cfg, inputs.ledger, placement,
                             None if prep is None else prep.slots)
        plan = planned.plan
        if placement is not None and not planned.kept_placement:
            self.replaced_placements += 1
        if cfg.placement in HELD:  # micro-batch 0: hold what it placed for the step
            G, E = counts_GE.shape
            inst = natives_GS(G, slots_per_rank(cfg, G, E), E)
            inst[:, :plan.S] = plan.inst_expert_GS.numpy()
            self.held[inputs.layer] = Held(inputs.step, inst, Slots(inst, E))
        self.rungs[plan.rung] = self.rungs.get(plan.rung, 0) + 1
        return plan

    def observe_fidelity(self, layer: int, cosine: float) -> None:
        """Keep-ratio controller (``keep='auto'``): raise the layer's floor when the
        cosine drops below the target, lower it slowly when well above (deterministic)."""
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
