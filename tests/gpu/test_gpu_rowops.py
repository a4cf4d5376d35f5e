"""The row kernels and the selection kernels on CUDA, at the Qwen3 layer's shapes (4,096
tokens, top-8, H 2048, bf16; 8 ranks x 18 slots), against their torch references: bit
for bit where the module docs say so (gathers, inverse, combine, top-k selection), to
rounding elsewhere; eager and under torch.compile; and the selection's kernel count."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_util import needs_cuda, report_dir  # noqa: E402

from bits import same_bits  # noqa: E402
from lrmoe.ops import rowops, selection  # noqa: E402
from lrmoe.ops.fused import fused, weighted_gather_sum  # noqa: E402
from lrmoe.parallel.options import BackwardOptions  # noqa: E402
from references.select_runtime import select_and_compact  # noqa: E402
from test_select_fast import SHAPES  # noqa: E402
from test_select_stage import home_case  # noqa: E402

pytestmark = needs_cuda
CUDA = torch.device("cuda")
T, K, H = 4096, 8, 2048


@pytest.fixture(scope="module")
def rows():
    assert rowops.on_kernels(torch.empty(0, device=CUDA)), "Triton should serve CUDA tensors"
    g = torch.Generator().manual_seed(0)
    P = T * K
    pair = torch.randperm(P, generator=g)
    r = dict(x=torch.randn(T, H, generator=g), d=torch.randn(T, H, generator=g),
             y=torch.randn(P + 17, H, generator=g), gate=torch.rand(T, K, generator=g),
             pair=pair, row=torch.argsort(pair).view(T, K))
    r["row"][::97] = P + 17 + 3  # a few dropped pairs: rows past the end
    return {k: v.to(CUDA, torch.bfloat16) if v.is_floating_point() else v.to(CUDA) for k, v in r.items()}


def test_gathers_and_inverse_move_bits(rows):
    y, pair = rows["y"], rows["pair"]
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 400, (144,), generator=g)
    lengths[::7] = 0
    starts = torch.randint(0, y.shape[0] - 400, (144,), generator=g)
    r = rowops.runs(starts.numpy(), lengths.numpy(), CUDA)
    dst, src, n = r.dst_first, r.src_first, r.n
    idx = torch.arange(y.shape[0], device=CUDA)
    for s in (y, y.float(), idx, idx.int()):
        assert same_bits(rowops.gather_runs(s, dst, src, n), rowops.gather_runs_reference(s, dst, src, n))
    perm = pair[: pair.numel() // 2].clone()
    perm[::5] = pair.numel() + 1  # dropped: ignored
    assert same_bits(rowops.invert_permutation(perm, pair.numel(), -1),
                     rowops.invert_permutation_reference(perm, pair.numel(), -1))


def test_combine_is_eager_weighted_gather_sum_bit_for_bit(rows):
    y, row, gate = rows["y"], rows["row"], rows["gate"]
    for src in (y, y.float(), y.half()):
        got = rowops.combine(src, row, gate)
        assert same_bits(got, rowops.combine_reference(src, row, gate))
    # the compiled form the runtime uses today may contract into FMAs: report, not assert
    valid = (row < y.shape[0]).float()
    compiled = fused("combine", weighted_gather_sum, y)(y, row.clamp(max=y.shape[0] - 1), gate * valid)
    differ = int((compiled.view(torch.int16) != rowops.combine(y, row, gate).view(torch.int16)).sum())
    out = report_dir("rowops")
    if out is not None:
        (out / "combine_vs_compiled.txt").write_text(f"elements differing from the compiled "
                                                     f"weighted_gather_sum: {differ} of {compiled.numel()}\n")


def test_combine_grad_gate_within_rounding(rows):
    y, row, d = rows["y"], rows["row"], rows["d"]
    dot = rowops.combine_grad_gate(y, row, d)
    torch.testing.assert_close(dot, rowops.combine_grad_gate_reference(y, row, d), rtol=1e-4, atol=1e-3)
    assert bool((dot[row >= y.shape[0]] == 0).all())


def test_operators_under_compile(rows):
    """The registered operators inside an inductor-compiled function, with dynamic rows."""
    def step(y, row, gate, d, pair, dst, src):
        out = rowops.combine(y, row, gate)
        dot = rowops.combine_grad_gate(y, row, d)
        inv = rowops.invert_permutation(pair, pair.numel(), -1)
        runs = rowops.gather_runs(y, dst, src, 1000)
        return out, dot, inv, runs

    compiled = torch.compile(step, dynamic=True)
    table = rowops.runs([5, 900, 0], [300, 100, 600], CUDA)
    dst, src = table.dst_first, table.src_first
    for t in (T, T // 2):
        pair = rows["pair"][rows["pair"] < t * K]  # the pairs of the first t tokens
        args = (rows["y"], rows["row"][:t], rows["gate"][:t], rows["d"][:t], pair, dst, src)
        for a, b in zip(compiled(*args), step(*args)):
            assert same_bits(a, b)


@pytest.mark.parametrize("shape", SHAPES + ((4096, 8, 128, 8, 18, 0.5),), ids=lambda s: "x".join(map(str, s)))
def test_selection_on_cuda(shape):
    """Top-k bit for bit; sampled: the same rows, tokens, counts and exchange, scales to
    the last fp32 bit (lrmoe.ops.selection's module doc)."""
    Tn, Kn, E, G, S, keep = shape
    case = home_case(Tn, Kn, 64, E, G, S, 0.65, keep, CUDA, seed=0)
    home, norm = case["home"], rowops.token_norm(case["dout"])
    exchange = lambda s: s.flip(0) + 1  # noqa: E731
    for est in ("topk", "sampled"):
        for metric in ("grad_norm", "gate"):
            gen_a, gen_b = (torch.Generator(device=CUDA).manual_seed(3) for _ in range(2))
            ref = select_and_compact(case["dout"], case["tok"], case["g"], case["gate"], home,
                                     BackwardOptions(estimator=est, metric=metric), gen_a, False, exchange)
            args = (metric, norm, case["tok"], case["g"], case["gate"], home.retain_I, home.select_I)
            got = (selection.select_topk(*args, case["dout"]) if est == "topk" else
                   selection.select_sampled(*args, gen_b, exchange, home.splits_shape, case["dout"]))
            tok_s, scale, sent, recv, keep_m, sel_idx = ref
            assert torch.equal(got.keep_N, keep_m) and torch.equal(got.sel_idx_S, sel_idx)
            assert torch.equal(got.tok_S, tok_s) and torch.equal(got.sent_B, sent)
            assert same_bits(got.dy_SH, case["dout"][tok_s])
            if est == "topk":
                assert same_bits(got.scale_S, scale)
            else:
                torch.testing.assert_close(got.scale_S, scale, rtol=2.0**-23, atol=0)
                assert torch.equal(got.recv_GS, recv)
                assert torch.equal(gen_a.get_state(), gen_b.get_state())


def test_selection_kernel_count():
    """Top-k: the metric, select and compaction kernels; sampled: torch.rand's, the select
    kernel, the count concatenation (for the one read) and the compaction."""
    case = home_case(4096, 8, 64, 128, 8, 18, 0.65, 0.5, CUDA, seed=0)
    home, norm = case["home"], rowops.token_norm(case["dout"])
    args = ("grad_norm", norm, case["tok"], case["g"], case["gate"], home.retain_I, home.select_I)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    for fn, most in ((lambda: selection.select_topk(*args, case["dout"]), 3),
                     (lambda: selection.select_sampled(*args, gen, dout_TH=case["dout"]), 4)):
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                 and not e.name.startswith(("Memcpy", "Memset"))]
        assert len(names) <= most, names


