"""lrmoe's one planning entry point and the records it passes on: the trimmed plan or the
placement whose minimum does not fit (:class:`Trimmed`), and what the planner kept
(:class:`Planned`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from lrmoe.errors import OutOfMemory
from lrmoe.ledger import Ledger, plan_counts
from lrmoe.policy import lrmoe as lrmoe_mod
from lrmoe.policy.lrmoe import LrmoeConfig, plan_lrmoe
from lrmoe.policy.lrmoe_ladder import Trimmed, climb
from lrmoe.policy.plan import native_plan
from lrmoe.presets import get_preset
from lrmoe.routing_loads import synthetic_counts

G = 4


def _layer():
    cfg = get_preset("tiny-qwen3")
    counts = synthetic_counts(G, cfg.num_experts, 64, cfg.num_experts_per_tok, 1.5, 1)
    free = Ledger.for_dtype(cfg, G, None, "fp32", num_moe_layers=48)
    return cfg, counts, free


def test_a_held_placement_over_the_budget_hands_the_ladder_its_exact_plan():
    cfg, counts, free = _layer()
    placed = plan_lrmoe(counts, LrmoeConfig(), free).plan
    assert placed.num_replicas() > 0
    inst = placed.inst_expert_GS.numpy()
    tight = dataclasses.replace(free, budget_bytes=1)
    got = lrmoe_mod._trimmed(counts, LrmoeConfig(), tight, inst, None, True)
    assert got.plan is None and not got.kept and isinstance(got.over, OutOfMemory)
    assert np.array_equal(got.placed.inst_expert_GS.numpy(), inst)  # on that placement
    assert got.placed.exact  # every pair retained and selected
    assert torch.equal(got.placed.assign_GGS.sum(), counts.sum())
    with pytest.raises(OutOfMemory, match="smallest lrmoe plan"):
        plan_lrmoe(counts, LrmoeConfig(), tight, inst, hold=True, ladder=False)


def test_the_ladder_goes_on_from_the_placement_it_is_handed():
    cfg, counts, free = _layer()
    placed = plan_lrmoe(counts, LrmoeConfig(), free).plan
    exact = dataclasses.replace(placed, retain_GGS=placed.assign_GGS.clone(),
                                select_GGS=placed.assign_GGS.clone())
    need = max(t["total"] for t in free.rank_terms(exact))
    led = dataclasses.replace(free, budget_bytes=need)
    over = OutOfMemory("over", need + 1, need, "rank 0")
    plan = climb(counts, Trimmed(None, placed=exact, over=over), led, placed.S)
    assert plan.rung == "exact"
    assert torch.equal(plan.inst_expert_GS, placed.inst_expert_GS)
    with pytest.raises(OutOfMemory, match="over"):  # no budget to climb under
        climb(counts, Trimmed(None, placed=exact, over=over), None, placed.S)


def test_planned_says_whether_the_given_placement_was_kept():
    cfg, counts, free = _layer()
    first = plan_lrmoe(counts, LrmoeConfig(), free)
    assert not first.kept_placement  # none given
    inst = first.plan.inst_expert_GS.numpy()
    again = plan_lrmoe(counts, LrmoeConfig(), free, inst)
    assert again.kept_placement and torch.equal(again.plan.select_GGS, first.plan.select_GGS)
    floor = max(t["total"] for t in free.rank_terms(first.plan))
    # a budget the natives fit and the replicated placement does not: made again
    for frac in np.linspace(0.5, 1.0, 51):
        led = dataclasses.replace(free, budget_bytes=int(floor * frac))
        try:
            got = plan_lrmoe(counts, LrmoeConfig(), led, inst, ladder=False)
        except OutOfMemory:
            continue
        if not np.array_equal(got.plan.inst_expert_GS.numpy(), inst):
            assert not got.kept_placement
            return
    pytest.fail("no budget made the placement again")


def _fewest_recomputed(led, plan):
    """Whether every rank of ``plan`` fits ``led`` and each recomputing rank would be over
    the budget with one row fewer recomputed (the ledger's terms rank by rank)."""
    terms = led.rank_terms(plan)
    rec = plan.recompute_G.tolist()
    n, R, h, k = (x.tolist() for x in plan_counts(plan))
    fewer = [r == 0 or led.terms(n[g], R[g], h[g], k[g], r - 1, exact=True)["total"]
             > led.budget_bytes for g, r in enumerate(rec)]
    return all(t["total"] <= led.budget_bytes for t in terms) and all(fewer)


def test_the_ladder_recomputes_before_it_gives_replicas_up():
    """Just below the exact plan's need the ladder keeps the placement and recomputes the
    fewest rows per rank; just below the natives' exact need it gives the replicas up and
    recomputes on static's placement."""
    cfg, counts, free = _layer()
    placed = plan_lrmoe(counts, LrmoeConfig(), free).plan
    exact = dataclasses.replace(placed, retain_GGS=placed.assign_GGS.clone(),
                                select_GGS=placed.assign_GGS.clone())
    over = OutOfMemory("over", 1, 1, "rank 0")
    natives = native_plan(counts.numpy())
    for plan_need, rung, replicas in ((exact, "recompute", placed.num_replicas()),
                                      (natives, "recompute-natives", 0)):
        need = max(t["total"] for t in free.rank_terms(plan_need))
        led = dataclasses.replace(free, budget_bytes=need - 10**6)
        plan = climb(counts, Trimmed(None, placed=exact, over=over), led, placed.S)
        assert plan.rung == rung and plan.num_replicas() == replicas
        assert plan.exact and int(plan.recompute_G.sum()) > 0
        assert _fewest_recomputed(led, plan)
