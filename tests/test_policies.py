"""Planners: static, capacity, symi, lrmoe, the registry and ``lrmoe plan``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from budgets import natives_floor
from lrmoe.config import ModelConfig
from lrmoe.errors import LrmoeError
from lrmoe.ledger import Ledger
from lrmoe.parallel.options import BackwardOptions
from lrmoe.policy import PlanInputs
from lrmoe.policy.capacity import capacity_per_expert, plan_capacity
from lrmoe.policy.lrmoe import LrmoeConfig, LrmoePolicy, plan_lrmoe
from lrmoe.policy.plan import Plan
from lrmoe.policy.plan_numpy import full_plan
from lrmoe.policy.registry import PolicyConfig, make_policy
from lrmoe.policy.static import StaticPolicy
from lrmoe.policy.symi import SymiPolicy, largest_feasible_slots, plan_symi
from references.plans import (
    apportion,
    contiguous_placement,
    even_split,
    native_placement,
    replica_counts,
)

FAST = settings(max_examples=40, deadline=None)


def _cfg(E: int = 16, **kw) -> ModelConfig:
    base = dict(hidden_size=32, moe_intermediate_size=24, num_experts=E, num_experts_per_tok=2,
                num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    base.update(kw)
    return ModelConfig(**base)


def _skewed(G: int, E: int, seed: int, scale: int = 50) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hot = torch.rand(E, generator=g) ** 4 * 20 + 0.2
    return (torch.rand(G, E, generator=g) * hot * scale).long()


# ---------------------------------------------------------------------- helpers
def test_even_split_ignores_empty_slots():
    # Regression: empty slots used to count as instances of expert 0 when ranking, so
    # expert 0's 5 pairs over 3 instances summed to 4.
    ie = torch.tensor([[0, -1, -1], [0, 1, 0]])
    counts = torch.tensor([[5, 1], [0, 0]])
    assert even_split(counts, ie).tolist() == [[2, 0, 0], [2, 1, 1]]
    full_plan(counts, ie).check(counts)


@FAST
@given(st.integers(1, 6), st.integers(1, 8), st.integers(0, 10**6), st.integers(0, 2**31))
def test_apportion_exact(N, K, scale, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.rand(N, K, generator=g) * scale).long()
    total = (torch.rand(K, generator=g) * (w.sum(0) + 1)).long().clamp(max=w.sum(0))
    out = apportion(total, w)
    assert torch.equal(out.sum(0), total)
    assert (out >= 0).all() and (out <= w).all()
    # proportional to within one unit
    W = w.sum(0).clamp(min=1).double()
    assert ((out.double() - total.double() * w.double() / W).abs() < 1 + 1e-9).all()


# ---------------------------------------------------------------------- symi
def test_symi_counts_hand_worked():
    # G=2 ranks, s=4 slots -> 8 instances; pop = [9, 7, 3, 1] (sum 20)
    #   goal = pop/20*8        = [3.6, 2.8, 1.2, 0.4]
    #   cnt  = floor(max(goal,1)) = [3, 2, 1, 1]  (sum 7 < 8)
    #   diff = cnt - goal      = [-0.6, -0.8, -0.2, 0.6]
    #   increment the smallest diff (expert 1)   -> cnt = [3, 3, 1, 1]
    # contiguous placement: rank 0 = [0, 0, 0, 1], rank 1 = [1, 1, 2, 3]
    cnt = replica_counts(torch.tensor([9, 7, 3, 1]), 4, 8)
    assert cnt == [3, 3, 1, 1]
    assert contiguous_placement(cnt, 2, 4).tolist() == [[0, 0, 0, 1], [1, 1, 2, 3]]
    # Decrement case: pop = [1, 1, 1, 17], 6 slots: goal = [.3, .3, .3, 5.1],
    # cnt = [1, 1, 1, 5] (sum 8 > 6); only expert 3 has cnt > 1 -> 4 -> 3.
    assert replica_counts(torch.tensor([1, 1, 1, 17]), 4, 6) == [1, 1, 1, 3]
    # Uniform (first step): 6 slots over 4 experts: goal 1.5 each, cnt [1,1,1,1],
    # diff -0.5 each -> increment experts 0 then 1 (ties to the lower id).
    assert replica_counts(None, 4, 6) == [2, 2, 1, 1]


def test_symi_plan_hand_worked():
    counts = torch.tensor([[5, 4, 1, 0], [4, 3, 2, 1]])  # expert totals 9, 7, 3, 1
    plan = plan_symi(counts, 4, prev_counts_E=torch.tensor([9, 7, 3, 1]))
    assert plan.inst_expert_GS.tolist() == [[0, 0, 0, 1], [1, 1, 2, 3]]
    # expert 0: 9 pairs over 3 instances -> 3,3,3; expert 1: 7 over 3 -> 3,2,2
    assert plan.assign_GGS.sum(0).tolist() == [[3, 3, 3, 3], [2, 2, 3, 1]]
    plan.check(counts)
    assert plan.exact


@FAST
@given(st.sampled_from([(2, 4), (4, 8), (4, 16), (8, 16)]), st.integers(0, 4),
       st.integers(0, 2**31), st.booleans())
def test_symi_properties(GE, extra, seed, first_step):
    G, E = GE
    s = E // G + extra
    counts = _skewed(G, E, seed)
    prev = None if first_step else _skewed(G, E, seed + 1).sum(0)
    cnt = replica_counts(prev, E, G * s)
    assert sum(cnt) == G * s and min(cnt) >= 1
    plan = plan_symi(counts, s, prev)
    ie = plan.inst_expert_GS.flatten()
    assert (ie[1:] >= ie[:-1]).all()  # contiguous
    assert torch.bincount(ie, minlength=E).tolist() == cnt
    plan.check(counts)
    assert plan.exact
    # even split: the instances of one expert differ by at most one pair
    load = plan.assign_GGS.sum(0).flatten()
    for e in range(E):
        li = load[ie == e]
        assert int(li.max() - li.min()) <= 1
    again = plan_symi(counts, s, prev)
    assert torch.equal(again.assign_GGS, plan.assign_GGS)


def test_symi_rejects_too_few_slots():
    with pytest.raises(LrmoeError, match="slots_per_rank=1 must be"):
        plan_symi(torch.ones(2, 8, dtype=torch.long), 1)


def test_symi_budget_and_largest_feasible_slots():
    cfg = _cfg()
    G, E = 4, cfg.num_experts
    counts = _skewed(G, E, 3)
    ledger = Ledger(cfg, G)
    need = [max(t["total"] for t in ledger.rank_terms(plan_symi(counts, s, counts.sum(0))))
            for s in range(4, E + 1)]
    budget = need[3]  # s = 7 fits exactly
    led = Ledger(cfg, G, budget)
    s = largest_feasible_slots(led, counts, counts.sum(0), max_slots=9)
    assert s >= 7 and need[s - 4] <= budget
    assert all(need[x - 4] > budget for x in range(s + 1, 10))
    s = largest_feasible_slots(led, counts, counts.sum(0))
    assert need[s - 4] <= budget and all(need[x - 4] > budget for x in range(s + 1, E + 1))
    with pytest.raises(LrmoeError, match="short by"):
        plan_symi(counts, 9, counts.sum(0), Ledger(cfg, G, min(need) - 1))
    with pytest.raises(LrmoeError, match="no slots_per_rank >= 4 fits: .*short by"):
        largest_feasible_slots(Ledger(cfg, G, min(need) - 1), counts, counts.sum(0))
    with pytest.raises(LrmoeError, match="fits: the native experts alone exceed the budget"):
        largest_feasible_slots(Ledger(cfg, G, 1), counts, counts.sum(0))


def test_symi_prepares_from_per_rank_or_global_counts():
    """The previous step's ``[G, E]`` counts place as their ``[E]`` sum does."""
    G, E = 4, 16
    prev = _skewed(G, E, 5)
    pol = SymiPolicy(6)
    per_rank = pol.prepare(prev, G, PlanInputs())
    glob = pol.prepare(prev.sum(0), G, PlanInputs())
    assert np.array_equal(per_rank.inst_expert_GS, glob.inst_expert_GS)
    assert (glob.inst_expert_GS >= 0).sum() > E  # replicas: the placement follows the counts


