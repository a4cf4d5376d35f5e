"""benchmarks/whatif_ttl.py on hand-made bench ttl records whose answers are known."""

from __future__ import annotations

import json

import pytest

from dist_util import load_benchmark

STAGES = ("plan", "count_exchange", "local", "fwd_experts", "select", "gather", "bwd_experts",
          "opt_d2h", "opt_host_update", "opt_h2d")


def _policy(stages: dict, non_moe: float, losses: list[float], every: int = 2) -> dict:
    """A run with the same stage seconds at every step and one evaluation every
    ``every`` steps (``losses``: the evaluations at steps every, 2·every, ...)."""
    st = {k: stages.get(k, 0.0) for k in STAGES}
    per = non_moe + sum(st.values())
    n = every * len(losses)
    steps = [{"step": i, "non_moe_s": non_moe, "stages_emulated_s": dict(st),
              "step_emulated_s": per} for i in range(1, n + 1)]
    evals = [{"step": 0, "val_loss": 10.0, "cum_emulated_s": 0.0}] + [
        {"step": every * (j + 1), "val_loss": v, "cum_emulated_s": per * every * (j + 1)}
        for j, v in enumerate(losses)]
    return {"steps": steps, "evals": evals}


def _record(lrmoe_stages: dict, symi_stages: dict, lrmoe_losses=None):
    losses = [9.0 - 0.5 * j for j in range(10)]  # falls steadily: static's target at step 16
    pol = {"static": _policy(symi_stages, 1.0, losses),
           "symi": _policy(symi_stages, 1.0, losses),
           "lrmoe": _policy(lrmoe_stages, 1.0, lrmoe_losses or losses)}
    return pol


def _write(tmp_path, pol: dict, name: str, recorded: dict | None = None):
    d = tmp_path / name
    d.mkdir()
    (d / "ttl.json").write_text(json.dumps({"policies": pol,
                                            "ratios_over_symi_time_to_target_emulated":
                                            recorded or {}}))
    return d


def test_scenarios_match_the_arithmetic(tmp_path):
    mod = load_benchmark("whatif_ttl")
    symi = {"plan": 1.0, "local": 2.0, "select": 0.5, "fwd_experts": 4.0, "bwd_experts": 8.0,
            "opt_host_update": 20.0, "opt_d2h": 2.0, "opt_h2d": 2.0}
    # lrmoe: half the expert work, a dearer control plane, the same optimizer
    lrmoe = dict(symi, plan=2.0, local=3.0, select=3.5, gather=1.0, fwd_experts=2.0,
                 bwd_experts=4.0)
    r = mod.seed_ratios(_record(lrmoe, symi), 0.8, 3)["lrmoe"]
    # same curves, constant steps: the ratio is the ratio of the per-step seconds
    s_all, s_opt = 1 + 39.5, 24.0
    l_ctl, s_ctl = 2 + 3 + 3.5 + 1, 1 + 2 + 0.5
    l_all = 1 + 2 + 4 + 24 + l_ctl
    assert r["as run"] == pytest.approx(l_all / s_all, rel=1e-12)
    assert r["optimizer off the critical path"] == pytest.approx(
        (l_all - s_opt) / (s_all - s_opt), rel=1e-12)
    assert r["lrmoe control plane at SYMI's"] == pytest.approx(
        (l_all - l_ctl + s_ctl) / s_all, rel=1e-12)
    assert r["both"] == pytest.approx((l_all - l_ctl + s_ctl - s_opt) / (s_all - s_opt),
                                      rel=1e-12)
    assert r["no optimizer, no control plane"] == pytest.approx(
        (l_all - l_ctl - s_opt) / (s_all - s_ctl - s_opt), rel=1e-12)


def test_slower_curve_and_cli(tmp_path, capsys):
    mod = load_benchmark("whatif_ttl")
    stages = {"fwd_experts": 4.0, "bwd_experts": 8.0, "opt_host_update": 10.0}
    # lrmoe's curve lags two steps behind: it reaches the target later at the same step cost
    late = [9.5] + [9.0 - 0.5 * j for j in range(9)]
    pol = _record(stages, stages, late)
    r = mod.seed_ratios(pol, 0.8, 3)["lrmoe"]
    assert all(v > 1.0 for v in r.values())
    assert r["as run"] == pytest.approx(r["optimizer off the critical path"], rel=1e-12)
    # the CLI: "as run" is checked against the recorded ratio
    good = _write(tmp_path, pol, "s0", {"lrmoe": r["as run"]})
    assert mod.main([str(good)]) == 0
    out = capsys.readouterr().out
    assert "MODELLED" in out and f"| lrmoe | as run | {r['as run']:.3f} |" in out
    bad = _write(tmp_path, pol, "s1", {"lrmoe": r["as run"] * 1.01})
    assert mod.main([str(bad)]) == 2
    assert "recorded" in capsys.readouterr().err
    assert mod.main([str(tmp_path / "missing")]) == 2
    # a policy that never reaches the target
    never = _record(stages, stages, [9.9] * 10)
    assert mod.seed_ratios(never, 0.8, 3)["lrmoe"]["as run"] is None
