"""The select stage's fast path against its first form (tests/references/select_stage.py),
bit for bit on fresh random inputs: the inclusion probabilities (one sort on a
(block, metric, row) key instead of three sorts) and the sampled branch's compaction
(``nonzero_static`` once the kept count is on the host, instead of writing each kept
row's index at its rank)."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lrmoe.ops.selection import inclusion_probs
from lrmoe.parallel import stages
from lrmoe.parallel.options import BackwardOptions
from lrmoe.parallel.stages import Picked, select_and_compact
from references.select_stage import inclusion_probs_reference, select_and_compact_reference
from test_select_stage import assert_picked_is, home_case

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def metric_case(g: torch.Generator, n_blocks: int, dtype: torch.dtype, grouped: bool):
    """``(metric, block, quota, size)``: blocks of 0 to 40 rows (one empty, one of a
    single row), metrics over a wide range with many exact ties (small integers and a
    repeated value), zeros, -0.0, negatives and one block of zeros only; quotas 0, the
    block's size, past it, and random in between; rows grouped by block or shuffled."""
    size = torch.randint(0, 41, (n_blocks,), generator=g)
    size[0], size[-1] = 0, 1
    N = int(size.sum())
    blk = torch.repeat_interleave(torch.arange(n_blocks), size)
    spread = 3.0 if dtype == torch.float16 else 10.0  # float16 overflows past 65504
    m = torch.exp(spread * torch.randn(N, generator=g, dtype=torch.float64))
    u = torch.rand(N, generator=g)
    m[u < 0.3] = torch.randint(0, 4, (int((u < 0.3).sum()),), generator=g).double()
    m[(u >= 0.3) & (u < 0.4)] = 0.1
    m[(u >= 0.4) & (u < 0.45)] = -1.0
    m[(u >= 0.45) & (u < 0.5)] = -0.0
    if n_blocks > 3:
        m[blk == 2] = 0.0
    quota = (torch.rand(n_blocks, generator=g, dtype=torch.float64) * 1.5 * size).round().long()
    quota[1::4] = 0
    quota[2::4] = size[2::4]
    quota[3::4] = size[3::4] + 2
    m = m.to(dtype)
    if not grouped:
        perm = torch.randperm(N, generator=g)
        m, blk = m[perm], blk[perm]
    return m, blk, quota, size


def assert_bitwise(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.int64) if a.dtype == torch.float64 else a,
                       b.view(torch.int64) if b.dtype == torch.float64 else b), \
        f"{int((a != b).sum())} rows differ, first {(a != b).nonzero()[:4].flatten().tolist()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inclusion_probs_is_the_reference_bit_for_bit(dtype):
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        n_blocks = (1, 2, 5, 18, 144)[seed % 5]
        m, blk, quota, size = metric_case(g, n_blocks, dtype, grouped=seed % 2 == 0)
        for given in (None, size):
            pi = inclusion_probs(m, blk, quota, given)
            assert_bitwise(pi, inclusion_probs_reference(m, blk, quota, given))
            assert_bitwise(pi, inclusion_probs_reference(m, blk, quota, given, stable=True))


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
def test_inclusion_probs_ranks_equal_metrics_in_row_order(dtype):
    """Equal metrics straddling the cap (a tied group whose share is exactly 1) take
    1.0 capped or 1 - 2^-53 free depending on their rank: the runtime ranks them in row
    order, as the reference does with a stable sort."""
    g = torch.Generator().manual_seed(0)
    parts_m, parts_b, quota = [], [], []
    for b in range(400):
        t = int(torch.randint(2, 60, (1,), generator=g))
        x = float(torch.rand(1, generator=g))
        k, extra = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        parts_m.append(torch.tensor([x] * t + [x * extra / k] * k)[torch.randperm(t + k, generator=g)])
        parts_b.append(torch.full((t + k,), b))
        quota.append(t + extra)
    m, blk, quota = torch.cat(parts_m).to(dtype), torch.cat(parts_b), torch.tensor(quota)
    pi = inclusion_probs(m, blk, quota)
    ref = inclusion_probs_reference(m, blk, quota, stable=True)
    assert_bitwise(pi, ref)
    # the case bites: some tied rows of one block get different probabilities
    tied = [(blk == b) & (m == v) for b, v in {(int(b), float(v)) for b, v in zip(blk, m)}]
    assert any(ref[t].unique().numel() > 1 for t in tied)


def test_inclusion_probs_keys_at_their_widest():
    """The one-sort key reaches ``(B - 1) * N * 2^31``: just under ``2^63`` it is exact;
    past ``B * N = 2^32`` (where the key would pass ``2^63``) the two-sort order takes
    over, with the same result."""
    g = torch.Generator().manual_seed(3)
    N = 2**17
    for B in (2**15 - 1, 2**15 + 1):
        m = torch.rand(N, generator=g)
        m[::7] = 0.5  # ties
        blk = torch.sort(torch.randint(0, B, (N,), generator=g)).values
        blk[-3:] = B - 1  # the key's largest values: the last block's zeros
        m[-3:] = 0.0
        quota = torch.randint(0, 3, (B,), generator=g)
        assert_bitwise(inclusion_probs(m, blk, quota), inclusion_probs_reference(m, blk, quota))


