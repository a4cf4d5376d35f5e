"""The fast planners against their references.

lrmoe's fast planner (:func:`lrmoe.policy.lrmoe.plan_lrmoe`) must make exactly the plans
of the reference (``tests/references/lrmoe_planner.py``) and fail exactly where it fails;
identical plans have identical modelled MoE time, so "feasible wherever today's is and
within 1%" holds with equality. symi and capacity likewise against their torch readings.
"""

import dataclasses

import numpy as np
import pytest
import torch

from budgets import natives_floor
from lrmoe.errors import LrmoeError
from lrmoe.ledger import Ledger
from lrmoe.policy import LrmoePolicy, PlanInputs, StaticPolicy, SymiPolicy
from lrmoe.policy import lrmoe as lrmoe_mod
from lrmoe.policy.base import prepare
from lrmoe.policy.capacity import CapacityPolicy, plan_capacity
from lrmoe.policy.ledger_view import LedgerView, plan_exact_fit, plan_totals
from lrmoe.policy.lrmoe import LrmoeConfig, plan_lrmoe, previous_totals
from lrmoe.policy.plan_numpy import Slots, apportion_rows_np, blocks_to_GGS, full_plan
from lrmoe.policy.symi import plan_symi, replica_counts_heap
from lrmoe.presets import get_preset
from references import lrmoe_planner
from references.plans import (
    apportion,
    contiguous_placement,
    even_split,
    interval_overlap,
    native_placement,
    plan_capacity_reference,
    replica_counts,
    symi_fewer_placement,
)

PRESETS = ("qwen3-30b-a3b", "glm-4.5-air")
FIELDS = ("inst_expert_GS", "assign_GGS", "retain_GGS", "select_GGS", "recompute_G", "dropped_GE")


def _counts(rng, G: int, E: int, pairs: int, skew: float) -> torch.Tensor:
    """Per home rank, ``pairs`` drawn from Zipf(skew) over a random expert order."""
    w = 1.0 / np.arange(1, E + 1, dtype=np.float64) ** skew
    w = w[rng.permutation(E)]
    return torch.from_numpy(rng.multinomial(pairs, w / w.sum(), size=G)).long()


def _same(a, b, rung: bool = False) -> bool:
    """Every field equal (``rung`` too where both plans name it)."""
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
            return False
    return all(getattr(a, f) == getattr(b, f) for f in (
        "layer_checkpoint", "replicas_given_up", "given_up_for") + (("rung",) if rung else ()))


def _trimmed(counts, cfg, ledger):
    """lrmoe's trimmed plan alone (no ladder): what the reference makes."""
    return plan_lrmoe(counts, cfg, ledger, ladder=False).plan


def _fit(counts, cfg, ledger):
    """What :class:`LrmoePolicy` plans: the trimmed plan, else its ladder's rung."""
    return lrmoe_mod.plan_lrmoe(counts, cfg, ledger).plan


def _outcome(fn, *args):
    """``(fn(*args), None)``, or ``(None, message)`` if it raises LrmoeError."""
    try:
        return fn(*args), None
    except LrmoeError as e:
        return None, str(e)


def _budget(cfg, G: int, counts: torch.Tensor, frac: float) -> int:
    """The unbounded plan's fixed bytes plus ``frac`` of its largest retained bytes
    (``frac`` < 0: below what any plan needs; > 1: loose)."""
    free = Ledger.for_dtype(cfg, G, None)
    terms = free.rank_terms(plan_lrmoe(counts, LrmoeConfig(), free, ladder=False).plan)
    fixed = max(t["total"] - t["retained_acts"] for t in terms)
    return max(1, int(fixed + frac * max(t["retained_acts"] for t in terms)))


def _layer(rng, preset: str, G: int, pairs: int, skew: float, frac: float):
    """``(counts, ledger)`` of one random layer; ``frac`` as :func:`_budget`, NaN: no
    budget."""
    mcfg = get_preset(preset)
    counts = _counts(rng, G, 128, pairs, skew)
    budget = None if np.isnan(frac) else _budget(mcfg, G, counts, frac)
    return counts, Ledger.for_dtype(mcfg, G, budget)


