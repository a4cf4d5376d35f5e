"""``lrmoe plan --compare`` and the modelled stats behind it (lrmoe.sim.analytic).

The key check: for the same plan, the modelled bytes and rows of every exchange equal
what the virtual EP emulator records when it actually runs the layer on CPU.
"""

from __future__ import annotations

import json

import pytest
import torch

from budgets import natives_floor
from dist_util import FixedRouter
from emulated import EmulatedLayer
from lrmoe.cli import main
from lrmoe.config import ModelConfig
from lrmoe.ledger import Ledger
from lrmoe.model.moe import MoELayer
from lrmoe.policy.base import PlanInputs
from lrmoe.policy.plan import Plan
from lrmoe.policy.plan_numpy import full_plan
from lrmoe.policy.registry import PolicyConfig, make_policy
from lrmoe.policy.static import StaticPolicy
from lrmoe.policy.symi import plan_symi
from lrmoe.presets import get_preset
from lrmoe.routing_loads import RoutingTrace, read_trace, synthetic_counts
from lrmoe.sim.analytic import mean_step_times, modelled_stats
from lrmoe.sim.cost import STAGES, step_times
from lrmoe.sim.links import LINKS
from lrmoe.sim.vstats import EXCHANGES
from lrmoe.units import parse_bytes
from references.plans import native_placement

T, H, E, K, F, G = 16, 16, 8, 2, 8, 4
RATE = 1e12


def small_cfg() -> ModelConfig:
    return ModelConfig(model_type="qwen3_moe", vocab_size=32, hidden_size=H, num_attention_heads=2,
                       num_key_value_heads=1, moe_intermediate_size=F, num_experts=E,
                       num_experts_per_tok=K, num_hidden_layers=1, intermediate_size=32)


def small_counts() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    c = torch.randint(0, 5, (G, E), generator=gen)
    c[:, 3] += 9  # one hot expert
    return c


