"""Backward selection: topk keeps exactly the highest metrics per block; sampled is
unbiased (Horvitz-Thompson) with error falling like 1/sqrt(draws)."""

import copy

import pytest
import torch

from lrmoe.model import MoEForCausalLM
from lrmoe.model.moe import MoERuntime
from lrmoe.ops.selection import inclusion_probs
from lrmoe.parallel.options import BackwardOptions
from lrmoe.policy.base import Policy
from lrmoe.policy.plan import Plan
from lrmoe.policy.plan_numpy import full_plan
from lrmoe.presets import get_preset
from references.selection import select_sampled, select_topk


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


def segment_sum(x, seg, n):
    """Per-segment sums of rows in any order (the references' own helper)."""
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, seg, x)


def _inclusion_probs_loop(metric_N, block_N, quota_B):
    """Reference: the water-filling loop (cap rows whose share reaches 1, re-spread)."""
    B = quota_B.numel()
    m = metric_N.double().clamp(min=0)
    q = quota_B.double()
    n_B = segment_sum(torch.ones_like(m), block_N, B)
    capped = torch.zeros_like(m, dtype=torch.bool)
    pi = torch.zeros_like(m)
    for _ in range(m.numel() + 1):
        free = ~capped
        rem = (q - segment_sum(capped.double(), block_N, B)).clamp(min=0)
        mass = segment_sum(m * free, block_N, B)
        nfree = (n_B - segment_sum(capped.double(), block_N, B)).clamp(min=1)
        share = torch.where(mass[block_N] > 0, rem[block_N] * m / mass[block_N].clamp(min=1e-300),
                            rem[block_N] / nfree[block_N])
        pi = torch.where(capped, torch.ones_like(m), share)
        new = free & (share >= 1)
        if not bool(new.any()):
            break
        capped |= new
    return pi.clamp(max=1.0)


def _random_case(g, n, B):
    """Blocks of random sizes (some empty), heavy-tailed metrics (many rows cap) with
    ties, zeros and negatives, an all-zero block, block masses 1e12 apart, and quotas
    from 0 to past the size."""
    m = torch.exp(4 * torch.randn(n, generator=g, dtype=torch.float64))
    m[torch.rand(n, generator=g) < 0.1] = 0
    m[torch.rand(n, generator=g) < 0.05] = -1.0
    tie = torch.rand(n, generator=g) < 0.2
    m[tie] = m[tie][:1].expand(int(tie.sum())) if tie.any() else m[tie]
    blk = torch.sort(torch.randint(0, max(B - 1, 1), (n,), generator=g)).values
    blk[blk == 1] = 2  # block 1 empty; block B-1 empty too (randint stops at B-2)
    if B > 3:
        m[blk == 3] = 0  # a block with no metric mass
    m = m * 10.0 ** (12 * (blk % 3 - 1))  # blocks whose masses differ by 1e12 and 1e24
    size = torch.bincount(blk, minlength=B)
    quota = (torch.rand(B, generator=g, dtype=torch.float64) * 1.5 * size).round().long()
    quota[0] = 0
    perm = torch.randperm(n, generator=g)  # rows need not come grouped by block
    return m[perm], blk[perm], quota, size


def test_inclusion_probs_matches_water_filling_loop():
    for seed in range(6):
        g = torch.Generator().manual_seed(100 + seed)
        for n, B in ((0, 3), (1, 2), (40, 4), (500, 9), (3000, 18)):
            m, blk, quota, size = _random_case(g, n, B)
            pi = inclusion_probs(m, blk, quota)
            ref = _inclusion_probs_loop(m, blk, quota)
            torch.testing.assert_close(pi, ref, rtol=0, atol=1e-12)
            assert (pi >= 0).all() and (pi <= 1).all()
            torch.testing.assert_close(segment_sum(pi, blk, B),
                                       torch.minimum(quota, size).double(), rtol=0, atol=1e-9)


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


class HalfPolicy(Policy):
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


def test_inclusion_probs_under_deterministic_algorithms():
    """`bench ttl --deterministic` runs the water-filling with torch's deterministic
    algorithms on (no op of it may refuse), and it gives the same probabilities."""
    g = torch.Generator().manual_seed(7)
    m, blk, quota, _ = _random_case(g, 800, 12)
    ref = _inclusion_probs_loop(m, blk, quota)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        pi = inclusion_probs(m, blk, quota)
    finally:
        torch.use_deterministic_algorithms(was)
    torch.testing.assert_close(pi, ref, rtol=0, atol=1e-12)


def test_inclusion_probs_with_host_sizes_and_poisson_keep():
    """Sizes passed by the caller give the same probabilities as sizes counted on the
    device; rows with pi 0 are never kept and rows with pi 1 always (Poisson sampling)."""
    from references.select_runtime import poisson_keep
    g = torch.Generator().manual_seed(11)
    for n, B in ((1, 2), (500, 9), (3000, 18)):
        m, blk, quota, size = _random_case(g, n, B)
        ref = _inclusion_probs_loop(m, blk, quota)
        torch.testing.assert_close(inclusion_probs(m, blk, quota, size), ref, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="block sizes"):
        inclusion_probs(m, blk, quota, size + 1)
    pi = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.5] * 400, dtype=torch.float64)
    keep = poisson_keep(pi, torch.Generator().manual_seed(0))
    assert not keep[pi == 0].any() and keep[pi == 1].all()
    assert 0.4 < keep[pi == 0.5].double().mean() < 0.6
