"""What ``bench ttl`` holds on the device at the optimizer step: the experts' optimizer
with its "host" on the parameters' own device keeps no second copy of an fp32 weight or
gradient (same update, bitwise), and neither the warm-up probe nor the step's autograd
graph (the rows the exchanges' contexts kept) outlives the backward."""

from __future__ import annotations

import contextlib
import gc
import weakref

import torch

from lrmoe.sim import ttl
from lrmoe.train import offload
from lrmoe.train.offload import HostOffloadAdamW


def _params(seed):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 6, 5)), torch.nn.Parameter(torch.randn(4, 5, 3)),
            torch.nn.Parameter(torch.randn(7))]


def test_same_device_offload_is_fused_adamw_bitwise_without_copies():
    a, b = _params(0), _params(0)
    opt = HostOffloadAdamW([{"params": a, "weight_decay": 0.1}], a[:2], lr=1e-2, host="cpu")
    ref = torch.optim.AdamW([{"params": b[:2], "weight_decay": 0.1}], lr=1e-2,
                            betas=(0.9, 0.95), eps=1e-8, fused=True)
    ref_rest = torch.optim.AdamW([{"params": b[2:], "weight_decay": 0.1}], lr=1e-2,
                                 betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, q in zip(a, b):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        ref_rest.step()
        for p, q in zip(a, b):
            assert torch.equal(p, q)
    for p in a[:2]:  # the parameter is its own master; the gradient is read in place
        assert opt.state[p]["master"].data_ptr() == p.data_ptr()
    assert not opt._grad_buf
    # a reload takes the checkpoint's master into the parameter and keeps no copy
    sd = opt.state_dict()
    sd["state"][0]["master"] = sd["state"][0]["master"] + 1
    before = a[0].detach().clone()
    opt.load_state_dict(sd)
    assert torch.equal(a[0], before + 1)
    assert opt.state[a[0]]["master"].data_ptr() == a[0].data_ptr()


def test_bench_ttl_optimizer_step_sees_no_probe_and_no_graph(monkeypatch):
    seen = []
    step = offload.HostOffloadAdamW.step
    gc.collect()  # parameters other tests in this process left alive are not the run's
    before = {id(o): weakref.ref(o) for o in gc.get_objects()
              if isinstance(o, torch.nn.Parameter)}
    # contexts other tests in this process left alive (held here, so their ids stay theirs)
    old_ctxs = [o for o in gc.get_objects() if type(o).__name__ == "ExpertExchangeBackward"]

    def spy(self, closure=None):
        mine = {id(p) for g in self.param_groups for p in g["params"]}
        objs = gc.get_objects()
        stale = [o for o in objs if isinstance(o, torch.nn.Parameter) and id(o) not in mine
                 and not (id(o) in before and before[id(o)]() is o)]
        ctxs = [o for o in objs if type(o).__name__ == "ExpertExchangeBackward"
                and not any(o is c for c in old_ctxs)]
        seen.append((len(stale), len(ctxs)))
        return step(self, closure)

    monkeypatch.setattr(offload.HostOffloadAdamW, "step", spy)
    cfg = ttl.TTLConfig.from_flat(preset="tiny-qwen3", ep=2, steps=1, batch_size=4, seq_len=16,
                                  eval_every=0, eval_batches=1, max_data_bytes=100_000,
                                  optimizer_offload="host", policies=("static",))
    was = gc.isenabled()
    gc.disable()  # only the code's own collections run
    try:
        ttl.bench_ttl(cfg, log=lambda *a: None)
    finally:
        if was:
            gc.enable()
    assert seen == [(0, 0)]


def test_warm_up_runs_its_forward_under_the_steps_autocast():
    """The untimed warm-up steps run the kernels the timed steps run: each forward inside
    their autocast (in fp32, grouped-query attention falls back to a kernel that keeps
    the whole score matrix), each backward outside, as the steps do."""
    from lrmoe.config import ModelConfig
    from lrmoe.model import MoEForCausalLM
    from lrmoe.presets import PRESETS
    from lrmoe.sim.vmodel import warm_up

    cfg = ModelConfig.from_hf_dict(dict(PRESETS["tiny-qwen3"], num_hidden_layers=2))
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    inside, seen = [False], []

    @contextlib.contextmanager
    def autocast():
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False

    model.lm_head.register_forward_hook(lambda *a: seen.append(("forward", inside[0])))
    model.lm_head.weight.register_hook(lambda g: seen.append(("backward", inside[0])))
    batch = torch.randint(0, cfg.vocab_size, (4, 17))
    warm_up(model, 2, batch, autocast)
    assert seen == [("forward", True), ("backward", False)] * 3  # plain, rows recomputed, layer
    assert model.lm_head.weight.grad is not None


def test_warm_up_runs_the_budget_fallbacks(monkeypatch):
    """The warm-up also runs static's budget fallbacks, rows recomputed in backward and a
    whole-layer checkpoint's re-run, so their kernels compile before any timed step (the
    first policy to take a fallback would otherwise pay for it); every MoE layer."""
    from lrmoe.config import ModelConfig
    from lrmoe.model import MoEForCausalLM
    from lrmoe.parallel import exchange, stages
    from lrmoe.presets import PRESETS
    from lrmoe.sim.vmodel import warm_up

    cfg = ModelConfig.from_hf_dict(dict(PRESETS["tiny-qwen3"], num_hidden_layers=2))
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    seen = {"rebuilt": 0, "rerun": 0}
    rebuild, forward = stages._rebuild_gate_up, exchange.forward_ranks

    def rebuilt(rows, keep, *a):
        seen["rebuilt"] += keep.n_rec > 0
        return rebuild(rows, keep, *a)

    def ranks(*a, rerun=False, **k):
        seen["rerun"] += rerun
        return forward(*a, rerun=rerun, **k)
    monkeypatch.setattr(stages, "_rebuild_gate_up", rebuilt)
    monkeypatch.setattr(exchange, "forward_ranks", ranks)
    warm_up(model, 2, torch.randint(0, cfg.vocab_size, (4, 17)), contextlib.nullcontext)
    layers = len(model.moe_layers)
    assert seen["rerun"] == layers, seen
    assert seen["rebuilt"] >= layers, seen
