"""The expert-parallel MoE layer (gloo, loopback) against one process on the same tokens.

Dispatch/combine, replica placement across ranks, and compaction are checked on
random inputs, with routings that stress the layout: experts with no tokens, a rank
that sends nothing off-rank, and every token on one expert.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

from dist_util import FixedRouter, hot_replica_plan, run_world, trimmed
from lrmoe.config import ModelConfig
from lrmoe.model.moe import MoELayer, MoERuntime
from lrmoe.parallel.comm import EPComm
from lrmoe.parallel.exchange import BackwardOptions
from lrmoe.parallel.groups import ParallelContext, shard_experts
from lrmoe.policy.base import Policy
from lrmoe.policy.static import StaticPolicy

pytestmark = pytest.mark.dist

T, H, E, K, F = 12, 16, 8, 2, 8


class ReplicaPolicy(Policy):
    """Natives plus two replicas of the hottest experts on the coldest ranks."""

    name = "replica-test"

    def plan(self, counts_GE, inputs):
        return hot_replica_plan(counts_GE, avoid_owner=False)


class PartialPolicy(ReplicaPolicy):
    """Replicas, 80% retained, 60% of those selected (top-k selection at runtime)."""

    def plan(self, counts_GE, inputs):
        return trimmed(super().plan(counts_GE, inputs))


class RecomputePolicy(ReplicaPolicy):
    """Replicas, exact, and each rank recomputes a different prefix of its rows' gate_up
    outputs in backward (a third, all, none, half, ...): the math must not change."""

    def plan(self, counts_GE, inputs):
        p = super().plan(counts_GE, inputs)
        load = p.rank_load()
        frac = torch.tensor([(1, 3), (1, 1), (0, 1), (1, 2)] * 2)[: p.G]
        return dataclasses.replace(p, recompute_G=load * frac[:, 0] // frac[:, 1])


class PartialRecomputePolicy(PartialPolicy):
    """PartialPolicy's plan with a prefix of each rank's retained rows recomputed."""

    def plan(self, counts_GE, inputs):
        p = super().plan(counts_GE, inputs)
        kept = p.retain_GGS.sum(dim=(0, 2))
        frac = torch.tensor([(1, 2), (1, 1), (0, 1), (1, 3)] * 2)[: p.G]
        return dataclasses.replace(p, recompute_G=kept * frac[:, 0] // frac[:, 1])


def routing(case: str, world: int, gen: torch.Generator) -> torch.Tensor:
    n = world * T
    if case == "random":
        return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n)])
    if case == "empty_experts":  # only experts 0 and 3 get tokens
        return torch.tensor([[0, 3]] * n)
    if case == "local_only":  # rank 0's tokens stay on rank 0's experts
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n)])
        idx[:T] = torch.tensor([0, 1]) if world > 1 else idx[:T]
        return idx
    if case == "one_expert":  # every token's first choice is expert 5
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n)])
        idx[:, 0] = 5
        idx[:, 1] = torch.where(idx[:, 1] == 5, torch.tensor(2), idx[:, 1])
        return idx
    raise ValueError(case)


def _run_layer(layer, x, coeff):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y = layer(x.unsqueeze(0)).squeeze(0)
    (y * coeff).sum().backward()
    return y.detach(), x.grad


def _worker(rank, world, case, policy_name, compaction, outdir=None):
    gen = torch.Generator().manual_seed(1234)
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=32, hidden_size=H, num_attention_heads=2,
                      num_key_value_heads=1, moe_intermediate_size=F, num_experts=E,
                      num_experts_per_tok=K, num_hidden_layers=1, intermediate_size=32)
    torch.manual_seed(0)
    layer = MoELayer(cfg, 0)
    idx = routing(case, world, gen)
    layer.router = FixedRouter(idx, E, H)
    x = torch.randn(world * T, H, generator=gen)
    coeff = torch.randn(world * T, H, generator=gen)
    policy = {"static": StaticPolicy(), "replica": ReplicaPolicy(),
              "partial": PartialPolicy(), "recompute": RecomputePolicy(),
              "partial_recompute": PartialRecomputePolicy()}[policy_name]

    ref = copy.deepcopy(layer)  # one process, all tokens, static plan
    y_ref, dx_ref = _run_layer(ref, x, coeff)

    sl = slice(rank * T, (rank + 1) * T)
    layer.router.idx = idx[sl]
    ctx = ParallelContext(world=world, rank=rank, ep_size=world, ep_group=dist.group.WORLD)
    shard_experts(layer, ctx)
    layer.runtime = MoERuntime(comm=EPComm(dist.group.WORLD), policy=policy,
                               backward=BackwardOptions(compaction=compaction))
    y, dx = _run_layer(layer, x[sl], coeff[sl])
    torch.testing.assert_close(y, y_ref[sl], rtol=1e-5, atol=1e-6)
    per = E // world
    own = slice(rank * per, (rank + 1) * per)
    g13, g2 = layer.experts.gate_up_proj.grad, layer.experts.down_proj.grad
    gr = layer.router.weight.grad.clone()
    dist.all_reduce(gr)
    if policy_name.startswith("partial"):
        # The router gradient stays exact; the rest is compared across the two runs.
        torch.testing.assert_close(gr, ref.router.weight.grad, rtol=1e-5, atol=1e-6)
        torch.save({"dx": dx, "g13": g13, "g2": g2, "stats": layer.runtime.stats[0]},
                   f"{outdir}/{policy_name}_{compaction}_{rank}.pt")
        return
    torch.testing.assert_close(dx, dx_ref[sl], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g13, ref.experts.gate_up_proj.grad[own], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g2, ref.experts.down_proj.grad[own], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gr, ref.router.weight.grad, rtol=1e-5, atol=1e-6)
    if policy_name == "recompute":  # the recomputed rows saved only their input row
        st = layer.runtime.stats[0]
        rec, n = st["recomputed_rows"], st["fwd_rows"]
        want = n * [1, 1, 0, 1][rank % 4] // [3, 1, 1, 2][rank % 4]  # RecomputePolicy's prefix
        assert rec == want, (rec, want)
        assert st["saved_act_bytes"] == (n * H + (n - rec) * 2 * F) * 4


CASES = ["random", "empty_experts", "local_only", "one_expert"]


def _all_cases(rank, world):
    for case in CASES:
        for policy in ("static", "replica", "recompute"):
            try:
                _worker(rank, world, case, policy, True)
            except AssertionError as e:
                raise AssertionError(f"case={case} policy={policy}: {e}") from None


@pytest.mark.parametrize("world", [2, 4])
def test_ep_layer_matches_single_process(world, tmp_path):
    """Every routing case x {static, replicas across ranks}, in one process group."""
    run_world(world, _all_cases, tmp_path=tmp_path)


@pytest.mark.parametrize("world", [2, 4])
def test_compaction_on_off_same_gradients(world, tmp_path):
    for comp in (True, False):
        run_world(world, _worker, "random", "partial", comp, str(tmp_path), tmp_path=tmp_path)
    for r in range(world):
        on = torch.load(tmp_path / f"partial_True_{r}.pt")
        off = torch.load(tmp_path / f"partial_False_{r}.pt")
        for k in ("dx", "g13", "g2"):
            torch.testing.assert_close(on[k], off[k], rtol=1e-5, atol=1e-6)
        # compaction ships and multiplies only the selected rows
        assert on["stats"]["bwd_rows"] == on["stats"]["selected_rows"]
        assert off["stats"]["bwd_rows"] > on["stats"]["bwd_rows"]


@pytest.mark.parametrize("world", [2, 4])
def test_recompute_on_a_trimmed_backward_same_gradients(world, tmp_path):
    """Recomputing a prefix of the retained rows' gate_up outputs changes memory, not math."""
    for name in ("partial", "partial_recompute"):
        run_world(world, _worker, "random", name, True, str(tmp_path), tmp_path=tmp_path)
    for r in range(world):
        a = torch.load(tmp_path / f"partial_True_{r}.pt")
        b = torch.load(tmp_path / f"partial_recompute_True_{r}.pt")
        for k in ("dx", "g13", "g2"):
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
        rec = b["stats"]["recomputed_rows"]
        assert a["stats"]["saved_act_bytes"] - b["stats"]["saved_act_bytes"] == rec * 2 * F * 4
    assert any(torch.load(tmp_path / f"partial_recompute_True_{r}.pt")["stats"]["recomputed_rows"]
               for r in range(world))