def test_full_plan_splits_by_the_given_loads():
    """Hand-worked: expert 0's 6 pairs (3 from each home) over its two instances as loads
    5 and 1 (not the even 3 and 3): contiguous intervals, homes in rank order."""
    counts = torch.tensor([[3, 1], [3, 1]])
    ie = torch.tensor([[0, 1], [0, -1]])
    plan = full_plan(counts, ie, torch.tensor([[5, 2], [1, 0]]))
    assert plan.assign_GGS.tolist() == [[[3, 1], [0, 0]], [[2, 1], [1, 0]]]
    assert torch.equal(plan.retain_GGS, plan.assign_GGS)
    assert full_plan(counts, ie).assign_GGS.tolist() == [[[3, 1], [0, 0]], [[0, 1], [3, 0]]]


# ---------------------------------------------------------------------- capacity
def test_capacity_huge_factor_is_static():
    counts = _skewed(4, 16, 0)
    plan = plan_capacity(counts, 1e6)
    ref = StaticPolicy().plan(counts, PlanInputs())
    assert torch.equal(plan.assign_GGS, ref.assign_GGS)
    assert int(plan.dropped_GE.sum()) == 0
    plan.check(counts)


@FAST
@given(st.floats(0.1, 3.0), st.integers(0, 2**31))
def test_capacity_drops(cf, seed):
    counts = _skewed(4, 8, seed)
    plan = plan_capacity(counts, cf)
    plan.check(counts)
    cap = capacity_per_expert(counts, cf)
    kept_E = (counts - plan.dropped_GE).sum(0)
    assert torch.equal(kept_E, counts.sum(0).clamp(max=cap))
    assert (plan.dropped_GE >= 0).all() and plan.exact
    assert cap == math.ceil(round(cf * int(counts.sum()) / 8, 9))


