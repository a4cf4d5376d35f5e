"""lrmoe's selection in lrmoe.ops.selection, on the CPU (its torch reference) against the
select stage as the runtime ran it before these kernels (tests/references/select_runtime.py)
and that stage's first form (tests/references/select_stage.py), bit for bit on fresh
random inputs. The Triton
kernels are checked against the same in tests/test_rowops_triton.py and on CUDA."""

from __future__ import annotations

import pytest
import torch

from lrmoe.ops import rowops, selection
from lrmoe.parallel.options import BackwardOptions
from references.select_runtime import select_and_compact
from references.select_stage import select_and_compact_reference
from test_select_fast import SHAPES, assert_bitwise
from test_select_stage import home_case


def _run(fn, case, opts, seed, exchange):
    gen = torch.Generator().manual_seed(seed)
    out = fn(case["dout"], case["tok"], case["g"], case["gate"], case["home"], opts, gen, False, exchange)
    return out, gen.get_state()


def _select(case, opts, seed, exchange):
    gen = torch.Generator().manual_seed(seed)
    norm = rowops.token_norm(case["dout"]) if opts.metric == "grad_norm" else None
    home = case["home"]
    args = (opts.metric, norm, case["tok"], case["g"], case["gate"], home.retain_I, home.select_I)
    if opts.estimator == "sampled":
        got = selection.select_sampled(*args, gen, exchange, home.splits_shape, case["dout"])
        return got, gen.get_state()
    return selection.select_topk(*args, case["dout"]), gen.get_state()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_selection_is_the_select_stage_bit_for_bit(shape):
    T, K, E, G, S, keep = shape
    for seed in range(2):
        case = home_case(T, K, 16, E, G, S, 0.65, keep, torch.device("cpu"), seed=seed)
        for opts in (BackwardOptions(), BackwardOptions(metric="gate"), BackwardOptions(estimator="sampled"),
                     BackwardOptions(estimator="sampled", metric="gate")):
            for exchange in (None, lambda s: s.flip(0) + 1):
                got, state = _select(case, opts, seed, exchange)
                for fn in (select_and_compact, select_and_compact_reference):
                    ref, ref_state = _run(fn, case, opts, seed, exchange)
                    tok_s, scale, sent, recv, keep_m, sel_idx = ref
                    assert torch.equal(state, ref_state)
                    for a, b in ((got.tok_S, tok_s), (got.scale_S, scale), (got.sent_B, sent),
                                 (got.keep_N, keep_m), (got.sel_idx_S, sel_idx)):
                        assert_bitwise(a, b)
                    if opts.estimator == "sampled" and exchange is not None:
                        assert_bitwise(got.recv_GS, recv)
                    else:
                        assert got.recv_GS is None and recv is None
                    assert_bitwise(got.dy_SH, case["dout"][tok_s])


def test_grad_norm_without_the_token_norms_is_refused():
    """(A metric name the selection does not know is refused by ``BackwardOptions``:
    tests/test_policies.py.)"""
    case = home_case(8, 2, 16, 8, 2, 4, 0.65, 0.5, torch.device("cpu"))
    home = case["home"]
    with pytest.raises(ValueError, match="'grad_norm' needs the token norms"):
        selection.select_topk("grad_norm", None, case["tok"], case["g"], case["gate"], home.retain_I,
                              home.select_I)
    with pytest.raises(ValueError, match="'grad_norm' needs the token norms"):
        selection.select_sampled("grad_norm", None, case["tok"], case["g"], case["gate"], home.retain_I,
                                 home.select_I, None)
