"""The device layouts against their block-by-block references on random plans of every
policy: every pair's send row, the pairs of each block and their order inside it, the
retained rows, each row's block, and the receive permutation."""

from __future__ import annotations

import pytest
import torch

from budgets import natives_floor
from lrmoe.config import ModelConfig
from lrmoe.ledger import Ledger
from lrmoe.ops.rowops import runs
from lrmoe.parallel.stages import home_layout, recv_layout
from lrmoe.policy import PlanInputs
from lrmoe.policy.capacity import plan_capacity
from lrmoe.policy.lrmoe import LrmoeConfig, plan_lrmoe
from lrmoe.policy.plan_numpy import full_plan
from lrmoe.policy.static import StaticPolicy
from lrmoe.policy.symi import SymiPolicy
from references.layout import home_layout_reference
from references.layout import ranges as ranges_reference
from references.plans import native_placement


def _cfg(E: int) -> ModelConfig:
    return ModelConfig(hidden_size=32, moe_intermediate_size=24, num_experts=E, num_experts_per_tok=2,
                       num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)


def _routing(G: int, E: int, P: int, seed: int, gate_dtype: torch.dtype):
    """Skewed routing of P pairs per rank, with tied gates (quantised) and a -0.0."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.rand(E, generator=g) ** 3 + 0.02
    idx = torch.multinomial(hot, G * P, replacement=True, generator=g).reshape(G, P)
    gate = (torch.rand(G, P, generator=g) * 8).round() / 8  # many ties
    gate[0, 0] = -0.0
    counts = torch.stack([torch.bincount(idx[r], minlength=E) for r in range(G)])
    return idx, gate.to(gate_dtype), counts


def _plans(G: int, E: int, counts: torch.Tensor, seed: int):
    yield "static", StaticPolicy().plan(counts, PlanInputs())
    yield "symi", SymiPolicy(slots_per_rank=E // G + 2).plan(
        counts, PlanInputs(0, 1, counts.sum(0).roll(seed % E), None))
    yield "capacity", plan_capacity(counts, 0.8)
    mcfg = _cfg(E)
    base = Ledger(mcfg, G)
    floor = natives_floor(base, counts)
    full = max(t["total"] for t in base.rank_terms(full_plan(counts, native_placement(G, E))))
    for slack in (0.1, 0.5):
        ledger = Ledger(mcfg, G, int(floor + slack * (full - floor)))
        cfg = LrmoeConfig(balance=1.0, min_keep=0.3, max_slots_per_rank=E // G + 2)
        yield f"lrmoe{slack}", plan_lrmoe(counts, cfg, ledger, ladder=False).plan


@pytest.mark.parametrize("G,E,P", [(1, 8, 40), (2, 8, 64), (4, 16, 96), (8, 32, 200)])
@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("seed", [0, 1])
def test_home_layout_equals_reference(G, E, P, gate_dtype, seed):
    idx, gate, counts = _routing(G, E, P, seed, gate_dtype)
    trimmed = 0
    for name, plan in _plans(G, E, counts, seed):
        plan.check(counts)
        trimmed += not torch.equal(plan.retain_GGS, plan.assign_GGS)
        for me in range(G):
            got = home_layout(plan, me, idx[me], gate[me], E)
            ref = home_layout_reference(plan, me, idx[me], gate[me], E)
            for f in ("send_row_P", "src_pair", "j_in_block"):
                assert torch.equal(getattr(got, f), ref[f]), (name, me, f)
            assert got.dropped == ref["dropped"] and got.splits == ref["splits"], name
            rp = got.retained(torch.device("cpu"))
            assert (rp is None) == (ref["retained_pos"] is None), name
            if rp is not None:
                n_send = got.src_pair.numel()
                assert torch.equal(rp.apply(torch.arange(n_send)), ref["retained_pos"]), name
    if G > 1:
        assert trimmed, "no plan trimmed retention: the gate order was not exercised"


def test_dropped_pairs_are_each_experts_lowest_gates():
    """Capacity drops a home's lowest-gate pairs of an over-full expert (its docstring)."""
    G, E, P = 2, 4, 64
    idx, gate, counts = _routing(G, E, P, 3, torch.float32)
    gate = torch.rand(G, P, generator=torch.Generator().manual_seed(1))
    plan = plan_capacity(counts, 0.6)
    assert int(plan.dropped_GE.sum()) > 0
    for me in range(G):
        h = home_layout(plan, me, idx[me], gate[me], E)
        for e in range(E):
            mine = idx[me] == e
            dropped = mine & (h.send_row_P >= h.src_pair.numel())
            kept = mine & (h.send_row_P < h.src_pair.numel())
            assert int(dropped.sum()) == int(plan.dropped_GE[me, e])
            if dropped.any() and kept.any():
                assert gate[me][dropped].max() <= gate[me][kept].min()


@pytest.mark.parametrize("seed", range(4))
def test_runs_and_recv_layout_equal_reference(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 12, (1,), generator=g))
    lengths = torch.randint(0, 5, (n,), generator=g) * (torch.rand(n, generator=g) > 0.3)
    starts = torch.randint(0, 50, (n,), generator=g)
    got = runs(starts, lengths, "cpu").apply(torch.arange(60) * 10)
    assert torch.equal(got, ranges_reference(starts, lengths) * 10)
    block_GS = torch.randint(0, 4, (3, 5), generator=g)
    rl = recv_layout(block_GS)
    start_GS = (block_GS.reshape(-1).cumsum(0) - block_GS.reshape(-1)).reshape(3, 5)
    ref = ranges_reference(start_GS.t().reshape(-1), block_GS.t().reshape(-1))
    n = int(block_GS.sum())
    assert torch.equal(rl.to_inst.apply(torch.arange(n)), ref)
    # the inverse: back to arrival order
    assert torch.equal(rl.to_arrival.apply(rl.to_inst.apply(torch.arange(n))), torch.arange(n))
    assert rl.splits == block_GS.sum(1).tolist() and rl.counts == block_GS.sum(0).tolist()