# ---------------------------------------------------------------------- analytic stats
def test_modelled_bytes_are_the_hand_computed_sums():
    cfg, c = small_cfg(), small_counts()
    per = E // G
    # natives plus a replica of expert 3 on rank 0 and of expert 1 on rank 3
    ie = torch.full((G, per + 1), -1, dtype=torch.long)
    ie[:, :per] = native_placement(G, E)
    ie[0, per], ie[3, per] = 3, 1
    full = full_plan(c, ie)
    sel = (full.assign_GGS * 3) // 4
    plan = Plan(full.inst_expert_GS, full.assign_GGS, full.assign_GGS.clone(), sel)
    ba, bw = 2, 4
    st = modelled_stats(plan, cfg, RATE, bytes_act=ba, bytes_w=bw, recompute_rows=[0, 1, 2, 3])

    for g in range(G):
        for r in range(G):
            fwd = sum(int(plan.assign_GGS[g, r, s]) for s in range(plan.S))
            bwd = sum(int(plan.select_GGS[g, r, s]) for s in range(plan.S))
            assert st.bytes_GG["fwd_dispatch"][g, r] == fwd * H * ba
            assert st.bytes_GG["fwd_combine"][r, g] == fwd * H * ba
            assert st.bytes_GG["bwd_dispatch"][g, r] == bwd * (H * ba + 12)
            assert st.bytes_GG["bwd_combine"][r, g] == bwd * H * ba
            # instances on rank r whose expert rank g owns
            n = sum(1 for e in ie[r].tolist() if e >= 0 and e // per == g)
            assert st.bytes_GG["weight_scatter"][g, r] == n * 3 * H * F * bw
            assert st.bytes_GG["grad_reduce"][r, g] == n * 3 * H * F * bw
    # only the two replicas leave their owner
    off = st.rows_GG["weight_scatter"] - torch.diag(torch.diagonal(st.rows_GG["weight_scatter"]))
    assert int(off.sum()) == 2

    assert st.rows["fwd"] == plan.rank_load().tolist()
    assert st.rows["selected"] == st.rows["bwd"] == plan.rank_backward_load().tolist()
    assert st.recompute_rows == [0, 1, 2, 3]
    for r in range(G):
        assert st.expert_ms["fwd"][r] == pytest.approx(st.rows["fwd"][r] * 6 * H * F / RATE * 1e3)
        # with the recomputed rows' gate_up (2 of the 3 GEMMs) in the expert backward
        want = (st.rows["bwd"][r] * 12 + st.recompute_rows[r] * 4) * H * F / RATE * 1e3
        assert st.expert_ms["bwd"][r] == pytest.approx(want)
        assert st.saved_act_bytes[r] == st.rows["retained"][r] * (H + 2 * F) * ba


def test_modelled_times_go_through_step_times():
    cfg, c = small_cfg(), small_counts()
    plan = full_plan(c, native_placement(G, E))
    st = modelled_stats(plan, cfg, RATE, recompute_rows=[0] * G)
    link = LINKS["ib"]
    times = mean_step_times([st, st], link)
    once = step_times(st, link)
    assert times.label == "modelled"
    for s in STAGES:
        assert getattr(times, s) == pytest.approx(getattr(once, s))
    assert times.fwd_experts == pytest.approx(max(plan.rank_load().tolist()) * 6 * H * F / RATE)
    assert times.weight_scatter == 0.0  # static: every instance is on its owner


@pytest.mark.parametrize("name", ["static", "symi", "lrmoe"])
def test_a_projection_plans_every_sample(name):
    """Each sample is planned on its own: two samples give the larger of their peaks and
    the mean of their replicas, as each projects alone."""
    from lrmoe.sim.analytic import project_policy

    cfg, a = small_cfg(), small_counts()
    b = a.flip(1) * 3  # another hot expert, three times the pairs: a higher peak
    ledger = Ledger(cfg, G, 2**40)

    def row(samples):
        return project_policy(name, cfg, ledger, samples, LINKS["nvlink"], RATE)
    both, one, other = row([a, b]), row([a]), row([b])
    assert one["peak_bytes"] < other["peak_bytes"] == both["peak_bytes"]
    assert both["replicas"] == (one["replicas"] + other["replicas"]) / 2


def _emulated_stats(policy, ledger=None):
    """Run the layer over G virtual ranks on CPU (fp32) and return its stats."""
    gen = torch.Generator().manual_seed(1)
    cfg = small_cfg()
    torch.manual_seed(1)
    layer = MoELayer(cfg, 0)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(G * T)])
    idx[:, 0] = torch.where(torch.rand(G * T, generator=gen) < 0.5, 3, idx[:, 0])  # skew
    idx[:, 1] = torch.where(idx[:, 1] == idx[:, 0], (idx[:, 0] + 1) % E, idx[:, 1])
    layer.router = FixedRouter(idx, E, H)
    layer.prev_counts_E = torch.bincount(idx.flatten(), minlength=E)
    v = EmulatedLayer(layer, G, policy, ledger=ledger)
    x = torch.randn(G * T, H, generator=gen, requires_grad=True)
    v(x).sum().backward()
    return cfg, v.stats


