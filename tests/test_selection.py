"""Backward selection: topk keeps exactly the highest metrics per block; sampled is
unbiased (Horvitz-Thompson) with error falling like 1/sqrt(draws)."""

import copy

import torch

from lrmoe.model import MoEForCausalLM
from lrmoe.model.moe import MoERuntime
from lrmoe.parallel.exchange import (
    BackwardOptions,
    inclusion_probs,
    select_sampled,
    select_topk,
)
from lrmoe.policy.plan import Plan, full_plan
from lrmoe.presets import get_preset


def test_topk_keeps_highest_per_block():
    g = torch.Generator().manual_seed(0)
    n, B = 200, 7
    m = torch.rand(n, generator=g)
    blk = torch.sort(torch.randint(0, B, (n,), generator=g)).values
    quota = torch.randint(0, 20, (B,), generator=g)
    keep = select_topk(m, blk, quota)
    for b in range(B):
        mb, kb = m[blk == b], keep[blk == b]
        k = min(int(quota[b]), mb.numel())
        assert int(kb.sum()) == k
        if 0 < k < mb.numel():
            assert mb[kb].min() >= mb[~kb].max()


def test_inclusion_probs_sum_to_quota_and_cap():
    g = torch.Generator().manual_seed(1)
    n, B = 300, 5
    m = torch.rand(n, generator=g) ** 4  # heavy tail: some rows must cap at 1
    m[:3] = 0
    blk = torch.sort(torch.randint(0, B, (n,), generator=g)).values
    quota = torch.tensor([1, 5, 17, 30, 60])
    pi = inclusion_probs(m, blk, quota)
    assert (pi <= 1 + 1e-12).all() and (pi >= 0).all()
    for b in range(B):
        sz = int((blk == b).sum())
        torch.testing.assert_close(pi[blk == b].sum().item(), float(min(quota[b], sz)),
                                   rtol=1e-9, atol=1e-9)
    assert (pi == 1).any()


def test_sampled_estimator_unbiased_on_vectors():
    g = torch.Generator().manual_seed(2)
    n, B = 120, 3
    v = torch.randn(n, 4, generator=g, dtype=torch.float64)
    m = v.norm(dim=1)
    blk = torch.sort(torch.randint(0, B, (n,), generator=g)).values
    quota = torch.tensor([8, 10, 12])
    exact = v.sum(0)
    est = torch.zeros(4, dtype=torch.float64)
    draws = 5000
    for _ in range(draws):
        keep, w = select_sampled(m, blk, quota, g)
        est += (v * w[:, None]).sum(0)
    est /= draws
    assert float((est - exact).norm() / exact.norm()) < 0.04


class HalfPolicy:
    """Everything retained, half of each block (rounded up) selected."""

    name = "half"

    def plan(self, counts, inputs):
        p = full_plan(counts, torch.arange(counts.shape[1]).reshape(1, -1))
        # ceil: every non-empty block keeps a positive quota, so every row has pi > 0
        return Plan(p.inst_expert_GS, p.assign_GGS, p.retain_GGS, (p.retain_GGS + 1) // 2)


def test_sampled_expert_gradient_converges_to_exact():
    torch.manual_seed(0)
    layer = copy.deepcopy(MoEForCausalLM(get_preset("tiny-qwen3")).moe_layers[0])
    x = torch.randn(1, 24, layer.cfg.hidden_size)
    coeff = torch.randn(1, 24, layer.cfg.hidden_size)

    def grad():
        layer.zero_grad()
        (layer(x) * coeff).sum().backward()
        return torch.cat([layer.experts.gate_up_proj.grad.flatten(),
                          layer.experts.down_proj.grad.flatten()])

    exact = grad()
    gen = torch.Generator().manual_seed(5)
    layer.runtime = MoERuntime(policy=HalfPolicy(), generator=gen,
                               backward=BackwardOptions(estimator="sampled"))
    total, errs = torch.zeros_like(exact), {}
    for d in range(1, 161):
        total += grad()
        if d in (10, 160):
            errs[d] = float((total / d - exact).norm() / exact.norm())
    # 16x more draws: error should fall ~4x (1/sqrt); allow slack for randomness
    assert errs[160] < errs[10] / 2.5, errs
    assert errs[160] < 0.15, errs
