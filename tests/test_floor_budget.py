"""benchmarks/floor_budget.py: static's floor F over a routing trace (MODELLED, ledger).

F against a budget search with ``fit_exact`` on a synthetic trace, the count matrices'
sums, the settings read from a recorded run, and bad input."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pytest
import torch

from dist_util import load_benchmark
from lrmoe.cli import main as lrmoe_main
from lrmoe.errors import LrmoeError, OutOfMemory
from lrmoe.policy.plan import fit_exact, native_plan
from lrmoe.presets import get_preset
from lrmoe.sim.ttl import TTLConfig, static_floor_ledger

fb = load_benchmark("floor_budget")
RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "ttl_glm_bias03_3p6gib" / "s0"
G, T = 4, 512  # ranks, tokens per rank


def synthetic() -> dict:
    """3 steps of tiny-qwen3's 4 MoE layers, skewed counts (some experts take many pairs)."""
    mcfg = get_preset("tiny-qwen3")
    gen = torch.Generator().manual_seed(0)
    E, total = mcfg.num_experts, G * T * mcfg.num_experts_per_tok
    steps = []
    for _ in range(3):
        layers = []
        for _ in range(len(mcfg.moe_layers)):
            w = torch.rand(E, generator=gen) ** 4
            c = (w / w.sum() * total).long()
            c[0] += total - int(c.sum())
            layers.append(c.tolist())
        steps.append(layers)
    return {"model": mcfg.to_hf_dict(), "ep": G, "tokens_per_rank": T, "steps": steps}


def least_budget(trace: dict, cfg: TTLConfig, lo: int, hi: int, n: int = 200):
    """``(budget, spacing, fits)``: the first of ``n`` evenly spaced budgets in ``[lo, hi]``
    at which ``fit_exact`` of static's plan raises for no step and layer, and that test."""
    mcfg = get_preset("tiny-qwen3")
    led = static_floor_ledger(cfg, mcfg)
    home = T * mcfg.num_experts_per_tok
    plans = [native_plan(fb.counts_matrix(c, G, home)) for s in trace["steps"] for c in s]
    step = (hi - lo) // n + 1

    def fits(b: int) -> bool:
        try:
            for p in plans:
                fit_exact(p, dataclasses.replace(led, budget_bytes=b), "static")
        except OutOfMemory:
            return False
        return True

    b = next(b for b in range(lo, hi + step, step) if fits(b))
    return b, step, fits


def test_floor_is_the_least_budget_fit_exact_accepts():
    trace, cfg = synthetic(), TTLConfig.from_flat(ep=G, device="cuda")
    r = fb.floors(trace, cfg, get_preset("tiny-qwen3"))
    assert r["F"] < r["row_floor"] < r["as_is"]  # the checkpoint is static's cheapest fallback
    b, step, fits = least_budget(trace, cfg, r["F"] // 2, r["as_is"])
    assert b - step < r["F"] <= b  # the search's first budget that fits brackets F
    assert fits(r["F"]) and not fits(r["F"] - 1)  # and F to the byte
    assert r["fit_floor"] == r["F"]


def test_the_emulator_agrees_at_the_floor(tmp_path, capsys):
    """A ``bench ttl`` run's recorded peak is the tool's as-is peak; re-run at the
    any-fallback floor static fits, one byte below it runs out of memory."""
    args = ["bench", "ttl", "--preset", "tiny-qwen3", "--ep", "4", "--steps", "4", "--policies",
            "static", "--batch-size", "8", "--seq-len", "32", "--eval-every", "2",
            "--eval-batches", "1"]
    assert lrmoe_main(args + ["--mem-budget", "1GiB", "--out", str(tmp_path / "a")]) == 0
    assert fb.run([str(tmp_path / "a"), "--out", str(tmp_path / "f")]) == 0
    (r,) = json.loads((tmp_path / "f" / "floor_budget.json").read_text())["results"]
    rec = json.loads((tmp_path / "a" / "ttl.json").read_text())["policies"]["static"]
    assert r["as_is"] == rec["ledger_peak_bytes"] and r["dtype"] == "fp32"
    assert r["fit_floor"] < r["row_floor"] < r["as_is"]  # the floor needs the checkpoint
    capsys.readouterr()
    at = lrmoe_main(args + ["--mem-budget", str(r["fit_floor"]), "--out", str(tmp_path / "b")])
    below = lrmoe_main(args + ["--mem-budget", str(r["fit_floor"] - 1), "--out", str(tmp_path / "c")])
    assert (at, below) == (0, 2) and "out of memory" in capsys.readouterr().err


def test_counts_matrix_keeps_expert_and_home_sums():
    c = [5, 0, 9, 2, 0, 8]
    m = fb.counts_matrix(c, 2, 12)
    assert m.sum(0).tolist() == c and m.sum(1).tolist() == [12, 12]
    # counts that are not a routing of G·home pairs (a wrong sum, or a negative count)
    for bad in ([5, 0, 9, 2, 0, 7], [5, -1, 10, 2, 0, 8]):
        with pytest.raises(LrmoeError, match="a layer's counts sum to"):
            fb.counts_matrix(bad, 2, 12)


def test_run_settings_and_outputs(tmp_path, capsys):
    assert fb.run([str(RUN), "--fractions", "1.1", "--mem-budget", "3.6GiB",
                   "--out", str(tmp_path)]) == 0
    (r,) = json.loads((tmp_path / "floor_budget.json").read_text())["results"]
    assert (r["dtype"], r["optimizer_offload"], r["router_grad"]) == ("bf16", "host", "experts")
    assert r["run_budget"] == 3865470566
    assert r["given_over_F"]["3.6GiB"] == r["run_budget_over_F"]
    assert r["budgets"]["1.1"]["bytes"] == int(1.1 * r["F"])
    assert "MODELLED (ledger)" in (tmp_path / "floor_budget.md").read_text()


def test_bad_input_one_line_exit_2(tmp_path, capsys):
    out = tmp_path / "out"
    assert fb.run([str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lrmoe: error:") and err.count("\n") == 1 and "nowhere" in err
    bad = tmp_path / "run"
    bad.mkdir()
    (bad / "routing_trace_static.json.gz").write_bytes(gzip.compress(b"{not json"))
    assert fb.run([str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lrmoe: error:") and err.count("\n") == 1 and "not readable" in err
    assert not (out / "floor_budget.json").exists()