def test_capacity_rounding():
    counts = torch.full((2, 10), 40)  # 800 pairs, 10 experts
    assert capacity_per_expert(counts, 1.25) == 100


# ---------------------------------------------------------------------- lrmoe
def test_lrmoe_unbounded_no_selection_is_exact():
    counts = _skewed(4, 16, 1)
    plan = plan_lrmoe(counts, LrmoeConfig(selection=False), ladder=False).plan
    plan.check(counts)
    assert plan.exact
    assert plan.num_replicas() > 0
    static = full_plan(counts, native_placement(4, 16))
    assert plan.rank_load().max() < static.rank_load().max()


def test_lrmoe_huge_budget_retains_everything():
    cfg = _cfg()
    counts = _skewed(4, 16, 2)
    plan = plan_lrmoe(counts, LrmoeConfig(selection=False), Ledger(cfg, 4, 2**50), ladder=False).plan
    assert plan.exact


def test_lrmoe_balance_zero_selects_all_retained():
    counts = _skewed(4, 16, 2)
    plan = plan_lrmoe(counts, LrmoeConfig(balance=0.0), ladder=False).plan
    assert torch.equal(plan.select_GGS, plan.retain_GGS)


@pytest.mark.parametrize("placement", ["current", "previous"])
def test_lrmoe_select_from_turns_selection_off_before_step_n_only(placement):
    """Before step ``select_from`` every retained pair is selected; from it on, the plans
    (their placements too, weighed on IB with selection) are the default config's, bit
    for bit."""
    from lrmoe.sim.links import get_link, link_cost

    counts, prev = _skewed(4, 16, 1), _skewed(4, 16, 1)
    link = link_cost(get_link("ib"), 1e11, 64, 32, 2, 2, 1)  # it places otherwise unselected
    cfg = LrmoeConfig(placement=placement, link=link)
    warm = LrmoePolicy(dataclasses.replace(cfg, select_from=3))
    plain = LrmoePolicy(cfg)
    for step in range(5):
        got = warm.plan(counts, PlanInputs(layer=0, step=step, prev_counts_E=prev))
        ref = plain.plan(counts, PlanInputs(layer=0, step=step, prev_counts_E=prev))
        if step < 3:
            assert torch.equal(got.select_GGS, got.retain_GGS), step
            assert not torch.equal(ref.select_GGS, ref.retain_GGS)  # it did trim
        else:  # every field: the replicas given up for their link cost too
            for f in dataclasses.fields(ref):
                x, y = getattr(got, f.name), getattr(ref, f.name)
                assert torch.equal(x, y) if isinstance(y, torch.Tensor) else x == y, (step, f)
    with pytest.raises(LrmoeError, match="select_from=-1"):
        LrmoeConfig(select_from=-1)


