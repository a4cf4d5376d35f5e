"""``lrmoe bench ttl`` on the CPU: a tiny end-to-end harness run (emulated times)."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter

import pytest
import torch

from budgets import balanced_budget
from lrmoe.cli import main
from lrmoe.presets import get_preset
from shared_run import run_once
from test_step_oom import HOST_OOM

ARGS = ["bench", "ttl", "--preset", "tiny-qwen3", "--ep", "2", "--steps", "6",
        "--batch-size", "4", "--seq-len", "32", "--eval-every", "3",
        "--max-data-bytes", "200000", "--threads", "1"]
# a budget that binds at these settings: a balanced static rank keeping 80% of its pairs
BUDGET = str(balanced_budget(get_preset("tiny-qwen3"), 2, 4 * 32 // 2, 0.8, "fp32"))


@pytest.fixture(scope="module")
def ttl_run(tmp_path_factory):
    """One three-policy run shared by the tests below (they read its outputs), made once
    per session (``shared_run``): ``(exit code, folder)``."""
    def make(out):
        return {"rc": main(ARGS + ["--policies", "static,symi,lrmoe", "--out", str(out)])}

    out, rec = run_once(tmp_path_factory, "ttl", make)
    return rec["rc"], out


@pytest.fixture(scope="module")
def report(ttl_run):
    """The shared run's ``ttl.json`` and ``ttl.md``."""
    rc, out = ttl_run
    assert rc == 0, f"bench ttl exited with {rc}"
    return json.loads((out / "ttl.json").read_text()), (out / "ttl.md").read_text()


