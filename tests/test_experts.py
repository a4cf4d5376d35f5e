"""Grouped-GEMM SwiGLU experts against the per-expert loop, forward and backward."""

import pytest
import torch

from lrmoe.ops import experts as ex
from references.moe import swiglu_loop_reference


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("counts", [[5, 0, 7, 3], [0, 0, 9, 0], [1, 1, 1, 1], [0, 12, 0, 4]])
def test_grouped_matches_loop(dtype, tol, counts, monkeypatch):
    calls = []  # the grouped GEMM runs, forward and backward (the loop is the reference)
    grouped = ex._grouped_mm

    def counted(*a, **k):
        calls.append(1)
        return grouped(*a, **k)

    monkeypatch.setattr(ex, "_grouped_mm", counted)
    g = torch.Generator().manual_seed(sum(counts) * 7 + len(counts))
    R, H, F, I = sum(counts), 16, 8, len(counts)
    x = torch.randn(R, H, generator=g).to(dtype).requires_grad_()
    w13 = (torch.randn(I, 2 * F, H, generator=g) * 0.3).to(dtype).requires_grad_()
    w2 = (torch.randn(I, H, F, generator=g) * 0.3).to(dtype).requires_grad_()
    ref = swiglu_loop_reference(x, w13, w2, counts)
    dy = torch.randn(ref.shape, generator=g).to(dtype)
    ref.backward(dy)
    with torch.no_grad():
        y, gu = ex.swiglu_forward(x, w13, w2, counts)
        forward = len(calls)
        dx, d13, d2 = ex.swiglu_backward({"x": x, "gu": gu, "dy": dy}, w13, w2, counts)
    assert forward == 2 and len(calls) > forward
    assert y.dtype == dtype and not torch.isnan(y).any()
    assert rel(y, ref) < tol
    assert rel(dx, x.grad) < tol
    assert rel(d13, w13.grad) < tol
    assert rel(d2, w2.grad) < tol
    # empty experts get exactly zero weight gradient
    for i, n in enumerate(counts):
        if n == 0:
            assert d13[i].abs().max() == 0 and d2[i].abs().max() == 0


def test_loop_fallback_matches_grouped(monkeypatch):
    """The fallback path (unaligned widths) computes the same function, forward and
    backward (its weight gradients' per-instance products included)."""
    g = torch.Generator().manual_seed(3)
    counts = [4, 0, 6]
    x = torch.randn(10, 6, generator=g).requires_grad_()  # 6*4 bytes: unaligned -> loop
    w13 = torch.randn(3, 10, 6, generator=g).requires_grad_()
    w2 = torch.randn(3, 6, 5, generator=g).requires_grad_()
    assert not ex._grouped_ok(x, w13.transpose(1, 2))
    ref = swiglu_loop_reference(x, w13, w2, counts)
    dy = torch.randn(ref.shape, generator=g)
    ref.backward(dy)
    with torch.no_grad():
        y, gu = ex.swiglu_forward(x, w13, w2, counts)
        dx, d13, d2 = ex.swiglu_backward({"x": x, "gu": gu, "dy": dy}, w13, w2, counts)
    torch.testing.assert_close(y, ref)
    for got, want in ((dx, x.grad), (d13, w13.grad), (d2, w2.grad)):
        torch.testing.assert_close(got, want)


def test_counts_from_offsets_are_the_segment_sizes():
    """The per-expert loop's counts read back from the inclusive offsets, empty segments
    included (first, inner, last)."""
    from lrmoe.ops.experts import counts_from_offsets, offsets

    g = torch.Generator().manual_seed(5)
    for n in (1, 2, 3, 9):
        counts = torch.randint(0, 4, (n,), generator=g).tolist()
        counts[0] = 0
        assert counts_from_offsets(offsets(counts, torch.device("cpu"))) == counts