class OpCount(TorchDispatchMode):
    """Counts the aten ops run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def run_select(fn, case: dict, opts: BackwardOptions, seed: int, exchange_counts=None):
    gen = torch.Generator().manual_seed(seed)
    args = (case["dout"], case["tok"], case["g"], case["gate"], case["home"], opts, gen)
    out = (fn(*args, exchange_counts) if fn is select_and_compact
           else fn(*args, False, exchange_counts))
    return out, gen.get_state()


SHAPES = (  # T, K, E, G, S, keep: empty slots, blocks of 0 or 1 rows, quotas 0 and full
    (96, 3, 16, 4, 5, 0.5), (7, 2, 8, 2, 6, 1.0), (50, 4, 16, 4, 4, 0.0), (512, 8, 128, 8, 18, 0.4))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_select_and_compact_is_the_reference_bit_for_bit(shape):
    T, K, E, G, S, keep = shape
    for seed in range(4):
        case = home_case(T, K, 16, E, G, S, 0.65, keep, torch.device("cpu"), seed=seed)
        for opts in (BackwardOptions(estimator="sampled"),
                     BackwardOptions(estimator="sampled", metric="gate"),
                     BackwardOptions(estimator="sampled", compaction=False), BackwardOptions()):
            for counts in (None, lambda s: s.flip(0) + 1):
                got, state = run_select(select_and_compact, case, opts, seed, counts)
                ref, ref_state = run_select(select_and_compact_reference, case, opts, seed, counts)
                assert torch.equal(state, ref_state)
                assert_picked_is(got, ref, case)


def test_sampled_select_takes_one_sort_and_no_scatter():
    """At the headline's shape (4,096 tokens x top-8, 8 ranks x 18 slots) the sampled
    select sorts once, writes through no index (none of the ops torch's deterministic
    mode slows down) and gives the reference's tensors with deterministic mode on."""
    case = home_case(4096, 8, 16, 128, 8, 18, 0.65, 0.5, torch.device("cpu"), seed=0)
    opts = BackwardOptions(estimator="sampled")
    with OpCount() as count:
        got, _ = run_select(select_and_compact, case, opts, 1)
    # one sort, and one scan (the water-filling's; the compaction takes none)
    assert count.ops["sort"] == 1 and count.ops["cumsum"] == 1, count.ops
    assert not {"index_put", "index_put_", "index_copy", "index_copy_", "index_add", "index_add_",
                "scatter", "scatter_", "put_", "nonzero"} & set(count.ops), count.ops
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        again, _ = run_select(select_and_compact, case, opts, 1)
    finally:
        torch.use_deterministic_algorithms(was)
    ref, _ = run_select(select_and_compact_reference, case, opts, 1)
    assert_picked_is(got, ref, case)
    assert_picked_is(again, ref, case)


def test_sampled_layer_backward_is_unchanged(monkeypatch):
    """A whole sampled MoE layer backward (tiny-qwen3, half of every block selected)
    gives the same gradients, bit for bit, with the reference select stage."""
    from lrmoe.model import MoEForCausalLM
    from lrmoe.model.moe import MoERuntime
    from lrmoe.presets import get_preset
    from test_selection import HalfPolicy

    torch.manual_seed(0)
    base = MoEForCausalLM(get_preset("tiny-qwen3")).moe_layers[0]
    x = torch.randn(1, 24, base.cfg.hidden_size)
    coeff = torch.randn(1, 24, base.cfg.hidden_size)

    def grads():
        layer = copy.deepcopy(base)
        layer.runtime = MoERuntime(policy=HalfPolicy(), generator=torch.Generator().manual_seed(5),
                                   backward=BackwardOptions(estimator="sampled"))
        xi = x.clone().requires_grad_(True)
        for _ in range(3):
            (layer(xi) * coeff).sum().backward()
        return [xi.grad] + [p.grad for p in layer.parameters() if p.grad is not None]

    calls = []

    def reference(dout, tok_c, g_c, gate_c, home, opts, gen, exchange_counts=None):
        calls.append(1)
        tok_s, scale, sent, recv, _, idx = select_and_compact_reference(
            dout, tok_c, g_c, gate_c, home, opts, gen, False, exchange_counts)
        return Picked(idx, scale, dout[tok_s], sent, recv)

    fast = grads()
    monkeypatch.setattr(stages, "select_and_compact", reference)
    slow = grads()
    assert len(calls) == 3 and len(fast) == len(slow) > 1
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
