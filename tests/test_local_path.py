"""The one-process local path (``run_local`` in ``parallel/exchange.py``): no host wait, same results.

Against the exchange (``MoERuntime(fast_local=False)``) on fresh random inputs with
uneven loads and experts without tokens: forward, input, router and expert gradients are
bitwise equal (same kernels, same order), fp32 and bf16, and close to the loop
reference. It runs whole on the meta device (any host read of device data fails there),
the exchange does not. It is taken only for the plain static policy's trivial plan on
one process; its stats equal the exchange's (the counts resolved by their reader), and what it keeps
for backward is the ledger's static terms, itemized.
"""

from __future__ import annotations

import copy

import pytest
import torch

import test_ledger_truth as truth
from lrmoe.errors import LrmoeError
from lrmoe.ledger import Ledger
from lrmoe.model import MoEForCausalLM
from lrmoe.model.moe import MoELayer, MoERuntime, host_stats
from lrmoe.ops import experts as ops
from lrmoe.parallel.exchange import BackwardOptions
from lrmoe.policy.base import PlanInputs
from lrmoe.policy.lrmoe import LrmoeConfig, LrmoePolicy
from lrmoe.policy.static import StaticPolicy
from lrmoe.policy.symi import SymiPolicy
from lrmoe.presets import get_preset
from lrmoe.train.metrics import layer_row, rank_summary
from onerank import one_rank_layer
from references.moe import moe_layer_reference

EXPERTS = BackwardOptions(router_grad="experts")
TIMES = ("count_exchange_ms", "plan_ms", "expert_fwd_ms", "expert_bwd_ms")


def _layer(preset: str, dtype=torch.float32, seed: int = 0) -> MoELayer:
    """A tiny preset's first MoE layer whose router never picks the last two experts and
    favours the first ones (uneven loads, empty experts)."""
    torch.manual_seed(seed)
    layer = copy.deepcopy(MoEForCausalLM(get_preset(preset)).moe_layers[0])
    E = layer.cfg.num_experts
    with torch.no_grad():
        w = layer.router.weight
        w += torch.linspace(0.5, -0.5, E)[:, None] * w.abs().mean()
        w[E - 2:] = -w[:E - 2].abs().sum(0) * 10  # logits far below the others' for x > 0
    return layer.to(dtype)


