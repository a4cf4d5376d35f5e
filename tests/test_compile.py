"""``torch.compile`` of the MoE layer and of the whole model: results agree with eager
and with the loop reference, forward and gradients, on one process and under EP 2;
something is actually compiled; the only graph break is the layer's host-driven stages
(one per MoE layer); a new plan does not recompile.

Backend: ``aot_eager`` (Dynamo + AOTAutograd's joint forward/backward graph, run
eagerly). Inductor is what runs on the GPU; on the CI's 2 CPU cores its C++ codegen
costs minutes, so the compiled-kernel numerics are checked there (benchmarks).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

from compile_counts import compile_counts, reset_compile_counts
from dist_util import hot_replica_plan, load_benchmark, run_world
from lrmoe.config import ModelConfig
from lrmoe.model import MoEForCausalLM
from lrmoe.model.compile import compile_model
from lrmoe.model.moe import MoELayer, MoERuntime, host_stats
from lrmoe.parallel.comm import EPComm
from lrmoe.parallel.exchange import BackwardOptions
from lrmoe.parallel.groups import ParallelContext, shard_experts
from lrmoe.policy.base import Policy
from lrmoe.presets import get_preset
from references.moe import moe_layer_reference

BACKEND = "aot_eager"
TOL = dict(rtol=1e-5, atol=1e-6)


_grads = load_benchmark("compile_check", "tests/gpu").layer_grads


def test_compiled_layer_matches_reference():
    """Qwen3's layer (softmax router with aux loss); GLM's router and shared expert are
    covered by the whole-model test below."""
    torch.manual_seed(0)
    layer = copy.deepcopy(MoEForCausalLM(get_preset("tiny-qwen3")).moe_layers[0])
    reset_compile_counts()
    compiled = torch.compile(layer, backend=BACKEND)
    plans = []
    for seed in (1, 2):  # a second batch routes differently: a new plan, same graphs
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(2, 16, layer.cfg.hidden_size, generator=g)
        coeff = torch.randn(x.shape, generator=g)
        got = _grads(layer, x, coeff, compiled)
        aux = layer.last.aux_loss
        plans.append(host_stats(layer.runtime.stats[0])["counts_E"])
        ref = _grads(layer, x, coeff, lambda v: moe_layer_reference(layer, v))
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, **TOL)
        assert aux is not None and aux.requires_grad  # set by the eager region
    assert plans[0] != plans[1]
    n = compile_counts()
    # router before the break, shared experts / output cast after it: two graphs
    assert n["graphs"] == 2 and n["recompiles"] == 0, n


@pytest.mark.parametrize("loss_chunk", [0, 7])
def test_compiled_model_matches_eager(loss_chunk):
    """``compile_model`` (what ``lrmoe train --compile`` calls) on a 3-layer GLM (a dense
    layer, two MoE layers with the sigmoid group router and a shared expert), with and
    without ``--loss-chunk``: the training loss and every parameter agree with the eager
    model over two optimizer steps; parameter names (checkpoints) are unchanged; the graph
    breaks are the MoE layers' host-driven stages and nothing else."""
    torch.manual_seed(0)
    model = MoEForCausalLM(dataclasses.replace(get_preset("tiny-glm"), num_hidden_layers=3))
    model.set_loss_chunk(loss_chunk)
    eager = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    reset_compile_counts()
    compile_model(model, backend=BACKEND)
    assert [n for n, _ in model.named_parameters()] == names
    # SGD, not Adam: Adam turns rounding noise in gradients that are zero in exact
    # arithmetic (k_proj.bias) into full-size steps
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, eager)]
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=g)
        losses = []
        for m, opt in zip((model, eager), opts):
            opt.zero_grad()
            lm, obj = m.loss(ids[:, :-1], ids[:, 1:])
            obj.backward()
            losses.append(obj.detach())
        torch.testing.assert_close(losses[0], losses[1], **TOL)
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
        for m, opt in zip((model, eager), opts):
            opt.step()
            m.end_step()
    n = compile_counts()
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert breaks and all("MoELayer.routed" in reason for reason in breaks), list(breaks)
    # every region between breaks compiled: before the first MoE layer, between them, after
    assert n["graphs"] >= len(model.moe_layers) + 1 and n["recompiles"] == 0, n


# ---------------------------------------------------------------------------- EP 2
T, H, E, K, F = 12, 16, 8, 2, 8


class _ReplicaPolicy(Policy):
    name = "replica-test"

    def plan(self, counts_GE, inputs):
        return hot_replica_plan(counts_GE, avoid_owner=False)