def _budget_ledger(cfg, counts):
    """A one-layer fp32 ledger halfway between the smallest plan and the static plan."""
    lo = Ledger(cfg, G, None, 4, 4, 1)
    floor = natives_floor(lo, counts)
    full = max(t["total"] for t in lo.rank_terms(full_plan(counts, native_placement(G, E))))
    return Ledger(cfg, G, (floor + full) // 2, 4, 4, 1)


@pytest.mark.parametrize("name", ["static", "symi", "lrmoe"])
def test_modelled_bytes_equal_the_emulators(name):
    cfg = small_cfg()
    ledger = None
    if name == "static":
        policy = StaticPolicy()
    elif name == "symi":
        policy = make_policy(PolicyConfig("symi", slots_per_rank=E // G + 2), cfg, G)
    else:
        policy = make_policy(PolicyConfig("lrmoe"), cfg, G)
        _, probe = _emulated_stats(StaticPolicy())
        counts = probe.plan.assign_GGS.reshape(G, E)  # natives: [g, r, s] is expert r*E/G + s
        ledger = _budget_ledger(cfg, counts)
    _, emu = _emulated_stats(policy, ledger)
    plan = emu.plan
    if name == "symi":
        assert plan.num_replicas() > 0
    if name == "lrmoe":
        assert not plan.exact and plan.num_replicas() > 0
        assert max(t["total"] for t in ledger.rank_terms(plan)) <= ledger.budget_bytes
    mod = modelled_stats(plan, cfg, RATE, bytes_act=4, bytes_w=4)
    for ex in EXCHANGES:  # the sampled estimator's count exchange is not in these runs
        assert (ex in mod.bytes_GG) == (ex in emu.bytes_GG) == (ex != "bwd_count_exchange")
        if ex in emu.bytes_GG:
            assert torch.equal(mod.bytes_GG[ex], emu.bytes_GG[ex]), ex
            assert torch.equal(mod.rows_GG[ex], emu.rows_GG[ex]), ex
    for k in ("fwd", "retained", "bwd", "selected"):
        assert mod.rows[k] == emu.rows[k], k
    assert mod.saved_act_bytes == emu.saved_act_bytes
    # with the emulator's measured kernel times swapped in, the link stages agree exactly
    mod.expert_ms, mod.stage_ms = emu.expert_ms, emu.stage_ms
    a, b = step_times(mod, LINKS["nvlink"]), step_times(emu, LINKS["nvlink"])
    assert a.stages() == pytest.approx(b.stages())


# ---------------------------------------------------------------------- the command
TINY = ["--preset", "tiny-qwen3", "--tokens-per-rank", "256"]


def _compare(tmp_path, capsys, *extra):
    out = tmp_path / "cmp.json"
    rc = main(["plan", "--compare", *TINY, "--json", str(out), *extra])
    return rc, capsys.readouterr(), out


def test_compare_rows_fit_and_budgets(tmp_path, capsys):
    eps, budgets = [2, 4], ["12MiB", "14MiB", "64MiB"]
    rc, cap, out = _compare(tmp_path, capsys, "--ep-list", "2,4", "--budgets", ",".join(budgets))
    assert rc == 0, cap.err
    rep = json.loads(out.read_text())
    assert rep["label"] == "modelled"
    got = [(r["ep"], r["budget"], r["policy"]) for r in rep["rows"]]
    assert got == [(g, b, p) for g in eps for b in budgets for p in ("static", "symi", "lrmoe")]
    assert "does not fit" in cap.out and "modelled" in cap.out
    assert "not modelled: non-MoE time" in cap.out
    time_keys = {k for r in rep["rows"] for k in r if k.endswith("_ms")}
    assert time_keys == {"modelled_layer_ms", "modelled_all_layers_ms", "modelled_stages_ms",
                         "planning_ms"}
    assert "plan ms/layer" in cap.out and "MEASURED on this machine" in cap.out

    cfg = get_preset("tiny-qwen3")
    L = len(cfg.moe_layers)
    for r in rep["rows"]:
        budget = parse_bytes(r["budget"])
        if not r["fits"]:
            assert r["reason"] and r["modelled_layer_ms"] is None
            continue
        assert r["peak_bytes"] <= budget
        assert r["modelled_all_layers_ms"] == pytest.approx(r["modelled_layer_ms"] * L)
        assert r["modelled_layer_ms"] == pytest.approx(sum(r["modelled_stages_ms"].values()))
        # the measured planning time is a stage of the layer time (every rank plans)
        assert r["planning_ms"] > 0
        assert r["modelled_stages_ms"]["plan"] == pytest.approx(r["planning_ms"])
        # exact policies fit at the ledger level once they recompute
        G_ = r["ep"]
        ledger = Ledger.for_dtype(cfg, G_, budget, "bf16")
        counts = synthetic_counts(G_, 16, 256, 2, 1.0)
        if r["policy"] == "static":
            plan = full_plan(counts, native_placement(G_, 16))
        elif r["policy"] == "symi":
            plan = plan_symi(counts, r["slots_per_rank"], counts.sum(0))
        else:
            plan = make_policy(PolicyConfig("lrmoe"), cfg, G_).plan(
                counts, PlanInputs(prev_counts_E=counts.sum(0), ledger=ledger))
            assert max(t["total"] for t in ledger.rank_terms(plan)) <= budget
            continue
        mode, rec, terms = ledger.exact_fit(plan)
        assert mode != "over" and max(t["total"] for t in terms) <= budget
        assert r["recompute_ratio"] == pytest.approx(sum(rec) / int(plan.assign_GGS.sum()))
    by = {(r["ep"], r["budget"], r["policy"]): r for r in rep["rows"]}
    # ep 2: the owned state alone exceeds 12 MiB; ep 4 at 14.5 MiB: static recomputes
    assert all(not by[(2, "12MiB", p)]["fits"] for p in ("static", "symi", "lrmoe"))
    assert "owned state" in by[(2, "12MiB", "lrmoe")]["reason"]
    assert by[(4, "14MiB", "static")]["fits"] and by[(4, "14MiB", "static")]["recompute_ratio"] > 0
    lr, sy = by[(4, "64MiB", "lrmoe")], by[(4, "64MiB", "symi")]
    assert lr["lrmoe_over_symi"] == pytest.approx(lr["modelled_layer_ms"] / sy["modelled_layer_ms"])


@pytest.mark.parametrize("argv, msg", [
    (["--ep-list", "3"], "do not divide"),
    (["--ep-list", "a,b"], "--ep-list"),
    (["--ep-list", "4", "--budgets", "lots"], "--budgets"),
    (["--ep-list", "4", "--gemm-tflops", "0"], "--gemm-tflops"),
])
def test_compare_bad_input_is_exit_2(tmp_path, capsys, argv, msg):
    rc, cap, out = _compare(tmp_path, capsys, *argv)
    assert rc == 2 and msg in cap.err and len(cap.err.strip().splitlines()) == 1
    assert not out.exists()


def test_plan_needs_ep_without_compare(capsys):
    assert main(["plan", *TINY]) == 2
    assert "--ep is required without --compare" in capsys.readouterr().err
    assert main(["plan", "--compare", *TINY, "--ep", "4"]) == 2
    assert "--ep-list" in capsys.readouterr().err


def test_plan_help_renders(capsys):
    assert main(["plan", "--help"]) == 0
    assert "742 TFLOP/s" in capsys.readouterr().out


# ---------------------------------------------------------------------- routing traces
def _trace(n_steps: int, layers: int, experts: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    steps = [[(torch.randint(1, 50, (experts,), generator=gen) * (1 + (torch.arange(experts) == s % experts)
                                                                 * 10)).tolist()
              for _ in range(layers)] for s in range(n_steps)]
    return {"label": "routing trace of lrmoe bench ttl, policy static",
            "model": {"model_type": "qwen3_moe", "num_experts": experts}, "ep": 2,
            "tokens_per_rank": 64, "format": "steps[step][moe_layer][expert] = global pairs routed",
            "steps": steps}


def test_read_trace_samples_and_rescales():
    data = _trace(5, 3, 16)
    tr = read_trace("t.json", data, 16, 2, 3)
    assert isinstance(tr, RoutingTrace) and tr.n_steps == 5 and tr.steps == [0, 2, 4]
    assert len(tr.loads_E) == 9
    want = [max(layer) / (sum(layer) / 16) for s in (0, 2, 4) for layer in data["steps"][s]]
    assert tr.skew == pytest.approx(sum(want) / len(want))
    assert read_trace("t.json", data, 16, 2, 1).steps == [4]  # the last step always
    assert read_trace("t.json", data, 16, 2, 50).steps == [0, 1, 2, 3, 4]
    for c in tr.counts(4, 100, 2):
        assert c.shape == (4, 16) and int(c.sum()) == 4 * 100 * 2
        assert int(c.sum(0).max()) <= 4 * 100  # one pair per token


def test_compare_with_trace(tmp_path, capsys):
    p = tmp_path / "routing_trace_static.json"
    p.write_text(json.dumps(_trace(6, 4, 16)))
    rc, cap, out = _compare(tmp_path, capsys, "--ep-list", "4", "--budgets", "64MiB",
                            "--loads", str(p), "--trace-steps", "2")
    assert rc == 0, cap.err
    assert str(p) in cap.out and "steps [2, 5] of 6" in cap.out and "observed skew" in cap.out
    rep = json.loads(out.read_text())
    assert rep["loads"]["steps_sampled"] == [2, 5] and rep["loads"]["samples"] == 8
    assert all(r["fits"] for r in rep["rows"])
    trace = read_trace(str(p), json.loads(p.read_text()), 16, 2, 2)
    _rows_project(rep["rows"], trace.counts(4, 256, 2))  # TINY: 256 tokens per rank


def _rows_project(rows: list[dict], samples: list[torch.Tensor]) -> None:
    """``--compare``'s rows (tiny-qwen3, EP 4, 64MiB, bf16) are the projection of
    ``samples``, every one of them."""
    from lrmoe.sim.analytic import project_policy

    cfg = get_preset("tiny-qwen3")
    ledger = Ledger.for_dtype(cfg, 4, parse_bytes("64MiB"), "bf16")
    for r in rows:
        want = project_policy(r["policy"], cfg, ledger, samples, LINKS["nvlink"], 440e12)
        assert _unmeasured(r) == _unmeasured({"budget": "64MiB", **want}), r["policy"]


def test_compare_plans_symi_for_each_samples_own_popularity(tmp_path, capsys):
    """Two sampled layers whose hot experts sit on different ranks: symi's row is that of
    each sample planned with its own popularity (its replicas where its load is), the
    peak the larger of theirs and the modelled stages their mean."""
    from lrmoe.sim.analytic import project_policy

    gen = torch.Generator().manual_seed(1)
    base = torch.randint(20, 40, (2, 16), generator=gen)
    base[0, 3] *= 12  # rank 0's native
    base[1, 12] *= 12  # rank 3's native
    p = tmp_path / "trace.json"
    p.write_text(json.dumps({"steps": [base.tolist()]}))
    s = 16 // 4 + 2  # two replicas a rank (tiny experts: the least modelled time has none)
    rc, cap, out = _compare(tmp_path, capsys, "--ep-list", "4", "--budgets", "64MiB",
                            "--loads", str(p), "--slots-per-rank", str(s))
    assert rc == 0, cap.err
    row = next(r for r in json.loads(out.read_text())["rows"] if r["policy"] == "symi")
    assert row["fits"] and row["slots_per_rank"] == s, row
    a, b = read_trace(str(p), {"steps": [base.tolist()]}, 16, 2, 1).counts(4, 256, 2)
    # the samples differ enough that whose popularity places b's replicas shows
    own, other = (int(plan_symi(b, s, pop).rank_load().max()) for pop in (b.sum(0), a.sum(0)))
    assert own < other, (own, other)
    cfg = get_preset("tiny-qwen3")
    ledger = Ledger.for_dtype(cfg, 4, parse_bytes("64MiB"), "bf16")
    each = [project_policy("symi", cfg, ledger, [c], LINKS["nvlink"], 440e12, slots_per_rank=s)
            for c in (a, b)]
    assert row["peak_bytes"] == max(e["peak_bytes"] for e in each)
    assert row["replicas"] == pytest.approx(sum(e["replicas"] for e in each) / 2)
    for k in STAGES:
        if k != "plan":  # measured
            want = sum(e["modelled_stages_ms"][k] for e in each) / 2
            assert row["modelled_stages_ms"][k] == pytest.approx(want, rel=1e-9, abs=1e-12), k


def test_compare_with_a_loads_file(tmp_path, capsys):
    p = tmp_path / "loads.json"
    counts = torch.arange(1, 17).repeat(4, 1) * 50  # [G, E]: expert 15 the hottest
    p.write_text(json.dumps(counts.tolist()))
    rc, cap, out = _compare(tmp_path, capsys, "--ep-list", "4", "--budgets", "64MiB",
                            "--loads", str(p))
    assert rc == 0, cap.err
    _rows_project(json.loads(out.read_text())["rows"], [counts])


def test_trace_errors_are_one_line_exit_2(tmp_path, capsys):
    p = tmp_path / "trace.json"
    p.write_text(json.dumps(_trace(3, 2, 8)))
    rc, cap, _ = _compare(tmp_path, capsys, "--ep-list", "4", "--loads", str(p))
    assert rc == 2 and "8 experts per layer; the model has 16" in cap.err
    assert len(cap.err.strip().splitlines()) == 1
    p.write_text('{"steps": [[[1, 2')
    rc, cap, _ = _compare(tmp_path, capsys, "--ep-list", "4", "--loads", str(p))
    assert rc == 2 and "not valid JSON" in cap.err and len(cap.err.strip().splitlines()) == 1
    p.write_text(json.dumps({"steps": [[[1, 2], [3]]]}))
    rc, cap, _ = _compare(tmp_path, capsys, "--ep-list", "4", "--loads", str(p))
    assert rc == 2 and "routing trace" in cap.err
    p.write_text(json.dumps(_trace(3, 2, 16)))
    assert main(["plan", *TINY, "--ep", "4", "--loads", str(p)]) == 2
    assert "use it with --compare" in capsys.readouterr().err


def _unmeasured(row: dict) -> dict:
    """A row without what the measured planning time changes from run to run."""
    out = {k: v for k, v in row.items()
           if k not in ("planning_ms", "modelled_layer_ms", "modelled_all_layers_ms",
                        "lrmoe_over_symi")}
    if out.get("modelled_stages_ms"):
        out["modelled_stages_ms"] = {k: v for k, v in out["modelled_stages_ms"].items()
                                     if k != "plan"}
    return out


def test_compare_lrmoe_recompute_keeps_more(tmp_path, capsys):
    """--lrmoe-recompute: lrmoe keeps at least as many pairs, reports its recompute
    ratio and charges the recomputed rows' gate_up in its expert backward; the exact
    policies are unaffected."""
    args = ("--ep-list", "4", "--budgets", "13MiB,64MiB")
    rc, cap, out = _compare(tmp_path, capsys, *args)
    assert rc == 0, cap.err
    base = {(r["budget"], r["policy"]): r for r in json.loads(out.read_text())["rows"]}
    rc, cap, out = _compare(tmp_path, capsys, *args, "--lrmoe-recompute")
    assert rc == 0, cap.err
    rec = {(r["budget"], r["policy"]): r for r in json.loads(out.read_text())["rows"]}
    for key, r in rec.items():
        if key[1] != "lrmoe":
            assert _unmeasured(r) == _unmeasured(base[key])
            continue
        assert r["fits"] and r["keep_ratio"] >= base[key]["keep_ratio"]
        assert r["recompute_ratio"] is not None and base[key]["recompute_ratio"] is None
        assert r["modelled_stages_ms"]["bwd_recompute"] == 0  # a layer checkpoint's only
    assert rec[("13MiB", "lrmoe")]["recompute_ratio"] > 0


def test_loads_must_be_counts():
    from lrmoe.errors import LrmoeError
    from lrmoe.routing_loads import load_counts

    with pytest.raises(LrmoeError, match="--loads x.json must hold non-negative integers"):
        load_counts("x.json", 2, 4, data=[1, -1, 2, 3])
    with pytest.raises(LrmoeError, match="--loads x.json must be a list of numbers"):
        load_counts("x.json", 2, 4, data=["a", 1])
    with pytest.raises(LrmoeError, match='routing trace "steps" must hold non-negative'):
        read_trace("t.json", {"steps": [[[1, 2.5, 0, 1]]]}, 4, 2, 1)


def test_compare_charges_the_optimizer_offload_only_when_asked(tmp_path, capsys):
    """``--optimizer-offload host``: the modelled host link and memory are printed and every
    row charges the three offload stages; without it no row charges them."""
    stages = ("opt_d2h", "opt_host_update", "opt_h2d")
    for off in ("host", "device"):
        rc, cap, out = _compare(tmp_path, capsys, "--ep-list", "2", "--budgets", "64MiB",
                                "--optimizer-offload", off)
        assert rc == 0, cap.err
        rep = json.loads(out.read_text())
        assert rep["optimizer_offload"] == off
        assert ("optimizer offload to host, modelled: host link" in cap.out) == (off == "host")
        for row in rep["rows"]:
            charged = [row["modelled_stages_ms"][s] for s in stages]
            assert all(v > 0 for v in charged) if off == "host" else not any(charged), row


def test_aligned_columns_pad_to_the_widest_cell():
    """The commands' tables: each column as wide as its widest cell, two spaces apart, the
    ``left`` columns left-justified, the others right; no trailing blanks."""
    from lrmoe.commands.columns import aligned, fmt

    got = aligned([["name", "n"]], [["a", "10"], ["bbb", "2"]], {0})
    assert got == "name   n\na     10\nbbb    2"
    assert aligned([["x", "name"]], [["10", "a"]], {1}) == " x  name\n10  a"
    assert (fmt(None), fmt(1 / 3), fmt(2.5, ".1f", "-")) == ("never", "0.3333", "2.5")
