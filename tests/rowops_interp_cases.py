"""The Triton kernels of the row operations and the selection against their torch
references, run on the CPU by Triton's interpreter.

Run by tests/test_rowops_triton.py in a process of its own with ``TRITON_INTERPRET=1``
(Triton reads it when a kernel is defined, so it must be set before lrmoe.ops is
imported). Under the interpreter the public functions send CPU tensors to the kernels
(:func:`lrmoe.ops.rowops.on_kernels`), so these tests drive the same entry points, host
tables and custom operators as CUDA. Shapes stay tiny: the interpreter runs each kernel
program in Python.
"""

from __future__ import annotations

import os
from fractions import Fraction

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before Triton is imported "
                "(tests/test_rowops_triton.py runs this file so)", allow_module_level=True)

from bits import same_bits  # noqa: E402
from lrmoe.ops import rowops, selection  # noqa: E402
from lrmoe.parallel.options import BackwardOptions  # noqa: E402
from references.select_runtime import select_and_compact  # noqa: E402
from test_select_fast import OpCount, metric_case  # noqa: E402
from test_select_stage import home_case  # noqa: E402
from triton_interp import patch_interpreter  # noqa: E402

patch_interpreter()

assert rowops.on_kernels(torch.zeros(1)), "the kernels should serve CPU tensors here"



def runs_case(g: torch.Generator, n_src: int, n_runs: int, idx_dtype: torch.dtype):
    """Random runs over a source of ``n_src`` rows, some empty, tables in ``idx_dtype``."""
    lengths = torch.randint(0, 6, (n_runs,), generator=g)
    lengths[::3] = 0
    starts = torch.stack([torch.randint(0, n_src - int(n) + 1, (1,), generator=g)[0] for n in lengths])
    r = rowops.runs(starts.numpy(), lengths.numpy(), "cpu")
    return r.dst_first.to(idx_dtype), r.src_first.to(idx_dtype), r.n


@pytest.mark.parametrize("idx_dtype", (torch.int64, torch.int32), ids=str)
def test_gather_runs(idx_dtype):
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(40, 37, generator=g).bfloat16(), torch.randn(40, 8, generator=g).half(),
               torch.randn(40, 1, generator=g), torch.randint(-9, 9, (40,), generator=g),
               torch.randint(-9, 9, (40,), generator=g).int(), torch.randn(40, generator=g)]
    for src in sources:
        dst_first, src_first, n_out = runs_case(g, 40, 11, idx_dtype)
        got = rowops.gather_runs(src, dst_first, src_first, n_out)
        assert n_out > 0 and same_bits(got, rowops.gather_runs_reference(src, dst_first, src_first, n_out))
    empty = rowops.gather_runs(sources[0], dst_first, src_first, 0)
    assert empty.shape == (0, 37)


def test_invert_permutation():
    g = torch.Generator().manual_seed(2)
    perm = torch.randperm(50, generator=g)[:30]
    perm[::7] = 50 + torch.arange(5)  # dropped pairs: outside the output
    perm[3] = -1
    for fill in (-1, 99):
        assert same_bits(rowops.invert_permutation(perm, 50, fill),
                         rowops.invert_permutation_reference(perm, 50, fill))
    full = torch.randperm(33, generator=g)
    assert same_bits(rowops.invert_permutation(full, 33), torch.argsort(full))
    assert rowops.invert_permutation(full[:0], 4, 7).tolist() == [7] * 4
    assert rowops.invert_permutation(full, 0, 7).numel() == 0


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
def test_combine_is_the_reference_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(3)
    for T, K, N, H in ((13, 4, 20, 37), (9, 1, 5, 64), (6, 8, 30, 3)):
        src = torch.randn(N, H, generator=g).to(dtype)
        row = torch.randint(0, N + 3, (T, K), generator=g)  # some past the end: dropped pairs
        for w in (torch.rand(T, K, generator=g).bfloat16(), torch.randn(T, K, generator=g)):
            assert same_bits(rowops.combine(src, row, w), rowops.combine_reference(src, row, w))
    # a token whose pairs are all dropped sums w * 0 * src[N - 1]: a signed zero
    src[-1] = -1.0
    row[0] = N
    w = torch.rand(T, K, generator=g)
    out = rowops.combine(src, row, w)
    assert same_bits(out, rowops.combine_reference(src, row, w)) and bool(torch.signbit(out[0]).all())
    assert same_bits(rowops.combine(src[:0], row, w), torch.zeros(T, H, dtype=dtype))


