"""benchmarks/routing_concentration.py on hand-made traces."""

from __future__ import annotations

import json

from dist_util import load_benchmark


def test_collapsed_and_uniform_traces(tmp_path, capsys):
    mod = load_benchmark("routing_concentration")
    E, k, T = 16, 2, 100  # 100 tokens, top-2: 200 pairs a step
    uniform = [[[200 // E + (e < 200 % E) for e in range(E)]] for _ in range(4)]
    # collapsed: experts (s, s+1) take every token at step s (the hot pair moves)
    collapsed = [[[T if e in (s, s + 1) else 0 for e in range(E)]] for s in range(4)]
    r = mod.concentration({"steps": uniform}, [0, 3], k)
    assert [x["experts_for_90pct"] for x in r["rows"]] == [15, 15]
    assert all(x["experts_every_token"] == 0 for x in r["rows"])
    r = mod.concentration({"steps": collapsed}, [0, 3], k)
    assert [(x["experts_for_90pct"], x["experts_every_token"]) for x in r["rows"]] == [(2, 2), (2, 2)]
    assert (r["top_repeats"], r["transitions"]) == (0, 3)  # the top expert moves every step
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"steps": collapsed}))
    assert mod.main([str(p), "--steps", "0,3", "--top-k", "2"]) == 0
    assert "| 2 / 2 | 2 / 2 | 0 of 3 |" in capsys.readouterr().out
    assert mod.main([str(tmp_path / "missing.json")]) == 2


def test_gpu_router_check_script_on_cpu(tmp_path):
    """benchmarks/gpu_router_check.sh end to end on a tiny model (its CPU overrides): one
    row per setting in concentration.md and concentration_rows.md, each run archived at
    the top of OUTDIR as it ends."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {"MODEL_ARGS": "--preset tiny-glm", "DEVICE": "cpu", "EP": "2", "BATCH": "4",
           "SEQ": "32", "PATH": os.environ["PATH"], "PYTHON": sys.executable}
    p = subprocess.run(["bash", "benchmarks/gpu_router_check.sh", str(tmp_path), "6",
                        "lr=1e-3,scale=1", "lr=1e-3,scale=0.25"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    md = (tmp_path / "concentration.md").read_text()
    assert "lr1e-3_scale1/" in md and "lr1e-3_scale0.25/" in md
    rows = (tmp_path / "concentration_rows.md").read_text().splitlines()
    assert len(rows) == 2 and "lr1e-3_scale0.25/" in rows[1]
    import tarfile
    for name in ("lr1e-3_scale1", "lr1e-3_scale0.25"):
        with tarfile.open(tmp_path / f"routing_{name}.tar.gz") as t:
            assert f"{name}/routing_trace_static.json" in t.getnames()
    assert not (tmp_path / "runs").exists()
