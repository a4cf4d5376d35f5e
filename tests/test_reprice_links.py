"""benchmarks/reprice_links.py: a ``bench ttl`` run re-priced for another link (MODELLED).

A closed-form run (doubling the bandwidth halves its exchange stages), the as-run guard on
a run ``bench ttl`` records here (and on a tampered copy), and bad input."""

from __future__ import annotations

import copy
import gzip
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from budgets import balanced_budget
from dist_util import load_benchmark
from lrmoe.cli import main as lrmoe_main
from lrmoe.errors import LrmoeError
from lrmoe.presets import get_preset
from lrmoe.sim.links import Link

rl = load_benchmark("reprice_links")
OLD = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "ttl_qwen3_2gib_devcp" / "s0"
BW = 1e9  # the closed-form run's link: 1 GB/s, no latency
# per policy: (compute s a step, exchange s a step at BW, val loss at steps 2 and 4)
SYNTH = {"static": (0.1, 0.1, (3.0, 2.0)), "symi": (0.1, 0.05, (4.0, 2.0)),
         "lrmoe": (0.1, 0.2, (2.5, 2.0))}


def synthetic() -> dict:
    """4 steps, evaluations at 2 and 4, window 1, fraction 0.5: the target is static's
    loss at step 2 (3.0); static and lrmoe reach it at step 2, symi at step 3."""
    link = Link("x1", BW, 0.0)
    pols = {}
    for name, (comp, ex, (v2, v4)) in SYNTH.items():
        step = comp + ex
        rows = [{"step": i + 1, "non_moe_s": 0.0, "step_emulated_s": step,
                 "cum_emulated_s": step * (i + 1),
                 "stages_emulated_s": {"fwd_experts": comp, "fwd_dispatch": ex},
                 "link_terms": {"G": 2, "stages": {"fwd_dispatch": [[1, ex * BW]]}}}
                for i in range(4)]
        evals = [{"step": 0, "val_loss": 5.0, "cum_emulated_s": 0.0},
                 {"step": 2, "val_loss": v2, "cum_emulated_s": 2 * step},
                 {"step": 4, "val_loss": v4, "cum_emulated_s": 4 * step}]
        at = 3 if name == "symi" else 2
        pols[name] = {"steps": rows, "evals": evals, "steps_to_target": float(at),
                      "time_to_target_emulated_s": at * step, "out_of_memory": None}
    return {"link": asdict(link), "config": {"steps": 4, "ep": 2},
            "target": {"val_loss": 3.0, "fraction": 0.5, "smooth_window": 1},
            "ratios_over_symi_time_to_target_emulated":
                {"lrmoe": 2 * 0.3 / (3 * 0.15)}, "policies": pols}


def test_doubling_bandwidth_halves_the_exchanges_closed_form(tmp_path):
    rep = synthetic()
    rl.guard(rep, tmp_path)  # as run: its own figures back
    got = rl.reprice(rep, Link("x2", 2 * BW, 0.0), tmp_path)
    for name, (comp, ex, _) in SYNTH.items():
        assert got[name]["step_s"] == pytest.approx([comp + ex / 2] * 4, rel=1e-12)
    assert got["static"]["time_to_target_emulated_s"] == pytest.approx(2 * 0.15, rel=1e-12)
    assert got["symi"]["steps_to_target"] == pytest.approx(3.0)
    assert got["symi"]["time_to_target_emulated_s"] == pytest.approx(3 * 0.125, rel=1e-12)
    assert got["lrmoe"]["ratio"] == pytest.approx(2 * 0.2 / (3 * 0.125), rel=1e-12)
    assert got["static"]["ratio"] == pytest.approx(2 * 0.15 / (3 * 0.125), rel=1e-12)