def test_ttl_writes_report_and_plots(ttl_run):
    rc, out = ttl_run
    assert rc == 0, f"bench ttl exited with {rc}"
    for f in ("ttl.json", "ttl.md", "ttl_loss_vs_time.png", "ttl_loss_vs_step.png"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f"{f} missing or empty"


def test_ttl_report_is_labelled_emulated_and_lists_every_policy(report):
    rep, md = report
    assert rep["label"] == "emulated", f"label {rep['label']!r}"
    assert "emulated" in md, "ttl.md does not say its times are emulated"
    assert list(rep["policies"]) == ["static", "symi", "lrmoe"], list(rep["policies"])
    for name in rep["policies"]:
        assert f"| {name} |" in md, f"ttl.md has no table row for {name}"


def test_ttl_md_tables_are_well_formed(report):
    """Every table in ``ttl.md``: a header, a separator of as many columns, and rows of as
    many cells; the stage table has a column per stage, then non_moe and total, and its
    total is each policy's mean emulated step."""
    rep, md = report
    tables, cur = [], []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            cur.append(line)
        elif cur:
            tables, cur = tables + [cur], []
    assert len(tables) >= 2, f"ttl.md holds {len(tables)} tables"
    for t in tables:
        cols = t[0].count("|") - 1
        assert t[1] == "|" + "---|" * cols, f"separator {t[1]!r} under {t[0]!r}"
        assert all(r.count("|") - 1 == cols for r in t[2:]), f"ragged table under {t[0]!r}"
    stages = list(rep["policies"]["static"]["steps"][0]["stages_emulated_s"])
    head = "| policy | " + " | ".join(stages + ["non_moe", "total"]) + " |"
    stage_table = next(t for t in tables if t[0] == head)
    for row, (name, r) in zip(stage_table[2:], rep["policies"].items(), strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == name
        assert float(cells[-1]) == pytest.approx(r["mean_step_emulated_s"] * 1e3, abs=6e-4)


def test_ttl_records_every_step_and_eval(report):
    for name, r in report[0]["policies"].items():
        assert len(r["steps"]) == 6, f"{name}: {len(r['steps'])} steps recorded, ran 6"
        evals = [e["step"] for e in r["evals"]]
        assert evals == [0, 3, 6], f"{name}: evals at {evals}, --eval-every 3 over 6 steps"
        # the emulator's device peak is a CUDA figure (tests/gpu)
        assert r["emulator_device_peak_bytes"] is None, \
            f"{name}: a device peak on the CPU: {r['emulator_device_peak_bytes']}"


def test_ttl_step_times_are_positive_and_accumulate(report):
    for name, r in report[0]["policies"].items():
        for s in r["steps"]:
            at = f"{name} step {s['step']}"
            assert s["moe_emulated_s"] > 0 and s["step_emulated_s"] > 0, \
                f"{at}: emulated times {s['moe_emulated_s']}, {s['step_emulated_s']}"
            assert s["non_moe_measured_s"] >= 0, f"{at}: non-MoE time {s['non_moe_measured_s']}"
            assert s["wall_s"] > s["moe_wall_s"] > 0, \
                f"{at}: wall {s['wall_s']} s must exceed the MoE wall {s['moe_wall_s']} s > 0"
        cum = [s["cum_emulated_s"] for s in r["steps"]]
        assert all(b > a for a, b in zip(cum, cum[1:])), f"{name}: cumulative times {cum}"


def test_ttl_steps_record_what_they_compiled(report):
    """Each step records what it compiled; on the CPU without ``--compile`` nothing does,
    and the report then says nothing of it."""
    for name, r in report[0]["policies"].items():
        assert [s["compiles"] for s in r["steps"]] == [0] * 6, name
    assert "Steps that compiled" not in report[1]


def test_ttl_step_compiles_are_counted_across_the_step(tmp_path, monkeypatch):
    """A step's ``compiles`` is the count after it less the count before it."""
    from lrmoe.sim import ttl

    calls = iter(range(0, 1000, 1))
    monkeypatch.setattr(ttl, "compiles_so_far", lambda: next(calls) ** 2)  # 0, 1, 4, 9, ...
    args = [a if a != "6" else "2" for a in ARGS]
    assert main(args + ["--policies", "static", "--out", str(tmp_path / "o")]) == 0
    steps = json.loads((tmp_path / "o" / "ttl.json").read_text())["policies"]["static"]["steps"]
    assert [s["compiles"] for s in steps] == [1 - 0, 9 - 4]
    md = (tmp_path / "o" / "ttl.md").read_text()
    assert "Steps that compiled (a one-off cost inside their measured times): static 1, 2." in md


def test_compiles_so_far_counts_dynamo_graphs_and_lrmoes_triton_variants(monkeypatch):
    """A new Dynamo graph counts one; each compiled variant of a kernel in lrmoe's Triton
    modules counts one (a kernel's per-device cache, first entry of its tuple)."""
    import types

    from lrmoe.sim.ttl import compiles_so_far

    torch._dynamo.reset()
    n0 = compiles_so_far()
    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    f(torch.ones(3))
    f(torch.ones(3))  # no new graph
    assert compiles_so_far() == n0 + 1
    kernel = types.SimpleNamespace(device_caches={0: ({"a": 1, "b": 2}, None), 1: ({"c": 3}, None)})
    monkeypatch.setitem(sys.modules, "lrmoe.ops.selection_triton",
                        types.SimpleNamespace(_kernel=kernel, BLOCK=4))
    assert compiles_so_far() == n0 + 1 + 3


def test_ttl_step_load_and_keep_ratio_are_in_range(report):
    for name, r in report[0]["policies"].items():
        for s in r["steps"]:
            at = f"{name} step {s['step']}"
            assert s["fwd_load_max_over_mean"] >= 1.0, \
                f"{at}: max/mean load {s['fwd_load_max_over_mean']} below 1"
            assert 0 < s["keep_ratio"] <= 1, f"{at}: keep ratio {s['keep_ratio']}"


def test_ttl_eval_loss_is_the_mean_of_its_batches(report):
    for name, r in report[0]["policies"].items():
        for e in r["evals"]:
            b = e["val_batch_losses"]
            assert len(b) >= 1, f"{name} eval at step {e['step']}: no batch losses"
            assert e["val_loss"] == pytest.approx(sum(b) / len(b)), \
                f"{name} eval at step {e['step']}: {e['val_loss']} is not the mean of {b}"


def test_ttl_target_is_read_off_statics_smoothed_curve(report):
    """static's smoothed curve read at ceil(0.8 * 6) = 5 (between evals 3 and 6)."""
    from lrmoe.sim.target import smooth

    rep = report[0]
    st, tg = rep["policies"]["static"], rep["target"]
    sm = smooth([e["val_loss"] for e in st["evals"][1:]], 3)
    assert tg["static_step"] == 5, f"target step {tg['static_step']}, want ceil(0.8 * 6) = 5"
    want = sm[0] + (5 - 3) / 3 * (sm[1] - sm[0])
    assert tg["val_loss"] == pytest.approx(want), \
        f"target loss {tg['val_loss']}, want {want} (interpolated between evals 3 and 6)"
    assert tg["raw_static_step"] == 6, f"raw target step {tg['raw_static_step']}: first eval >= 5"
    assert 3 < st["steps_to_target"] <= 6, f"static reaches it at {st['steps_to_target']}"
    assert st["time_to_target_emulated_s"] > 0, \
        f"static's emulated time to target {st['time_to_target_emulated_s']}"
    assert st["raw_steps_to_target"] == 6, f"raw steps to target {st['raw_steps_to_target']}"


def test_ttl_symi_replicates_with_statics_losses(report):
    """Replication changes placement, never the math."""
    pol = report[0]["policies"]
    st, sy = pol["static"], pol["symi"]
    assert sy["steps"][0]["replicas"] > 0, "symi placed no replica"
    assert all(s["keep_ratio"] == 1 for s in sy["steps"]), "symi dropped pairs from backward"
    for what, a, b in (
            ("train loss", [s["train_loss"] for s in st["steps"]],
             [s["train_loss"] for s in sy["steps"]]),
            ("val loss", [e["val_loss"] for e in st["evals"]], [e["val_loss"] for e in sy["evals"]])):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, w=what: f"symi's {w} vs static's: {m}")
    assert sy["steps_to_target"] == pytest.approx(st["steps_to_target"], abs=1e-3), \
        f"steps to target: symi {sy['steps_to_target']}, static {st['steps_to_target']}"


def test_ttl_lrmoe_trims_the_backward_and_stays_close_to_static(report):
    pol = report[0]["policies"]
    lr, st = pol["lrmoe"], pol["static"]
    keep = min(s["keep_ratio"] for s in lr["steps"])
    assert keep < 1, "lrmoe kept every pair in every step: nothing trimmed"
    gap = abs(lr["final_val_loss"] - st["final_val_loss"])
    assert gap < 0.5, f"final val loss lrmoe {lr['final_val_loss']} vs static " \
        f"{st['final_val_loss']}: {gap} apart"


def test_ttl_out_follows_train_rules(ttl_run, tmp_path, capsys):
    """--out: marked and unlocked after a run; someone else's files, a training run, a
    live run's directory and an earlier run's results (without --reuse) are refused,
    each with one line and nothing changed; --reuse continues the earlier run there."""
    import hashlib
    import shutil
    import socket
    import subprocess
    import sys

    from lrmoe.train import rundir

    def digest(d):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir()}

    def refused(out, *words, extra=()):
        before = digest(out)
        capsys.readouterr()
        assert main(ARGS + ["--steps", "1", *extra, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("lrmoe: error:")]
        assert len(lines) == 1 and "Traceback" not in err, err
        assert all(w in lines[0] for w in words), lines[0]
        assert digest(out) == before

    rc, first = ttl_run
    assert rc == 0 and (first / rundir.BENCH_MARKER).is_file()
    assert not (first / rundir.LOCK).exists()
    out = tmp_path / "again"
    shutil.copytree(first, out)
    refused(out, "earlier bench ttl run", "ttl.json", "--reuse")
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("mine")
    refused(foreign, "did not write", "thesis.tex")
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.MARKER).write_text("x\n")
    (run / "metrics.jsonl").write_text("")
    refused(run, "lrmoe train run directory")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / rundir.LOCK).write_text(json.dumps({"pid": holder.pid,
                                                   "host": socket.gethostname()}))
        refused(out, f"pid {holder.pid}", extra=["--reuse", str(out / "ttl.json")])
    finally:
        holder.kill()
        holder.wait()
    (out / rundir.LOCK).unlink()
    # train refuses the bench directory too
    assert main(["train", "--preset", "tiny-qwen3", "--out", str(out), "--steps", "1"]) == 2
    assert "output directory of lrmoe bench ttl" in capsys.readouterr().err
    # a re-run with --reuse takes every policy from the file and rewrites the outputs
    assert main(ARGS + ["--reuse", str(out / "ttl.json"), "--out", str(out)]) == 0
    rep = json.loads((out / "ttl.json").read_text())["policies"]
    assert all(r["reused_from"] == str(out / "ttl.json") for r in rep.values())
    assert not (out / rundir.LOCK).exists()


