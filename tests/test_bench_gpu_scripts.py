"""The GPU benchmark scripts (moe_layer.py, train_step.py) run end to end on the CPU (``--smoke``): they
write JSON + markdown, the HF peers hold our weights (same outputs), and bad input is
one line with exit code 2. Their times are not results (the CPU runs each call once)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *map(str, args)],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_moe_layer_smoke(tmp_path):
    p = _run("moe_layer.py", "--smoke", "--out", tmp_path, "--shapes", "glm", "--skews", "1",
             "--compile-impl", "")
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((tmp_path / "moe_layer.json").read_text())["results"]
    assert len(res) == 1
    r = res[0]
    assert r["peer"]["grouped_mm"]["rel_err_vs_ours"] < 2e-2  # bf16: same weights, same routing
    assert r["ours_compiled"]["rel_err_vs_ours"] < 1e-6
    assert r["ours_router_grad_experts"]["rel_err_vs_ours"] < 1e-6
    assert r["ours_save_input"]["rel_err_vs_ours"] < 1e-6  # recompute changes no math
    assert {"keep1.0_bwd_ms", "keep0.5_bwd_ms", "keep0.5_nocompact_bwd_ms"} <= set(r)
    assert "| glm | 64 | 1 |" in (tmp_path / "moe_layer.md").read_text()


@pytest.mark.slow
def test_train_step_smoke(tmp_path):
    p = _run("train_step.py", "--smoke", "--out", tmp_path, "--shapes", "qwen3", "--regimes",
             "fp32-autocast", "--no-compile", "--loss-chunk", 16)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads((tmp_path / "train_step.json").read_text())["results"]
    assert [r["variant"] for r in rows] == ["ours eager", "ours eager, --loss-chunk 16",
                                            "ours eager, router grad at experts", "HF grouped_mm"]
    assert all("error" not in r for r in rows), rows
    assert rows[3]["logits_rel_err_vs_ours"] < 1e-5  # fp32: HF holds exactly our weights
    assert abs(rows[0]["first_loss"] - rows[3]["first_loss"]) < 0.05 * rows[0]["first_loss"]
    assert "| qwen3 | fp32-autocast | ours eager |" in (tmp_path / "train_step.md").read_text()


@pytest.mark.parametrize("script", ["moe_layer.py", "train_step.py"])
def test_bad_input_exit_2_and_no_output(tmp_path, script):
    p = _run(script, "--smoke", "--out", tmp_path / "o", "--shapes", "qwen4")
    assert p.returncode == 2
    assert "qwen4" in p.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "o").exists()
