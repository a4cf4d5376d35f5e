"""lrmoe under a tight budget: the ladder of fallbacks, cheapest first (docs/design.md §4).

Legend: G ranks, S slots per rank, E experts. All arrays int64 on the host.

When the trimmed plan (:func:`lrmoe.policy.lrmoe.plan_lrmoe_placed`: its placement with
one retained pair per instance) does not fit the budget, the planner climbs:

=================  ==========================================================  ==========
rung               what runs                                                   extra cost
=================  ==========================================================  ==========
``plan``           the trimmed plan as configured                              none
``exact``          lrmoe's placement, every pair retained and selected: fits   none
                   where the trimmed plan's bound does not (§5: an exact
                   backward gathers and copies no saved rows)
``recompute``      lrmoe's placement, every pair in backward, the fewest rows  gate_up of
                   per rank keep only their input row (``Plan.recompute_G``)   those rows
``layer``          lrmoe's placement, every pair in backward, nothing          the layer's
                   retained: a whole-MoE-layer checkpoint re-runs dispatch,    forward
                   experts and combine in backward (:func:`whole_layer_ckpt`)
``*-natives``      ``exact``, ``recompute`` or ``layer`` with the replicas     balance
                   given up
=================  ==========================================================  ==========

Why these and in this order: the trimmed plan's minimum is its placed instances with one
retained pair each (:func:`lrmoe.policy.lrmoe.plan_lrmoe_placed`); neither the keep
floor (``min_keep`` guards replica destinations and trims selection, never the
retention) nor the placement raises it (a replica goes only where its destination can
still afford that minimum, and it only takes pairs off its expert's other hosts), so
lowering the floor or placing fewer replicas never makes a trimmed plan exist. What
frees memory beyond it is keeping less per pair: the input row only (recompute, 2 of
the expert's 3 GEMMs again for those rows), then nothing (the whole layer re-run:
its dispatch, experts and combine). Both keep lrmoe's replicas while they fit; giving
them up is the last resort, which is static's plan with the same fallback, so lrmoe
finds a plan wherever static with the whole-layer checkpoint fits. Below that every
rung is over: :class:`lrmoe.errors.OutOfMemory`, with the natives' whole-layer total
as what the step needs.

The whole-layer checkpoint is one function, :func:`whole_layer_ckpt`: the plan it
returns is priced and charged by the ledger's ``layer`` mode
(:meth:`lrmoe.memory.Ledger.exact_fit`) in the emulator; the runtime's checkpoint mode
is wired to it there.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from lrmoe.errors import LrmoeError, OutOfMemory
from lrmoe.policy.fastops import host_counts, to_plan
from lrmoe.policy.ledger_view import plan_exact_fit
from lrmoe.policy.plan import Plan

# the ladder's rungs, cheapest first, and what each runs (shown by `lrmoe plan`)
RUNG_NOTES = {
    "plan": "the trimmed plan as configured",
    "exact": "lrmoe's placement, every pair in backward",
    "recompute": "lrmoe's placement, every pair in backward, the fewest rows recomputed",
    "layer": "lrmoe's placement, every pair in backward, whole-layer checkpoint",
    "exact-natives": "no replicas, every pair in backward",
    "recompute-natives": "no replicas, every pair in backward, the fewest rows recomputed",
    "layer-natives": "no replicas, every pair in backward, whole-layer checkpoint",
}
RUNGS = tuple(RUNG_NOTES)


def whole_layer_ckpt(plan: Plan) -> Plan:
    """``plan`` (exact) run under a whole-MoE-layer checkpoint: nothing retained on the
    expert ranks, backward re-runs the layer's forward first (the ledger's ``layer``
    mode). The one place the rung is made."""
    return dataclasses.replace(plan, rung="layer")


def rung_terms(ledger, plan: Plan) -> list[dict[str, int]]:
    """The ledger's terms per rank for ``plan`` as its rung runs it: a whole-layer
    checkpoint retains nothing (:meth:`lrmoe.memory.Ledger.exact_fit`'s ``layer``
    terms), any other plan as :meth:`lrmoe.memory.Ledger.rank_terms` prices it."""
    if plan.rung in ("layer", "layer-natives"):
        return ledger.exact_fit(plan)[2]
    return ledger.rank_terms(plan)


def _exact(plan: Plan) -> Plan:
    """``plan``'s placement and split with every pair retained and selected."""
    a = plan.assign_GGS
    return Plan(plan.inst_expert_GS, a, a.clone(), a.clone())


def _fit(plan: Plan, ledger, natives: bool) -> tuple[Plan | None, int]:
    """The exact ``plan`` as it is or on its cheapest fallback (recompute, else the whole
    layer), or
    ``None`` and the smallest total a rank needed."""
    mode, rec, totals = plan_exact_fit(ledger, plan)  # Ledger.exact_fit, vectorised
    tag = "-natives" if natives else ""
    if mode == "fits":
        return dataclasses.replace(plan, rung="exact" + tag), 0
    if mode == "pairs":
        return dataclasses.replace(plan, recompute_G=torch.from_numpy(rec),
                                   rung="recompute" + tag), 0
    if mode == "layer":
        return dataclasses.replace(whole_layer_ckpt(plan), rung="layer" + tag), 0
    return None, int(totals.max())


def climb(counts_GE, plan_fn, ledger) -> Plan:
    """The first rung whose plan fits ``ledger`` (see the module docstring).

    ``plan_fn()`` makes the trimmed plan and its placement's plan: it returns the plan
    (rung ``plan``) or raises :class:`OutOfMemory` with the placement it could not fit
    attached (``placed``: the exact plan on it).
    """
    try:
        return dataclasses.replace(plan_fn(), rung="plan")
    except OutOfMemory as e:
        first = e
    if ledger is None or ledger.budget_bytes is None:
        raise first
    tried = []
    placed = getattr(first, "placed", None)
    if placed is not None:
        plan, need = _fit(_exact(placed), ledger, natives=False)
        if plan is not None:
            return plan
        tried.append(need)
    G, E = counts_GE.shape
    if E % G:
        raise LrmoeError(f"number of experts {E} is not divisible by the EP size {G}")
    a = host_counts(counts_GE).reshape(G, G, E // G)
    natives = to_plan(np.arange(E).reshape(G, E // G), a, a.copy(), a.copy())
    plan, need = _fit(natives, ledger, natives=True)
    if plan is not None:
        return plan
    raise OutOfMemory(f"lrmoe: no plan fits mem_budget at any rung ({', '.join(RUNGS)}): "
                      f"{first.detail}", need, ledger.budget_bytes, first.detail)