def test_combine_grad_gate_within_rounding():
    g = torch.Generator().manual_seed(4)
    for T, K, N, H in ((13, 4, 20, 37), (5, 1, 3, 300)):
        src = torch.randn(N, H, generator=g).bfloat16()
        d = torch.randn(T, H, generator=g).bfloat16()
        row = torch.randint(0, N + 2, (T, K), generator=g)
        ref = rowops.combine_grad_gate_reference(src, row, d)
        got = rowops.combine_grad_gate(src, row, d)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        assert bool((got[row >= N] == 0).all())
    assert torch.equal(rowops.combine_grad_gate(src[:0], row, d), torch.zeros(T, K))


# --------------------------------------------------------------------------- selection
CASES = ((40, 3, 8, 2, 4, 0.5), (6, 2, 8, 2, 6, 1.0), (30, 4, 8, 2, 5, 0.0))  # T, K, E, G, S, keep


def _home(shape, seed):
    T, K, E, G, S, keep = shape
    return home_case(T, K, 16, E, G, S, 0.9, keep, torch.device("cpu"), seed=seed)


@pytest.mark.parametrize("shape", CASES, ids=lambda s: "x".join(map(str, s)))
def test_select_topk_is_the_runtime_bit_for_bit(shape):
    case = _home(shape, 0)
    norm = rowops.token_norm(case["dout"])
    for metric in ("grad_norm", "gate")[: 2 if shape == CASES[0] else 1]:
        ref = select_and_compact(case["dout"], case["tok"], case["g"], case["gate"], case["home"],
                                 BackwardOptions(metric=metric), None, False)
        got = selection.select_topk(metric, norm, case["tok"], case["g"], case["gate"],
                                    case["home"].retain_I, case["home"].select_I, case["dout"])
        _assert_as_runtime(got, ref, case)


def test_select_topk_ties_and_keys_that_round_together():
    """Exact ties (kept in row order) and metrics so far below the largest that their sort
    keys round to the same float64 (also kept in row order, though the metrics differ)."""
    g = torch.Generator().manual_seed(5)
    size = torch.tensor([0, 1, 45, 70, 12, 3])
    quota = torch.tensor([0, 1, 20, 33, 12, 5])
    N = int(size.sum())
    m = torch.randint(0, 4, (N,), generator=g).float()
    # far below the largest metric (3): their keys all round to block + 0.5, as zeros do
    m[::5] = torch.rand(int(m[::5].numel()), generator=g) * 1e-30
    sel = selection.select_topk("gate", None, torch.arange(N), torch.rand(N, generator=g), m, size, quota)
    assert torch.equal(sel.sel_idx_S, selection.topk_indices(m, size, quota))
    assert torch.equal(sel.keep_N.nonzero().view(-1), sel.sel_idx_S)


@pytest.mark.parametrize("shape", CASES[:2], ids=lambda s: "x".join(map(str, s)))
def test_select_sampled_keeps_the_runtime_rows(shape):
    """Same draws, same kept rows, tokens, counts and exchange; the probabilities to
    float64 rounding (each block's mass is summed in the kernel's order) and so the
    scales to their last fp32 bit."""
    case = _home(shape, 1)
    norm = rowops.token_norm(case["dout"])
    exchange = lambda s: s.flip(0) + 1  # noqa: E731
    for metric in ("grad_norm", "gate")[: 2 if shape == CASES[0] else 1]:
        gen_ref, gen = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
        ref = select_and_compact(case["dout"], case["tok"], case["g"], case["gate"], case["home"],
                                 BackwardOptions(estimator="sampled", metric=metric), gen_ref, False,
                                 exchange)
        got = selection.select_sampled(metric, norm, case["tok"], case["g"], case["gate"],
                                       case["home"].retain_I, case["home"].select_I, gen, exchange,
                                       case["home"].splits_shape, case["dout"])
        assert torch.equal(gen.get_state(), gen_ref.get_state())
        _assert_as_runtime(got, ref, case, rounding=True)
        assert torch.equal(got.recv_GS, ref[3])


def _assert_as_runtime(got: selection.Selection, ref, case, rounding: bool = False):
    tok_s, scale, sent, _, keep, sel_idx = ref
    assert torch.equal(got.keep_N, keep) and torch.equal(got.sel_idx_S, sel_idx)
    assert torch.equal(got.tok_S, tok_s) and torch.equal(got.sent_B, sent)
    assert same_bits(got.dy_SH, case["dout"][tok_s])
    if rounding:
        torch.testing.assert_close(got.scale_S, scale, rtol=2.0**-23, atol=0)
    else:
        assert same_bits(got.scale_S, scale)


