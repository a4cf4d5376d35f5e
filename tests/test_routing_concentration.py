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
