"""``--optimizer-offload host``: the host AdamW of the experts (same update as on the
device), the ledger's GPU-only accounting, and the emulator's offload traffic model."""

from __future__ import annotations

import copy

import pytest
import torch

from lrmoe.model import MoEForCausalLM
from lrmoe.presets import get_preset
from lrmoe.train.offload import HostOffloadAdamW, offloaded_params
from lrmoe.train.optim import build_optimizer, build_scheduler

VOCAB = get_preset("tiny-qwen3").vocab_size


def _model(seed=0):
    torch.manual_seed(seed)
    return MoEForCausalLM(get_preset("tiny-qwen3"))


def _train(model, opt, steps=4, seed=1):
    sched = build_scheduler(opt, 2, steps)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 17), generator=gen)
        _, obj = model.loss(ids[:, :-1], ids[:, 1:])
        opt.zero_grad(set_to_none=True)
        obj.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()


def test_host_adamw_equals_device_adamw():
    """A few training steps with the experts stepped by the offload path (host = CPU here)
    give the same parameters as the plain on-device AdamW, to fp32 tolerance."""
    ref, off = _model(), _model()
    _train(ref, build_optimizer(ref, 3e-3, 0.1))
    opt = build_optimizer(off, 3e-3, 0.1, offload="host")
    assert isinstance(opt, HostOffloadAdamW)
    _train(off, opt)
    experts = {id(p) for p in offloaded_params(off)}
    assert experts, "the tiny model has expert parameters to offload"
    moved = 0
    for (n, a), b in zip(ref.named_parameters(), off.parameters()):
        # the host update is torch's fused CPU AdamW, the reference its single-tensor
        # loop: they differ in the last bits, which Adam amplifies a little over steps
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=n)
        moved += int(id(b) in experts and not torch.equal(b, _model().state_dict()[n]))
    assert moved == len(experts)  # every expert weight was updated (through the host)
    for p in offloaded_params(off):  # their state lives on the host, keyed by the parameter
        st = opt.state[p]
        assert st["exp_avg"].device.type == "cpu" and float(st["step"]) == 4
        torch.testing.assert_close(opt._master[id(p)], p.detach())


def test_host_adamw_resume_from_state_dict():
    """State dict round trip: a fresh model + optimizer loaded from step 2 continue like
    the uninterrupted run."""
    a = _model()
    opt_a = build_optimizer(a, 3e-3, 0.1, offload="host")
    _train(a, opt_a, steps=2)
    b = _model(seed=7)
    b.load_state_dict(a.state_dict())
    opt_b = build_optimizer(b, 3e-3, 0.1, offload="host")
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for p in offloaded_params(b):
        assert opt_b.state[p]["exp_avg"].device.type == "cpu"
    _train(a, opt_a, steps=2, seed=5)
    _train(b, opt_b, steps=2, seed=5)
    for x, y in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(y, x, rtol=0, atol=0)


def test_build_optimizer_rejects_unknown_offload():
    from lrmoe.errors import LrmoeError
    with pytest.raises(LrmoeError, match="optimizer offload 'gpu'"):
        build_optimizer(_model(), 1e-3, 0.0, offload="gpu")
