"""The dense building blocks against HF transformers' own (Qwen3-MoE's RMSNorm and rotary
embedding), bit for bit on the CPU, forward and backward: the fused ``rms_norm`` path
and the q/k glue (norm, transpose, rotary) written once for the compiled region. On
CUDA the fused kernels differ in the last bits (``tests/gpu/test_gpu_layers.py``)."""

from __future__ import annotations

import pytest
import torch

from lrmoe.model.layers import RMSNorm, Rotary, qk_rotary

tf = pytest.importorskip("transformers")
from transformers.models.qwen3_moe.modeling_qwen3_moe import (  # noqa: E402
    Qwen3MoeRMSNorm,
    apply_rotary_pos_emb,
)

BF16 = torch.bfloat16


def _norms(H: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ours, hf = RMSNorm(H, 1e-6), Qwen3MoeRMSNorm(H, eps=1e-6)
    w = torch.randn(H, generator=g)
    with torch.no_grad():
        ours.weight.copy_(w)
        hf.weight.copy_(w)
    return ours, hf


def _fwd_bwd(norm, x, dy, autocast):
    x = x.clone().requires_grad_()
    norm.zero_grad()
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        y = norm(x)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, norm.weight.grad


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (BF16, False),
                                            (torch.float32, True), (BF16, True)],
                         ids=["fp32", "bf16", "fp32-autocast", "bf16-autocast"])
def test_rms_norm_is_hf_bit_for_bit(dtype, autocast):
    """The residual stream (fp32, the weight inside the fused op) and q/k under autocast
    (bf16 in, rounded before the weight as HF rounds it): same output, same dtype, same
    input and weight gradients."""
    ours, hf = _norms(96)
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(4, 7, 96, generator=g)).to(dtype)
    dy = torch.randn(4, 7, 96, generator=g)
    a, b = _fwd_bwd(ours, x, dy, autocast), _fwd_bwd(hf, x, dy, autocast)
    assert a[0].dtype == b[0].dtype
    for u, v in zip(a, b):
        assert torch.equal(u, v)


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_qk_glue_is_hf_bit_for_bit(qk_norm, partial):
    """q and k from the projections' layout to SDPA's, as HF's attention does it (q/k
    norm on ``[B, T, N, D]``, transpose, rotary on the first ``partial`` of each head),
    forward and backward."""
    B, T, N, K, D = 2, 9, 4, 2, 16
    R = int(D * partial)
    rot = Rotary(R, 10000.0)
    cos, sin = rot.cos_sin(T, torch.device("cpu"), torch.float32)
    qn, hq = _norms(D, 2)
    kn, hk = _norms(D, 3)
    g = torch.Generator().manual_seed(4)
    q0, k0 = torch.randn(B, T, N, D, generator=g), torch.randn(B, T, K, D, generator=g)
    dq, dk = torch.randn(B, N, T, D, generator=g), torch.randn(B, K, T, D, generator=g)

    def run(fn):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        qo, ko = fn(q, k)
        (qo * dq).sum().backward(retain_graph=True)
        (ko * dk).sum().backward()
        return qo.detach(), ko.detach(), q.grad, k.grad

    def hf(q, k):
        if qk_norm:
            q, k = hq(q), hk(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        qr, kr = apply_rotary_pos_emb(q[..., :R], k[..., :R], cos[None], sin[None])
        return torch.cat([qr, q[..., R:]], -1), torch.cat([kr, k[..., R:]], -1)

    w = (qn.weight, kn.weight, qn.eps) if qk_norm else (None, None, 0.0)
    for u, v in zip(run(lambda q, k: qk_rotary(q, k, cos, sin, *w)), run(hf)):
        assert torch.equal(u, v)
