"""What the planners price (``Ledger.counts_buffer_bytes``) against the code-derived
account of the plans they make, and the ledger's solvers against brute force.

* exact plans (static, SYMI): the planners' buffers term *is* the code-derived one
  (``Ledger.rows_buffer_bytes`` with the plan's rows, checked against the live row
  tensors in ``tests/test_ledger_truth.py`` and the H200's peak);
* trimmed plans (LRMoE): the planners' term bounds it from above, for every rank;
* ``retain_capacity``, ``recompute_needed`` and ``retain_capacity_recompute`` give what
  a search over every count gives.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lrmoe.config import ModelConfig
from lrmoe.errors import LrmoeError
from lrmoe.ledger import Ledger
from lrmoe.policy.lrmoe import LrmoeConfig, plan_lrmoe
from lrmoe.policy.symi import plan_symi
from lrmoe.presets import get_preset
from lrmoe.routing_loads import synthetic_counts


def _cfg(H: int = 32, F: int = 24, E: int = 8, K: int = 2) -> ModelConfig:
    return ModelConfig(hidden_size=H, moe_intermediate_size=F, num_experts=E,
                       num_experts_per_tok=K, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=3)


@pytest.mark.parametrize("rg", [False, True])
def test_exact_plans_are_priced_by_the_code_derived_account(rg):
    cfg = get_preset("tiny-qwen3")
    G, E = 4, cfg.num_experts
    led = Ledger.for_dtype(cfg, G, None, "bf16", router_grad_at_experts=rg)
    for seed, skew in ((0, 0.0), (1, 1.0), (2, 1.6)):
        counts = synthetic_counts(G, E, 256, cfg.num_experts_per_tok, skew, seed=seed)
        for s in (E // G, E // G + 2):
            plan = plan_symi(counts, s, counts.sum(0))
            assert plan.exact
            planned = led.rank_terms(plan)
            derived = led.rank_terms(plan, plan_buffers=True)
            assert [t["buffers"] for t in planned] == [t["buffers"] for t in derived]


@pytest.mark.parametrize("recompute", [False, True])
def test_trimmed_plans_are_bounded_by_what_the_planners_price(recompute):
    """For every rank of LRMoE plans at tight budgets: planned >= the plan's own account
    (its selected rows, gathered or not), and the plan fits the budget under both."""
    cfg = get_preset("tiny-qwen3")
    G, E = 4, cfg.num_experts
    free = Ledger.for_dtype(cfg, G, None, "bf16")
    seen_tight = False
    for seed, skew in ((0, 0.5), (1, 1.2), (3, 1.8)):
        counts = synthetic_counts(G, E, 256, cfg.num_experts_per_tok, skew, seed=seed)
        plan = plan_lrmoe(counts, LrmoeConfig(), free, ladder=False).plan
        need = max(t["total"] for t in free.rank_terms(plan))
        for frac in (1.0, 0.9, 0.8):
            led = dataclasses.replace(free, budget_bytes=int(need * frac))
            try:
                plan = plan_lrmoe(counts, LrmoeConfig(recompute=recompute), led, ladder=False).plan
            except LrmoeError:  # an infeasible budget: the planner says so
                continue
            planned = led.rank_terms(plan)
            derived = led.rank_terms(plan, plan_buffers=True)
            for p, d in zip(planned, derived):
                assert p["buffers"] >= d["buffers"]
                assert d["total"] <= p["total"] <= led.budget_bytes
            seen_tight |= not plan.exact and bool((plan.retain_GGS < plan.assign_GGS).any())
    assert seen_tight  # some plan trimmed its retention


@pytest.mark.parametrize("exact", [False, True])
def test_capacities_equal_a_search_over_every_count(exact):
    led0 = Ledger(_cfg(), 2)
    n, h = 5, 90
    g = torch.Generator().manual_seed(1)
    for R in (0, 7, 60, 140):
        tot = [led0.terms(n, R, h, k, 0, exact)["total"] for k in range(R + 1)]
        grid = {(k, m): led0.terms(n, R, h, k, m, exact)["total"]
                for k in range(R + 1) for m in range(k + 1)}
        lo, hi = min(grid.values()) - 100, tot[-1] + 100
        for budget in torch.randint(lo, hi, (25,), generator=g).tolist() + [tot[-1], tot[0]]:
            led = dataclasses.replace(led0, budget_bytes=budget)
            want = max((k for k in range(R + 1) if tot[k] <= budget), default=-1)
            got = led.retain_capacity(n, R, h, exact)
            assert min(got, R) == want, (R, budget, got, want)
            fits = [(k, m) for (k, m), t in grid.items() if t <= budget]
            k_best = max((k for k, _ in fits), default=-1)
            m_best = min((m for k, m in fits if k == k_best), default=0)
            assert led.retain_capacity_recompute(n, R, h, exact) == (
                (k_best, m_best) if k_best >= 0 else (-1, 0)), (R, budget)
