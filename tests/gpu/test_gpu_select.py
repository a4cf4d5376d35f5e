"""The select stage's fast path against its first form on CUDA, bit for bit: the
inclusion probabilities (one sort on a (block, metric, row) key) and the sampled
compaction (``nonzero_static``), on fresh random inputs (the CPU test,
``tests/test_select_fast.py``, checks the same on the host)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_util import needs_cuda  # noqa: E402

from lrmoe.ops.selection import inclusion_probs  # noqa: E402
from lrmoe.parallel.options import BackwardOptions  # noqa: E402
from lrmoe.parallel.stages import select_and_compact  # noqa: E402
from references.select_stage import inclusion_probs_reference, select_and_compact_reference  # noqa: E402
from test_select_fast import SHAPES, assert_bitwise, metric_case  # noqa: E402
from test_select_stage import home_case  # noqa: E402

pytestmark = needs_cuda
CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
def test_inclusion_probs_is_the_reference_bit_for_bit_on_cuda(dtype):
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        m, blk, quota, size = metric_case(g, (1, 2, 5, 18, 144)[seed % 5], dtype, seed % 2 == 0)
        pi = inclusion_probs(m.to(CUDA), blk.to(CUDA), quota.to(CUDA), size)
        ref = inclusion_probs_reference(m.to(CUDA), blk.to(CUDA), quota.to(CUDA), size, stable=True)
        assert_bitwise(pi.cpu(), ref.cpu())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_select_and_compact_is_the_reference_on_cuda(shape):
    """The runtime's select stage (the row kernels on CUDA) against the frozen one: top-k
    bit for bit; sampled: the same draws, kept rows, counts and rows shipped, the scales
    to the last fp32 bit (the kernel sums each block's metric mass in its own order)."""
    T, K, E, G, S, keep = shape
    for seed in range(3):
        case = home_case(T, K, 16, E, G, S, 0.65, keep, CUDA, seed=seed)
        for opts in (BackwardOptions(estimator="sampled"), BackwardOptions()):
            args = (case["dout"], case["tok"], case["g"], case["gate"], case["home"], opts)
            gen = torch.Generator(device=CUDA).manual_seed(seed)
            got = select_and_compact(*args, gen, lambda s: s.flip(0) + 1)
            gen = torch.Generator(device=CUDA).manual_seed(seed)
            tok_s, scale, sent, recv, _, idx = select_and_compact_reference(
                *args, gen, False, lambda s: s.flip(0) + 1)
            assert torch.equal(got.idx.cpu(), idx.cpu())
            assert torch.equal(got.sent_B, sent)
            assert (got.recv_GS is None) == (recv is None)
            assert recv is None or torch.equal(got.recv_GS, recv)
            assert torch.equal(got.dy.cpu(), case["dout"][tok_s].cpu())
            if opts.estimator == "sampled":
                torch.testing.assert_close(got.scale.cpu(), scale.cpu(), rtol=2.4e-7, atol=0)
            else:
                assert_bitwise(got.scale.cpu(), scale.cpu())
