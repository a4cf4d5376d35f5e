"""The row operations' torch references (what the CPU runs) against the runtime's own
compositions they replace, bit for bit, on fresh random inputs; and the custom operators
under torch.compile. The Triton kernels are checked against these references in
tests/test_rowops_triton.py (interpreter) and tests/gpu/test_gpu_rowops.py (CUDA)."""

from __future__ import annotations

import pytest
import torch

from bits import same_bits
from lrmoe.ops import rowops
from lrmoe.ops.fused import gathered_dot, weighted_gather_sum
from references.layout import pair_rows, ranges
from references.select_runtime import metric_grad_norm


def test_gather_runs_follows_its_definition_and_ranges():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        R = int(torch.randint(1, 12, (1,), generator=g))
        lengths = torch.randint(0, 5, (R,), generator=g)
        lengths[::4] = 0
        starts = torch.randint(0, 30, (R,), generator=g)
        r = rowops.runs(starts.numpy(), lengths.numpy(), "cpu")
        dst, src, n_out = r.dst_first, r.src_first, r.n
        # the runtime's positions of the same runs (which drops the empty ones itself)
        assert torch.equal(rowops.run_positions(dst, src, n_out), ranges(starts, lengths))
        x = torch.randn(40, 5, generator=g).bfloat16()
        want = [x[int(s) + j] for s, n in zip(starts, lengths) for j in range(int(n))]
        got = rowops.gather_runs(x, dst, src, n_out)
        assert same_bits(got, torch.stack(want) if want else x[:0])
        assert torch.equal(rowops.gather_runs(torch.arange(40), dst.int(), src.int(), n_out),
                           ranges(starts, lengths))


def test_invert_permutation_is_the_index_put_it_replaces():
    """``row_of_pair = full(n, fill); row_of_pair[perm] = arange`` (the exchange's dx
    rows), and perm entries past the end (the home layout's dropped pairs) ignored."""
    g = torch.Generator().manual_seed(2)
    for n_out, n in ((50, 30), (8, 8), (6, 0)):
        perm = torch.randperm(n_out, generator=g)[:n]
        want = torch.full((n_out,), 77, dtype=torch.long)
        want[perm] = torch.arange(n)
        assert same_bits(rowops.invert_permutation(perm, n_out, 77), want)
    dropped = torch.cat((perm, torch.tensor([n_out, n_out, -1])))
    assert same_bits(rowops.invert_permutation(dropped, n_out, 77), want)
    full = torch.randperm(9, generator=g)
    assert torch.equal(rowops.invert_permutation(full, 9), torch.argsort(full))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
def test_combine_is_the_runtime_combine_bit_for_bit(dtype):
    """The exchange's forward combine (rows past the end clamped, gates masked by 0/1)
    and its dx combine (weights 1 or 0), against :func:`rowops.combine` on the raw rows."""
    g = torch.Generator().manual_seed(3)
    for T, K, N, H in ((13, 4, 20, 37), (7, 1, 7, 8), (5, 8, 40, 1)):
        src = torch.randn(N, H, generator=g).to(dtype)
        gate = torch.rand(T, K, generator=g).to(dtype)
        # rows past the end only where some pair is dropped (then fewer rows than pairs)
        send_row = torch.randint(0, N + 2 * (N != T * K), (T * K,), generator=g)
        row_TK, valid = pair_rows(send_row, N, T, K)
        w = gate if valid is None else gate * valid
        assert same_bits(rowops.combine(src, send_row.view(T, K), gate), weighted_gather_sum(src, row_TK, w))
        ones = torch.ones(T, K) if valid is None else valid
        assert same_bits(rowops.combine(src, send_row.view(T, K), torch.ones(T, K)),
                         weighted_gather_sum(src, row_TK, ones))
    assert same_bits(rowops.combine(src[:0], send_row.view(T, K), gate), torch.zeros(T, H, dtype=dtype))


def test_combine_grad_gate_is_the_runtime_router_gradient():
    g = torch.Generator().manual_seed(4)
    T, K, N, H = 11, 4, 30, 24
    src, d = torch.randn(N, H, generator=g).bfloat16(), torch.randn(T, H, generator=g).bfloat16()
    send_row = torch.randint(0, N + 3, (T * K,), generator=g)
    row_TK, valid = pair_rows(send_row, N, T, K)
    want = gathered_dot(src, row_TK, d) * valid
    assert same_bits(rowops.combine_grad_gate(src, send_row.view(T, K), d), want)
    # the metric's token norm: |gate| * norm[tok] is metric_grad_norm's value
    tok, gate = torch.randint(0, T, (40,), generator=g), torch.rand(40, generator=g)
    assert same_bits(gate.abs() * rowops.token_norm(d)[tok], metric_grad_norm(d, tok, gate))


def test_public_functions_compile_whole():
    """On the CPU the public functions are their references: one graph under
    torch.compile, rows dynamic, the eager bits. (The custom operators themselves are
    compiled on CUDA: tests/gpu/test_gpu_rowops.py.)"""

    def step(src, row, w, d, perm, dst, first):
        out = rowops.combine(src, row, w)
        dot = rowops.combine_grad_gate(src, row, d)
        inv = rowops.invert_permutation(perm, src.shape[0], -1)
        runs = rowops.gather_runs(src, dst, first, 6)
        return out, dot, inv, runs

    compiled = torch.compile(step, backend="aot_eager", dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(5)
    for T in (6, 9):
        N, K, H = 2 * T, 2, 16
        args = (torch.randn(N, H, generator=g), torch.randint(0, N + 1, (T, K), generator=g),
                torch.rand(T, K, generator=g), torch.randn(T, H, generator=g),
                torch.randperm(N, generator=g)[:T], torch.tensor([0, 2, 2]), torch.tensor([4, 0, 1]))
        for a, b in zip(compiled(*args), step(*args)):
            assert same_bits(a, b)


def test_sort_key_orders_by_expert_then_descending_gate_over_every_float():
    """The send order's key: a stable ascending sort of it is a stable sort by expert, then
    by descending gate, for any float32 gate (negatives, both zeros, infinities, ties)."""
    g = torch.Generator().manual_seed(8)
    gate = torch.randn(400, generator=g) * torch.logspace(-30, 30, 400)[torch.randperm(400, generator=g)]
    gate[:40] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1.0, -1.0] * 6 + [2.0] * 4)
    idx = torch.randint(0, 5, (400,), generator=g)
    got = torch.argsort(rowops.sort_key_by_expert_then_gate(idx, gate), stable=True)
    want = sorted(range(400), key=lambda p: (int(idx[p]), -float(gate[p])))  # stable
    assert got.tolist() == want
