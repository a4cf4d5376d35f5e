"""``benchmarks/hf_init.py``'s logic on the CPU (tiny shapes): it makes the checkpoint,
runs ``lrmoe train --init-from`` to the first steps, stops it, and reports each rank's
reads and host memory; the rule's arithmetic for the full model is checked against
the shapes written out by hand."""

from __future__ import annotations

import json

import pytest

from dist_util import load_benchmark

TINY = ["--device", "cpu", "--make-device", "cpu", "--layers", "2", "--hidden", "64",
        "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--experts", "8",
        "--moe-intermediate", "32", "--vocab", "512", "--intermediate", "96", "--seq-len", "32",
        "--batch-size", "2", "--shard", "20KB", "--tokenizer-vocab", "300"]


def test_full_model_rule_by_hand():
    b = load_benchmark("hf_init")
    r = b.rule(b.model_config(b.FULL), 8)
    L, H, E, F, V = 48, 2048, 128, 768, 151936
    expert = L * E * 3 * H * F * 2  # bf16
    attention = H * 32 * 128 * 2 + H * 4 * 128 * 2 + 2 * 128  # q, o; k, v; q/k norms
    dense = (2 * V * H + L * (attention + 2 * H + E * H) + H) * 2  # + norms, router; final norm
    assert r["expert_bytes"] == expert == 57_982_058_496
    assert r["dense_bytes"] == dense
    assert r["largest_tensor_bytes"] == V * H * 2
    assert r["read_per_rank_bytes"] == dense + expert // 8
    assert r["host_loading_cpu_bytes"] == 2 * (dense + expert // 8) + V * H * 2


@pytest.mark.slow
def test_bench_runs_and_measures(tmp_path):
    b = load_benchmark("hf_init")
    assert b.main(["--out", str(tmp_path / "o"), "--steps", "2", *TINY]) == 0
    res = json.loads((tmp_path / "o" / "hf_init.json").read_text())["results"][0]
    m = res["measured"]
    assert m["steps"] >= 2 and m["wall_to_first_step_s"] > 0 and m["first_step_s"] > 0
    (rank,) = m["ranks"]
    assert rank["bytes_read"] == res["rule_measured_config"]["read_per_rank_bytes"]
    assert res["read_equals_rule"]
    assert rank["peak_rss_run_bytes"] >= rank["peak_rss_at_load_bytes"] > 0
    assert res["checkpoint_bytes"] > 0
    assert not (tmp_path / "o" / "work").exists()  # the checkpoint and run are removed
    assert "## The full 48-layer" in (tmp_path / "o" / "hf_init.md").read_text()
