"""benchmarks/ttl_numerics_equal.py: two ``bench ttl`` reports are the same training when
every number but the times is equal (the check for runs that should change no number)."""

from __future__ import annotations

import copy
import gzip
import json
import math
from pathlib import Path

from dist_util import load_benchmark

mod = load_benchmark("ttl_numerics_equal")
RUNS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "headline_qwen3_ib_h200"


def _load(seed: int) -> dict:
    return json.loads(gzip.decompress((RUNS / f"s{seed}" / "ttl.json.gz").read_bytes()))


def test_times_do_not_count_numbers_do(tmp_path):
    rep = _load(0)
    timed = copy.deepcopy(rep)  # every time of the run changed: still the same training
    for p in timed["policies"].values():
        for s in p["steps"]:
            s["wall_s"] += 1.0
            s["step_emulated_s"] *= 2
            s["stages_emulated_s"] = {k: v + 1 for k, v in s["stages_emulated_s"].items()}
            s["link_terms"] = {}
            s["prepare_ms"] = 0.0
        for e in p["evals"]:
            e["cum_emulated_s"] += 3
    assert mod.differences(mod.numerics(rep), mod.numerics(timed)) == []
    flipped = copy.deepcopy(rep)  # one training loss one ulp away
    step = flipped["policies"]["static"]["steps"][5]
    step["train_loss"] = math.nextafter(step["train_loss"], math.inf)
    diff = mod.differences(mod.numerics(rep), mod.numerics(flipped))
    assert len(diff) == 1 and "static steps[5].train_loss" in diff[0]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(rep))
    b.write_text(json.dumps(flipped))
    assert mod.main([str(a), str(a)]) == 0
    assert mod.main([str(a), str(b)]) == 1
    assert mod.main([str(a), str(RUNS / "s1" / "ttl.json.gz")]) == 1  # another seed
    assert mod.main([str(a), str(tmp_path / "missing.json")]) == 2
    assert mod.main([str(a)]) == 2
