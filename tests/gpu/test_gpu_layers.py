"""The dense blocks on CUDA: torch's fused ``rms_norm`` against HF's RMSNorm formula, and
the q/k glue compiled (what eager attention runs on CUDA) against its eager ops. On the
CPU both are HF's bit for bit (``tests/test_layers.py``); here the fused kernels reduce
in another order, so the check is a tolerance: fp32 to a few ulps, bf16 q/k to one bf16
ulp in a few elements (HF rounds the normalised q/k to bf16 before the weight: without
that rounding every element would differ)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_util import needs_cuda  # noqa: E402

pytestmark = needs_cuda
BF16 = torch.bfloat16


def _hf_rms(x, w, eps):
    dt = x.dtype
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dt)


def test_fused_rms_norm_matches_hf_on_cuda():
    from lrmoe.model.layers import rms_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(2048, device="cuda", generator=g)
    x = 3 * torch.randn(64, 128, 2048, device="cuda", generator=g)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), _hf_rms(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    wq = torch.randn(128, device="cuda", generator=g)
    q = (3 * torch.randn(64, 128, 32, 128, device="cuda", generator=g)).to(BF16)
    with torch.autocast("cuda", dtype=BF16):
        got, want = rms_norm(q, wq, 1e-6), _hf_rms(q, wq, 1e-6)
    assert got.dtype == want.dtype == torch.float32
    diff = (got - want).abs()
    ulp = (want.abs() * 2.0 ** -7).clamp(min=1e-30)  # one bf16 ulp of the product, or less
    assert bool((diff <= ulp).all())
    assert float((diff > 0).float().mean()) < 0.05, "the normalised q is not rounded to bf16"


@pytest.mark.parametrize("qk_norm", [True, False])
def test_compiled_qk_glue_matches_its_eager_ops(qk_norm):
    from lrmoe.model.layers import Rotary, qk_rotary
    from lrmoe.ops.fused import _COMPILED, fused

    B, T, N, K, D = 4, 256, 32, 4, 128
    cos, sin = Rotary(D // 2, 1e6).cos_sin(T, torch.device("cuda"), torch.float32)  # partial
    g = torch.Generator(device="cuda").manual_seed(1)
    w = ((torch.randn(D, device="cuda", generator=g), torch.randn(D, device="cuda", generator=g),
          1e-6) if qk_norm else (None, None, 0.0))
    q0 = torch.randn(B, T, N, D, device="cuda", generator=g).to(BF16)
    k0 = torch.randn(B, T, K, D, device="cuda", generator=g).to(BF16)

    def run(fn):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        with torch.autocast("cuda", dtype=BF16):
            qo, ko = fn(q, k, cos, sin, *w)
        (qo.float().square().sum() + ko.float().sum()).backward()
        return [qo.float(), ko.float(), q.grad.float(), k.grad.float()]
    compiled = fused("qk_rotary", qk_rotary, q0)
    got, want = run(compiled), run(qk_rotary)
    assert callable(_COMPILED.get("qk_rotary")), "the glue did not compile"
    for a, b in zip(got, want):
        rel = float((a - b).norm() / b.norm())
        assert rel < 1e-2, rel  # bf16 activations: a few bf16 roundings apart at most
