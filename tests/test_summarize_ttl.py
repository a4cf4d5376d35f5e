"""benchmarks/summarize_ttl.py, per run and over seeds, reads a run's time to target as
``bench ttl`` recorded it (lrmoe.sim.target's smoothed crossing), on a recorded H200 run
and on a hand-made run whose raw and smoothed readings differ."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from dist_util import load_benchmark

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "ttl_qwen3_2gib" / "s0"


def test_recorded_run_read_the_same_by_every_tool():
    st = load_benchmark("summarize_ttl")
    rep = st.load_report(RUN)
    row = st.seed_row(rep)
    tg = st.target(rep)
    assert tg == pytest.approx(rep["target"]["val_loss"], rel=1e-12)
    for name, rec in rep["policies"].items():
        step, t = st.reach(rep, name, tg)
        assert step == pytest.approx(rec["steps_to_target"], rel=1e-12), name
        assert t == pytest.approx(rec["time_to_target_emulated_s"], rel=1e-12), name
        assert (step, t) == (row["policies"][name]["step"], row["policies"][name]["time"])
    md = st.summarize(RUN)
    # the run's ttl.md: steps to target 96.0 / 92.7 / 100.8 and the ratio 1.173
    assert "| symi | over budget at 14/120 steps | 92.7 |" in md
    assert "/ symi time to target: 1.173" in md
    lr = next(n for n in rep["policies"] if n.startswith("lrmoe"))
    over = st.seeds([RUN, RUN])  # --seeds: the same ratio, per seed and as their mean
    assert f"| {lr} | 1.173 (" in over and "| 1.173 | 1.173–1.173 | 1.173–1.173 | 2 of 2 |" in over
    assert "| symi | 1.000 (" in over
    ttl_md = (RUN / "ttl.md").read_text()
    assert "| 92.7 | 10.7829 |" in ttl_md and "1.173" in ttl_md


def _evals(losses, every=2, step_s=1.0):
    return [{"step": i * every, "val_loss": v, "cum_emulated_s": i * every * step_s}
            for i, v in enumerate(losses)]


def test_smoothed_crossing_not_the_first_raw_evaluation(tmp_path):
    """symi's raw curve dips below the target at one noisy evaluation (step 4); smoothed,
    it crosses later, between steps 8 and 10. Both tools say the smoothed answer."""
    static = [5.0, 4.0, 3.0, 2.5, 2.0, 1.5, 1.0]
    symi = [5.0, 4.0, 1.0, 3.0, 2.2, 1.8, 1.2]
    steps = [{"step_emulated_s": 1.0, "moe_emulated_s": 0.5, "exchange_critical_bytes": {},
              "expert_load_max_over_mean": 1.0, "fwd_load_max_over_mean": 1.0,
              "keep_ratio": 1.0, "stages_emulated_s": {}, "non_moe_s": 0.5}] * 12
    pol = {n: {"evals": _evals(v), "steps": steps, "final_val_loss": v[-1],
               "budget_status": "fits"} for n, v in (("static", static), ("symi", symi))}
    rep = {"target": {"fraction": 0.75, "smooth_window": 3, "static_step": 9},
           "config": {"ep": 2, "steps": 12}, "link": {"name": "nvlink"}, "budget_bytes": None,
           "policies": pol}
    run = tmp_path / "s0"
    run.mkdir()
    (run / "ttl.json.gz").write_bytes(gzip.compress(json.dumps(rep).encode()))
    st = load_benchmark("summarize_ttl")
    tg = st.target(st.load_report(run))
    step, t = st.reach(rep, "symi", tg)
    row = st.seed_row(rep)
    assert row["target"] == pytest.approx(tg)
    assert (step, t) == (row["policies"]["symi"]["step"], row["policies"]["symi"]["time"])
    raw_first = next(e["step"] for e in pol["symi"]["evals"] if e["val_loss"] <= tg)
    assert raw_first == 4 and 8 < step < 10
    assert f"| symi | fits | {step:.1f} |" in st.summarize(run)


def test_non_moe_share_per_micro_batch():
    """The share is each micro-batch's non-MoE over its non-MoE plus MoE time (the
    optimizer step, recorded apart, plays no part), averaged after the first steps."""
    mod = load_benchmark("summarize_ttl")

    def step(*mbs):
        return {"micro_batch_emulated_s": [{"non_moe_s": a, "moe_emulated_s": b} for a, b in mbs],
                "optimizer_step_emulated_s": {"moe_emulated_s": 9.0, "non_moe_s": 9.0}}

    steps = [step((9.0, 1.0)), step((9.0, 1.0)), step((1.0, 3.0), (3.0, 1.0)), step((1.0, 4.0))]
    assert mod.non_moe_share(steps) == pytest.approx((0.25 + 0.75 + 0.2) / 3)
    assert mod.non_moe_share(steps, skip=0) == pytest.approx((0.9 + 0.9 + 0.25 + 0.75 + 0.2) / 5)
    assert mod.non_moe_share(steps[:2]) is None


def test_ci95_student_t():
    """Five paired ratios: mean ± t(0.975, 4 df) · s / √5, s the sample deviation."""
    mod = load_benchmark("summarize_ttl")
    xs = [0.8, 0.9, 1.0, 0.85, 0.95]
    s = (sum((x - 0.9) ** 2 for x in xs) / 4) ** 0.5
    lo, hi = mod.ci95(xs)
    assert (lo, hi) == pytest.approx((0.9 - 2.776 * s / 5 ** 0.5, 0.9 + 2.776 * s / 5 ** 0.5))
    assert mod.ci95([1.0]) is None


def test_bad_run_folder_one_line_exit_2(tmp_path, capsys):
    mod = load_benchmark("summarize_ttl")
    assert mod.main([str(tmp_path / "nowhere")]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1
    assert cap.err.startswith("lrmoe: error:") and "holds none of ttl.json" in cap.err
    (tmp_path / "ttl.json.gz").write_bytes(gzip.compress(b"{not json"))
    assert mod.main(["--seeds", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ttl.json.gz: not readable JSON" in err


def test_seeds_plot_draws_each_runs_recorded_ratio(tmp_path, capsys):
    """--seeds --plot: the points are the ratios each run recorded (the 5-seed headline),
    the bar their mean and Student-t interval; --plot alone is a usage error."""
    mod = load_benchmark("summarize_ttl")
    runs = [RUN.parents[1] / "headline_qwen3_ib_h200" / f"s{s}" for s in range(5)]
    png = tmp_path / "ratios.png"
    assert mod.main(["--seeds", *map(str, runs), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    drawn = mod.plot_seeds(runs, tmp_path / "again.png")
    assert "symi" not in drawn and set(drawn) >= {"static"}
    recorded = []
    for r in runs:
        rep = json.loads(gzip.decompress((r / "ttl.json.gz").read_bytes()))
        recorded.append(rep["ratios_over_symi_time_to_target_emulated"])
    for name, (ratios, mean, (lo, hi)) in drawn.items():
        if name.startswith("lrmoe"):
            assert ratios == pytest.approx([x[name] for x in recorded], rel=1e-9)
        m = sum(ratios) / 5
        s = (sum((x - m) ** 2 for x in ratios) / 4) ** 0.5
        assert mean == pytest.approx(m)
        assert (lo, hi) == pytest.approx((m - 2.776 * s / 5 ** 0.5, m + 2.776 * s / 5 ** 0.5))
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        assert f"| {mean:.3f} | " in row and f"| {lo:.3f}–{hi:.3f} |" in row
    assert mod.main([str(runs[0]), "--plot", str(png)]) == 2
    assert "--plot draws the seeds" in capsys.readouterr().err


def test_one_off_steps_charged_at_the_median():
    """``--one-off R``: a policy's steps slower than R × its median step are charged at
    that median, so its evaluations' cumulative times drop by those steps' excess from
    the evaluation after them on; steps at or below R × the median, and other policies,
    are untouched; the report read is not changed."""
    st = load_benchmark("summarize_ttl")
    times = [1.0, 1.2, 0.9, 6.0, 1.0, 1.1, 2.9, 1.0]  # median 1.05: steps 4 and 7 are one-offs
    steps = [{"step": i + 1, "step_emulated_s": t} for i, t in enumerate(times)]
    cum = [sum(times[:k]) for k in range(0, 9, 2)]
    evals = [{"step": k, "val_loss": 5.0 - k / 4, "cum_emulated_s": c}
             for k, c in zip(range(0, 9, 2), cum)]
    flat = [{"step": i + 1, "step_emulated_s": 1.0} for i in range(8)]
    rep = {"policies": {"symi": {"steps": steps, "evals": evals},
                        "static": {"steps": flat, "evals": [dict(e) for e in evals]}}}
    out = st.one_offs_at_median(rep, 2.0)
    med = 1.05
    want = [cum[0], cum[1], cum[2] - (6.0 - med), cum[3] - (6.0 - med),
            cum[4] - (6.0 - med) - (2.9 - med)]
    got = [e["cum_emulated_s"] for e in out["policies"]["symi"]["evals"]]
    assert got == pytest.approx(want, abs=1e-12)
    assert out["policies"]["symi"]["one_off_steps"] == [4, 7]
    assert out["policies"]["static"]["one_off_steps"] == []
    assert [e["cum_emulated_s"] for e in out["policies"]["static"]["evals"]] == cum
    assert [e["cum_emulated_s"] for e in rep["policies"]["symi"]["evals"]] == cum  # not mutated
    # at a higher ratio only the 6.0 s step is a one-off (2.9 <= 3 × 1.05)
    assert st.one_offs_at_median(rep, 3.0)["policies"]["symi"]["one_off_steps"] == [4]
    with pytest.raises(Exception, match="above 1"):
        st.one_offs_at_median(rep, 1.0)


def test_one_off_view_over_recorded_seeds(capsys):
    """On a recorded run the view is labelled MODELLED and names the steps it charged; a
    run without slow steps keeps its ratio."""
    st = load_benchmark("summarize_ttl")
    assert st.run([str(RUN), str(RUN), "--seeds", "--one-off", "50"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("MODELLED:") and "steps none; compiled at (not recorded)" in out
    assert st._compiled_steps([{"step": 1, "compiles": 0}, {"step": 2, "compiles": 3}]) == "[2]"
    assert st._compiled_steps([{"step": 1, "compiles": 0}]) == "none"
    lr = next(n for n in st.load_report(RUN)["policies"] if n.startswith("lrmoe"))
    assert f"| {lr} | 1.173 (" in out
    with pytest.raises(Exception, match="give --seeds"):
        st.run([str(RUN), "--one-off", "2"])


def test_a_gzipped_partial_run_is_read(tmp_path):
    """A run cut short keeps ``ttl_partial.json``; kept gzipped, it reads the same."""
    st = load_benchmark("summarize_ttl")
    rep = st.load_report(RUN)
    part = tmp_path / "s0"
    part.mkdir()
    (part / "ttl_partial.json.gz").write_bytes(gzip.compress(json.dumps(rep).encode()))
    assert st.load_report(part) == rep
