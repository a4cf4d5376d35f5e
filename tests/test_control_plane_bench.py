"""benchmarks/control_plane.py: the routing it synthesises, the rank it picks, how it
summarises the runtime's stage records and prints them; one tiny CPU run end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import control_plane as cp  # noqa: E402

from lrmoe.policy.base import PlanInputs  # noqa: E402
from lrmoe.presets import get_preset  # noqa: E402


def test_routing_counts_are_each_ranks_tokens():
    G, T, E, K = 4, 50, 16, 3
    idx, counts = cp.routing(G, T, E, K, 0.8, seed=3)
    assert idx.shape == (G * T, K) and counts.shape == (G, E)
    # distinct experts per token
    assert (idx.sort(1).values.diff(dim=1) > 0).all()
    for g in range(G):
        assert torch.equal(counts[g], torch.bincount(idx[g * T:(g + 1) * T].flatten(), minlength=E))
    again, _ = cp.routing(G, T, E, K, 0.8, seed=3)
    assert torch.equal(idx, again)


def test_skew_orders_the_load():
    flat = cp.load_skew(cp.routing(4, 400, 32, 4, 0.0, 0)[1])["expert_max_over_mean"]
    steep = cp.load_skew(cp.routing(4, 400, 32, 4, 1.2, 0)[1])["expert_max_over_mean"]
    assert flat < 1.3 < 3.0 < steep


def test_busiest_rank_by_forward_then_backward_load():
    def plan(fwd, bwd):
        return SimpleNamespace(rank_load=lambda: torch.tensor(fwd),
                               rank_backward_load=lambda: torch.tensor(bwd))
    assert cp.busiest_rank(plan([5, 9, 7], [9, 1, 9])) == 1
    assert cp.busiest_rank(plan([9, 9, 7], [1, 4, 9])) == 1
    assert cp.busiest_rank(plan([9, 9, 7], [4, 4, 9])) == 0


def _sample(**kw):
    base = {k: None for k in cp.STAGES}
    base.update(wall_ms=20.0, fwd_ms=8.0, bwd_ms=12.0)
    base.update(kw)
    return base


def test_stage_row_medians_and_missing_stages():
    rows = [_sample(plan_ms=p, count_exchange_ms=1.0, expert_fwd_ms=2.0, expert_bwd_ms=4.0,
                    local_ms=None) for p in (1.0, 3.0, 2.0)]
    s = cp.stage_row(rows)
    assert s["plan_ms"] == 2.0
    assert s["local_ms"] is None and "local_ms" in s["missing_stages"]
    assert s["control_stages"] == ["plan_ms", "count_exchange_ms"]
    assert s["control_ms"] == 3.0 and s["expert_ms"] == 6.0
    assert s["control_over_expert"] == pytest.approx(0.5)
    assert s["unaccounted_ms"] == pytest.approx(20.0 - 9.0)
    # a stage recorded in some repeats only is not a median of those: it is missing
    rows[0]["select_ms"] = 5.0
    assert cp.stage_row(rows)["select_ms"] is None


def test_markdown_says_what_is_missing_and_shows_errors():
    meta = {"device": "cpu", "dtype": "fp32", "command": "x", "date": "d", "torch": "t",
            "skew": 0.65, "repeats": 1, "warmup": 0}
    stages = cp.stage_row([_sample(plan_ms=1.5, count_exchange_ms=0.5, expert_fwd_ms=1.0,
                                   expert_bwd_ms=3.0)])
    ok = {"preset": "p", "ep": 4, "tokens_per_rank": 8, "expert_max_over_mean": 2.0,
          "policy": "static", "budget": "ample", "rank": 1, "fwd_rows": 10, "bwd_rows": 10,
          "keep_ratio": 1.0, "retain_ratio": 1.0, "recompute_rows": 0,
          "stages": stages, "syncs": {"forward": 1, "backward": 2}}
    bad = {**ok, "policy": "lrmoe", "budget": "binding", "error": "no plan: x"}
    md = cp.markdown(meta, [ok, bad])
    assert "local_ms, select_ms, gather_ms" in md
    line = next(ln for ln in md.splitlines() if "| static |" in ln)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[9] == "1.000 / 1.000 / 0"
    assert cells[10:16] == ["0.500", "1.500", "n/a", "n/a", "n/a", "**2.000**"]
    assert cells[18] == "**0.50**" and cells[-1] == "1/2"
    assert "no plan: x" in md
    n_cols = len(md.splitlines()[-3].split("|"))
    assert all(len(ln.split("|")) == n_cols for ln in md.splitlines() if ln.startswith("| p |"))


def test_the_run_rank_reports_the_synthesised_counts():
    cfg = get_preset("tiny-qwen3")
    G, T = 4, 24
    idx, counts = cp.routing(G, T, cfg.num_experts, cfg.num_experts_per_tok, 0.65, 0)
    policy, opts = cp.make_policy("lrmoe:recompute+estimator=sampled", cfg, G, False)
    plan = policy.plan(counts, PlanInputs(0, 0, counts.sum(0), None))
    me = cp.busiest_rank(plan)
    layer = cp.build_rank(cfg, me, counts, idx[me * T:(me + 1) * T], policy, None, opts,
                          torch.device("cpu"), plan)
    x = torch.randn(1, T, cfg.hidden_size, requires_grad=True)
    layer(x).sum().backward()
    assert torch.equal(layer.runtime.comm.last_counts_GE, counts)
    assert layer.experts.first == me * cfg.num_experts // G


def test_cpu_run_end_to_end(tmp_path):
    rc = cp.main(["--out", str(tmp_path), "--preset", "tiny-qwen3", "--eps", "4", "--tokens",
                  "64", "--device", "cpu", "--repeats", "1", "--warmup", "0", "--budgets",
                  "ample", "--policies", "static,lrmoe:recompute+estimator=sampled"])
    assert rc == 0
    rep = json.loads((tmp_path / "control_plane.json").read_text())
    rows = rep["results"]
    assert [r["policy"] for r in rows] == ["static", "lrmoe:recompute+estimator=sampled"]
    # the sampled backward trims here: its count exchange runs (with the peers' planned rows)
    assert rows[1]["bwd_rows"] < rows[1]["fwd_rows"]
    for r in rows:
        s = r["stages"]
        assert s["plan_ms"] is not None and s["expert_fwd_ms"] is not None
        # every stage the runtime recorded is read, none is invented
        assert set(cp.STAGES) - set(s["missing_stages"]) == set(cp.STAGES) & set(r["runtime_stat_keys"])
        assert s["unaccounted_ms"] >= 0  # the recorded stages lie inside the layer's wall
    assert (tmp_path / "control_plane.md").read_text().count("| tiny-qwen3 |") == 2


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert cp.main(["--out", str(tmp_path), "--preset", "tiny-qwen3", "--eps", "3",
                    "--device", "cpu"]) == 2
    assert "lrmoe: error: --eps [3]" in capsys.readouterr().err
    assert cp.main(["--out", str(tmp_path), "--policies", "lrmoe:bogus", "--device",
                    "cpu"]) == 2
    assert not (tmp_path / "control_plane.json").exists()


def test_binding_budget_binds_lrmoe_and_lets_it_plan():
    from lrmoe.ledger import Ledger
    from lrmoe.policy.lrmoe import LrmoePolicy

    cfg = get_preset("tiny-qwen3")
    G = 4
    _, counts = cp.routing(G, 64, cfg.num_experts, cfg.num_experts_per_tok, 0.65, 0)
    b, f = cp.binding_budget(cfg, G, counts, "fp32")
    assert f in cp.BINDING_FRACTIONS
    free = Ledger.for_dtype(cfg, G, None, "fp32", num_moe_layers=1)
    inputs = PlanInputs(0, 0, counts.sum(0), free)
    unbounded = max(t["total"] for t in free.rank_terms(LrmoePolicy().plan(counts, inputs)))
    assert b < unbounded  # it binds
    policy, _ = cp.make_policy(cp.POLICIES[2], cfg, G, True)
    led = Ledger.for_dtype(cfg, G, b, "fp32", num_moe_layers=1)
    plan = policy.plan(counts, PlanInputs(0, 0, counts.sum(0), led))
    assert max(t["total"] for t in led.rank_terms(plan)) <= b
    # the smallest fraction that plans: the one below it does not
    if f != cp.BINDING_FRACTIONS[0]:
        lower = cp.BINDING_FRACTIONS[cp.BINDING_FRACTIONS.index(f) - 1]
        assert cp.binding_budget(cfg, G, counts, "fp32", (lower,)) == (None, None)


def test_own_rows_arrive_as_sent_in_the_sampled_count_exchange():
    """The peers report the plan's selection; this rank's rows to itself arrive as it sent
    them, so their in-block positions stay inside their own blocks."""
    G, S, me = 4, 3, 2
    g = torch.Generator().manual_seed(0)
    select = torch.randint(0, 9, (G, G, S), generator=g)
    comm = cp.PlannedPeersComm(me, torch.zeros(G, 8, dtype=torch.long),
                               SimpleNamespace(select_GGS=select))
    sent = torch.randint(0, 9, (G, S), generator=g)
    sent[me] = select[me, me] + torch.tensor([2, 0, -1]).clamp(min=-int(select[me, me, 2]))
    recv = comm.exchange_counts(sent)
    assert torch.equal(recv[me], sent[me])
    others = [r for r in range(G) if r != me]
    assert torch.equal(recv[others], select[others, me])
