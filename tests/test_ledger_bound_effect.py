"""``benchmarks/ledger_bound_effect.py``: static's and SYMI's plans priced under the
planners' transient bound and under the transients derived from the code, replayed from
a routing trace (ledger arithmetic only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ledger_bound_effect as lbe  # noqa: E402

from lrmoe.memory import Ledger  # noqa: E402
from lrmoe.policy.base import PlanInputs  # noqa: E402
from lrmoe.policy.static import StaticPolicy  # noqa: E402
from lrmoe.presets import get_preset  # noqa: E402


def _trace(tmp_path, cfg, G=4, T=64, steps=5, seed=0) -> str:
    g = torch.Generator().manual_seed(seed)
    E, k, L = cfg.num_experts, cfg.num_experts_per_tok, len(cfg.moe_layers)
    rows = []
    for _ in range(steps):
        layers = []
        for _ in range(L):
            w = torch.rand(E, generator=g) ** 3 + 0.01
            c = torch.distributions.Multinomial(G * T * k, w / w.sum()).sample().long()
            layers.append(c.tolist())
        rows.append(layers)
    p = tmp_path / "routing_trace_static.json"
    p.write_text(json.dumps({"label": "test", "model": {}, "ep": G, "tokens_per_rank": T,
                             "format": "steps[step][moe_layer][expert]", "steps": rows}))
    return str(p)


def test_the_two_accounts_decide_fits_separately(tmp_path):
    cfg = get_preset("tiny-qwen3")
    path = _trace(tmp_path, cfg)
    big = lbe.analyse(cfg, path, 2**40, False, max_s=cfg.num_experts // 4 + 2)
    n = big["samples"]
    assert n == 5 * len(cfg.moe_layers)
    assert big["static"]["fits_planners"] == big["static"]["fits_code"] == n
    st = big["static"]
    # the code-derived account of an exact plan is below the planners' bound here
    assert st["max_code"] < st["max_planners"]
    # at the code-derived peak as the budget every sample fits that way, and the
    # planners' bound refuses the samples whose planners' peak is above it (some here)
    counts = lbe.read_trace(path, json.loads(Path(path).read_text()), cfg.num_experts,
                            cfg.num_experts_per_tok, 5).counts(4, 64, cfg.num_experts_per_tok)
    led = Ledger.for_dtype(cfg, 4, None, "bf16", optimizer_offload="host", transients="bound")
    per = [lbe.peaks(led, StaticPolicy().plan(c, PlanInputs()), 64) for c in counts]
    budget = st["max_code"]
    r = lbe.analyse(cfg, path, budget, False, max_s=cfg.num_experts // 4 + 2)
    assert r["static"]["fits_code"] == n
    assert r["static"]["fits_planners"] == sum(p <= budget for p, _ in per) < n
    # SYMI's largest s follows the same account, and with s = E/G its plan is static's
    s0 = cfg.num_experts // 4
    assert r["symi"][s0]["max_code"] == r["static"]["max_code"]
    assert r["symi_largest_s"]["code"] >= s0
    assert (r["symi_largest_s"]["planners"] or 0) <= r["symi_largest_s"]["code"]
    assert "MODELLED" in lbe.markdown("t", r)
