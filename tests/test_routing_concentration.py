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


def test_whole_run_summary(tmp_path, capsys):
    """--whole-run: the 90% counts from a step on, the sink steps over the whole run, the
    steps where one expert has half of the tokens and the largest share."""
    mod = load_benchmark("routing_concentration")
    E, k, T = 16, 2, 1000

    def step(hot: int, share: float) -> list[list[int]]:
        """Expert ``hot`` gets ``share`` of the tokens, the rest spread evenly."""
        c = [0] * E
        c[hot] = round(share * T)
        rest = T * k - c[hot]
        others = [e for e in range(E) if e != hot]
        for i, e in enumerate(others):
            c[e] = rest // len(others) + (i < rest % len(others))
        return [c]

    # steps 0-1: a sink (every token), 2: 0.6 of the tokens, 3: 0.995 (not every token),
    # 4: five experts share all pairs (0.4 of the tokens each), 5: even
    narrow = [[400 if e < 5 else 0 for e in range(E)]]
    steps = [step(0, 1.0), step(1, 1.0), step(2, 0.6), step(3, 0.995), narrow,
             step(5, 0.125)]
    w = mod.whole_run({"steps": steps}, k, 2)
    assert (w["sink_steps"], w["first_sink"], w["last_sink"]) == (2, 0, 1)
    assert w["half_steps"] == 4 and abs(w["max_share"] - 1.0) < 1e-12
    n90 = [mod.concentration({"steps": steps}, [i], k)["rows"][0]["experts_for_90pct"]
           for i in range(2, 6)]
    assert w["min_90pct"] == min(n90) and w["median_90pct"] == sorted(n90)[1]
    assert w["min_90pct"] < w["median_90pct"]  # the two differ on this trace
    w5 = mod.whole_run({"steps": steps}, k, 5)  # only the last, even step counted
    assert w5["min_90pct"] == w5["median_90pct"] == n90[-1]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"steps": steps}))
    assert mod.main([str(p), "--steps", "0", "--top-k", "2", "--whole-run", "2"]) == 0
    out = capsys.readouterr().out
    assert f"| {min(n90)} / {sorted(n90)[1]} | 2 (0–1) | 4 of 6 | 1.000 |" in out
    assert mod.main([str(p), "--steps", "0", "--top-k", "2"]) == 0
    assert "largest share" not in capsys.readouterr().out


def test_gpu_runner_ttl_on_cpu(tmp_path):
    """benchmarks/gpu_run.sh end to end on a tiny model (its CPU overrides): a ttl run
    lands in OUTDIR/ttl/WORKLOAD/sSEED with its routing trace, which
    routing_concentration.py reads; an unknown benchmark fails with one line and counts
    in the exit code, after the others ran; MEM_BUDGET=none runs with no budget, LINK picks the link."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {"MODEL_ARGS": "--preset tiny-glm", "DEVICE": "cpu", "EP": "2", "BATCH": "4",
           "SEQ": "32", "STEPS": "4", "POLICIES": "static", "MEM_BUDGET": "none", "LINK": "ib",
           "PATH": os.environ["PATH"],
           "PYTHON": sys.executable, "PYTHONPATH": str(root / "src")}
    p = subprocess.run(["bash", "benchmarks/gpu_run.sh", str(tmp_path), "nosuch",
                        "ttl:glm_bias03:1"], cwd=root, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "no benchmark 'nosuch'" in (tmp_path / "nosuch.log").read_text()
    run = tmp_path / "ttl" / "glm_bias03" / "s1"
    rep = json.loads((run / "ttl.json").read_text())
    assert rep["config"]["seed"] == 1 and rep["config"]["steps"] == 4
    assert list(rep["policies"]) == ["static"]
    assert rep["budget_bytes"] is None and rep["config"]["budget_floor_fraction"] is None
    assert rep["config"]["link"] == "ib"
    mod = load_benchmark("routing_concentration")
    assert mod.main([str(run / "routing_trace_static.json"), "--steps", "0,3"]) == 0
