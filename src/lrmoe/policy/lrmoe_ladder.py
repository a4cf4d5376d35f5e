"""lrmoe under a tight budget: the ladder of fallbacks (:data:`RUNGS`, cheapest first;
why these and in this order: docs/design.md §4, "lrmoe's ladder").

Legend: G ranks, S slots per rank, E experts. All arrays int64 on the host.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from lrmoe.errors import OutOfMemory
from lrmoe.policy.ledger_view import plan_exact_fit
from lrmoe.policy.lrmoe_place import natives_GS
from lrmoe.policy.plan import Plan, fitted, layer_checkpoint_plan, native_plan
from lrmoe.policy.plan_numpy import Slots, full_plan, host_counts

# the ladder's rungs, cheapest first, and what each runs (shown by `lrmoe plan`)
RUNG_NOTES = {
    "plan": "the trimmed plan as configured",
    "exact": "lrmoe's placement, every pair in backward",
    "recompute": "lrmoe's placement, every pair in backward, the fewest rows recomputed",
    "exact-natives": "no replicas, every pair in backward",
    "recompute-natives": "no replicas, every pair in backward, the fewest rows recomputed",
    "layer": "every pair in backward, whole-layer checkpoint, replicas that fit it",
}
RUNGS = tuple(RUNG_NOTES)


def _fit(plan: Plan, ledger, tag: str) -> Plan | None:
    """The exact ``plan`` as it is or with the fewest rows recomputed, named (``tag``:
    the rung suffix); ``None`` when it needs the whole layer."""
    mode, rec, _ = plan_exact_fit(ledger, plan)  # Ledger.exact_fit, vectorised
    if mode not in ("fits", "pairs"):
        return None
    return fitted(plan, mode, rec, rung=("exact" if mode == "fits" else "recompute") + tag)


def layer_placement(counts_GE: np.ndarray, S: int, ledger, max_replicas: float = math.inf
                    ) -> np.ndarray | None:
    """Replicas for a whole-layer checkpoint (``[G, S]``): pass 1's rule from the natives,
    each replica placed only where every rank still fits the ledger's whole-layer terms;
    ``None`` when even the natives do not fit."""
    G, E = counts_GE.shape
    total = counts_GE.sum(0)
    inst = natives_GS(G, S, E)

    def fits(p, load):
        # the ledger's own verdict on the exact plan (Ledger.exact_fit): "over" exactly
        # when even the whole-layer checkpoint does not fit, as it decides for static
        return plan_exact_fit(ledger, full_plan(counts_GE, p, load))[0] != "over"
    load = Slots(inst, E).even_split(total)
    if not fits(inst, load):
        return None
    added = 0
    while added < max_replicas:
        rank = load.sum(1)
        top = int(rank.max())
        key = (top, int((rank == top).sum()))
        hot = np.flatnonzero(rank == top)
        n_of = np.bincount(inst[inst >= 0], minlength=E)
        cands = sorted({int(e) for e in inst[hot].ravel() if e >= 0 and total[e] > n_of[e]},
                       key=lambda e: (-total[e] / n_of[e], e))
        for e in cands:
            held = (inst == e).any(1)
            # only the least-loaded destination with a free slot, as pass 1
            d = next((r for r in sorted(range(G), key=lambda r: (rank[r], r))
                      if not held[r] and (inst[r] < 0).any()), None)
            if d is None:
                continue
            trial = inst.copy()
            trial[d, np.flatnonzero(inst[d] < 0)[0]] = e
            tl = Slots(trial, E).even_split(total)
            tr = tl.sum(1)
            if (int(tr.max()), int((tr == tr.max()).sum())) < key and fits(trial, tl):
                inst, load = trial, tl
                break
        else:  # no candidate lowers the maximum
            break
        added += 1
    return inst


@dataclass(frozen=True)
class Trimmed:
    """Where the ladder starts: lrmoe's trimmed ``plan`` (``kept``: on the given placement),
    or, where its placement's minimum (one retained pair per instance) does not fit,
    ``None``, the exact plan on that placement (``placed``) and the ledger's error."""

    plan: Plan | None
    kept: bool = False
    placed: Plan | None = None
    over: OutOfMemory | None = None


def climb(counts_GE, trimmed: Trimmed, ledger, slots_per_rank: int,
          max_replicas: float = math.inf, whole_layer: bool = True) -> Plan:
    """The first rung whose plan fits ``ledger``, from the planner's ``trimmed`` result;
    ``whole_layer=False``: no whole-layer rung."""
    if trimmed.plan is not None:
        return dataclasses.replace(trimmed.plan, rung="plan")
    if ledger is None or ledger.budget_bytes is None:
        raise trimmed.over
    c = host_counts(counts_GE)
    natives = native_plan(c)
    for placed, tag in ((trimmed.placed, ""), (natives, "-natives")):
        plan = _fit(placed, ledger, tag)
        if plan is not None:
            return plan
    inst = layer_placement(c, slots_per_rank, ledger, max_replicas) if whole_layer else None
    if inst is not None:
        return dataclasses.replace(layer_checkpoint_plan(full_plan(c, inst)), rung="layer")
    if whole_layer:  # what the last rung needed: the natives' whole-layer totals
        last = dataclasses.replace(natives, layer_checkpoint=True)
        rungs = RUNGS
    else:  # what the last rung tried needed: the natives with every row recomputed
        last = dataclasses.replace(natives, recompute_G=natives.rank_load().clone())
        rungs = RUNGS[:-1]
    terms = ledger.rank_terms(last)
    r = max(range(len(terms)), key=lambda i: terms[i]["total"])
    detail = ledger.describe(r, terms[r])  # the need, with the terms that make it
    raise OutOfMemory(f"lrmoe: no plan fits mem_budget at any rung ({', '.join(rungs)}): "
                      f"{detail}", terms[r]["total"], ledger.budget_bytes, detail)
