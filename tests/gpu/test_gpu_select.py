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

from lrmoe.parallel.select import BackwardOptions, inclusion_probs, select_and_compact  # noqa: E402
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
def test_select_and_compact_is_the_reference_bit_for_bit_on_cuda(shape):
    T, K, E, G, S, keep = shape
    for seed in range(3):
        case = home_case(T, K, 16, E, G, S, 0.65, keep, CUDA, seed=seed)
        for opts in (BackwardOptions(estimator="sampled"), BackwardOptions()):
            outs = []
            for fn in (select_and_compact, select_and_compact_reference):
                gen = torch.Generator(device=CUDA).manual_seed(seed)
                outs.append(fn(case["dout"], case["tok"], case["g"], case["gate"], case["home"],
                               opts, gen, False, lambda s: s.flip(0) + 1))
            for a, b in zip(*outs):
                assert type(a) is type(b)
                if isinstance(a, torch.Tensor):
                    assert_bitwise(a.cpu(), b.cpu())
                else:
                    assert a == b