def _compiled_variants(kernel) -> int:
    """How many compiled variants a Triton kernel holds, over devices (the kernel cache
    is the first entry of each device's cache tuple)."""
    return sum(len(c[0]) for c in kernel.device_caches.values())


def test_row_kernels_compile_once_across_row_counts():
    """Row counts change every step; the kernels do not specialize on them (Triton
    otherwise compiles a variant per count divisible by 16 or not, at whichever timed step
    first meets it), so counts of every residue reuse one compiled kernel."""
    from lrmoe.ops import rowops_triton as rt
    g = torch.Generator().manual_seed(1)
    kernels = (rt._gather_runs_kernel, rt._invert_kernel, rt._combine_kernel, rt._combine_dot_kernel)
    before = [_compiled_variants(k) for k in kernels]
    for n in (32, 33, 48, 17, 1, 64, 7):
        src = torch.randn(n + 5, 256, generator=g).to(CUDA, torch.bfloat16)
        row = torch.randint(0, n + 5, (n, 4), generator=g).to(CUDA)
        w, d = torch.rand(n, 4, device=CUDA), torch.randn(n, 256, device=CUDA, dtype=torch.bfloat16)
        rowops.combine(src, row, w)
        rowops.combine_grad_gate(src, row, d)
        rowops.invert_permutation(torch.randperm(n, generator=g).to(CUDA), n + 3, fill=-1)
        first = torch.arange(0, n, 2, device=CUDA)
        rowops.gather_runs(src, first, first, n)
    torch.cuda.synchronize()
    added = [_compiled_variants(k) - b for k, b in zip(kernels, before)]
    assert all(a <= 1 for a in added), dict(zip((k.__name__ for k in kernels), added))