def _cases(n: int, seed: int):
    rng = np.random.default_rng(seed)
    for i in range(n):
        preset = PRESETS[i % 2]
        G = int(rng.choice([8, 16, 32, 64]))
        skew = float(rng.uniform(0, 2))
        pairs = int(rng.choice([512, 4096, 131072]))
        frac = float(rng.choice([-0.3, 0.05, 0.2, 0.4, 0.7, 1.0, 1.5, np.nan]))
        extra = int(rng.choice([0, 1, 2, 2, 4]))
        cfg = LrmoeConfig(balance=float(rng.choice([0.0, 0.5, 1.0])),
                          min_keep=float(rng.uniform(0, 1)),
                          selection=bool(rng.random() < 0.85),
                          recompute=bool(rng.random() < 0.3),
                          max_replicas_per_step=None if rng.random() < 0.9 else int(rng.integers(0, 20)),
                          max_slots_per_rank=128 // G + extra)
        yield i, preset, G, skew, pairs, frac, cfg, rng


@pytest.mark.slow
def test_lrmoe_fast_equals_reference_on_200_random_layers():
    """200 seeded layers: EP 8-64, skew 0-2, budgets from infeasible through binding to
    loose and none, both full presets, random knobs. Same plan or same error."""
    kinds = {"plan": 0, "error": 0, "trimmed": 0, "replicas": 0}
    for i, preset, G, skew, pairs, frac, cfg, rng in _cases(200, seed=13):
        counts, ledger = _layer(rng, preset, G, pairs, skew, frac)
        fast, err = _outcome(_trimmed, counts, cfg, ledger)
        ref, ref_err = _outcome(lrmoe_planner.plan_lrmoe, counts, cfg, ledger)
        where = f"case {i}: {preset} EP {G} skew {skew:.2f} frac {frac} {cfg}"
        assert err == ref_err, where
        if ref is None:
            kinds["error"] += 1
            continue
        assert _same(fast, ref), where
        fast.check(counts)
        ledger.check(fast)
        kinds["plan"] += 1
        kinds["trimmed"] += int(not torch.equal(ref.select_GGS, ref.assign_GGS))
        kinds["replicas"] += int(ref.num_replicas() > 0)
    # the sample covers what it claims to: plans with replicas, trimmed plans, errors
    assert kinds["plan"] >= 150 and kinds["error"] >= 5, kinds
    assert kinds["trimmed"] >= 50 and kinds["replicas"] >= 50, kinds


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("G", [8, 64])
def test_ledger_view_is_exact_for_the_presets(preset, G):
    """The view gives the ledger's own totals and capacities (trimmed and exact plans,
    with and without recompute)."""
    mcfg = get_preset(preset)
    rng = np.random.default_rng(G)
    counts = _counts(rng, G, 128, 4096, 1.2)
    home = counts.sum(1).tolist()
    ledger = Ledger.for_dtype(mcfg, G, _budget(mcfg, G, counts, 0.5))
    view = LedgerView(ledger, counts.sum(1).numpy())
    plan = plan_lrmoe(counts, LrmoeConfig(recompute=True), ledger, ladder=False).plan
    n = (plan.inst_expert_GS >= 0).sum(1).numpy()
    R = plan.rank_load().numpy()
    k = plan.retain_GGS.sum((0, 2)).numpy()
    rec = plan.recompute_G.numpy()
    assert view.totals(n, R, k, rec).tolist() == [t["total"] for t in ledger.rank_terms(plan)]
    # the recompute branch, whatever the plan chose; one row on every other rank
    for some in (k // 3, np.arange(G) % 2):
        assert view.totals(n, R, k, some).tolist() == [
            ledger.terms(int(a), int(b), h, int(c), int(d))["total"]
            for a, b, h, c, d in zip(n, R, home, k, some)]
    for r in range(G):
        for dn, dR in ((0, 0), (1, 1000), (2, -int(R[r]))):
            args = (int(n[r]) + dn, int(R[r]) + dR)
            assert view.capacity_fn()(r, *args) == ledger.retain_capacity(*args, home[r])
    assert view.capacity(n, R).tolist() == [ledger.retain_capacity(int(a), int(b), h)
                                            for a, b, h in zip(n, R, home)]
    for r in range(0, G, max(G // 4, 1)):  # a budget met to the byte, and one byte short
        at = ledger.terms(int(n[r]), int(R[r]), home[r], 0)["total"]
        for budget, fits in ((at, True), (at - 1, False)):
            tight = Ledger.for_dtype(mcfg, G, budget)
            view = LedgerView(tight, counts.sum(1).numpy())
            want = [tight.retain_capacity(int(a), int(b), h) for a, b, h in zip(n, R, home)]
            assert (want[r] >= 0) == fits
            assert bool(view.fits(n, R, np.zeros_like(R))[r]) == fits
            assert view.capacity(n, R).tolist() == want
            assert [view.capacity_fn()(i, int(n[i]), int(R[i])) for i in range(G)] == want
    exact = LedgerView(ledger, counts.sum(1).numpy(), exact=True)
    assert exact.totals(n, R, R).tolist() == [
        ledger.terms(int(a), int(b), h, int(b), exact=True)["total"]
        for a, b, h in zip(n, R, home)]
    top = max(ledger.terms(int(a), int(b), h, 0)["total"] for a, b, h in zip(n, R, home))
    for budget, over in ((top, False), (top - 1, True)):  # to the byte, and one byte over
        v = LedgerView(Ledger.for_dtype(mcfg, G, budget), counts.sum(1).numpy())
        assert v.over(n, R, np.zeros_like(R)) == over


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-glm", *PRESETS])
def test_ledger_view_totals_with_recompute_equal_the_ledger(preset):
    """Every rank recomputing some rows, at random counts, trimmed and exact: the view's
    totals are the ledger's (its recompute branch's pieces, not the plain ones)."""
    mcfg = get_preset(preset)
    G = 4
    rng = np.random.default_rng(1)
    home = rng.integers(1, 5000, G)
    ledger = Ledger.for_dtype(mcfg, G, None)
    for ex in (False, True):
        view = LedgerView(ledger, home, exact=ex, priced=True)
        for _ in range(25):
            n = rng.integers(1, 9, G)
            R = rng.integers(1, 20000, G)
            k = R if ex else rng.integers(1, R + 1)
            rec = rng.integers(1, k + 1)
            assert view.totals(n, R, k, rec).tolist() == [
                ledger.terms(int(a), int(b), int(h), int(c), int(d), exact=ex)["total"]
                for a, b, h, c, d in zip(n, R, home, k, rec)]


def test_numpy_primitives_equal_torch():
    rng = np.random.default_rng(0)
    for _ in range(200):
        N, K = int(rng.integers(1, 40)), int(rng.integers(1, 60))
        w = rng.integers(0, int(rng.integers(1, 30)), size=(N, K))
        tot = np.floor(w.sum(0) * rng.random(K)).astype(np.int64)
        assert np.array_equal(apportion_rows_np(tot, w.T).T,
                              apportion(torch.from_numpy(tot), torch.from_numpy(w)).numpy())
        G = int(rng.choice([1, 2, 4, 8]))
        E = G * int(rng.integers(1, 5))
        S = E // G + int(rng.integers(0, 3))
        c = torch.from_numpy(rng.integers(0, 50, size=(G, E)))
        inst = np.full((G, S), -1)
        inst[:, : E // G] = np.arange(E).reshape(G, E // G)
        extra = rng.integers(-1, E, size=(G, S - E // G))
        inst[:, E // G:] = extra
        ti = torch.from_numpy(inst)
        load = even_split(c, ti)
        idx = Slots(inst, E)
        assert np.array_equal(idx.even_split(c.numpy().sum(0)), load.numpy())
        assert np.array_equal(blocks_to_GGS(idx.overlap_ig(c.numpy(), load.numpy()), G, S),
                              interval_overlap(c, ti, load).numpy())


def test_apportion_of_large_blocks_equals_torch():
    """The split of many rows (the float-division quotient and the narrow sort keys it
    takes from 2,048 entries on) against the torch reading: small and large weights,
    totals from none to all, keys near the int32 and float limits of their paths."""
    rng = np.random.default_rng(4)
    for i in range(60):
        K, N = int(rng.integers(30, 300)), int(rng.integers(8, 70))
        hi = int(rng.choice([3, 1000, 10**6, 3 * 10**7, (1 << 31) // 64, 10**9]))
        w = rng.integers(0, hi, size=(K, N)) * (rng.random((K, N)) < 0.9)
        t = (w.sum(1) * rng.random(K)).astype(np.int64)
        t[rng.random(K) < 0.1] = 0
        full = rng.random(K) < 0.1
        t[full] = w.sum(1)[full]
        if int(w.sum(1).max()) * int(w.max(initial=0)) >= 1 << 63:
            continue  # t·w must fit int64 (any caller's counts do)
        want = apportion(torch.from_numpy(t), torch.from_numpy(w.T)).numpy().T
        assert np.array_equal(apportion_rows_np(t, w), want), i


def _fit_exact_reference(plan, ledger, what):
    """:func:`lrmoe.policy.plan.fit_exact` on the ledger's own per-rank exact_fit."""
    if ledger is None or ledger.budget_bytes is None:
        return plan
    mode, rec, _ = ledger.exact_fit(plan)
    if mode == "fits":
        return plan
    if mode == "pairs":
        return dataclasses.replace(plan, recompute_G=torch.tensor(rec, dtype=torch.long))
    layer = dataclasses.replace(plan, layer_checkpoint=True)
    if mode == "layer":
        return layer
    ledger.raise_if_over(ledger.rank_terms(layer), f"{what}, even with a whole-layer checkpoint,")
    raise AssertionError("exact_fit said it does not fit")


def _symi_reference(counts, s, prev, ledger, recompute):
    G, E = counts.shape
    plan = full_plan(counts, contiguous_placement(replica_counts(prev, E, G * s), G, s))
    if recompute:
        what = f"symi with slots_per_rank={s}"
        if G * s == E or ledger.exact_fit(plan)[0] != "over":
            return _fit_exact_reference(plan, ledger, what)
        for k in range(1, G * s - E + 1):  # its most replicas that fit (the loop reading)
            fewer = full_plan(counts, symi_fewer_placement(prev, G, s, k))
            mode = ledger.exact_fit(fewer)[0]
            if mode != "over":
                return dataclasses.replace(
                    _fit_exact_reference(fewer, ledger, what), replicas_given_up=k,
                    given_up_for="memory", rung={"fits": "fewer-replicas",
                                                 "pairs": "recompute-fewer-replicas",
                                                 "layer": "layer-fewer-replicas"}[mode])
        return _fit_exact_reference(fewer, ledger, f"{what}, every replica given up "
                                                   "(static's placement),")
    if ledger is not None and ledger.budget_bytes is not None:
        ledger.raise_if_over(ledger.rank_terms(plan), f"symi with slots_per_rank={s}")
    return plan


def test_symi_and_capacity_fast_equal_reference():
    rng = np.random.default_rng(7)
    for E in (8, 128, 160):
        for _ in range(30):
            pop = torch.from_numpy(rng.integers(0, 1000, size=E) * (rng.random(E) < 0.8))
            total = E + int(rng.integers(0, 3 * E))
            assert replica_counts_heap(pop, E, total)[0] == replica_counts(pop, E, total)
    for i in range(24):
        preset = PRESETS[i % 2]
        mcfg = get_preset(preset)
        G = int(rng.choice([8, 16, 64]))
        counts = _counts(rng, G, 128, 4096, float(rng.uniform(0, 2)))
        frac = float(rng.choice([-0.3, 0.3, 1.2]))
        ledger = Ledger.for_dtype(mcfg, G, _budget(mcfg, G, counts, frac))
        s, prev, rc = 128 // G + int(rng.integers(0, 3)), counts.sum(0), bool(i % 3 == 0)
        fast, err = _outcome(plan_symi, counts, s, prev, ledger, rc)
        ref, ref_err = _outcome(_symi_reference, counts, s, prev, ledger, rc)
        assert err == ref_err and (ref is None or _same(fast, ref, rung=True)), (i, err, ref_err)
        cf = float(rng.choice([0.5, 1.0, 1.25, 2.0]))
        assert _same(plan_capacity(counts, cf), plan_capacity_reference(counts, cf))
        fast, err = _outcome(CapacityPolicy(cf).plan, counts, PlanInputs(ledger=ledger))
        ref, ref_err = _outcome(ledger.check, plan_capacity_reference(counts, cf))
        assert err == ref_err, i


def _plan_speed():
    from dist_util import load_benchmark
    return load_benchmark("plan_speed")


def test_plan_speed_benchmark_writes_its_table(tmp_path, capsys):
    """The benchmark's logic on CPU at one tiny point: every policy and route, both
    budgets, the critical part and what is off it, JSON and markdown written; a bad
    --eps or --policies is one line and exit 2, nothing written."""
    mod = _plan_speed()
    out = tmp_path / "speed"
    assert mod.main(["--out", str(out), "--eps", "8", "--skews", "1", "--repeats", "1",
                     "--tokens-per-rank", "256", "--reference", "--no-gpu"]) == 0
    import json
    rows = json.loads((out / "plan_speed.json").read_text())["results"]
    assert {(r["policy"], r["budget"]) for r in rows} == {
        (p, b) for p in mod.POLICIES for b in ("loose", "binding")}
    assert all(r["cpu_thread_ms"] >= 0 and r["gpu_ms"] is None for r in rows)
    assert all(r["reference_ms"] is not None for r in rows
               if r["policy"] in ("lrmoe", "lrmoe:recompute"))
    lr = [r for r in rows if r["policy"].startswith("lrmoe")]
    assert all(r["error"] is None and r["check_ms"] >= 0 for r in lr)  # plans, both budgets
    assert all(r["replaced"] is not None for r in lr)
    md = (out / "plan_speed.md").read_text()
    assert "| 8 | 1 | binding | lrmoe:recompute+previous |" in md
    assert "| lrmoe:previous | " in md  # the summary per policy and EP
    for bad_args, msg in ((["--eps", "7"], "--eps [7]"),
                          (["--policies", "lrmoe:next"], "lrmoe:next")):
        bad = tmp_path / "bad"
        assert mod.main(["--out", str(bad), *bad_args]) == 2
        assert not bad.exists()
        assert msg in capsys.readouterr().err


# ------------------------------------------------------- placement from earlier counts
def _drift(rng, counts: torch.Tensor, how: str) -> torch.Tensor:
    """Previous-step counts: the same routing (``same``), a fresh draw from similar
    weights (``near``: each home's pairs re-drawn around its counts), or another
    routing altogether (``far``: the experts' loads permuted)."""
    if how == "same":
        return counts.clone()
    c = counts.numpy()
    if how == "far":
        return torch.from_numpy(np.ascontiguousarray(c[:, rng.permutation(c.shape[1])]))
    p = (c + 1) / (c + 1).sum(1, keepdims=True)
    return torch.from_numpy(np.stack([rng.multinomial(int(n), w) for n, w in zip(c.sum(1), p)]))


def test_previous_placement_equals_current_when_the_counts_repeat():
    """Prepared from the same counts (as ``[G, E]``, or as the runtime's global ``[E]``
    with the pairs per home: the homes are equal), or not prepared (the policy prepares
    from ``prev_counts_E`` itself), placement="previous" makes exactly the current plan,
    or fails with the same error; ``rungs`` counts each plan made once, by its rung."""
    seen = 0
    for i, preset, G, skew, pairs, frac, cfg, rng in _cases(40, seed=29):
        counts, ledger = _layer(rng, preset, G, pairs, skew, frac)
        cur, err = _outcome(_fit, counts, cfg, ledger)  # the policy climbs its ladder
        pol = LrmoePolicy(dataclasses.replace(cfg, placement="previous"))
        unprepared = PlanInputs(prev_counts_E=counts.sum(0), ledger=ledger)
        for prev in (counts, counts.sum(0), None):
            inputs = (unprepared if prev is None
                      else prepare(pol, prev, G, PlanInputs(ledger=ledger), pairs))
            assert (inputs.prepared is None) == (prev is None)
            got, got_err = _outcome(pol.plan, counts, inputs)
            assert got_err == err, i
            assert cur is None or _same(got, cur), i
            seen += cur is not None
        assert pol.rungs == ({} if cur is None else {cur.rung: 3}), i
    assert pol.replaced_placements == 0 and seen >= 90


def test_previous_placement_fits_the_budget_on_the_new_counts():
    """Placed on other counts (near or far from these), under budgets from loose to
    binding: the plan routes exactly these counts, every rank fits the ledger on them,
    it keeps the prepared placement unless that one does not fit (then it is the
    current plan), and it exists exactly when the current plan does."""
    kept = replaced = 0
    for i, preset, G, skew, pairs, frac, cfg, rng in _cases(60, seed=31):
        # odd cases: routing that moved, under a budget with no room to spare
        counts, ledger = _layer(rng, preset, G, pairs, skew, 0.01 if i % 2 else frac)
        prev = _drift(rng, counts, ("near", "far")[i % 2])
        pcfg = dataclasses.replace(cfg, placement="previous")
        pol = LrmoePolicy(pcfg)
        inputs = prepare(pol, prev.sum(0), G, PlanInputs(ledger=ledger), pairs)
        got, err = _outcome(pol.plan, counts, inputs)
        cur, cur_err = _outcome(_fit, counts, cfg, ledger)
        assert (got is None) == (cur is None), (i, err, cur_err)
        if got is None:
            continue
        got.check(counts)
        ledger.raise_if_over(ledger.rank_terms(got), "the plan")  # as its rung runs it
        if pol.replaced_placements:
            replaced += 1
            assert _same(got, cur), i
        else:
            kept += 1
            assert np.array_equal(got.inst_expert_GS.numpy(), inputs.prepared.inst_expert_GS)
            # the same placement, planned from scratch on these counts: the same quotas
            again = lrmoe_mod.plan_lrmoe(counts, pcfg, ledger, inputs.prepared.inst_expert_GS,
                                         ladder=False).plan
            assert _same(got, again), i
    assert kept >= 40, (kept, replaced)


def test_a_prepared_placement_that_no_longer_fits_is_made_again():
    """Placed on uniform counts (natives only), then the routing concentrates where the
    natives alone do not fit the budget: the plan is the current one, within budget."""
    mcfg, G = get_preset("qwen3-30b-a3b"), 64
    counts = _counts(np.random.default_rng(G), G, 128, 4096, 2.0)
    ledger = Ledger.for_dtype(mcfg, G, _budget(mcfg, G, counts, 0.05))
    assert natives_floor(Ledger.for_dtype(mcfg, G, None), counts) > ledger.budget_bytes
    pol = LrmoePolicy(LrmoeConfig(placement="previous"))
    inputs = prepare(pol, torch.full((128,), 4096 * G // 128), G, PlanInputs(ledger=ledger), 4096)
    assert (inputs.prepared.inst_expert_GS >= 0).sum() == 128  # natives, no replica
    plan = pol.plan(counts, inputs)
    assert pol.replaced_placements == 1
    assert _same(plan, _trimmed(counts, LrmoeConfig(), ledger)) and plan.num_replicas() > 0
    ledger.check(plan)


def test_previous_totals_scale_the_global_counts_to_this_steps_pairs():
    prev = torch.tensor([5, 0, 3, 2])  # 10 pairs over two micro-batches of 2 ranks
    total, home = previous_totals(prev, 2, home_pairs=3)
    assert total.tolist() == [3, 0, 2, 1] and home.tolist() == [3, 3]  # 6 pairs: 3, 1.8, 1.2
    total, home = previous_totals(prev, 4)
    assert total.tolist() == [5, 0, 3, 2] and home.tolist() == [3, 3, 2, 2]
    assert previous_totals(None, 2) is None and previous_totals(torch.zeros(4), 2) is None
    with pytest.raises(LrmoeError, match="placement"):
        LrmoeConfig(placement="next")


def test_symi_prepared_placement_makes_the_same_plan():
    rng = np.random.default_rng(3)
    for i in range(12):
        mcfg = get_preset(PRESETS[i % 2])
        G = int(rng.choice([8, 32, 64]))
        counts = _counts(rng, G, 128, 4096, float(rng.uniform(0, 2)))
        prev = _drift(rng, counts, "near").sum(0)
        ledger = Ledger.for_dtype(mcfg, G, _budget(mcfg, G, counts, float(rng.choice([0.3, 2]))))
        pol = SymiPolicy(None, recompute=bool(i % 2))
        plain = PlanInputs(prev_counts_E=prev, ledger=ledger)
        want, err = _outcome(pol.plan, counts, plain)
        got, got_err = _outcome(pol.plan, counts, prepare(pol, prev, G, plain, 4096))
        assert err == got_err and (want is None or _same(want, got)), i
        assert prepare(pol, None, G, plain).prepared is None  # first step: uniform, in plan


def test_static_plan_is_the_full_native_plan():
    rng = np.random.default_rng(5)
    for G in (1, 4, 64):
        counts = _counts(rng, G, 128, 512, 1.0)
        assert _same(StaticPolicy().plan(counts, PlanInputs()),
                     full_plan(counts, native_placement(G, 128)))


def test_vectorised_exact_fit_and_recompute_capacity_equal_the_ledger():
    """Every rank at once, the ledger's own answers: exact_fit's modes, rows and totals
    on static and symi plans; the recompute retention's ``(k, rec)``; plan totals."""
    rng = np.random.default_rng(11)
    modes = set()
    for i in range(40):
        mcfg = get_preset(PRESETS[i % 2])
        G = int(rng.choice([8, 16, 64]))
        counts = _counts(rng, G, 128, int(rng.choice([512, 65536])), float(rng.uniform(0, 2)))
        ledger = Ledger.for_dtype(mcfg, G, _budget(mcfg, G, counts,
                                                   float(rng.uniform(-0.5, 1.2))))
        for plan in (full_plan(counts, native_placement(G, 128)),
                     plan_symi(counts, 128 // G + 2, counts.sum(0))):
            mode, rec, totals = plan_exact_fit(ledger, plan)
            want = ledger.exact_fit(plan)
            assert (mode, rec.tolist(), totals.tolist()) == (
                want[0], want[1], [t["total"] for t in want[2]]), i
            modes.add(mode)
        home = counts.sum(1).numpy()
        view = LedgerView(ledger, home)
        n = rng.integers(128 // G, 128 // G + 3, G)
        R = (home * rng.uniform(0.2, 3, G)).astype(np.int64)
        want = [ledger.retain_capacity_recompute(int(a), int(b), int(h))
                for a, b, h in zip(n, R, home)]
        k, rec = view.capacity_recompute(n, R, np.arange(G))
        assert list(zip(k.tolist(), rec.tolist())) == want, i
        # with no bound the window starts at every received pair: answers below it come
        # from the ledger's own search
        loose = LedgerView(ledger, home)
        M, b, den = loose._bounds()
        loose._extra = {"bounds": (M, b, np.zeros_like(den))}
        k, rec = loose.capacity_recompute(n, R, np.arange(G), window=1)
        assert list(zip(k.tolist(), rec.tolist())) == want, i
        if mode in ("layer", "over"):  # lrmoe's own search is not this mode's
            plan = plan_symi(counts, 128 // G, counts.sum(0))
        else:
            try:  # a budget below what any plan needs: the native plan's totals instead
                plan = plan_lrmoe(counts, LrmoeConfig(recompute=True), ledger, ladder=False).plan
            except LrmoeError:
                plan = plan_symi(counts, 128 // G, counts.sum(0))
        assert plan_totals(ledger, plan).tolist() == [t["total"] for t in ledger.rank_terms(plan)]
    assert modes >= {"fits", "pairs", "over"}, modes
    # a budget the busiest rank meets to the byte with one row recomputed: "pairs", not "fits"
    mcfg, G = get_preset(PRESETS[0]), 8
    counts = _counts(rng, G, 128, 512, 1.0)
    plan = full_plan(counts, native_placement(G, 128))
    free = Ledger.for_dtype(mcfg, G, None)
    n, R = (plan.inst_expert_GS >= 0).sum(1).tolist(), plan.rank_load().tolist()
    budget = max(free.terms(a, b, int(h), b, 1, exact=True)["total"]
                 for a, b, h in zip(n, R, counts.sum(1)))
    led = Ledger.for_dtype(mcfg, G, budget)
    want = led.exact_fit(plan)
    assert want[0] == "pairs" and max(want[1]) == 1
    mode, rec, totals = plan_exact_fit(led, plan)
    assert (mode, rec.tolist(), totals.tolist()) == (want[0], want[1], [t["total"] for t in want[2]])


def test_recompute_capacity_equals_the_ledger_where_recompute_buys_nothing():
    """Ranks from far below to far above their home pairs, small layers included: the
    vectorised recompute retention is the ledger's, the ranks where recomputing buys no
    pair (``(k0, 0)``: nothing recomputed) among them."""
    rng = np.random.default_rng(5)
    no_gain = 0
    for i in range(200):
        mcfg = get_preset(PRESETS[i % 2])
        G = int(rng.choice([8, 16, 64]))
        counts = _counts(rng, G, 128, int(rng.choice([64, 512, 65536])), float(rng.uniform(0, 2)))
        ledger = Ledger.for_dtype(mcfg, G, _budget(mcfg, G, counts, float(rng.uniform(-0.5, 1.5))))
        home = counts.sum(1).numpy()
        n = rng.integers(128 // G, 128 // G + 3, G)
        R = (home * rng.uniform(0.05, 4, G)).astype(np.int64)
        want = [ledger.retain_capacity_recompute(int(a), int(b), int(h))
                for a, b, h in zip(n, R, home)]
        k, rec = LedgerView(ledger, home).capacity_recompute(n, R, np.arange(G))
        assert list(zip(k.tolist(), rec.tolist())) == want, i
        k0 = [ledger.retain_capacity(int(a), int(b), int(h)) for a, b, h in zip(n, R, home)]
        no_gain += sum(0 <= a == b < r for a, b, r in zip(k.tolist(), k0, R.tolist()))
    assert no_gain > 0


def test_recompute_retention_equals_the_reference_rank_by_rank():
    """Pass 2 with recompute on the natives, at budgets around where ranks run short:
    every rank's retained pairs and rows recomputed are the reference's (which asks the
    ledger rank by rank)."""
    from lrmoe.policy.lrmoe_place import natives_GS
    from lrmoe.policy.lrmoe_quotas import retention

    rng = np.random.default_rng(5)
    short = 0
    for i in range(60):
        mcfg = get_preset(PRESETS[i % 2])
        G = int(rng.choice([4, 8, 16]))
        counts = _counts(rng, G, 128, int(rng.choice([4096, 65536])), float(rng.uniform(0, 2)))
        ledger = Ledger.for_dtype(mcfg, G, _budget(mcfg, G, counts, float(rng.uniform(0, 1))))
        c, home = counts.numpy(), counts.sum(1).numpy()
        inst = natives_GS(G, 128 // G, 128)
        slots = Slots(inst, 128)
        load = slots.even_split(c.sum(0))
        assign = slots.overlap_ig(c, load)
        retain, rec, keep = retention(assign, inst, LedgerView(ledger, home), True, load)
        a_GGS = torch.from_numpy(blocks_to_GGS(assign, G, 128 // G))
        want, want_rec = lrmoe_planner._retention(a_GGS, torch.from_numpy(inst),
                                                  torch.from_numpy(home), ledger, True)
        assert rec.tolist() == want_rec.tolist(), i
        assert keep.tolist() == want.sum(dim=(0, 2)).tolist(), i
        short += int((keep < load.sum(1)).sum())
    assert short > 0  # some ranks ran short of room
