"""A plan's traffic (:mod:`lrmoe.traffic`): the replica rows are the runtime's own
weight routes, and the byte prices are the layer's counters on a real one-process
exchange, each checked against arithmetic written out here."""

from __future__ import annotations

import numpy as np
import torch

from lrmoe.model.moe import MoELayer, MoERuntime
from lrmoe.parallel.instances import instance_route
from lrmoe.policy import SymiPolicy
from lrmoe.policy.base import PlanInputs
from lrmoe.presets import get_preset
from lrmoe.traffic import RowBytes, plan_rows_GG, replica_rows_GG, weight_scatter_bytes


def _symi_plans(G: int = 4, E: int = 16):
    g = torch.Generator().manual_seed(0)
    for s in (E // G + 1, E // G + 3):
        for _ in range(3):
            counts = torch.randint(0, 200, (G, E), generator=g) * (torch.arange(E) % 5 + 1)
            yield SymiPolicy(slots_per_rank=s).plan(counts, PlanInputs(prev_counts_E=counts.sum(0)))


def test_replica_rows_are_the_runtimes_weight_routes():
    for plan in _symi_plans():
        E = 16
        routes = np.array([instance_route(plan, g, E).send_splits for g in range(plan.G)])
        rows = replica_rows_GG(plan.inst_expert_GS.numpy(), E)
        assert np.array_equal(rows, routes)
        assert rows.sum() > E  # replicas placed: more instances than experts
        got = plan_rows_GG(plan, E)
        assert torch.equal(got["grad_reduce"], got["weight_scatter"].t())
        assert torch.equal(got["fwd_dispatch"], plan.assign_GGS.sum(2))
        for me in range(plan.G):
            ie = plan.inst_expert_GS[me]
            remote = int(((ie >= 0) & (ie // (E // plan.G) != me)).sum())
            assert weight_scatter_bytes(plan, E, me, 7) == remote * 7


def test_row_prices():
    b = RowBytes(100, 5000, dot=True)
    assert (b.of("fwd_dispatch"), b.of("fwd_combine"), b.of("bwd_dispatch"),
            b.of("bwd_combine"), b.of("weight_scatter"), b.of("grad_reduce")) == \
        (100, 100, 100 + 8 + 4, 100 + 4, 5000, 5000)
    assert RowBytes(100).bwd_combine == 100


def test_exchange_counters_are_the_prices():
    """One process through the exchange (no fast path): the counters are rows times
    ``H·4`` (fp32), ``+ 12`` backward, as written here."""
    cfg = get_preset("tiny-qwen3")
    torch.manual_seed(0)
    layer = MoELayer(cfg, 0)
    layer.runtime = MoERuntime(fast_local=False)
    x = torch.randn(1, 10, cfg.hidden_size, requires_grad=True)
    layer(x).square().sum().backward()
    st, P, H = layer.runtime.stats[0], 10 * cfg.num_experts_per_tok, cfg.hidden_size
    assert layer.last.path == "exchange"
    assert st["fwd_dispatch_bytes_sent"] == st["fwd_combine_bytes_recv"] == P * H * 4
    assert st["bwd_dispatch_bytes_sent"] == P * (H * 4 + 12)
    assert st["bwd_combine_bytes_sent"] == P * H * 4
    assert st["bwd_exact_bytes"] == P * (2 * H * 4 + 12)
