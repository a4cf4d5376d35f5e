"""``bench ttl --budget-floor-fraction X``: a budget static fits at every step, because it
is at least static's whole-layer floor over the run's own routing; memory still binds
at X = 1. An out-of-memory stop names the flag the user gave and one need."""

from __future__ import annotations

import json

import pytest

from lrmoe.cli import main
from lrmoe.sim.ttl_budget import FLAG
from lrmoe.units import fmt_bytes
from test_reliability import one_error_line

# the README's emulator workload (tiny-qwen3, EP 4, 16 x 128 tokens), shortened: the
# rule it replaced ran out of memory for static at step 4 here (0.8 of a balanced rank)
ARGS = ["bench", "ttl", "--preset", "tiny-qwen3", "--ep", "4", "--steps", "5",
        "--eval-every", "0", "--eval-batches", "1", "--max-data-bytes", "300000",
        "--threads", "1", "--policies", "static"]


@pytest.fixture(scope="module")
def floor_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ttl") / "floor"
    assert main(ARGS + [FLAG, "1", "--out", str(out)]) == 0
    return json.loads((out / "ttl.json").read_text())


def test_static_fits_every_step_at_its_floor_and_memory_binds(floor_run):
    rep = floor_run
    rule, budget = rep["budget_rule"], rep["budget_bytes"]
    assert rule["fraction"] == 1 and rule["floor_bytes"] == budget == rule["budget_bytes"]
    steps = rep["policies"]["static"]["steps"]
    assert len(steps) == 5 and rep["policies"]["static"]["out_of_memory"] is None
    assert all(s["fits"] and s["ledger_peak_bytes"] <= budget for s in steps)
    # at its floor static cannot keep every row at the step that sets it: it falls back
    rungs = rep["policies"]["static"]["rungs"]
    assert set(rungs) - {"plan"}, rungs


def test_the_rule_it_replaced_is_refused_naming_the_new_one(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(ARGS + ["--budget-retain-fraction", "0.8", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--budget-floor-fraction" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("x", ["0.9", "nan", "inf"])
def test_a_fraction_below_one_is_refused(tmp_path, capsys, x):
    out = tmp_path / "o"
    assert main(ARGS + [FLAG, x, "--out", str(out)]) == 2
    one_error_line(capsys.readouterr().err, FLAG, ">= 1")
    assert not out.exists()


def test_static_out_of_memory_names_the_flag_given_and_one_need(tmp_path, capsys, floor_run):
    """Just below the floor static runs out at the step that sets it."""
    out = tmp_path / "o"
    assert main(ARGS + ["--mem-budget", str(floor_run["budget_bytes"] - 1),
                        "--out", str(out)]) == 2
    line = one_error_line(capsys.readouterr().err, "static (whose run sets the target) is out "
                          "of memory at step", "raise --mem-budget")
    assert "--budget-" not in line
    need = line.split("(needs ")[1].split(",")[0]
    assert f"needs {need} >" in line and need == fmt_bytes(floor_run["budget_bytes"]), line



def test_each_run_starts_after_the_previous_models_are_released(tmp_path, monkeypatch):
    """The emulator's layers and their model refer to each other; on CUDA a run's model is
    freed for the next run only by a collection (``ttl._release``). The GLM-4.5-Air twin's
    static run peaks at ~120 GB of an H200's 140, so a calibration run left uncollected
    put the next run out of device memory."""
    import lrmoe.sim.ttl as ttl

    events, run, release = [], ttl.run_policy, ttl._release

    def logged_run(*args, **kw):
        events.append("run")
        return run(*args, **kw)

    def logged_release(cfg):
        events.append("release")
        release(cfg)

    monkeypatch.setattr(ttl, "run_policy", logged_run)
    monkeypatch.setattr(ttl, "_release", logged_release)
    assert main(ARGS + ["--policies", "static,symi", FLAG, "1.2",
                        "--out", str(tmp_path / "o")]) == 0
    # the probe, then the calibration, static and symi, each released before the next
    assert events == ["release", "run"] * 3 + ["release"]


def test_a_reused_static_brings_its_budget_or_is_refused():
    """``--reuse``: the static run taken brings the floor and the budget it ran under; one
    without either is refused, naming the file and what to do."""
    from types import SimpleNamespace

    from lrmoe.errors import LrmoeError
    from lrmoe.sim.ttl_budget import reused

    cfg = SimpleNamespace(reuse="old/ttl.json", budget_floor_fraction=1.1)
    rule = {"fraction": 1.1, "floor_bytes": 1000, "budget_bytes": 1100}
    got = reused(cfg, {"budget_rule": rule})
    assert (got.floor_bytes, got.budget_bytes, got.source) == (1000, 1100, "--reuse old/ttl.json")
    for static in ({"budget_rule": {**rule, "floor_bytes": None}},
                   {"budget_rule": {"fraction": 1.1, "floor_bytes": 1000}}, {"budget_rule": None},
                   {}):
        with pytest.raises(LrmoeError, match=f"--reuse old/ttl.json: its static run records no "
                                             f"{FLAG} budget; run static again"):
            reused(cfg, static)