def test_lrmoe_max_replicas_and_slots():
    counts = _skewed(4, 16, 4)
    assert plan_lrmoe(counts, LrmoeConfig(max_replicas_per_step=0), ladder=False).plan.num_replicas() == 0
    assert plan_lrmoe(counts, LrmoeConfig(max_replicas_per_step=2), ladder=False).plan.num_replicas() <= 2
    p = plan_lrmoe(counts, LrmoeConfig(max_slots_per_rank=4), ladder=False).plan
    assert p.num_replicas() == 0 and p.S == 4
    with pytest.raises(LrmoeError, match="max_slots_per_rank=3"):
        plan_lrmoe(counts, LrmoeConfig(max_slots_per_rank=3), ladder=False)


def _check_lrmoe(plan, counts, cfg: LrmoeConfig, ledger):
    plan.check(counts)  # select <= retain <= assign and exact routing
    if ledger is not None:
        ledger.check(plan)  # never over budget
    a, r, s = plan.assign_GGS, plan.retain_GGS, plan.select_GGS
    floor = torch.minimum(torch.ceil(a.double() * cfg.min_keep).long(), r)
    assert (s >= floor).all()
    assert plan.rank_backward_load().max() <= plan.rank_load().max()
    # one retained pair per non-empty instance
    assert (r.sum(0)[a.sum(0) > 0] >= 1).all()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(2, 8), (4, 16), (8, 16), (4, 32)]), st.integers(0, 2**31),
       st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.floats(0.0, 1.5), st.integers(0, 3),
       st.booleans())