# binding at these settings: a balanced static rank (host design) keeping 80% of its pairs
BUDGET = str(balanced_budget(get_preset("tiny-qwen3"), 2, 4 * 32 // 2, 0.8, "fp32", "host"))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A tiny CPU ``bench ttl`` run under a binding budget (recompute, whole-layer
    checkpoints), host offload (symi's sharded exchanges) and two micro-batches."""
    out = tmp_path_factory.mktemp("ttl")
    rc = lrmoe_main(["bench", "ttl", "--preset", "tiny-qwen3", "--ep", "2", "--steps", "6",
                     "--batch-size", "4", "--seq-len", "32", "--eval-every", "3",
                     "--max-data-bytes", "200000", "--threads", "1",
                     "--policies", "static,symi,lrmoe", "--mem-budget", BUDGET,
                     "--optimizer-offload", "host", "--grad-accum", "2", "--out", str(out)])
    assert rc == 0
    return out


def test_as_run_guard_passes_on_a_recorded_run(recorded, capsys):
    rep = json.loads((recorded / "ttl.json").read_text())
    terms = [s["link_terms"]["stages"] for s in rep["policies"]["symi"]["steps"]]
    assert any(len(c) == 3 and c[0] for t in terms for c in t.get("bwd_recompute", []))
    assert all(t["weight_scatter"] for t in terms)  # sharded: once per optimizer step
    assert rl.main(["--link", "nvlink", str(recorded)]) == 0  # as run: ratios unchanged
    out = capsys.readouterr().out
    assert "MODELLED (re-priced)" in out
    ratio = rep["ratios_over_symi_time_to_target_emulated"]["lrmoe"]
    assert f"| {ratio:.3f} | {ratio:.3f} |" in out
    assert rl.main(["--link", "pcie", str(recorded), str(recorded)]) == 0
    assert "(2 of 2)" in capsys.readouterr().out


@pytest.mark.parametrize("tamper", ["bytes", "step"])
def test_as_run_guard_refuses_a_tampered_run(recorded, tmp_path, capsys, tamper):
    rep = json.loads((recorded / "ttl.json").read_text())
    bad = copy.deepcopy(rep)
    row = bad["policies"]["symi"]["steps"][2]
    if tamper == "bytes":
        row["link_terms"]["stages"]["fwd_dispatch"][0][1] *= 2
    else:
        row["step_emulated_s"] *= 1 + 1e-7
    (tmp_path / "ttl.json.gz").write_bytes(gzip.compress(json.dumps(bad).encode()))
    assert rl.main(["--link", "ib", str(tmp_path)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.strip().splitlines()) == 1
    assert "symi step 3 step_emulated_s re-priced on its own link" in cap.err


def test_bad_input_exits_2(tmp_path, capsys):
    assert rl.main(["--link", "ib", str(OLD)]) == 2  # recorded before link_terms
    assert "lacks link_terms" in capsys.readouterr().err
    assert rl.main(["--link", "ib", str(tmp_path)]) == 2
    assert "neither ttl.json nor ttl.json.gz" in capsys.readouterr().err
    (tmp_path / "ttl.json").write_text("{not json")
    assert rl.main(["--link", "ib", str(tmp_path)]) == 2
    assert "ttl.json: not readable JSON" in capsys.readouterr().err
    assert rl.main(["--link", "carrier-pigeon", str(OLD)]) == 2
    assert "--link 'carrier-pigeon' is not known" in capsys.readouterr().err
    rep = synthetic()
    for p in rep["policies"].values():
        for s in p["steps"]:
            s["link_terms"]["G"] = 16  # ranks over two nodes: no intra/inter split recorded
    with pytest.raises(LrmoeError, match="span nodes of 8"):
        rl.reprice(rep, rl.get_link("nvlink+ib"), tmp_path)


@pytest.mark.parametrize("mode", ["measured", "pairs", "layer"])
def test_link_terms_price_each_stage_as_the_emulator(mode):
    """On every preset, each link-priced stage of one emulated layer (replicas, sampled
    counts) priced from its terms equals the emulator's own (cost.rank_stage_seconds);
    ``bwd_recompute`` as run (a whole-layer checkpoint) and as a modelled whole layer
    (forward exchanges and experts again); rows recomputed as pairs are run inside the
    expert backward, so they add nothing here."""
    from emulated import EmulatedLayer
    from lrmoe.sim.cost import LINK_STAGES, _record, price_terms, rank_link_terms, rank_stage_seconds
    from lrmoe.sim.links import LINKS
    from test_sim import G, make_case, make_opts, make_policy, run

    layer, _, x, coeff = make_case(3)
    v = EmulatedLayer(layer, G, make_policy("sampled"), make_opts("sampled"))
    run(v, layer, x, coeff)
    s = v.stats
    n = s.rows["fwd"]
    s.expert_ms.setdefault("fwd", [0.5 + g for g in range(G)])
    if mode == "measured":
        s.expert_ms["recompute"] = [0.2 * (g + 1) for g in range(G)]
        for a, b in (("recompute_dispatch", "fwd_dispatch"), ("recompute_combine", "fwd_combine")):
            s.bytes_GG[a] = s.bytes_GG[b]
    else:
        s.expert_ms.pop("recompute", None)
        s.recompute_mode = mode
        s.recompute_rows = [r // 2 for r in n]
    terms: dict = {}
    _record(terms, rank_link_terms(s))
    assert terms["fwd_dispatch"] and terms["weight_scatter"]
    assert bool(terms.get("bwd_recompute")) == (mode != "pairs")
    for link in LINKS.values():
        per = rank_stage_seconds(s, link)
        for k in LINK_STAGES:
            got = sum(price_terms(c, link, G) for c in terms.get(k, []))
            assert got == pytest.approx(max(per[k]), rel=1e-12, abs=1e-15), (link.name, k)
