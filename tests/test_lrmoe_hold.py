"""lrmoe's placement held for the optimizer step (``placement="step"`` and
``"step-previous"``): placed once, at micro-batch 0, from its counts or from the previous
step's; every later micro-batch of the step plans its own split, quotas and selection
on that placement; the same on every rank; a new step places again."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from lrmoe.ledger import Ledger
from lrmoe.policy import LrmoeConfig, LrmoePolicy, PlanInputs
from lrmoe.policy.base import prepare
from lrmoe.policy.lrmoe import place_lrmoe, plan_lrmoe, previous_totals
from lrmoe.presets import get_preset
from lrmoe.sim.links import LINKS, link_cost
from test_planner_fast import _budget, _counts

E = 128
MCFG = get_preset("qwen3-30b-a3b")


def _step(policy, micro_counts, step: int, prev_E=None, ledger=None, layer: int = 0):
    """The policy's plans of one optimizer step's micro-batches, as the runtime asks:
    prepare (before the counts), then plan, with the micro-batch index."""
    out = []
    for m, c in enumerate(micro_counts):
        G = c.shape[0]
        inputs = PlanInputs(layer, step, prev_E, ledger, micro=m)
        inputs = prepare(policy, prev_E, G, inputs, int(c.sum()) // G)
        out.append(policy.plan(c, inputs))
    return out


def _micro(seed: int, G: int, n: int, skew: float = 1.2, pairs: int = 4096):
    rng = np.random.default_rng(seed)
    return [_counts(rng, G, E, pairs, skew) for _ in range(n)]


@pytest.mark.parametrize("G", [8, 32])
def test_step_placement_is_micro_batch_zeros_and_held(G):
    cfg = LrmoeConfig(placement="step")
    micro = _micro(G, G, 4)
    ledger = Ledger.for_dtype(MCFG, G, _budget(MCFG, G, micro[0], 0.5), "bf16")
    pol = LrmoePolicy(cfg)
    plans = _step(pol, micro, step=3, ledger=ledger)
    assert pol.rungs == {"plan": 4}  # each micro-batch's plan counted once, held or not
    first = plan_lrmoe(micro[0], dataclasses.replace(cfg, placement="current"),
                              ledger, ladder=False).plan
    assert torch.equal(plans[0].inst_expert_GS, first.inst_expert_GS)
    assert plans[0].num_replicas() > 0
    for c, p in zip(micro[1:], plans[1:]):
        p.check(c)
        assert torch.equal(p.inst_expert_GS, first.inst_expert_GS)
        # its own split, quotas and selection on the held placement
        want = plan_lrmoe(c, cfg, ledger, first.inst_expert_GS.numpy(), hold=True, ladder=False).plan
        for f in ("assign_GGS", "retain_GGS", "select_GGS"):
            assert torch.equal(getattr(p, f), getattr(want, f))
        # ... which is not the placement its own counts would get
    assert any(not torch.equal(plan_lrmoe(c, cfg, ledger, ladder=False).plan.inst_expert_GS,
                               first.inst_expert_GS) for c in micro[1:])


def test_step_previous_places_from_the_previous_steps_counts():
    G = 16
    cfg = LrmoeConfig(placement="step-previous")
    micro = _micro(1, G, 3)
    prev_E = _micro(2, G, 1)[0].sum(0) * 3
    pol = LrmoePolicy(cfg)
    plans = _step(pol, micro, step=5, prev_E=prev_E)
    total, home = previous_totals(prev_E, G, int(micro[0].sum()) // G)
    want = place_lrmoe(total, home, cfg)
    for p, c in zip(plans, micro):
        p.check(c)
        assert np.array_equal(p.inst_expert_GS.numpy(), want)
    assert pol.replaced_placements == 0


def test_every_rank_holds_the_same_and_a_new_step_places_again():
    G = 8
    ib = link_cost(LINKS["ib"], 400e12, MCFG.hidden_size, MCFG.moe_intermediate_size, 2, 2,
                   share=4)
    for placement, link in (("step", None), ("step-previous", None), ("step", ib),
                            ("step-previous", ib)):
        cfg = LrmoeConfig(placement=placement, link=link)
        ranks = [LrmoePolicy(cfg) for _ in range(3)]
        prev = last = None
        for step in range(3):
            micro = _micro(10 + step, G, 4, skew=0.4 + 0.5 * step)
            per_rank = [_step(r, micro, step, prev) for r in ranks]
            for plans in per_rank[1:]:
                for a, b in zip(plans, per_rank[0]):
                    for f in ("inst_expert_GS", "assign_GGS", "retain_GGS", "select_GGS"):
                        assert torch.equal(getattr(a, f), getattr(b, f))
            held = [p.inst_expert_GS for p in per_rank[0]]
            assert all(torch.equal(h, held[0]) for h in held)
            if step and link is None:  # (the link rule may keep static's placement)
                assert not torch.equal(held[0], last), (placement, step)
            last = held[0]
            prev = sum(micro).sum(0)


def test_a_rerun_of_micro_batch_zero_and_plain_callers():
    """A re-run of micro-batch 0 (an activation checkpoint's) plans it again, the same
    plan; a caller that passes no micro-batch index (a projection over samples) gets
    each sample's own placement, as with ``current``."""
    G = 8
    micro = _micro(20, G, 2)
    pol = LrmoePolicy(LrmoeConfig(placement="step"))
    a = pol.plan(micro[0], PlanInputs(step=1, micro=0))
    b = pol.plan(micro[0], PlanInputs(step=1, micro=0))
    assert torch.equal(a.inst_expert_GS, b.inst_expert_GS)
    assert torch.equal(a.select_GGS, b.select_GGS)
    cur = LrmoePolicy(LrmoeConfig())
    for c in micro:
        assert torch.equal(pol.plan(c, PlanInputs()).inst_expert_GS,
                           cur.plan(c, PlanInputs()).inst_expert_GS)


def test_a_held_placement_a_micro_batch_cannot_fit_climbs_the_ladder_on_it():
    """A later micro-batch whose counts do not fit the held placement's trimmed plan is
    not placed again: the ladder's rungs on that placement (every pair in backward,
    then recompute) come first; the held placement stays for the next micro-batch."""
    G = 8
    calm = _micro(30, G, 1, skew=0.0, pairs=65536)[0]
    # all of micro-batch 1's pairs go to one rank's experts: its buffers outgrow the room
    hot = torch.zeros_like(calm)
    hot[:, : E // G] = calm.sum(1, keepdim=True) // (E // G)
    hot[:, 0] += calm.sum(1) - hot.sum(1)
    ledger = Ledger.for_dtype(MCFG, G, _budget(MCFG, G, calm, 0.15), "bf16")
    pol = LrmoePolicy(LrmoeConfig(placement="step", recompute=False))
    plans = _step(pol, [calm, hot, calm], step=0, ledger=ledger)
    assert plans[0].rung == "plan"
    assert plans[1].rung != "plan", plans[1].rung
    if plans[1].rung in ("exact", "recompute"):
        assert torch.equal(plans[1].inst_expert_GS, plans[0].inst_expert_GS)
    else:
        assert pol.replaced_placements == 1
    assert torch.equal(plans[2].inst_expert_GS, plans[0].inst_expert_GS)
    for p, c in zip(plans, (calm, hot, calm)):
        p.check(c)
        assert max(t["total"] for t in ledger.rank_terms(p)) <= ledger.budget_bytes
