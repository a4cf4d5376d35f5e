"""Out of memory instead of uncharged steps, and lrmoe's ladder of fallbacks.

A budget sweep from ample down to static's floor with a whole-layer checkpoint: lrmoe
finds a plan at every budget, names its rung, and the plan fits the ledger as its rung
runs it; below lrmoe's own floor (never above static's) the planner gives the
out-of-memory verdict. Exact policies over budget even with the whole layer stop with
the verdict (``bench ttl``: that policy's run stops and its ratios read OOM; ``train``:
one line, exit 2, checkpoints intact).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from dist_util import load_benchmark
from lrmoe.cli import main
from lrmoe.errors import OutOfMemory
from lrmoe.ledger import Ledger
from lrmoe.policy.base import PlanInputs
from lrmoe.policy.ledger_view import plan_exact_fit
from lrmoe.policy.lrmoe import LrmoeConfig, plan_lrmoe
from lrmoe.policy.lrmoe_ladder import RUNGS
from lrmoe.policy.static import StaticPolicy
from lrmoe.presets import get_preset
from lrmoe.routing_loads import synthetic_counts
from lrmoe.train.metrics import read_metrics


def _lowest(ok, hi: int) -> int:
    """The smallest budget in ``[1, hi]`` where ``ok`` holds (``ok`` monotone)."""
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def _lrmoe(counts, led):
    try:
        return plan_lrmoe(counts, LrmoeConfig(), led).plan
    except OutOfMemory:
        return None


# (preset, tokens per rank, EP, MoE layers priced, skew): a small config (48 layers
# priced, so the retained pairs weigh as at full size) and a full one (planner only)
CASES = [("tiny-qwen3", 64, 4, 48, 1.5), ("tiny-glm", 64, 2, 48, 0.0),
         ("qwen3-30b-a3b", 512, 8, None, 1.0)]


@pytest.mark.parametrize("preset,T,G,L,skew", CASES)
def test_lrmoe_finds_a_plan_down_to_statics_whole_layer_floor(preset, T, G, L, skew):
    cfg = get_preset(preset)
    counts = synthetic_counts(G, cfg.num_experts, T, cfg.num_experts_per_tok, skew, 1)
    free = Ledger.for_dtype(cfg, G, None, "fp32", num_moe_layers=L)
    static = StaticPolicy().plan(counts, PlanInputs())
    ample = max(t["total"] for t in free.rank_terms(static))
    floor = _lowest(lambda b: plan_exact_fit(dataclasses.replace(free, budget_bytes=b),
                                             static)[0] != "over", ample)
    seen = set()
    for b in sorted({int(x) for x in np.linspace(floor, ample * 1.05, 24)} | {floor},
                    reverse=True):
        led = dataclasses.replace(free, budget_bytes=b)
        plan = _lrmoe(counts, led)
        assert plan is not None, f"no lrmoe plan at {b} (static's floor {floor})"
        assert plan.rung in RUNGS
        plan.check(counts)
        assert max(t["total"] for t in led.rank_terms(plan)) <= b, plan.rung
        if plan.rung.startswith("layer"):  # the whole layer: every pair in backward
            assert plan.exact and plan_exact_fit(led, plan)[0] == "layer"
        seen.add(plan.rung)
    assert {"plan", "layer"} <= seen  # the ladder is climbed on the way down
    # below lrmoe's own floor (never above static's): the verdict, not a plan
    own = _lowest(lambda b: _lrmoe(counts, dataclasses.replace(free, budget_bytes=b))
                  is not None, floor)
    assert own <= floor
    with pytest.raises(OutOfMemory, match="no plan fits mem_budget at any rung") as e:
        plan_lrmoe(counts, LrmoeConfig(), dataclasses.replace(free, budget_bytes=own - 1))
    assert e.value.budget_bytes == own - 1 < e.value.needs_bytes


def test_without_the_whole_layer_rung_the_layer_budget_is_out_of_memory():
    """``LrmoeConfig(whole_layer=False)`` stops the ladder before that rung: where it would
    be taken the step is out of memory, needing more than the budget. ``lrmoe train``
    climbs to it (its runtime runs the whole-layer checkpoint)."""
    from lrmoe.policy.registry import make_policy
    from lrmoe.train.config import TrainConfig

    cfg = get_preset("tiny-qwen3")
    G = 4
    counts = synthetic_counts(G, cfg.num_experts, 64, cfg.num_experts_per_tok, 1.5, 1)
    free = Ledger.for_dtype(cfg, G, None, "fp32", num_moe_layers=48)
    static = StaticPolicy().plan(counts, PlanInputs())
    floor = _lowest(lambda b: plan_exact_fit(dataclasses.replace(free, budget_bytes=b),
                                             static)[0] != "over", 1 << 40)
    led = dataclasses.replace(free, budget_bytes=floor)
    assert plan_lrmoe(counts, LrmoeConfig(), led).plan.rung == "layer"
    with pytest.raises(OutOfMemory, match="recompute-natives\\)") as e:
        plan_lrmoe(counts, LrmoeConfig(whole_layer=False), led)
    assert e.value.needs_bytes > e.value.budget_bytes == floor
    pol = make_policy(TrainConfig.from_flat(preset="tiny-qwen3", policy="lrmoe", ep=1).policy,
                      cfg, 1)
    assert pol.config.whole_layer is True


def test_whole_layer_rung_places_replicas_only_where_every_rank_fits():
    """The whole-layer rung's placement: natives at static's whole-layer floor (a replica
    would not fit), replicas that lower the busiest rank's load with room to spare (each
    fitting the ledger's layer terms), nothing below the floor."""
    from lrmoe.policy.lrmoe_ladder import layer_placement

    cfg = get_preset("tiny-qwen3")
    G, S = 4, 6
    counts = synthetic_counts(G, cfg.num_experts, 64, cfg.num_experts_per_tok, 1.5, 1)
    free = Ledger.for_dtype(cfg, G, None, "fp32", num_moe_layers=48)
    static = StaticPolicy().plan(counts, PlanInputs())
    floor = _lowest(lambda b: plan_exact_fit(dataclasses.replace(free, budget_bytes=b),
                                             static)[0] != "over", 1 << 40)
    c = counts.numpy()
    natives = np.pad(static.inst_expert_GS.numpy(), ((0, 0), (0, 2)), constant_values=-1)
    at = layer_placement(c, S, dataclasses.replace(free, budget_bytes=floor))
    assert np.array_equal(at, natives)
    assert layer_placement(c, S, dataclasses.replace(free, budget_bytes=floor - 1)) is None
    roomy = dataclasses.replace(free, budget_bytes=2 * floor)
    inst = layer_placement(c, S, roomy)
    assert (inst >= 0).sum() > (natives >= 0).sum()  # replicas placed
    load = whole(inst, c).rank_load()
    assert load.max() < static.rank_load().max()
    tight = dataclasses.replace(free, budget_bytes=floor + (2 * floor - floor) // 50)
    some = layer_placement(c, S, tight)
    assert plan_exact_fit(tight, whole(some, c))[0] != "over"
    assert layer_placement(c, S, tight, max_replicas=0).tolist() == natives.tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_whole_layer_rung_with_room_places_as_pass_one(seed):
    """With room for every replica the whole-layer rung's rule is pass 1's without a
    budget, move for move: the same placement on random layers (EP 4-16, skews 0-2, one
    to three free slots), with and without a replica cap."""
    from lrmoe.policy.ledger_view import LedgerView
    from lrmoe.policy.lrmoe_ladder import layer_placement
    from lrmoe.policy.lrmoe_place import place_replicas

    rng = np.random.default_rng(seed)
    cfg = get_preset("tiny-qwen3")
    for _ in range(10):
        G, E = int(rng.choice([4, 8, 16])), int(rng.choice([16, 32, 64]))
        S = E // G + int(rng.integers(1, 4))
        w = 1.0 / np.arange(1, E + 1) ** rng.uniform(0, 2)
        c = rng.multinomial(int(rng.choice([64, 512, 4096])), w[rng.permutation(E)] / w.sum(),
                            size=G)
        roomy = Ledger.for_dtype(dataclasses.replace(cfg, num_experts=E), G, 1 << 60)
        for cap in (None, 2):
            got = layer_placement(c, S, roomy, np.inf if cap is None else cap)
            want, _ = place_replicas(c.sum(0), G, S, LrmoeConfig(max_replicas_per_step=cap),
                                     LedgerView(None, c.sum(1)))
            assert np.array_equal(got, want), (G, E, S, cap)


def whole(inst, c):
    """The exact plan on placement ``inst`` for counts ``c``."""
    from lrmoe.policy.plan_numpy import Slots, blocks_to_GGS, to_plan
    idx = Slots(inst, c.shape[1])
    a = blocks_to_GGS(idx.overlap_ig(c, idx.even_split(c.sum(0))), c.shape[0], inst.shape[1])
    return to_plan(inst, a, a.copy(), a.copy())


TTL = ["bench", "ttl", "--preset", "tiny-qwen3", "--ep", "2", "--steps", "4", "--batch-size",
       "4", "--seq-len", "32", "--eval-every", "2", "--max-data-bytes", "200000",
       "--threads", "1", "--budget-floor-fraction", "1.1"]


def test_bench_ttl_out_of_memory_verdict(tmp_path, capsys, monkeypatch):
    """A policy with no fallback left stops out of memory: here symi with every expert
    in every slot (s = E), which cannot fit the budget even with a whole-layer
    checkpoint, and its fallback of giving replicas up switched off. Its run stops at
    step 1 with the verdict, it gets no time to target, lrmoe's ratio over it reads OOM
    in ttl.json, ttl.md and the summaries."""
    from lrmoe.policy import symi

    def none_left(c, s, pop, ledger, view):  # the ledger's own verdict on the full plan
        plan = symi.plan_symi(torch.from_numpy(c), s, pop)
        return symi.fit_exact(plan, ledger, "symi")
    monkeypatch.setattr(symi, "fewer_replicas", none_left)
    out = tmp_path / "o"
    assert main(TTL + ["--policies", "static,symi,lrmoe", "--slots-per-rank", "16",
                       "--out", str(out)]) == 0
    rep = json.loads((out / "ttl.json").read_text())
    sy, lr, st = (rep["policies"][p] for p in ("symi", "lrmoe", "static"))
    oom = sy["out_of_memory"]
    assert oom["step"] == 1 and oom["budget_bytes"] == rep["budget_bytes"] < oom["needs_bytes"]
    assert f"needs {oom['needs_bytes'] / 2**20:.1f} MiB >" in oom["detail"]  # one need
    assert sy["budget_status"].startswith("out of memory at step 1 (needs ")
    assert f"budget {oom['budget_bytes'] / 2**20:.1f} MiB)" in sy["budget_status"]
    assert sy["steps"] == [] and sy["time_to_target_emulated_s"] is None
    assert sy["steps_to_target"] is None
    for r in (st, lr):  # the others fit every step with their fallbacks
        assert r["out_of_memory"] is None and len(r["steps"]) == 4
        assert all(s["ledger_peak_bytes"] <= rep["budget_bytes"] for s in r["steps"])
    assert rep["ratios_over_symi_time_to_target_emulated"] == {"lrmoe": "OOM"}
    assert rep["ratio_lrmoe_over_symi_time_to_target_emulated"] == "OOM"
    md = (out / "ttl.md").read_text()
    assert "lrmoe / symi emulated time-to-target: OOM" in md
    assert "| symi | " in md and "out of memory at step 1" in md and "| OOM | OOM |" in md
    ss = load_benchmark("summarize_ttl")
    assert "lrmoe / symi time to target: OOM" in ss.summarize(out)
    row = ss.seed_row(rep)
    assert row["policies"]["symi"]["ratio"] == row["policies"]["lrmoe"]["ratio"] == "OOM"
    capsys.readouterr()
    assert ss.main(["--seeds", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| symi | OOM at step 1 |" in table


SMALL = ["--batch-size", "4", "--seq-len", "64", "--max-data-bytes", "200000",
         "--eval-batches", "2", "--threads", "1", "--warmup", "5"]


def _budget() -> int:
    """Between static's plan with every pair kept and with every pair recomputed, on one
    rank (tiny-qwen3): static without --recompute is over it."""
    cfg = get_preset("tiny-qwen3")
    led = Ledger.for_dtype(cfg, 1, None, "fp32")
    E, P = cfg.num_experts, 4 * 64 * cfg.num_experts_per_tok
    full, every = (led.terms(E, P, P, P, n)["total"] for n in (0, P))
    return (full + every) // 2


@pytest.mark.parametrize("policy", ["static", "symi"])
def test_train_out_of_memory_is_one_line_and_exit_2(tmp_path, capsys, policy):
    """Either exact policy over the budget stops with one verdict; without --recompute
    the verdict offers it (both recompute rows to fit)."""
    common = ["train", "--preset", "tiny-qwen3", "--steps", "4", "--eval-every", "0", *SMALL,
              "--policy", policy, "--mem-budget", str(_budget())]
    assert main(common + ["--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the run's header, then the verdict
    assert "out of memory at step 1 (needs " in err[-1] and "no checkpoint was written" in err[-1]
    assert "; --recompute instead, if recomputing fits" in err[-1], err[-1]
    assert sum("out of memory" in line for line in err) == 1


def test_train_out_of_memory_mid_run_keeps_the_checkpoints(tmp_path, capsys, monkeypatch):
    """A step whose plan fits no fallback (here: the planner says so at step 3) stops the
    run there; the checkpoint of step 2 stays as it was and is named."""
    from lrmoe.train import checkpoint as ckpt

    real = StaticPolicy.plan

    def plan(self, counts_GE, inputs):
        if inputs.step == 2:
            raise OutOfMemory("the plan does not fit mem_budget: rank 0 needs more",
                              3 * 2**30, 2 * 2**30, "rank 0 needs 3.0 GiB > budget 2.0 GiB")
        return real(self, counts_GE, inputs)
    monkeypatch.setattr(StaticPolicy, "plan", plan)
    # every step planned (the one-process path's rule would find static's plan fits)
    monkeypatch.setattr(StaticPolicy, "plans_natives_exactly", lambda self: False)
    run = tmp_path / "m"
    common = ["train", "--preset", "tiny-qwen3", "--steps", "4", "--eval-every", "0",
              "--ckpt-every", "2", *SMALL, "--mem-budget", "10GiB", "--out", str(run)]
    assert main(common) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "out of memory at step 3 (needs 3.0 GiB, budget 2.0 GiB)" in err[-1]
    assert str(ckpt.ckpt_dir(run, 2)) in err[-1] and "intact" in err[-1]
    assert sum("out of memory" in line for line in err) == 1
    assert ckpt.ckpt_dir(run, 2).is_dir() and not ckpt.ckpt_dir(run, 3).exists()
    monkeypatch.undo()  # the checkpoint resumes: the run finishes from step 2
    assert main(["train", "--out", str(run), "--resume", "--threads", "1"]) == 0
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"]
    assert steps == [1, 2, 3, 4]


def test_train_falls_back_to_the_whole_layer_checkpoint(tmp_path):
    """``lrmoe train --policy static --recompute`` at a budget below every pair recomputed
    but above the whole-layer checkpoint's need: the steps run (no verdict), checkpointed
    whole, with the unbudgeted run's losses."""
    cfg = get_preset("tiny-qwen3")
    led = Ledger.for_dtype(cfg, 1, None, "fp32")
    E, P = cfg.num_experts, 4 * 64 * cfg.num_experts_per_tok
    every = led.terms(E, P, P, P, P)["total"]
    layer = led.layer_terms(E, P, P)["total"]
    assert layer < every
    common = ["train", "--preset", "tiny-qwen3", "--steps", "3", "--eval-every", "0", *SMALL]
    assert main(common + ["--out", str(tmp_path / "free")]) == 0
    assert main(common + ["--out", str(tmp_path / "ckpt"), "--recompute",
                          "--mem-budget", str((layer + every) // 2)]) == 0
    rows = {k: [r for r in read_metrics(tmp_path / k / "metrics.jsonl") if r.get("kind") == "train"]
            for k in ("free", "ckpt")}
    assert [r["loss"] for r in rows["ckpt"]] == pytest.approx([r["loss"] for r in rows["free"]],
                                                              rel=1e-5)
    for r in rows["ckpt"]:  # every MoE layer checkpointed whole: nothing saved, all re-run
        assert all(m["saved_act_bytes"] == 0 and m["recomputed"] == m["fwd_rows"] > 0
                   for m in r["moe"])
    assert all(m["saved_act_bytes"] > 0 for r in rows["free"] for m in r["moe"])