def _ep_worker(rank, world, backend=BACKEND, backward=None):
    """Rank ``rank`` of an EP group with replicas across ranks, against the loop reference
    on all tokens; compiled with ``backend`` (``None``: eager), with ``backward`` options."""
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=32, hidden_size=H, num_attention_heads=2,
                      num_key_value_heads=1, moe_intermediate_size=F, num_experts=E,
                      num_experts_per_tok=K, num_hidden_layers=1, intermediate_size=32)
    torch.manual_seed(0)
    layer = MoELayer(cfg, 0)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, world * T, H, generator=g)
    coeff = torch.randn(x.shape, generator=g)
    ref = _grads(layer, x, coeff, lambda v: moe_layer_reference(layer, v))

    sl = slice(rank * T, (rank + 1) * T)
    shard_experts(layer, ParallelContext(world=world, rank=rank, ep_size=world,
                                         ep_group=dist.group.WORLD))
    layer.runtime = MoERuntime(comm=EPComm(dist.group.WORLD), policy=_ReplicaPolicy(),
                               backward=backward or BackwardOptions())
    reset_compile_counts()
    run = layer if backend is None else torch.compile(layer, backend=backend)
    y, dx, g13, g2, gr = _grads(layer, x[:, sl], coeff[:, sl], run)
    assert layer.runtime.stats[0]["plan_replicas"] == 2  # replicas across ranks ran
    dist.all_reduce(gr)
    per = E // world
    own = slice(rank * per, (rank + 1) * per)
    torch.testing.assert_close(y, ref[0][:, sl], **TOL)
    torch.testing.assert_close(dx, ref[1][:, sl], **TOL)
    torch.testing.assert_close(g13, ref[2][own], **TOL)
    torch.testing.assert_close(g2, ref[3][own], **TOL)
    torch.testing.assert_close(gr, ref[4], **TOL)
    n = compile_counts()
    assert n["graphs"] == (0 if backend is None else 2) and n["recompiles"] == 0, n


@pytest.mark.dist
def test_compiled_layer_under_ep2_matches_reference(tmp_path):
    run_world(2, _ep_worker, tmp_path=tmp_path)


def test_train_compile_flag_same_losses(tmp_path, capsys, monkeypatch):
    """``lrmoe train --compile`` compiles (aot_eager here, inductor by default) and trains
    to the same losses as the eager run."""
    import lrmoe.model.compile as mc
    from lrmoe.cli import main
    from lrmoe.train.metrics import read_metrics

    calls = []

    def aot_eager(model, backend="inductor", **kw):
        calls.append(backend)
        return compile_model(model, backend=BACKEND, **kw)

    monkeypatch.setattr(mc, "compile_model", aot_eager)
    small = ["--preset", "tiny-qwen3", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
             "--max-data-bytes", "100000", "--eval-every", "0", "--eval-batches", "1",
             "--threads", "1", "--warmup", "1"]
    losses = {}
    reset_compile_counts()
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        assert main(["train", "--out", str(tmp_path / name), *small, *extra]) == 0
        losses[name] = [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")
                        if r.get("kind") == "train"]
    assert calls == ["inductor"]
    assert compile_counts()["graphs"] > 0
    assert len(losses["eager"]) == 3
    torch.testing.assert_close(losses["compiled"], losses["eager"], rtol=1e-4, atol=1e-5)
    # the out-of-memory line's way on for a compiled run: the checkpoint runs eager only
    more = ["train", "--out", str(tmp_path / "compiled"), "--resume", "--steps", "4",
            "--activation-checkpoint", "full"]
    assert main(more) == 2
    assert main([*more, "--no-compile"]) == 0
    rows = read_metrics(tmp_path / "compiled" / "metrics.jsonl")
    assert [r["step"] for r in rows if r.get("kind") == "train"][-1] == 4
    assert calls == ["inductor"]


def test_compile_check_script_catches_a_wrong_reference(monkeypatch):
    """``tests/gpu/compile_check.py`` (the inductor check run on the GPU) on the CPU with
    Dynamo's eager backend: it passes on correct code and flags a reference 1% off."""
    cc = load_benchmark("compile_check", "tests/gpu")
    got = cc.check_layer("cpu", "eager", 8)
    assert got["ok"] and max(got["rel_err"].values()) < 1e-5 and got["recompiles"] == 0
    real = cc.moe_layer_reference
    monkeypatch.setattr(cc, "moe_layer_reference", lambda layer, v: real(layer, v) * 1.01)
    bad = cc.check_layer("cpu", "eager", 8)
    assert not bad["ok"] and bad["rel_err"]["out"] > 5e-3
    assert "FAIL" in cc.markdown({"device": "cpu", "backend": "eager"}, bad,
                                 dict(loss_rel_err=0.0, grad_rel_err=0.0, worst_param="",
                                      tol=1e-3, graphs=1, graph_breaks=0, recompiles=0, ok=True))