def _inputs(layer: MoELayer, T: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    H = layer.cfg.hidden_size
    x = (torch.rand(1, T, H, generator=g) + 0.1).to(dtype)  # positive: see _layer
    return x, torch.randn(x.shape, generator=g).to(dtype)


def _grads(layer: MoELayer, x, coeff, fn=None):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = (fn or layer)(x)
    (y.float() * coeff.float()).sum().backward()
    return [y.detach(), x.grad, layer.experts.gate_up_proj.grad, layer.experts.down_proj.grad,
            layer.router.weight.grad]


def _counts(layer: MoELayer, x) -> torch.Tensor:
    with torch.no_grad():
        idx = layer.router(x.reshape(-1, x.shape[-1])).idx_TK
    return torch.bincount(idx.flatten(), minlength=layer.cfg.num_experts)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-glm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opts", [BackwardOptions(), EXPERTS], ids=["home", "experts"])
def test_local_equals_exchange_bitwise_and_reference(preset, dtype, opts):
    layer = _layer(preset, dtype)
    for T, seed in ((37, 1), (1, 2), (64, 3)):
        x, coeff = _inputs(layer, T, seed, dtype)
        c = _counts(layer, x)
        assert c[-2:].sum() == 0  # experts without tokens
        assert T == 1 or c.max() > 2 * c[c > 0].min()  # uneven loads
        got = {}
        for fast in (True, False):
            layer.runtime = MoERuntime(backward=opts, fast_local=fast)
            got[fast] = _grads(layer, x, coeff)
            assert layer.last.path == ("local" if fast else "exchange")
        for name, a, b in zip(("y", "dx", "dw13", "dw2", "drouter"), got[True], got[False]):
            assert a.dtype == b.dtype and torch.equal(a, b), (preset, dtype, T, name)
        assert got[True][2][-2:].abs().sum() == 0  # experts without tokens: zero gradient
        ref = _grads(layer, x, coeff, lambda v: moe_layer_reference(layer, v))
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
        for a, b in zip(got[True], ref):
            torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-glm"])
def test_zero_tokens_give_an_empty_output_and_zero_gradients(preset):
    """A micro-batch without tokens (no pairs) takes the exchange on one process too, by
    the rule; the local path would give the same: an empty output and input gradient and
    zero expert and router gradients."""
    layer = _layer(preset)
    x, coeff = _inputs(layer, 0, 1)
    layer.runtime = MoERuntime()
    got = _grads(layer, x, coeff)
    assert layer.last.path == "exchange"
    assert got[0].shape == got[1].shape == x.shape
    assert all(torch.equal(g, torch.zeros_like(g)) for g in got[2:])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("lrmoe.model.moe.runs_locally", lambda *a, **k: True)
        local = _grads(layer, x, coeff)
        assert layer.last.path == "local"
    assert all(torch.equal(a, b) for a, b in zip(got, local))


def test_local_loop_fallback_reads_host_counts(monkeypatch):
    """Without grouped GEMMs the per-expert loop runs on host counts (read from the
    device offsets where the loop runs): same results as the exchange's loop."""
    monkeypatch.setattr(ops, "_grouped_ok", lambda a, b: False)
    layer = _layer("tiny-qwen3")
    x, coeff = _inputs(layer, 29, 5)
    got = {}
    for fast in (True, False):
        layer.runtime = MoERuntime(fast_local=fast)
        got[fast] = _grads(layer, x, coeff)
    for a, b in zip(got[True], got[False]):
        assert torch.equal(a, b)
    ref = _grads(layer, x, coeff, lambda v: moe_layer_reference(layer, v))
    for a, b in zip(got[True], ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-glm"])
@pytest.mark.parametrize("opts", [BackwardOptions(), EXPERTS], ids=["home", "experts"])
def test_no_host_read_on_the_meta_device(preset, opts):
    """Meta tensors have no data: ``.item()``, ``.tolist()``, ``.cpu()``, ``torch.equal``,
    ``nonzero``, CUDA-style ``bincount`` all fail. bf16 takes the grouped GEMMs (as on
    CUDA), so the local path's forward and backward run through, the exchange's do not."""
    for fast in (True, False):
        layer = _layer(preset, torch.bfloat16).to("meta")
        layer.runtime = MoERuntime(backward=opts, fast_local=fast)
        x = torch.empty(2, 16, layer.cfg.hidden_size, dtype=torch.bfloat16,
                        device="meta", requires_grad=True)
        if not fast:
            with pytest.raises((RuntimeError, NotImplementedError)):
                layer(x)
            continue
        y = layer(x)
        aux = layer.last.aux_loss
        (y.sum() if aux is None else y.sum() + aux).backward()
        assert layer.last.path == "local"
        assert x.grad.shape == x.shape and layer.experts.gate_up_proj.grad.device.type == "meta"
        assert layer.router.weight.grad is not None


def _path(layer, x, **rt) -> str:
    layer.runtime = MoERuntime(**rt)
    layer(x).sum().backward()
    return layer.last.path


def test_taken_only_for_the_trivial_one_rank_plan():
    layer = _layer("tiny-qwen3")
    cfg, E = layer.cfg, layer.cfg.num_experts
    x, _ = _inputs(layer, 24, 7)
    # rank 0 of two (synthetic peers): the exchange
    two = one_rank_layer(layer, 0, torch.stack([_counts(layer, x)] * 2), StaticPolicy())
    assert _path(two, x, comm=two.runtime.comm) == "exchange"
    assert _path(layer, x) == "local"
    assert _path(layer, x, backward=EXPERTS) == "local"
    assert _path(layer, x, fast_local=False) == "exchange"
    assert _path(layer, x, policy=SymiPolicy(slots_per_rank=E + 1)) == "exchange"
    assert _path(layer, x, policy=LrmoePolicy(LrmoeConfig())) == "exchange"

    class MyStatic(StaticPolicy):
        pass
    assert _path(layer, x, policy=MyStatic()) == "exchange"
    for o in (BackwardOptions(fidelity=True), BackwardOptions(metric="gate"),
              BackwardOptions(estimator="sampled"), BackwardOptions(compaction=False)):
        assert _path(layer, x, backward=o) == "exchange", o
    # a budget: the ledger's check (or recompute) decides
    P = 24 * cfg.num_experts_per_tok
    plan = StaticPolicy().plan(torch.tensor([[P] + [0] * (E - 1)]), PlanInputs())
    terms = Ledger(cfg, 1).rank_terms(plan)[0]
    fits = Ledger(cfg, 1, terms["total"])
    assert _path(layer, x, ledger=fits) == "local"
    assert layer.runtime.stats[0]["ledger_total_bytes"] == terms["total"]
    assert _path(layer, x, ledger=fits, policy=StaticPolicy(recompute=True)) == "local"
    tight = Ledger(cfg, 1, terms["total"] - terms["retained_acts"] // 3)
    assert _path(layer, x, ledger=tight, policy=StaticPolicy(recompute=True)) == "exchange"
    assert layer.runtime.stats[0]["recomputed_rows"] > 0
    msgs = []
    for fast in (True, False):  # over budget without recompute: the same error either way
        layer.runtime = MoERuntime(ledger=tight, fast_local=fast)
        with pytest.raises(LrmoeError) as err:
            layer(x)
        msgs.append(str(err.value))
    assert msgs[0] == msgs[1] and "budget" in msgs[0], msgs


def test_stats_equal_the_exchanges_and_counts_stay_on_the_device():
    layer = _layer("tiny-glm")
    x, coeff = _inputs(layer, 40, 9)
    stats = {}
    for fast in (True, False):
        layer.runtime = MoERuntime(fast_local=fast)
        _grads(layer, x, coeff)
        stats[fast] = layer.runtime.stats[0]
    raw = stats[True]
    assert isinstance(raw["counts_E"], torch.Tensor)  # not read: still the device tensor
    assert torch.equal(raw["counts_E"], _counts(layer, x))
    st = host_stats(raw)  # the reader's one host read
    want = {k: v for k, v in stats[False].items() if k not in TIMES + ("_events",)}
    assert want["counts_E"] == _counts(layer, x).tolist()
    assert {k: v for k, v in st.items() if k not in TIMES + ("_events",)} == want
    for a, b in ((rank_summary(st), rank_summary(stats[False])),
                 (layer_row(st, [rank_summary(st)]), layer_row(stats[False], [rank_summary(stats[False])]))):
        assert {k: v for k, v in a.items() if k not in TIMES} == \
            {k: v for k, v in b.items() if k not in TIMES}
    assert set(st) == set(stats[False])


def test_train_metrics_are_the_exchanges(tmp_path, monkeypatch):
    """``lrmoe train`` on one process: the same losses and per-layer metrics (timings
    aside) with the local path as with the exchange (forced by making it never apply)."""
    import lrmoe.model.moe as moe
    from lrmoe.cli import main
    from lrmoe.train.metrics import read_metrics

    small = ["--preset", "tiny-glm", "--steps", "2", "--batch-size", "2", "--seq-len", "32",
             "--max-data-bytes", "100000", "--eval-every", "0", "--eval-batches", "1",
             "--threads", "1", "--warmup", "1"]
    rows, paths = {}, []
    real = moe.runs_locally

    def spy(*a, **k):
        paths.append(real(*a, **k))
        return paths[-1]
    for fast in (True, False):
        monkeypatch.setattr(moe, "runs_locally", spy if fast else lambda *a, **k: False)
        assert main(["train", "--out", str(tmp_path / str(fast)), *small]) == 0
        rows[fast] = [r for r in read_metrics(tmp_path / str(fast) / "metrics.jsonl")
                      if r.get("kind") == "train"]
    assert paths and all(paths)
    assert len(rows[True]) == 2
    drop = {"elapsed_s", "step_s", "tokens_per_s", "host_rss_bytes", "host_peak_rss_bytes",
            "host_rss_before_build_bytes"}
    for a, b in zip(rows[True], rows[False]):
        for r in (a, b):
            r["moe"] = [{k: v for k, v in m.items() if k not in TIMES} for m in r["moe"]]
        assert {k: v for k, v in a.items() if k not in drop} == \
            {k: v for k, v in b.items() if k not in drop}


# ------------------------------------------------------------------------- the ledger
def _kept(node) -> dict[int, int]:
    """``{storage: bytes}`` of every tensor the Function's backward node holds (saved
    tensors and ctx attributes, the stats' device counts among them), but the plan-derived
    ones (host memory on a GPU, as ``test_ledger_truth`` counts)."""
    attrs = dict(vars(node))
    out, host = list(node.saved_tensors), []
    truth._tensors([attrs, node.st.tp.stats], out, set())
    truth._tensors([node.st.plan, node.keep_G], host, set())  # the plan and what it derives
    hs = {truth._storage(t)[0] for t in host}
    return {p: nb for p, nb in map(truth._storage, out) if p not in hs}


def _node(out, name: str):
    node = out.grad_fn
    while type(node).__name__ != name:
        node = node.next_functions[0][0]
    return node


@pytest.mark.parametrize("opts", [BackwardOptions(), EXPERTS], ids=["home", "experts"])
def test_kept_bytes_are_the_ledgers_itemized(opts):
    """What the local path keeps for backward against ``Ledger`` for one rank's static
    plan (per layer, ``L = 1``), and against the exchange on one process, which keeps
    exactly the ledger's terms. Itemized: the local path keeps per pair two int64
    indices, not three (no row-in-block: only selection reads it), plus the ``E`` int32
    offsets and the ``E`` int64 device counts its stats hold (the exchange's are on
    the host)."""
    layer, x, _ = truth._layer_and_tokens()
    cfg, T, H, F, E, K = truth._cfg(), truth.T, truth.H, truth.F, truth.E, truth.K
    P = T * K
    led = Ledger(cfg, 1, num_moe_layers=1, router_grad_at_experts=opts.router_grad == "experts")
    t = led.terms(E, P, P, P, exact=True)
    ledger = t["retained_acts"] + t["combine_rows"] + t["pair_index"]
    params = {truth._storage(p)[0] for p in layer.parameters()}
    got = {}
    for fast in (True, False):
        layer.runtime = MoERuntime(backward=opts, fast_local=fast)
        out = layer(x[:T].view(1, T, H))
        stor = _kept(_node(out, "ExpertExchangeBackward"))
        weights = sum(nb for p, nb in stor.items() if p in params)
        assert weights == t["instance_weights"]  # the owned parameters themselves
        got[fast] = sum(nb for p, nb in stor.items() if p not in params)
    assert got[False] == ledger
    assert got[True] == ledger - 8 * P + 4 * E + 8 * E
    assert t["combine_rows"] == (0 if opts.router_grad == "experts" else P * H * 4)
    assert t["retained_acts"] == P * (H + 2 * F) * 4


def test_backward_rows_alive_are_the_exchanges():
    """The rows alive at every point of the backward (``live_rows.LiveRows``, as in
    ``test_ledger_truth``): the local path's largest set equals the exchange's on one
    process, and the ledger's buffers for that plan."""
    from live_rows import LiveRows, exchange_code, row_seams

    layer, x, _ = truth._layer_and_tokens()
    cfg, T, H, F, E, K = truth._cfg(), truth.T, truth.H, truth.F, truth.E, truth.K
    peak = {}
    for fast in (True, False):
        layer.runtime = MoERuntime(fast_local=fast)
        out = layer(x[:T].view(1, T, H))
        assert layer.last.path == ("local" if fast else "exchange")
        node = _node(out, "ExpertExchangeBackward")
        # no reference held here: backward frees the kept rows as it goes
        nb = sum(k.untyped_storage().nbytes() for k in node.kept[0].values())
        dout = torch.ones_like(out)
        live = LiveRows((H, F, 2 * F), exchange_code()[1], row_seams(),
                        count=[*node.kept[0].values(), dout])
        del node
        with live:
            out.backward(dout)
        peak[fast] = max(sum(p.values()) for _, p in live.points) - nb
    assert peak[True] == peak[False] > 0
    P = T * K
    plan = StaticPolicy().plan(torch.tensor([[P] + [0] * (E - 1)]), PlanInputs())
    # the ledger's buffers for that plan: the same largest point (its backward's), plus
    # the expert backward's 20 index bytes per row (Ledger.rows_buffer_bytes)
    buf = Ledger(cfg, 1, num_moe_layers=1).rank_terms(plan, plan_buffers=True)[0]["buffers"]
    assert peak[True] + 20 * P == buf


@pytest.mark.parametrize("opts", [BackwardOptions(), EXPERTS], ids=["home", "experts"])
def test_only_dgu_and_dout_alive_at_the_dx_gemm(opts, monkeypatch):
    """As ``test_backward_frees`` checks for the exchange: the kept rows are dropped at
    their last use, so at the dx GEMM only its input ``dgu`` and the output gradient
    are alive."""
    import weakref

    from live_rows import LiveRows

    layer, x, _ = truth._layer_and_tokens()
    T, H, F = truth.T, truth.H, truth.F
    gmm, at_dx, state = ops._gmm, [], {}

    def hook(a, b, *rest):
        if a.dim() == 2 and b.dim() == 3 and a.shape[1] == 2 * F and b.shape[1] == 2 * F:
            live = state["live"]
            at_dx.append((set(live.alive()), live.storage_id(a),
                          [k for k, ref in state["kept"].items() if ref() is not None]))
        return gmm(a, b, *rest)
    monkeypatch.setattr(ops, "_gmm", hook)
    layer.runtime = MoERuntime(backward=opts)
    out = layer(x[:T].view(1, T, H))
    rows = {k: t for k, t in _node(out, "ExpertExchangeBackward").kept[0].items() if t.numel()}
    assert set(rows) == ({"x", "gu"} if opts.router_grad == "experts" else {"x", "gu", "y_send"})
    state["kept"] = {k: weakref.ref(t.untyped_storage()) for k, t in rows.items()}
    dout = torch.ones_like(out)
    state["live"] = live = LiveRows((H, F, 2 * F), [], count=[*rows.values(), dout])
    del rows
    with live:
        out.backward(dout)
    assert len(at_dx) == 1
    alive, dgu, kept_alive = at_dx[0]
    assert not kept_alive and alive == {dgu, live.storage_id(dout)}


def test_a_second_backward_is_refused():
    layer = _layer("tiny-qwen3")
    x, _ = _inputs(layer, 8, 4)
    y = layer(x.requires_grad_())
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once per forward"):
        y.sum().backward()



def test_a_step_mixing_the_paths_counts_on_one_device():
    """The local path counts on the device, the exchange on the host (found on an H200:
    a benchmark that ran both on one layer in one step failed adding cuda to cpu
    counts). Here the device is meta (CPU has only one device): the step's sum stays on
    the device of its first count, and the exchange's planner gets host popularity."""
    layer = _layer("tiny-qwen3")
    E = layer.cfg.num_experts
    x, _ = _inputs(layer, 16, 3)
    want = _counts(layer, x)
    layer.runtime = MoERuntime(fast_local=False)
    layer.train()
    layer.step_counts_E = torch.zeros(E, dtype=torch.long, device="meta")  # as if local ran
    layer(x)
    assert layer.step_counts_E.device.type == "meta"
    layer.step_counts_E = None
    layer(x)  # exchange first, then local: the sum stays on the host
    layer.runtime = MoERuntime()
    layer(x)
    assert layer.last.path == "local" and torch.equal(layer.step_counts_E, 2 * want)
    # popularity left by a local step on the device is copied to the host before the
    # planner sees it (a meta tensor cannot be: the copy fails before planning)
    seen = []

    class Spy(StaticPolicy):
        def plan(self, counts_GE, inputs):
            seen.append(inputs.prev_counts_E.device.type)
            return super().plan(counts_GE, inputs)
    layer.prev_counts_E = want.clone()
    layer.runtime = MoERuntime(policy=Spy())
    layer(x)
    layer.prev_counts_E = want.to("meta")
    with pytest.raises(NotImplementedError):
        layer(x)
    assert seen == ["cpu"], seen


def test_local_stats_follow_the_token_count():
    """The local path's stats (rank loads) are this forward's token count's, not the
    last one's."""
    layer = _layer("tiny-qwen3")
    K = layer.cfg.num_experts_per_tok
    for T in (16, 8, 16, 5):
        x, _ = _inputs(layer, T, seed=T)
        layer(x)
        stats = layer.runtime.stats[0]
        assert layer.last.path == "local"
        assert stats["rank_load"] == [T * K] and stats["rank_backward_load"] == [T * K]
        assert stats["fwd_rows"] == T * K


@pytest.mark.parametrize("fast", [True, False])
def test_expert_kernels_are_timed_always_and_the_control_plane_on_request(fast):
    """The expert kernels' times are in every layer's stats (bench ttl and the metrics read
    them); the exchange's ``local`` and ``gather`` only with ``stage_timing`` (the local
    path, one block of device ops, times its expert kernels alone)."""
    layer = _layer("tiny-glm")
    x, coeff = _inputs(layer, 40, 9)
    for timing in (False, True):
        layer.runtime = MoERuntime(fast_local=fast, stage_timing=timing)
        _grads(layer, x, coeff)
        ms = {k for k in layer.runtime.stats[0] if k.endswith("_ms")}
        assert {"expert_fwd_ms", "expert_bwd_ms"} <= ms, ms
        assert ({"local_ms", "gather_ms"} <= ms) == (timing and not fast), ms
