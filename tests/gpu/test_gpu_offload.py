"""``--optimizer-offload host`` on CUDA (:mod:`offload_check`): the host optimizer lowers
the peak CUDA memory and trains to the same losses as the device optimizer, within the
spread of bf16 kernels."""

from __future__ import annotations

import tempfile
from pathlib import Path

import offload_check
from gpu_util import needs_cuda, report_dir

pytestmark = needs_cuda


def test_host_offload_lowers_the_peak_and_keeps_the_losses():
    d = report_dir("offload_check") or Path(tempfile.mkdtemp()) / "offload_check"
    assert offload_check.main(["--out", str(d), "--device", "cuda", "--steps", "30",
                               "--repeats", "2", "--seeds", "0,1,2"]) == 0
    import json

    res = json.loads((d / "offload_check.json").read_text())
    peak = {m["mode"]: m["peak_cuda_mem_bytes"] for m in res["modes"].values()}
    assert peak["host"] < peak["device"]
    # bf16 autocast: two device runs differ by ~1e-2; host vs device stays within 10x that
    assert res["summary"]["max_rel_train_loss_diff_device_vs_host"] < 0.1


def test_resumed_host_state_is_pinned_as_a_fresh_runs():
    """The trainer's CUDA setting (bf16 device experts, fp32 host state): a fresh run's
    masters and gradient buffers are pinned, its moments pageable; a reloaded one's are
    the same, and it continues bit for bit (the CPU test of the allocation is
    ``tests/test_offload.py``)."""
    import copy

    import torch

    from lrmoe.model import MoEForCausalLM
    from lrmoe.presets import get_preset
    from lrmoe.train.offload import offloaded_params
    from lrmoe.train.optim import build_optimizer

    def build(seed):
        torch.manual_seed(seed)
        model = MoEForCausalLM(get_preset("tiny-qwen3")).cuda()
        return model, build_optimizer(model, 3e-3, 0.1, offload="host",
                                      compute_dtype=torch.bfloat16)

    def step(model, opt, seed):
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
        opt.step()

    model, opt = build(0)
    for s in range(2):
        step(model, opt, s)
    fresh, fopt = build(1)
    fresh.load_state_dict(model.state_dict())
    fopt.load_state_dict(copy.deepcopy(opt.state_dict()))
    step(model, opt, 9)
    step(fresh, fopt, 9)
    for o, m in ((opt, model), (fopt, fresh)):
        for p in offloaded_params(m):
            st = o.state[p]
            assert st["master"].is_pinned() and o._grad_buf[id(p)].is_pinned()
            assert not st["exp_avg"].is_pinned() and not st["exp_avg_sq"].is_pinned()
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