def test_lrmoe_properties(GE, seed, balance, min_keep, slack, extra, selection):
    G, E = GE
    mcfg = _cfg(E)
    counts = _skewed(G, E, seed, scale=200)
    cfg = LrmoeConfig(balance=balance, min_keep=min_keep, selection=selection,
                      max_slots_per_rank=E // G + extra)
    base = Ledger(mcfg, G)
    floor = natives_floor(base, counts)
    full = max(t["total"] for t in base.rank_terms(full_plan(counts, native_placement(G, E))))
    budget = int(floor + slack * (full - floor))
    ledger = Ledger(mcfg, G, budget)
    plan = plan_lrmoe(counts, cfg, ledger, ladder=False).plan
    _check_lrmoe(plan, counts, cfg, ledger)
    assert torch.equal(plan_lrmoe(counts, cfg, ledger, ladder=False).plan.select_GGS, plan.select_GGS)
    if not selection:
        assert torch.equal(plan.select_GGS, plan.retain_GGS)
    if balance == 1.0 and selection:
        # every rank above the mean retained load is trimmed to it, unless its floors stop it
        ret = plan.retain_GGS.sum(dim=(0, 2)).double()
        bwd = plan.rank_backward_load().double()
        a, r = plan.assign_GGS, plan.retain_GGS
        fl = torch.minimum(torch.ceil(a.double() * min_keep).long(), r).sum(dim=(0, 2))
        target = torch.ceil(ret.mean() - 1e-9)
        assert (bwd <= torch.maximum(target, fl.double()) + 1e-9).all()


def test_lrmoe_infeasible_budget():
    mcfg = _cfg()
    counts = _skewed(4, 16, 5)
    ledger = Ledger(mcfg, 4)
    floor = natives_floor(ledger, counts)
    plan_lrmoe(counts, LrmoeConfig(), Ledger(mcfg, 4, floor), ladder=False)  # the natives' floor fits
    # Just below it, replicas take pairs (and buffer bytes) off the hot rank: it still fits.
    tight = Ledger(mcfg, 4, floor - 1)
    plan = plan_lrmoe(counts, LrmoeConfig(), tight, ladder=False).plan
    assert plan.num_replicas() > 0
    assert max(t["total"] for t in tight.rank_terms(plan)) <= floor - 1
    # Below the owned optimizer state no placement can help: a clear error.
    owned = ledger.owner_bytes()
    with pytest.raises(LrmoeError, match="short by") as ei:
        plan_lrmoe(counts, LrmoeConfig(), Ledger(mcfg, 4, owned - 1), ladder=False)
    assert "rank" in str(ei.value)


def test_lrmoe_config_validation():
    for kw, field in [(dict(balance=1.5), "balance"), (dict(min_keep=-0.1), "min_keep"),
                      (dict(keep="x"), "keep"), (dict(placement="x"), "placement"),
                      (dict(max_replicas_per_step=-1), "max_replicas_per_step")]:
        with pytest.raises(LrmoeError, match=field):
            LrmoeConfig(**kw)
    for kw, field in [(dict(estimator="x"), "estimator"), (dict(metric="x"), "metric"),
                      (dict(router_grad="x"), "router_grad")]:
        with pytest.raises(LrmoeError, match=field):
            BackwardOptions(**kw)


# ---------------------------------------------------------------------- registry
def test_registry():
    mcfg = _cfg()
    counts = _skewed(4, 16, 6)
    for name in ("static", "capacity", "symi", "lrmoe"):
        pol = make_policy(PolicyConfig(name=name), mcfg, 4)
        assert pol.name == name
        pol.plan(counts, PlanInputs(prev_counts_E=counts.sum(0))).check(counts)
    assert make_policy(PolicyConfig("symi", slots_per_rank=5), mcfg, 4).slots_per_rank == 5
    lp = make_policy(PolicyConfig("lrmoe", slots_per_rank=6), mcfg, 4)
    assert lp.config.max_slots_per_rank == 6
    with pytest.raises(LrmoeError, match="static, capacity, symi, lrmoe"):
        make_policy(PolicyConfig(name="eplb"), mcfg, 4)
    with pytest.raises(LrmoeError, match="slots_per_rank=2"):
        make_policy(PolicyConfig("symi", slots_per_rank=2), mcfg, 4)
    with pytest.raises(LrmoeError, match="divide"):
        make_policy(PolicyConfig(), mcfg, 3)


# ---------------------------------------------------------------------- lrmoe plan
def _run_plan(argv):
    from lrmoe.commands import plan as cmd

    parser = argparse.ArgumentParser()
    cmd.register(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


def _rank_rows(out: str, G: int) -> list[int]:
    return [int(line.split()[0]) for line in out.splitlines()
            if line.split() and line.split()[0].isdigit() and len(line.split()) > 8]


@pytest.mark.parametrize("argv, G, rc", [
    (["--preset", "qwen3-30b-a3b", "--ep", "32", "--policy", "symi", "--slots-per-rank", "6",
      "--mem-budget", "40GiB"], 32, 1),
    (["--preset", "glm-4.5-air", "--ep", "32", "--policy", "symi", "--slots-per-rank", "6",
      "--mem-budget", "40GiB"], 32, 1),
    (["--preset", "qwen3-30b-a3b", "--ep", "32", "--policy", "lrmoe", "--mem-budget",
      "64GiB"], 32, 0),
    (["--preset", "glm-4.5-air", "--ep", "64", "--policy", "lrmoe", "--mem-budget",
      "120GiB"], 64, 0),
    (["--preset", "qwen3-30b-a3b", "--ep", "8", "--policy", "capacity"], 8, 0),
    (["--preset", "glm-4.5-air", "--ep", "16", "--policy", "static", "--dtype", "fp32",
      "--tokens-per-rank", "2048", "--skew", "0"], 16, 0),
])
def test_plan_command_full_presets(capsys, argv, G, rc):
    assert _run_plan(argv) == rc
    out = capsys.readouterr().out
    assert _rank_rows(out, G) == list(range(G))
    assert "forward load  max" in out and "backward load max" in out


def test_plan_command_symi_picks_largest_slots(capsys):
    assert _run_plan(["--preset", "qwen3-30b-a3b", "--ep", "32", "--policy", "symi",
                      "--mem-budget", "120GiB"]) == 0
    assert "the largest that fits the budget" in capsys.readouterr().out


def test_plan_command_loads_file(tmp_path, capsys):
    E, G = 16, 4
    loads = list(range(1, E + 1))
    for i, data in enumerate([loads, {"counts": loads}, [loads] * G]):
        p = tmp_path / f"l{i}.json"
        p.write_text(json.dumps(data))
        assert _run_plan(["--preset", "tiny-qwen3", "--ep", str(G), "--policy", "lrmoe",
                          "--loads", str(p)]) == 0
        out = capsys.readouterr().out
        assert _rank_rows(out, G) == list(range(G))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([1, 2, 3]))
    with pytest.raises(LrmoeError, match="3 counts; the model has 16"):
        _run_plan(["--preset", "tiny-qwen3", "--ep", "4", "--loads", str(bad)])
    bad.write_text("{")
    with pytest.raises(LrmoeError, match="not valid JSON"):
        _run_plan(["--preset", "tiny-qwen3", "--ep", "4", "--loads", str(bad)])


def test_plan_command_infeasible_lrmoe():
    with pytest.raises(LrmoeError, match="short by"):
        _run_plan(["--preset", "glm-4.5-air", "--ep", "32", "--policy", "lrmoe",
                   "--mem-budget", "40GiB"])


def test_symi_best_slots_with_recompute():
    """best_slots: every s it considers fits with recompute, and it picks the least
    busiest-rank work (forward 3 + backward 6 + recompute 2 units per pair)."""
    from lrmoe.policy.symi import best_slots, slot_costs

    cfg = _cfg()
    G, E = 4, cfg.num_experts
    counts = _skewed(G, E, 3)
    pop = counts.sum(0)
    free = Ledger(cfg, G)
    costs_free = slot_costs(free, counts, pop)
    assert set(costs_free) == set(range(E // G, E + 1))  # no budget: all fit, no recompute
    for s, c in costs_free.items():
        assert c == 9 * int(plan_symi(counts, s, pop).rank_load().max())
    need = [max(t["total"] for t in free.rank_terms(plan_symi(counts, s, pop)))
            for s in range(E // G, E + 1)]
    budget = min(need) - 1  # no s fits without recompute
    led = Ledger(cfg, G, budget)
    costs = slot_costs(led, counts, pop)
    assert costs, "some s must fit with recompute at this budget"
    for s, c in costs.items():
        plan = plan_symi(counts, s, pop)
        mode, rec, terms = led.exact_fit(plan)
        assert mode in ("pairs", "layer") and max(t["total"] for t in terms) <= budget
        unit = 2 if mode == "pairs" else 3
        assert c == max(9 * n + unit * r for n, r in zip(plan.rank_load().tolist(), rec))
        if mode == "pairs":  # the runtime recomputes per row: the planner says which
            fitted = plan_symi(counts, s, pop, led, recompute=True)
            assert fitted.recompute_G.tolist() == rec
            assert max(t["total"] for t in led.rank_terms(fitted)) <= budget
        else:  # the planner checkpoints the whole layer (Plan.layer_checkpoint)
            fitted = plan_symi(counts, s, pop, led, recompute=True)
            assert fitted.layer_checkpoint and fitted.recompute_G is None
            assert max(t["total"] for t in led.rank_terms(fitted)) <= budget
    best, n_fit = best_slots(led, [counts, counts], [pop, pop])
    assert n_fit == 2 and costs[best] == min(costs.values())
    assert best == max(s for s, c in costs.items() if c == costs[best])
    # hand-worked: the most matrices fitted, then the least mean work, then the larger s
    assert best_slots(None, [], [], per=[{4: 90, 5: 90}, {4: 90, 5: 90}]) == (5, 2)
    assert best_slots(None, [], [], per=[{4: 81, 5: 90}, {4: 81, 5: 90}]) == (4, 2)
    assert best_slots(None, [], [], per=[{4: 90, 5: 81}, {4: 90}]) == (4, 2)
    # a second matrix only the smallest s fits: fitting more matrices wins over work
    tight = Ledger(cfg, G, budget)
    other = _skewed(G, E, 11)
    fits_other = slot_costs(tight, other, other.sum(0))
    if fits_other and set(fits_other) != set(costs):
        s2, n2 = best_slots(tight, [counts, other], [pop, other.sum(0)])
        assert n2 == 2 or not (set(fits_other) & set(costs))
    with pytest.raises(LrmoeError, match="short by"):
        plan_symi(counts, best, pop, led)  # without recompute it does not fit
    with pytest.raises(LrmoeError, match="even with activation recompute"):
        best_slots(Ledger(cfg, G, 1000), [counts], [pop])


def test_plan_recompute_field_checked_and_counted():
    """recompute_G: 0..retained rows per rank, and the ledger counts
    those rows at the input row's bytes; fit_exact recomputes the fewest that fit."""
    import dataclasses

    from lrmoe.policy.plan import fit_exact

    cfg = _cfg()
    G, E = 4, cfg.num_experts
    counts = _skewed(G, E, 5)
    plan = plan_symi(counts, E // G + 1, counts.sum(0))
    load = plan.rank_load()
    ok = dataclasses.replace(plan, recompute_G=load // 2)
    ok.check(counts)
    with pytest.raises(LrmoeError, match="0..retained"):
        dataclasses.replace(plan, recompute_G=load + 1).check(counts)
    half = plan.assign_GGS // 2
    partial = Plan(plan.inst_expert_GS, plan.assign_GGS, half, half,
                   recompute_G=half.sum(dim=(0, 2)))
    partial.check(counts)  # up to every retained row
    with pytest.raises(LrmoeError, match="0..retained"):
        dataclasses.replace(partial, recompute_G=half.sum(dim=(0, 2)) + 1).check(counts)
    # a whole-layer checkpoint re-runs every pair: an exact plan with no rows recomputed
    dataclasses.replace(plan, layer_checkpoint=True).check(counts)
    for bad in (dataclasses.replace(partial, recompute_G=None, layer_checkpoint=True),
                dataclasses.replace(ok, layer_checkpoint=True)):
        with pytest.raises(LrmoeError, match="must be exact, with no rows recomputed"):
            bad.check(counts)
    free = Ledger(cfg, G)
    a, b = free.rank_terms(plan), free.rank_terms(ok)
    for r in range(G):
        saved = int(load[r] // 2) * free.L * 2 * cfg.moe_intermediate_size * free.bytes_act
        assert a[r]["retained_acts"] - b[r]["retained_acts"] == saved
        # the backward's rebuild points make the transients grow by what the ledger says
        grew = b[r]["buffers"] - a[r]["buffers"]
        assert grew == free.counts_buffer_bytes(int(load[r]), int(counts[r].sum()),
                                                int(load[r]), int(load[r] // 2), True) \
            - free.counts_buffer_bytes(int(load[r]), int(counts[r].sum()), int(load[r]), 0, True)
        assert a[r]["total"] - b[r]["total"] == saved - grew
    budget = sorted(t["total"] for t in a)[G // 2]
    led = Ledger(cfg, G, budget)
    mode, rec, _ = led.exact_fit(plan)
    if mode == "pairs":
        fitted = fit_exact(plan, led, "test")
        assert fitted.recompute_G.tolist() == rec
        assert max(t["total"] for t in led.rank_terms(fitted)) <= budget
    assert fit_exact(plan, Ledger(cfg, G, max(t["total"] for t in a)), "test") is plan


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lrmoe_recompute_retains_more_within_budget(seed):
    """With recompute, lrmoe retains at least as many pairs per rank, recomputes only
    what the budget forces, and stays within it."""
    from lrmoe.policy.lrmoe import LrmoeConfig, plan_lrmoe

    cfg = _cfg()
    G, E = 4, cfg.num_experts
    counts = _skewed(G, E, seed)
    free = Ledger(cfg, G)
    terms = free.rank_terms(plan_lrmoe(counts, LrmoeConfig(), free, ladder=False).plan)
    need = max(t["total"] for t in terms)
    ret = max(t["retained_acts"] for t in terms)
    short = 0
    # below the unbounded plan's need by a quarter and a half of its retained activations
    for budget in (need - ret // 2, need - ret // 4):
        led = Ledger(cfg, G, budget)
        a = plan_lrmoe(counts, LrmoeConfig(), led, ladder=False).plan
        b = plan_lrmoe(counts, LrmoeConfig(recompute=True), led, ladder=False).plan
        b.check(counts)
        assert a.recompute_G is None and b.recompute_G is not None
        assert torch.equal(a.inst_expert_GS, b.inst_expert_GS)  # placement unchanged
        ka, kb = a.retain_GGS.sum(dim=(0, 2)), b.retain_GGS.sum(dim=(0, 2))
        assert bool((kb >= ka).all())
        if bool((ka < a.rank_load()).any()):  # some rank was short of room: it gains
            assert int(kb.sum()) > int(ka.sum())
        assert bool((b.recompute_G <= kb).all())
        assert max(t["total"] for t in led.rank_terms(b)) <= budget
        for r in range(G):  # ranks that retain everything recompute nothing
            if int(ka[r]) == int(a.rank_load()[r]):
                assert int(b.recompute_G[r]) == 0
        short += int(bool((ka < a.rank_load()).any()))
    assert short > 0, "the budgets must bind for some rank"


def test_lrmoe_placement_reaches_the_planner_from_every_command():
    """--lrmoe-placement / lrmoe:placement=previous end up in the planner's config (train,
    plan, bench ttl); a bad value is one error naming it."""
    from lrmoe.commands.plan import plan_policy
    from lrmoe.policy.registry import make_policy
    from lrmoe.presets import get_preset
    from lrmoe.sim.ttl import _choose
    from lrmoe.sim.ttl_config import TTLConfig, policy_variant
    from lrmoe.train.config import check_args, config_from_cli

    base, cfg = policy_variant("lrmoe:recompute+placement=previous", TTLConfig())
    pc = _choose(base, cfg, get_preset("tiny-qwen3"), None)[0]
    assert (pc.lrmoe.placement, pc.lrmoe.recompute) == ("previous", True)
    assert policy_variant("lrmoe", TTLConfig.from_flat(lrmoe_placement="previous"))[1] \
        .lrmoe.planner.placement == "previous"
    with pytest.raises(LrmoeError, match="lrmoe:placement=next"):
        policy_variant("lrmoe:placement=next", TTLConfig())
    args = argparse.Namespace(lrmoe_balance=1.0, lrmoe_min_keep=0.5, lrmoe_selection=True,
                              lrmoe_recompute=False, lrmoe_placement="previous")
    assert plan_policy(args).lrmoe.placement == "previous"
    tc = config_from_cli({"policy": "lrmoe", "lrmoe_placement": "previous",
                          "preset": "tiny-qwen3"})
    assert make_policy(tc.policy, get_preset("tiny-qwen3"), 2).config.placement == "previous"
    with pytest.raises(LrmoeError, match="--lrmoe-placement 'next'"):
        check_args(config_from_cli({"policy": "lrmoe", "lrmoe_placement": "next",
                                    "preset": "tiny-qwen3"}))