def test_ttl_infeasible_budget(tmp_path, capsys):
    out = tmp_path / "x"
    rc = main(ARGS[:-6] + ["--steps", "1", "--mem-budget", "1KiB", "--out", str(out)])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lrmoe: error:") and "budget" in err and "\n" not in err
    assert not out.exists()
    out.mkdir()  # an empty --out stays empty
    assert main(ARGS[:-6] + ["--steps", "1", "--mem-budget", "1KiB", "--out", str(out)]) == 2
    assert list(out.iterdir()) == []


def test_ttl_bad_batch(tmp_path, capsys):
    rc = main(["bench", "ttl", "--preset", "tiny-qwen3", "--ep", "4", "--batch-size", "6",
               "--out", str(tmp_path / "y")])
    assert rc == 2
    assert "--batch-size 6" in capsys.readouterr().err


def test_ttl_budget_recompute_and_trace(tmp_path, capsys, monkeypatch):
    """Under a binding budget: exact policies are charged recompute (and stay exact),
    lrmoe stays within the budget, and the routing trace feeds `plan --compare`."""
    import lrmoe.sim.ttl as ttl
    real, seen = ttl._step_row, []  # per step: the largest total of any rank's layer, rank 0's

    def step_row(step, loss, micro, *a, **k):
        totals = [s.ledger_total_bytes for m in micro for s in m[0]]
        seen.append((max(max(t) for t in totals), max(t[0] for t in totals)))
        return real(step, loss, micro, *a, **k)

    monkeypatch.setattr(ttl, "_step_row", step_row)
    out = tmp_path / "b"
    rc = main(ARGS + ["--policies", "static,symi,lrmoe", "--mem-budget", BUDGET,
                      "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "ttl.json").read_text())
    budget = rep["budget_bytes"]
    assert budget > 0 and not (out / "ttl_partial.json").exists()
    st, sy, lr = (rep["policies"][p] for p in ("static", "symi", "lrmoe"))
    for r in (st, sy):
        assert all("recompute_ratio" in s and s["keep_ratio"] == 1 for s in r["steps"])
        assert "recompute to fit" in r["config"]
    # the budget keeps 80% of a balanced rank's pairs: a skewed static rank recomputes
    assert max(s["recompute_ratio"] for s in st["steps"]) > 0
    assert max(s["stages_emulated_s"]["bwd_recompute"] for s in st["steps"]) > 0
    a = torch.tensor([s["train_loss"] for s in st["steps"]])
    b = torch.tensor([s["train_loss"] for s in sy["steps"]])
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # recompute never changes math
    # every policy fits every step with its fallbacks (else it would be out of memory),
    # and says which rung each layer-step took
    for r in (st, sy, lr):
        assert r["failed"] is None and r["out_of_memory"] is None
        assert len(r["steps"]) == 6 and r["budget_status"].startswith("fits")
        assert all(s["ledger_peak_bytes"] <= budget and s["fits"] for s in r["steps"])
        assert all(sum(s["rungs"].values()) == 4 for s in r["steps"])  # tiny-qwen3: 4 MoE layers
        assert r["rungs"] == dict(sum((Counter(s["rungs"]) for s in r["steps"]), Counter()))
        # the run's ledger peak is its largest step's, and the steps' peaks differ
        peaks = [s["ledger_peak_bytes"] for s in r["steps"]]
        assert r["ledger_peak_bytes"] == max(peaks) > min(peaks)
    # a step's peak is over every rank, and some step's is not on rank 0
    steps = [s for p in ("static", "symi", "lrmoe") for s in rep["policies"][p]["steps"]]
    assert [s["ledger_peak_bytes"] for s in steps] == [hi for hi, _ in seen]
    assert any(r0 < hi for hi, r0 in seen)
    assert st["rungs"].get("recompute", 0) > 0  # a skewed static rank recomputes
    for p in ("static", "symi", "lrmoe"):
        trace = json.loads((out / f"routing_trace_{p}.json").read_text())
        assert len(trace["steps"]) == len(rep["policies"][p]["steps"])
        assert trace["tokens_per_rank"] == 4 * 32 // 2
    capsys.readouterr()
    js = tmp_path / "cmp.json"
    rc = main(["plan", "--compare", "--preset", "tiny-qwen3", "--ep-list", "2,4",
               "--budgets", "1GiB", "--loads", str(out / "routing_trace_static.json"),
               "--tokens-per-rank", "64", "--json", str(js)])
    assert rc == 0 and "modelled" in capsys.readouterr().out
    rows = json.loads(js.read_text())["rows"]
    assert {(r["ep"], r["policy"]) for r in rows} >= {(2, "static"), (4, "lrmoe")}


def test_ttl_budget_options_exclusive(tmp_path, capsys):
    rc = main(ARGS + ["--mem-budget", "1GiB", "--budget-floor-fraction", "1.5",
                      "--out", str(tmp_path / "z")])
    assert rc == 2 and "not both" in capsys.readouterr().err
    rc = main(ARGS + ["--budget-floor-fraction", "0.5", "--out", str(tmp_path / "z")])
    assert rc == 2 and "--budget-floor-fraction" in capsys.readouterr().err
    assert not (tmp_path / "z").exists()


@pytest.mark.slow
def test_ttl_lrmoe_variants(tmp_path):
    """lrmoe variants in --policies run as their own policies with their own knobs and
    each gets a ratio over symi; bad specs fail before any run."""
    out = tmp_path / "v"
    rc = main(ARGS[:-6] + ["--steps", "4", "--eval-every", "2", "--policies",
                           "symi,lrmoe,lrmoe:min_keep=1+balance=0", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "ttl.json").read_text())
    assert list(rep["policies"]) == ["static", "symi", "lrmoe", "lrmoe:min_keep=1+balance=0"]
    full = rep["policies"]["lrmoe:min_keep=1+balance=0"]
    assert "min_keep 1.0" in full["config"]
    assert all(s["keep_ratio"] == 1 for s in full["steps"])  # keeps every retained pair
    assert min(s["keep_ratio"] for s in rep["policies"]["lrmoe"]["steps"]) < 1
    assert set(rep["ratios_over_symi_time_to_target_emulated"]) == {
        "lrmoe", "lrmoe:min_keep=1+balance=0"}
    assert (out / "routing_trace_lrmoe_min_keep-1_balance-0.json").exists()
    assert "lrmoe:min_keep=1+balance=0 / symi" in (out / "ttl.md").read_text()


def test_ttl_records_both_count_exchanges(tmp_path):
    """Each step's ``exchange_critical_bytes`` holds the forward count all-gather (E int64
    counts to the one peer at EP 2, every layer-micro-batch) and the sampled estimator's
    backward count exchange (S int64 to the peer, where a layer-micro-batch trimmed), as
    ``[critical bytes, live layer-micro-batches]``; static has no backward one."""
    out = tmp_path / "c"
    assert main(ARGS[:-6] + ["--steps", "4", "--eval-every", "2", "--policies",
                             "static,lrmoe:estimator=sampled", "--out", str(out)]) == 0
    pol = json.loads((out / "ttl.json").read_text())["policies"]
    E = get_preset("tiny-qwen3").num_experts
    S = int(re.search(r"max slots (\d+)", pol["lrmoe:estimator=sampled"]["config"])[1])
    live = []
    for name, p in pol.items():
        for step in p["steps"]:
            ex, n = step["exchange_critical_bytes"], step["layer_micro_batches"]
            assert ex["count_allgather"] == [n * E * 8, n]
            b, k = ex["bwd_count_exchange"]
            assert b == k * S * 8 and k <= n
            live.append((name, k))
    assert all(k == 0 for name, k in live if name == "static")
    assert sum(k for name, k in live if name != "static") > 0


@pytest.mark.parametrize("spec", ["symi:recompute", "lrmoe:foo", "lrmoe:min_keep",
                                  "lrmoe:recompute=1", "lrmoe:min_keep=x", "dense"])
def test_ttl_bad_policy_spec(tmp_path, capsys, spec):
    out = tmp_path / "z"
    rc = main(ARGS[:-6] + ["--steps", "1", "--policies", spec, "--out", str(out)])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lrmoe: error:") and spec in err and "\n" not in err
    assert not out.exists()


def test_ttl_reuse_takes_finished_policies_and_checks_the_settings(tmp_path, capsys):
    """--reuse: the earlier run's policies are taken as they are (not re-run), the rest
    run; another seed, or another setting recorded in the file, is refused before training."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(ARGS + ["--policies", "static,lrmoe", "--out", str(a)]) == 0
    first = json.loads((a / "ttl.json").read_text())["policies"]
    assert main(ARGS + ["--policies", "static,lrmoe,lrmoe:recompute", "--reuse",
                        str(a / "ttl.json"), "--out", str(b)]) == 0
    err = capsys.readouterr().err
    assert "[static] reused from" in err and "[lrmoe] reused from" in err
    rep = json.loads((b / "ttl.json").read_text())["policies"]
    for p in ("static", "lrmoe"):
        assert rep[p]["reused_from"] == str(a / "ttl.json")
        assert rep[p]["steps"] == first[p]["steps"] and rep[p]["evals"] == first[p]["evals"]
    new = rep["lrmoe:recompute"]
    assert "reused_from" not in new and len(new["steps"]) == 6
    # only what ran here writes a routing trace (a reused one stays with its run)
    assert sorted(p.name for p in b.glob("routing_trace_*")) == ["routing_trace_lrmoe_recompute.json"]
    assert new["evals"][0]["val_loss"] == pytest.approx(first["static"]["evals"][0]["val_loss"])
    # symi chooses its s on the static run's profile: reusing static alone cannot run symi
    assert main(ARGS + ["--policies", "static,symi", "--reuse", str(a / "ttl.json"), "--out",
                        str(tmp_path / "e")]) == 2
    assert "symi needs static's routing profile" in capsys.readouterr().err
    # a file whose recorded settings differ
    assert main(ARGS + ["--seed", "1", "--reuse", str(a / "ttl.json"), "--out",
                        str(tmp_path / "c")]) == 2
    assert "it ran with seed=0, this run has seed=1" in capsys.readouterr().err
    # a file without settings (older partial files): the initial model's loss tells
    rep_a = json.loads((a / "ttl.json").read_text())
    partial = tmp_path / "old_partial.json"
    partial.write_text(json.dumps({"policies": {"static": rep_a["policies"]["static"]}}))
    assert main(ARGS + ["--seed", "1", "--policies", "static,lrmoe", "--reuse", str(partial),
                        "--out", str(tmp_path / "d")]) == 2
    assert "initial validation loss" in capsys.readouterr().err
    assert not (tmp_path / "c").exists() and not (tmp_path / "d" / "ttl.json").exists()
    # a file from when transients' pricing was a setting: "code" (today's) is reused, also
    # without the settings added since; "bound", or no such key (older still), is refused
    old = json.loads((a / "ttl.json").read_text())
    for k in ("lrmoe_placement", "grad_accum", "activation_checkpoint"):
        del old["config"][k]
    for was in ("code", "bound", None):
        old["config"]["ledger_transients"] = was
        if was is None:
            del old["config"]["ledger_transients"]
        f = tmp_path / f"transients_{was}.json"
        f.write_text(json.dumps(old))
        assert main(ARGS + ["--policies", "static,lrmoe", "--reuse", str(f), "--out",
                            str(tmp_path / f"t_{was}")]) == (0 if was == "code" else 2)
        err = capsys.readouterr().err
        assert was == "code" or f"it ran with ledger_transients={was!r}, this run has " \
            "ledger_transients='code'" in err


RG_ARGS = ["bench", "ttl", "--preset", "tiny-qwen3", "--ep", "2", "--steps", "4", "--batch-size",
           "4", "--seq-len", "32", "--eval-every", "2", "--max-data-bytes", "200000",
           "--threads", "1"]

# lrmoe's per-step fields that do not depend on time measured on this machine
LRMOE_FIELDS = ("train_loss", "keep_ratio", "retain_ratio", "replicas", "recompute_ratio",
                "recompute_modes", "ledger_peak_bytes", "fits", "rungs",
                "exchange_critical_bytes", "fwd_load_max_over_mean", "bwd_load_max_over_mean")


def _slots(config_note: str) -> int:
    return int(config_note.split("s=")[1].split(":")[0].split(" ")[0].split(",")[0])


def test_ttl_router_grad_experts(tmp_path, capsys):
    """--router-grad experts under a binding budget: static and symi keep no combined
    rows, so at the same budget they recompute less (never more, strictly less
    somewhere) with the same losses, and the backward combine carries the router
    gradient; lrmoe's results are those of a home run. At this budget the home ledger
    affords no replica slot (only s = E/G fits), so symi cannot have fewer slots at the
    experts; where both afford several, its s is the least modelled time, which may
    be smaller with less recompute."""
    reps = {}
    for rg in ("home", "experts"):
        out = tmp_path / rg
        assert main(RG_ARGS + ["--policies", "static,symi,lrmoe", "--mem-budget",
                               BUDGET, "--router-grad", rg, "--out", str(out)]) == 0
        reps[rg] = json.loads((out / "ttl.json").read_text())
        md = (out / "ttl.md").read_text()
        assert ("router gradient at the experts" in md) == (rg == "experts")
    home, exp = reps["home"]["policies"], reps["experts"]["policies"]
    assert reps["home"]["budget_bytes"] == reps["experts"]["budget_bytes"]
    s_home, s_exp = _slots(home["symi"]["config"]), _slots(exp["symi"]["config"])
    assert s_exp >= s_home
    for p in ("static", "symi"):
        assert "router gradient at the experts" in exp[p]["config"]
        assert "router gradient at the experts" not in home[p]["config"]
        a, b = home[p]["steps"], exp[p]["steps"]
        torch.testing.assert_close([s["train_loss"] for s in b], [s["train_loss"] for s in a],
                                   rtol=1e-5, atol=1e-5)
        same_slots = p == "static" or s_exp == s_home
        for sa, sb in zip(a, b):
            ex_a, ex_b = sa["exchange_critical_bytes"], sb["exchange_critical_bytes"]
            assert ex_b["bwd_combine"][0] > ex_a["bwd_combine"][0]  # + the router gradient
            assert ex_b["bwd_dispatch"] == ex_a["bwd_dispatch"] or not same_slots
            assert sb["fits"] or not sa["fits"]
            if same_slots:
                assert sb["recompute_ratio"] <= sa["recompute_ratio"]
        rec_a, rec_b = (sum(s["recompute_ratio"] for s in r) for r in (a, b))
        assert rec_b < rec_a if same_slots else s_exp > s_home  # strictly better
    assert "router gradient at the experts" not in exp["lrmoe"]["config"]
    for sa, sb in zip(home["lrmoe"]["steps"], exp["lrmoe"]["steps"]):
        for k in LRMOE_FIELDS:
            assert sa[k] == sb[k], k
    assert [e["val_loss"] for e in home["lrmoe"]["evals"]] == \
        [e["val_loss"] for e in exp["lrmoe"]["evals"]]
    # a home run is not reused by an experts run; a file from before the option is "home"
    capsys.readouterr()
    assert main(RG_ARGS + ["--policies", "static",
                             "--mem-budget", BUDGET, "--router-grad", "experts",
                             "--reuse", str(tmp_path / "home" / "ttl.json"),
                             "--out", str(tmp_path / "r")]) == 2
    assert "router_grad='home', this run has router_grad='experts'" in capsys.readouterr().err
    old = reps["home"]
    del old["config"]["router_grad"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert main(RG_ARGS + ["--policies", "static",
                             "--mem-budget", BUDGET, "--reuse",
                             str(tmp_path / "old.json"), "--out", str(tmp_path / "o")]) == 0
    # a bad value: one line, exit code 2, nothing written
    capsys.readouterr()
    assert main(ARGS + ["--router-grad", "away", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--router-grad" in err and not (tmp_path / "bad").exists()


def test_symi_gets_more_slots_with_router_grad_at_experts():
    """symi's s (least modelled time among the s that fit, with recompute) at the
    smallest budget where, with the router gradient at the experts, it takes a replica
    slot: the home ledger (combined rows kept: more recompute at every s) does not."""
    from lrmoe.errors import LrmoeError
    from lrmoe.ledger import Ledger
    from lrmoe.presets import get_preset
    from lrmoe.sim.links import get_link
    from lrmoe.sim.ttl_symi import symi_slots

    cfg, G = get_preset("tiny-qwen3"), 2
    E = cfg.num_experts
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 6, (G, E), generator=g)
    counts[:, 3] += 40  # two hot experts: replicas pay
    counts[:, 5] += 30
    link = get_link("nvlink")

    def slots(budget: int, at_experts: bool) -> int:
        led = Ledger.for_dtype(cfg, G, budget, "fp32", router_grad_at_experts=at_experts)
        try:
            return symi_slots(cfg, led, [counts], [counts.sum(0)], link, 1e9)[0]
        except LrmoeError:  # no s fits
            return 0

    lo, hi = 1, 1 << 30  # the smallest budget where symi takes a replica slot at the experts
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if slots(mid, True) > E // G else (mid + 1, hi)
    assert slots(lo, True) > slots(lo, False) >= E // G


def test_plan_compare_router_grad_experts(tmp_path, capsys):
    """``plan --compare --router-grad experts``: static and symi are priced without the
    combined rows (lower ledger peak, less recompute, the router gradient in the backward
    combine), lrmoe as with home; a bad value is one line, exit code 2."""
    from lrmoe.ledger import Ledger
    from lrmoe.presets import get_preset

    cfg = get_preset("tiny-qwen3")
    lean = Ledger.for_dtype(cfg, 2, None, "fp32", router_grad_at_experts=True)
    budget = int(lean.terms(8, 128, 128, 128, exact=True)["total"])  # static, kept by the lean
    rows = {}
    for rg in ("home", "experts"):
        js = tmp_path / f"{rg}.json"
        assert main(["plan", "--compare", "--preset", "tiny-qwen3", "--ep-list", "2", "--budgets",
                     str(budget), "--tokens-per-rank", "64", "--skew", "0", "--dtype", "fp32",
                     "--router-grad", rg, "--json", str(js)]) == 0
        rep = json.loads(js.read_text())
        assert rep["router_grad"] == rg
        rows[rg] = {r["policy"]: r for r in rep["rows"]}
    assert "static and symi keep no combined" in capsys.readouterr().out
    home, exp = rows["home"], rows["experts"]
    assert home["static"]["recompute_ratio"] > 0 and exp["static"]["recompute_ratio"] == 0
    assert exp["static"]["fits"] and exp["static"]["peak_bytes"] <= budget
    assert exp["static"]["modelled_stages_ms"]["bwd_combine"] > \
        home["static"]["modelled_stages_ms"]["bwd_combine"]
    assert exp["symi"]["recompute_ratio"] <= home["symi"]["recompute_ratio"]
    for k in ("fits", "peak_bytes", "keep_ratio", "retain_ratio", "replicas"):
        assert exp["lrmoe"][k] == home["lrmoe"][k], k
    # one plan (as `train --router-grad experts` prices it): the combined rows column is 0
    for rg in ("home", "experts"):
        assert main(["plan", "--preset", "tiny-qwen3", "--ep", "2", "--tokens-per-rank", "64",
                     "--router-grad", rg]) == 0
        table = capsys.readouterr().out.splitlines()
        assert "combined" in table[2]
        for row in table[3:5]:  # rank rows: a zero term prints as "0 B"
            assert (re.search(r"\s0 B\s", row) is not None) == (rg == "experts"), row
    assert main(["plan", "--compare", "--preset", "tiny-qwen3", "--ep-list", "2",
                 "--router-grad", "away"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--router-grad 'away'" in err


@pytest.mark.slow
def test_ttl_deterministic_runs_every_policy_deterministically(tmp_path, capsys, monkeypatch):
    """--deterministic: each policy trains with torch's deterministic algorithms on (warn
    only), the caller's setting comes back after the run, the setting is recorded, and
    --reuse refuses a file made with the other setting (an older file without it counts as
    off)."""
    import lrmoe.sim.ttl as ttl

    seen = []
    real = ttl.run_policy

    def spy(*a, **k):
        seen.append((torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled()))
        return real(*a, **k)

    monkeypatch.setattr(ttl, "run_policy", spy)
    short = ARGS[:-6] + ["--steps", "2", "--eval-every", "1", "--policies", "static,lrmoe"]
    before = torch.are_deterministic_algorithms_enabled()
    assert main(short + ["--deterministic", "--out", str(tmp_path / "d")]) == 0
    assert seen == [(True, True), (True, True)]
    assert torch.are_deterministic_algorithms_enabled() == before
    rep = json.loads((tmp_path / "d" / "ttl.json").read_text())
    assert rep["config"]["deterministic"] is True
    seen.clear()
    assert main(short + ["--out", str(tmp_path / "n")]) == 0
    assert seen == [(before, False), (before, False)]
    assert main(short + ["--reuse", str(tmp_path / "d" / "ttl.json"), "--out",
                         str(tmp_path / "x")]) == 2
    assert "it ran with deterministic=True, this run has deterministic=False" in \
        capsys.readouterr().err
    old = json.loads((tmp_path / "n" / "ttl.json").read_text())
    del old["config"]["deterministic"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert main(short + ["--deterministic", "--reuse", str(tmp_path / "old.json"), "--out",
                         str(tmp_path / "y")]) == 2
    assert "it ran with deterministic=False, this run has deterministic=True" in \
        capsys.readouterr().err
    # --no-deterministic-fill: torch's NaN fill off during every policy, recorded, and a
    # run with the fill (or an older file, which had it) is not reused for one without
    import torch.utils.deterministic as tud
    seen.clear()
    real_spy = ttl.run_policy
    fills = []
    monkeypatch.setattr(ttl, "run_policy",
                        lambda *a, **k: (fills.append(tud.fill_uninitialized_memory),
                                         real_spy(*a, **k))[1])
    assert main(short + ["--deterministic", "--no-deterministic-fill", "--out",
                         str(tmp_path / "f")]) == 0
    assert fills == [False, False] and tud.fill_uninitialized_memory
    assert json.loads((tmp_path / "f" / "ttl.json").read_text())["config"][
        "deterministic_fill"] is False
    old = json.loads((tmp_path / "d" / "ttl.json").read_text())
    del old["config"]["deterministic_fill"]
    (tmp_path / "old_d.json").write_text(json.dumps(old))
    assert main(short + ["--deterministic", "--no-deterministic-fill", "--reuse",
                         str(tmp_path / "old_d.json"), "--out", str(tmp_path / "z")]) == 2
    assert "it ran with deterministic_fill=True, this run has deterministic_fill=False" in \
        capsys.readouterr().err


def test_symi_note_names_the_rule_that_chose_s():
    """When no s fits every profiled step (the popularity is a previous step's, and the
    hot expert moved), symi's s is the one that fits the most steps, and the note says
    that, not "least modelled time among the s that fit every step"."""
    from lrmoe.ledger import Ledger
    from lrmoe.policy.symi import best_slots, plan_symi, slot_costs
    from lrmoe.presets import get_preset
    from lrmoe.sim.links import get_link
    from lrmoe.sim.ttl_symi import symi_slots

    cfg, G = get_preset("tiny-qwen3"), 2
    E = cfg.num_experts
    hot = []
    for e in (3, 9):
        c = torch.full((G, E), 200, dtype=torch.long)
        c[:, e] += 30000  # enough rows that a replica's transients outweigh its slot
        hot.append(c)
    # step 1's popularity is right (replicas of expert 3 help it), step 2's is step 1's
    # (its hot expert moved to 9: a replica of 3 only costs memory there)
    counts, pops = hot, [hot[0].sum(0), hot[0].sum(0)]
    led0 = Ledger.for_dtype(cfg, G, None, "fp32")
    need = max(t["total"] for t in led0.rank_terms(plan_symi(counts[0], E // G, pops[0])))
    seen = set()
    for budget in range(need * 3 // 10, need * 21 // 20, need // 300):
        led = Ledger.for_dtype(cfg, G, budget, "fp32")
        per = [set(slot_costs(led, c, p)) for c, p in zip(counts, pops)]
        if not set().union(*per):
            continue
        s, note = symi_slots(cfg, led, counts, pops, get_link("nvlink"), 1e9)
        if set.intersection(*per):
            assert "among the s that fit every profiled static micro-batch" in note
            seen.add("all")
        else:
            assert s == best_slots(led, counts, pops)[0]
            assert "no s fits (with recompute) every profiled static micro-batch" in note
            seen.add("some")
    assert seen == {"all", "some"}


def test_symi_takes_its_natives_where_no_s_fits_any_step():
    """A budget no s fits at any profiled step, not even with a whole-layer checkpoint:
    symi runs on its natives (s = E/G) and the note says why."""
    from lrmoe.ledger import Ledger
    from lrmoe.presets import get_preset
    from lrmoe.sim.ttl import _choose
    from lrmoe.sim.ttl_config import TTLConfig, policy_variant

    mcfg, G = get_preset("tiny-qwen3"), 2
    counts = torch.full((G, mcfg.num_experts), 200, dtype=torch.long)
    counts[:, 3] += 30000
    base, cfg = policy_variant("symi", TTLConfig.from_flat(ep=G))
    ledger = Ledger.for_dtype(mcfg, G, 1000, "fp32")  # 1000 bytes: nothing fits
    pc, *_, note = _choose(base, cfg, mcfg, ledger, ([counts], [counts.sum(0)], 1e9))
    assert pc.slots_per_rank == mcfg.num_experts // G
    assert note.startswith(f"s={mcfg.num_experts // G} (E/G): no s fits the profiled steps")


def test_deterministic_mode_fill_setting_and_restore():
    import torch.utils.deterministic as tud

    from lrmoe.sim.ttl import deterministic_mode
    assert not torch.are_deterministic_algorithms_enabled() and tud.fill_uninitialized_memory
    with deterministic_mode(True):
        assert torch.are_deterministic_algorithms_enabled() and tud.fill_uninitialized_memory
        assert bool(torch.empty(8).isnan().all())      # torch's debugging fill
    with deterministic_mode(True, fill=False):
        assert torch.are_deterministic_algorithms_enabled()
        assert not tud.fill_uninitialized_memory
    assert not torch.are_deterministic_algorithms_enabled() and tud.fill_uninitialized_memory
    with deterministic_mode(False, fill=False):
        assert not torch.are_deterministic_algorithms_enabled()
        assert tud.fill_uninitialized_memory


@pytest.mark.parametrize("policies, want", [
    (["static", "symi"], set()),
    (["static", "lrmoe:estimator=sampled"], {"sampled"}),
    (["static", "lrmoe", "lrmoe:estimator=sampled"], {"topk", "sampled"}),
    (["static", "lrmoe:select_from=5"], {"topk"}),  # a keep warm-up selects from step 5
])
def test_ttl_warm_up_runs_each_lrmoe_variants_selection(monkeypatch, policies, want):
    """The untimed warm-up launches every lrmoe variant's selection (its kernels compile
    there, not inside the variant's first timed steps); static and symi select nothing."""
    from lrmoe.parallel import stages
    from lrmoe.sim import ttl
    from lrmoe.sim.ttl import TTLConfig

    seen = set()
    for name in ("select_topk", "select_sampled"):
        real = getattr(stages, name)
        monkeypatch.setattr(stages, name, lambda *a, _r=real, _n=name, **k: (
            seen.add(_n.removeprefix("select_")), _r(*a, **k))[1])
    cfg = TTLConfig.from_flat(preset="tiny-qwen3", ep=2, steps=1, batch_size=4, seq_len=32,
                              max_data_bytes=200000, policies=tuple(policies))
    torch.set_num_threads(1)
    ttl._probe(cfg, ttl._load_data(cfg), {p: ttl.policy_variant(p, cfg) for p in policies})
    assert seen == want, f"the warm-up selected with {sorted(seen)}, want {sorted(want)}"


def test_ttl_reuse_of_static_keeps_lrmoes_link_cost(tmp_path, capsys):
    """lrmoe weighs replicas against their link cost at static's measured GEMM rate: a
    static taken from --reuse brings its rate, so lrmoe runs as it would beside it (the
    same config, the same plans); a file whose static records no rate is refused."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(ARGS + ["--policies", "static,lrmoe", "--deterministic", "--out", str(a)]) == 0
    full = json.loads((a / "ttl.json").read_text())
    assert full["policies"]["static"]["gemm_rate_flops"] > 0
    only_static = dict(full, policies={"static": full["policies"]["static"]})
    (tmp_path / "static.json").write_text(json.dumps(only_static))
    assert main(ARGS + ["--policies", "static,lrmoe", "--deterministic", "--reuse",
                        str(tmp_path / "static.json"), "--out", str(b)]) == 0
    want, got = full["policies"]["lrmoe"], json.loads((b / "ttl.json").read_text())["policies"]["lrmoe"]
    assert "weighed against their" in got["config"] and got["config"] == want["config"]
    assert got["replicas_placed"] == want["replicas_placed"]
    assert [e["val_loss"] for e in got["evals"]] == [e["val_loss"] for e in want["evals"]]
    del only_static["policies"]["static"]["gemm_rate_flops"]
    (tmp_path / "norate.json").write_text(json.dumps(only_static))
    capsys.readouterr()
    assert main(ARGS + ["--policies", "static,lrmoe", "--deterministic", "--reuse",
                        str(tmp_path / "norate.json"), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert "records no GEMM rate" in err and "\n" not in err and not (tmp_path / "c").exists()


def _raising(e: BaseException):
    """A stand-in for a step that fails with ``e``."""
    def step(*a, **k):
        raise e
    return step


@pytest.mark.parametrize("where", ["GPU", "host"])
def test_ttl_emulation_out_of_memory_is_one_line_and_keeps_finished_policies(
        tmp_path, capsys, monkeypatch, where):
    """The emulation itself out of memory (its G ranks share one device) is no verdict on the
    policy: one line naming the memory and what to shrink, exit 2, the finished policies kept
    in ttl_partial.json and no report written."""
    import lrmoe.sim.ttl as ttl
    real = ttl._train_step
    text = {"GPU": "CUDA out of memory. Tried to allocate 240.00 MiB. GPU 0 has a total "
                   "capacity of 79.18 GiB of which 60.19 MiB is free. Of the allocated memory "
                   "76.70 GiB is allocated by PyTorch",
            "host": HOST_OOM}[where]
    err = torch.OutOfMemoryError(text) if where == "GPU" else RuntimeError(text)

    def step(run, *a, **k):
        if run.name != "static":
            raise err
        return real(run, *a, **k)

    monkeypatch.setattr(ttl, "_train_step", step)
    out = tmp_path / "o"
    assert main(ARGS[:-6] + ["--steps", "2", "--policies", "static,lrmoe", "--out", str(out)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("lrmoe: error: emulating lrmoe: out of ") and where in line
    assert "the 2 virtual ranks share this one device" in line and "--ep" in line
    assert not (out / "ttl.json").exists()
    assert list(json.loads((out / "ttl_partial.json").read_text())["policies"]) == ["static"]
    # any other RuntimeError is not an allocation failure: it is not rewritten
    monkeypatch.setattr(ttl, "_train_step", _raising(RuntimeError("shape mismatch")))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        main(ARGS[:-6] + ["--steps", "1", "--out", str(tmp_path / "p")])


def test_ttl_calibration_out_of_memory_is_one_line(tmp_path, capsys, monkeypatch):
    import lrmoe.sim.ttl as ttl
    monkeypatch.setattr(ttl, "_train_step", _raising(
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")))
    out = tmp_path / "c"
    assert main(ARGS[:-6] + ["--steps", "1", "--budget-floor-fraction", "1.1",
                             "--out", str(out)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("lrmoe: error: emulating static's calibration: out of GPU memory "
                           "(CUDA out of memory. Tried to allocate 2.00 GiB)")
    assert not out.exists()  # nothing finished: a new --out goes


def test_ttl_trains_and_evaluates_completions_only(tmp_path):
    """On prompt/completion rows bench ttl reads the data as ``lrmoe train`` does: its
    batches mask the prompts' targets, and its validation loss weights each batch by its
    trained targets (the trainer's loss over them all), not a mean over batches."""
    from hf_fixtures import write_rows
    from lrmoe.model.transformer import MoEForCausalLM
    from lrmoe.parallel.groups import ParallelContext
    from lrmoe.sim import ttl
    from lrmoe.sim.ttl import TTLConfig
    from lrmoe.train.loop import evaluate, make_autocast

    data = write_rows(tmp_path / "rows.jsonl", n=240)
    cfg = TTLConfig.from_flat(preset="tiny-qwen3", ep=2, steps=1, batch_size=2, seq_len=32,
                              grad_accum=2, data=str(data), eval_batches=3)
    d = ttl._load_data(cfg)
    b = d.batches.batch(0)
    masked = int((b.targets == -100).sum())
    assert 0 < masked < b.targets.numel(), "the prompts' targets are not masked"
    assert len(d.val_b) > 1 and all(0 < (v.targets != -100).sum() < v.targets.numel() for v in d.val_b)
    torch.manual_seed(0)
    model = MoEForCausalLM(d.mcfg)
    dev, ac = torch.device("cpu"), make_autocast(torch.device("cpu"))
    got = ttl._val_eval(model, d.val_b, dev, ac)
    want, n = evaluate(model, d.val_b, ParallelContext(device=dev), ac)
    assert n == sum(int((v.targets != -100).sum()) for v in d.val_b)
    assert got["val_loss"] == pytest.approx(want, rel=1e-12)
    per = got["val_batch_losses"]
    assert len({round(x, 9) for x in per}) > 1  # unequal batches: a mean would differ
    assert abs(sum(per) / len(per) - want) > 1e-9
