"""Router math of both families against a per-token reference written from the formulas."""

import math

import torch

from lrmoe.config import ModelConfig
from lrmoe.model.router import SigmoidGroupRouter, SoftmaxRouter, aux_loss


def qwen_cfg(**kw):
    base = dict(model_type="qwen3_moe", hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                num_experts=8, num_experts_per_tok=3, moe_intermediate_size=8, num_hidden_layers=1)
    base.update(kw)
    return ModelConfig(**base)


def glm_cfg(**kw):
    base = dict(model_type="glm4_moe", hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                num_experts=12, num_experts_per_tok=3, moe_intermediate_size=8, num_hidden_layers=2,
                n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
                n_shared_experts=1, use_qk_norm=False, partial_rotary_factor=0.5)
    base.update(kw)
    return ModelConfig(**base)


def test_softmax_router_matches_reference():
    for norm in (True, False):
        torch.manual_seed(0)
        r = SoftmaxRouter(qwen_cfg(norm_topk_prob=norm))
        x = torch.randn(20, 16)
        out = r(x)
        r.weight.requires_grad_(False)
        for t in range(20):
            logits = [float(sum(x[t, h] * r.weight[e, h] for h in range(16))) for e in range(8)]
            z = sum(math.exp(v) for v in logits)
            p = [math.exp(v) / z for v in logits]
            top = sorted(range(8), key=lambda e: -p[e])[:3]
            g = [p[e] for e in top]
            if norm:
                g = [v / sum(g) for v in g]
            assert out.idx_TK[t].tolist() == top
            torch.testing.assert_close(out.gate_TK[t], torch.tensor(g), rtol=1e-5, atol=1e-6)


def test_sigmoid_group_router_matches_reference():
    torch.manual_seed(1)
    r = SigmoidGroupRouter(glm_cfg())
    with torch.no_grad():
        r.weight.mul_(20)
        r.e_score_correction_bias.copy_(torch.randn(12) * 0.3)
    x = torch.randn(30, 16)
    out = r(x)
    r.weight.requires_grad_(False)
    b = r.e_score_correction_bias.tolist()
    for t in range(30):
        s = [1 / (1 + math.exp(-float(x[t] @ r.weight[e]))) for e in range(12)]
        c = [s[e] + b[e] for e in range(12)]  # bias only for choosing
        groups = [sorted(c[k * 3:(k + 1) * 3], reverse=True)[:2] for k in range(4)]
        gscore = [sum(v) for v in groups]
        keep = sorted(range(4), key=lambda k: -gscore[k])[:2]
        cand = [e for e in range(12) if e // 3 in keep]
        top = sorted(cand, key=lambda e: -c[e])[:3]
        g = [s[e] for e in top]
        g = [2.5 * v / sum(g) for v in g]
        got = dict(zip(out.idx_TK[t].tolist(), out.gate_TK[t].tolist()))
        assert sorted(got) == sorted(top)
        for e, v in zip(top, g):
            assert abs(got[e] - v) < 1e-5


def test_aux_loss_formula_and_bias_update():
    torch.manual_seed(2)
    probs = torch.softmax(torch.randn(10, 8), dim=-1)
    counts = torch.tensor([5, 0, 3, 2, 4, 1, 3, 2])
    got = aux_loss(probs, counts, 10, coef=0.01)
    ref = 0.01 * 8 * sum(float(counts[e]) / 10 * float(probs[:, e].mean()) for e in range(8))
    assert abs(float(got) - ref) < 1e-6
    r = SigmoidGroupRouter(glm_cfg())
    r.update_bias(torch.tensor([5, 1, 3, 3, 0, 0, 9, 3, 3, 3, 3, 3]), rate=0.1)
    mean = 3.0
    exp = [0.1 * (1 if c < mean else -1 if c > mean else 0)
           for c in (5, 1, 3, 3, 0, 0, 9, 3, 3, 3, 3, 3)]
    torch.testing.assert_close(r.e_score_correction_bias, torch.tensor(exp))


def test_aux_loss_fractions_are_over_the_global_tokens():
    """``f_e`` divides the global counts by the global token count, not by the T local
    rows whose probabilities are averaged (by hand: 2 local tokens, 12 global ones)."""
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0]])  # P = .5, .25, .25, 0
    counts = torch.tensor([6, 3, 2, 1])  # f = 1/2, 1/4, 1/6, 1/12
    assert abs(float(aux_loss(probs, counts, 12, coef=0.01)) - 0.01 * 17 / 12) < 1e-7


def test_aux_loss_averaged_over_equal_ranks_is_the_whole_batch_loss():
    torch.manual_seed(3)
    probs = torch.softmax(torch.randn(12, 8), dim=-1)
    counts = torch.bincount(probs.topk(2, dim=-1).indices.reshape(-1), minlength=8)
    whole = aux_loss(probs, counts, 12, coef=0.1)
    ranks = [aux_loss(p, counts, 12, coef=0.1) for p in probs.chunk(3)]
    torch.testing.assert_close(sum(ranks) / 3, whole)
