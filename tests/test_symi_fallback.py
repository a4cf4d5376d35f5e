"""SYMI at a step whose slots do not fit the budget, even with recompute and a
whole-layer checkpoint: it places that step's most replicas that fit, fewest-valued
replicas given up first by its own rounding rule (its decrement loop run on), and its
natives fit wherever static's do. ``bench ttl`` then never reports SYMI out of memory
where static runs, and says how often SYMI gave replicas up."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lrmoe.cli import main
from lrmoe.errors import OutOfMemory
from lrmoe.ledger import Ledger
from lrmoe.policy import PlanInputs, StaticPolicy, SymiPolicy
from lrmoe.policy.ledger_view import plan_exact_fit
from lrmoe.policy.plan import layer_checkpoint_plan
from lrmoe.policy.symi import plan_symi
from lrmoe.presets import get_preset
from references.plans import symi_fewer_placement

CFG = get_preset("tiny-qwen3")
G, E = 2, CFG.num_experts


def _counts(seed: int, pairs: int = 128) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, E + 1) ** 1.2
    return torch.from_numpy(rng.multinomial(pairs, w[rng.permutation(E)] / w.sum(),
                                            size=G)).long()


def _layer_need(plan) -> int:
    """The largest rank total of ``plan`` under a whole-layer checkpoint (its floor)."""
    free = Ledger.for_dtype(CFG, G, None, "fp32")
    return max(t["total"] for t in free.rank_terms(layer_checkpoint_plan(plan)))


def _fits(led, plan) -> bool:
    return plan_exact_fit(led, plan)[0] != "over"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_symi_places_its_most_replicas_that_fit(seed):
    counts, pop = _counts(seed), _counts(seed + 100).sum(0)
    s = E  # every slot a replica slot: far more than the budget holds
    full = plan_symi(counts, s, pop)
    static = StaticPolicy().plan(counts, PlanInputs())
    lo, hi = _layer_need(static), _layer_need(full)
    assert lo < hi
    led = Ledger.for_dtype(CFG, G, (lo + hi) // 2, "fp32")
    assert not _fits(led, full)  # the plan today's code stops on
    plan = SymiPolicy(s, recompute=True).plan(counts, PlanInputs(prev_counts_E=pop, ledger=led))
    plan.check(counts)
    assert plan.exact and plan.S == s
    k = plan.replicas_given_up
    assert plan.given_up_for == "memory" and 0 < k < G * s - E
    assert plan.num_replicas() == G * s - E - k
    # its placement is SYMI's rule run on to k fewer instances (the loop reference)
    assert torch.equal(plan.inst_expert_GS, symi_fewer_placement(pop, G, s, k))
    # it fits, with the fallback the runtime runs (recompute rows or the whole layer)
    assert max(t["total"] for t in led.rank_terms(plan)) <= led.budget_bytes
    mode = plan_exact_fit(led, plan)[0]
    assert plan.layer_checkpoint == (mode == "layer")
    assert (plan.recompute_G is not None) == (mode == "pairs")
    assert plan.rung == {"fits": "fewer-replicas", "pairs": "recompute-fewer-replicas",
                         "layer": "layer-fewer-replicas"}[mode]
    # ... and it is the most: one replica more does not fit
    more = symi_fewer_placement(pop, G, s, k - 1)
    assert not _fits(led, plan_symi(counts, s, pop, placement=more.numpy()))


def test_symi_natives_fit_wherever_statics_do():
    """Just above static's whole-layer floor, SYMI with any s gives up every replica and
    places static's natives; just below it both are out of memory."""
    counts, pop = _counts(7), _counts(8).sum(0)
    static = StaticPolicy().plan(counts, PlanInputs())
    floor = _layer_need(static)
    led = Ledger.for_dtype(CFG, G, floor, "fp32")
    for s in (E // G + 1, E):
        plan = SymiPolicy(s, recompute=True).plan(counts, PlanInputs(prev_counts_E=pop,
                                                                     ledger=led))
        assert plan.num_replicas() == 0 and plan.replicas_given_up == G * s - E
        assert plan.layer_checkpoint
        occupied = plan.inst_expert_GS[:, : E // G]
        assert torch.equal(occupied, static.inst_expert_GS)
        assert (plan.inst_expert_GS[:, E // G:] == -1).all()
        assert torch.equal(plan.assign_GGS[:, :, : E // G], static.assign_GGS)
    below = Ledger.for_dtype(CFG, G, floor - 1, "fp32")
    with pytest.raises(OutOfMemory):
        StaticPolicy(recompute=True).plan(counts, PlanInputs(ledger=below))
    with pytest.raises(OutOfMemory):
        SymiPolicy(E, recompute=True).plan(counts, PlanInputs(prev_counts_E=pop, ledger=below))


def test_symi_that_fits_gives_nothing_up():
    counts, pop = _counts(3), _counts(4).sum(0)
    s = E // G + 2
    plan = SymiPolicy(s, recompute=True).plan(
        counts, PlanInputs(prev_counts_E=pop, ledger=Ledger.for_dtype(CFG, G, None, "fp32")))
    assert plan.replicas_given_up == 0 and plan.given_up_for is None and plan.rung is None
    assert torch.equal(plan.inst_expert_GS, plan_symi(counts, s, pop).inst_expert_GS)


def test_bench_ttl_symi_never_out_of_memory_where_static_runs(tmp_path, capsys):
    """All 16 slots a rank for SYMI, a budget between static's whole-layer floor and
    SYMI's: it used to stop at step 1; now every step fits, with replicas given up, and
    ttl.md and ttl.json say how many (and lrmoe's replicas placed on the run's link)."""
    counts = torch.full((G, E), 4 * 32 // G * CFG.num_experts_per_tok // E)
    static = StaticPolicy().plan(counts, PlanInputs())
    full = plan_symi(counts, E, None)
    budget = (2 * _layer_need(static) + _layer_need(full)) // 3
    out = tmp_path / "t"
    rc = main(["bench", "ttl", "--preset", "tiny-qwen3", "--ep", "2", "--steps", "3",
               "--batch-size", "4", "--seq-len", "32", "--eval-every", "3",
               "--max-data-bytes", "200000", "--threads", "1", "--policies",
               "static,symi,lrmoe", "--link", "ib", "--slots-per-rank", str(E),
               "--mem-budget", str(budget), "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    rep = json.loads((out / "ttl.json").read_text())
    sy = rep["policies"]["symi"]
    assert sy["failed"] is None and sy["out_of_memory"] is None
    assert sy["budget_status"].startswith("fits") and len(sy["steps"]) == 3
    assert all(s["fits"] for s in sy["steps"])
    gave = sy["replicas_given_up"]["memory"]
    assert gave["layer_micro_batches"] == 3 * 4 and gave["replicas"] > 0
    assert all(s["replicas_given_up"]["memory"][0] == 4 for s in sy["steps"])
    md = (out / "ttl.md").read_text()
    assert "symi gave up replicas for memory at 12 of 12 layer-micro-batches" in md
    # lrmoe weighs its replicas against the IB link at the static run's GEMM rate
    lr = rep["policies"]["lrmoe"]
    assert "replicas weighed against their ib link cost" in lr["config"]
    assert lr["layer_micro_batches"] == 12 and "Replicas on link ib:" in md
    assert f"lrmoe placed {lr['replicas_placed'] / 12:.2f} replicas per layer-micro-batch" in md


def test_fewer_replicas_equals_the_loop_reference_on_full_presets():
    """Random layers of the full presets, EP 8-32, budgets between static's whole-layer
    floor and SYMI's: the same plan as the loop reading (every replica count tried from
    the most down), replicas given up in most of them."""
    from test_planner_fast import PRESETS, _outcome, _same, _symi_reference
    from test_planner_fast import _counts as zipf

    rng = np.random.default_rng(11)
    gave = 0
    for i in range(12):
        mcfg = get_preset(PRESETS[i % 2])
        G = int(rng.choice([8, 16, 32]))
        counts = zipf(rng, G, 128, 4096, float(rng.uniform(0.5, 2)))
        pop = zipf(rng, G, 128, 4096, float(rng.uniform(0.5, 2))).sum(0)
        s = 128 // G + int(rng.integers(1, 6))
        free = Ledger.for_dtype(mcfg, G, None)

        def need(plan, free=free):
            return max(t["total"] for t in free.rank_terms(layer_checkpoint_plan(plan)))
        lo = need(StaticPolicy().plan(counts, PlanInputs()))
        hi = need(plan_symi(counts, s, pop))
        led = Ledger.for_dtype(mcfg, G, int(lo + rng.uniform(-0.02, 1.0) * (hi - lo)))
        fast, err = _outcome(plan_symi, counts, s, pop, led, True)
        ref, ref_err = _outcome(_symi_reference, counts, s, pop, led, True)
        assert err == ref_err and (ref is None or _same(fast, ref, rung=True)), (i, err, ref_err)
        gave += int(fast is not None and 0 < fast.replicas_given_up < G * s - 128)
    assert gave >= 6


def test_symi_profile_takes_every_micro_batch():
    """SYMI's s is profiled on every micro-batch of the sampled static steps, each with
    the previous step's counts summed over its micro-batches as popularity (what the
    runtime keeps); the GEMM rate is calibrated on all of them."""
    from lrmoe.sim.ttl import _profile
    from lrmoe.sim.ttl_symi import calibrated_gemm_rate

    g = torch.Generator().manual_seed(0)
    steps = [[[torch.randint(0, 9, (G, E), generator=g) for _layer in range(3)]
              for _micro in range(2)] for _step in range(4)]
    counts, pops = _profile(steps, n=24)
    assert len(counts) == 3 * 2 * 3  # steps 1..3, every micro-batch and layer
    picked = [steps[t][m][k] for t in (1, 2, 3) for m in range(2) for k in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(counts, picked))
    for i, p in enumerate(pops):
        t, k = 1 + i // 6, i % 3
        assert torch.equal(p, (steps[t - 1][0][k] + steps[t - 1][1][k]).sum(0))
    H, F = 4, 3
    rows = [{"stages_emulated_s": {"fwd_experts": 0.5}} for _ in steps]
    flops = [sum(int(c.sum(0).reshape(G, E // G).sum(1).max()) * 6 * H * F
                 for micro in s for c in micro) for s in steps]
    want = sorted(f / 0.5 for f in flops[1:])[1]  # the median of steps 1..3
    assert calibrated_gemm_rate(rows, steps, H, F) == pytest.approx(want)


def test_replicas_are_given_up_in_symis_own_order():
    """Every count of replicas given up, on random popularities: the placement is the
    loop reading's (SYMI's decrement loop run on, contiguous layout)."""
    from lrmoe.policy.symi import contiguous, given_up_order

    rng = np.random.default_rng(5)
    for i in range(40):
        E_ = int(rng.choice([16, 128]))
        G_ = int(rng.choice([2, 4, 8]))
        s = E_ // G_ + int(rng.integers(1, 5))
        pop = torch.from_numpy(rng.integers(0, 1000, size=E_) * (rng.random(E_) < 0.8))
        cnt, order = given_up_order(pop, E_, G_ * s)
        assert len(order) == G_ * s - E_
        left = np.asarray(cnt)
        for k in range(len(order) + 1):
            if k:
                left[order[k - 1]] -= 1
            want = symi_fewer_placement(pop, G_, s, k)
            assert np.array_equal(contiguous(left, G_, s), want.numpy()), (i, k)


def test_one_replica_given_up_where_one_is_enough():
    """A budget at the whole-layer need of SYMI's placement with one replica fewer (on a
    routing where that need is below the full placement's: its busiest rank lost the
    slot): it gives up exactly one."""
    s = E
    for seed in range(40):
        counts, pop = _counts(seed), _counts(seed + 100).sum(0)
        full = plan_symi(counts, s, pop)
        one = plan_symi(counts, s, pop, placement=symi_fewer_placement(pop, G, s, 1).numpy())
        if _layer_need(one) < _layer_need(full):
            break
    else:
        pytest.fail("no routing where one replica fewer needs less")
    led = Ledger.for_dtype(CFG, G, _layer_need(one), "fp32")
    plan = SymiPolicy(s, recompute=True).plan(counts, PlanInputs(prev_counts_E=pop, ledger=led))
    assert plan.replicas_given_up == 1 and plan.layer_checkpoint