def exact_inclusion_probs(m: torch.Tensor, size: torch.Tensor, quota: torch.Tensor) -> list[Fraction]:
    """The water-filling in exact arithmetic, block by block: rows sorted by metric, the
    capped ones the prefix with ``(q - r) * m_r > R_r``, the free ones ``rem * m / mass``
    (``rem / n_free`` when they carry no mass), capped at 1."""
    out, start = [Fraction(0)] * m.numel(), 0
    for n, q in zip(size.tolist(), quota.tolist()):
        rows = list(range(start, start + n))
        val = {i: Fraction(max(float(m[i]), 0.0)) for i in rows}
        order = sorted(rows, key=lambda i: -val[i])
        suffix = [sum(val[i] for i in order[r:]) for r in range(n)]
        c = 0
        while c < n and (q - c) * val[order[c]] > suffix[c]:
            c += 1
        rem, mass = max(q - c, 0), sum(val[i] for i in order[c:])
        for r, i in enumerate(order):
            p = 1 if r < c else (rem * val[i] / mass if mass > 0 else Fraction(rem, max(n - c, 1)))
            out[i] = min(p, Fraction(1))
        start += n
    return out


@pytest.mark.parametrize("dtype", (torch.float16, torch.float32), ids=str)
def test_inclusion_probabilities(dtype):
    """Blocks of 0 to 40 rows with many exact ties, zeros, -0.0 and negatives, quotas 0,
    full and past the block. Over metrics within a few orders of magnitude the kernel's
    probabilities are the reference's to float64 rounding; over metrics spread across 30
    orders (where the reference's running sum rounds a tiny row's cap test away) they
    are the exact water-filling's, and each block's sum is its quota (at most its rows)."""
    g = torch.Generator().manual_seed(0)
    m, blk, quota, size = metric_case(g, 7, dtype, grouped=True)  # fp32: spread the widest
    # and a block where negative metrics (read as 0) would otherwise be kept
    m = torch.cat((m.float(), torch.tensor([5.0, -3.0, 2.0, -0.0, 1.0, -7.0])))
    blk, size, quota = torch.cat((blk, torch.full((6,), 7))), torch.cat((size, torch.tensor([6]))), \
        torch.cat((quota, torch.tensor([2])))
    N = m.numel()
    got = selection.select_sampled("gate", None, torch.arange(N), torch.ones(N), m, size, quota,
                                   torch.Generator().manual_seed(1))
    exact = torch.tensor([float(p) for p in exact_inclusion_probs(m, size, quota)], dtype=torch.float64)
    torch.testing.assert_close(got.pi_N, exact, rtol=1e-12, atol=1e-15)
    sums = torch.zeros(size.numel(), dtype=torch.float64).index_add_(0, blk, got.pi_N)
    torch.testing.assert_close(sums, torch.minimum(quota, size).double(), rtol=1e-12, atol=1e-12)
    u = torch.rand(N, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(got.keep_N, u < got.pi_N)
    if dtype == torch.float16:
        ref = selection.inclusion_probs(m, blk, quota, size)
        torch.testing.assert_close(got.pi_N, ref, rtol=1e-12, atol=1e-15)


def test_selection_is_three_kernels_and_one_read():
    """Each estimator issues three kernels (top-k: the metric and select kernels, inside
    one operator, and the compaction; sampled: torch.rand, the select kernel and the
    compaction), and nothing that sorts, scans or compacts on the host's orders."""
    case = home_case(16, 2, 16, 8, 2, 4, 0.65, 0.5, torch.device("cpu"), seed=0)
    norm = rowops.token_norm(case["dout"])
    args = ("grad_norm", norm, case["tok"], case["g"], case["gate"], case["home"].retain_I,
            case["home"].select_I)
    with OpCount() as topk:
        selection.select_topk(*args, case["dout"])
    with OpCount() as sampled:
        selection.select_sampled(*args, torch.Generator().manual_seed(0), dout_TH=case["dout"])
    assert topk.ops["topk_select"] == 1 and topk.ops["compact_selected"] == 1, topk.ops
    assert sampled.ops["rand"] == 1 and sampled.ops["sampled_select"] == 1, sampled.ops
    assert sampled.ops["compact_selected"] == 1, sampled.ops
    assert not {"sort", "argsort", "cumsum", "nonzero", "index", "segment_reduce"} & (
        set(topk.ops) | set(sampled.ops))
