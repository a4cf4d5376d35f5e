"""``--optimizer-offload host`` on CUDA (:mod:`offload_check`): the host optimizer lowers
the peak CUDA memory and trains to the same losses as the device optimizer, within the
spread of bf16 kernels; its pipeline (side streams, pinned buffers, events) leaves what
the serial update leaves, bit for bit, with no device-wide synchronisation."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the references
sys.path.insert(0, str(Path(__file__).resolve().parent))

import offload_check  # noqa: E402
from gpu_util import needs_cuda, report_dir  # noqa: E402

pytestmark = needs_cuda


def test_host_offload_lowers_the_peak_and_keeps_the_losses():
    d = report_dir("offload_check") or Path(tempfile.mkdtemp()) / "offload_check"
    assert offload_check.main(["--out", str(d), "--device", "cuda", "--steps", "30",
                               "--repeats", "2", "--seeds", "0,1,2"]) == 0
    import json

    res = json.loads((d / "offload_check.json").read_text())
    peak = {m["mode"]: m["peak_cuda_mem_bytes"] for m in res["modes"].values()}
    assert peak["host"] < peak["device"]
    # bf16 autocast: two runs of one mode differ by up to ~0.1 at a loss spike, so the
    # modes are read against that measured spread, averaged over the steps
    sm = res["summary"]
    assert sm["mean_rel_train_loss_diff_device_vs_host"] <= 2 * sm["mean_rel_train_loss_diff_within_mode"]
    assert not sm["host_mean_outside_device_range"]


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


def test_pipeline_on_cuda_steps_as_the_serial_update(monkeypatch):
    """tiny-qwen3 with bf16 device experts under bf16 autocast, 2 micro-batches a step,
    clipped. Each step's gradients come from one backward (the pipelined model's, its
    hooks armed before the last micro-batch) and are copied into the serial model, so
    both optimizers see the same gradients. Every expert gradient is in its pinned host
    buffer before the step; the step makes no device-wide synchronisation (the serial
    update makes two); masters, moments, steps and device weights are equal bit for bit
    after every step; the staging ring is pinned and the copies are timed."""
    import copy

    import torch

    from lrmoe.model import MoEForCausalLM
    from lrmoe.parallel.groups import ParallelContext, clip_grad_norm
    from lrmoe.presets import get_preset
    from lrmoe.train.accum import accumulate
    from lrmoe.train.offload import (
        HostOffloadAdamW,
        last_backward_hook,
        offloaded_params,
        presynced,
    )
    from lrmoe.train.optim import param_groups
    from references.offload_adamw import SerialHostOffloadAdamW

    bf16, dev = torch.bfloat16, torch.device("cuda")
    cfg = get_preset("tiny-qwen3")
    torch.manual_seed(0)
    a = MoEForCausalLM(cfg).to(dev)
    b = copy.deepcopy(a)
    oa = HostOffloadAdamW(param_groups(a, 0.1), offloaded_params(a), lr=3e-3,
                          compute_dtype=bf16, chunk=7 * 64 * 64)
    ob = SerialHostOffloadAdamW(param_groups(b, 0.1), offloaded_params(b), lr=3e-3,
                                compute_dtype=bf16)
    experts = offloaded_params(a)
    ctx = ParallelContext(device=dev)
    syncs = []
    real_sync = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda *x: (syncs.append(1), real_sync(*x))[1])
    gen = torch.Generator().manual_seed(4)
    for step in range(4):
        oa._pipe.timing = step == 3
        for o in (oa, ob):
            o.zero_grad(set_to_none=True)
        mbs = [torch.randint(0, cfg.vocab_size, (4, 33), generator=gen).to(dev) for _ in range(2)]
        accumulate(a, lambda m, mbs=mbs: mbs[m], 2, lambda: torch.autocast("cuda", dtype=bf16),
                   before_last_backward=last_backward_hook(oa, ctx))
        assert presynced(oa) == {id(p) for p in experts}  # sent during the last backward
        for ev in oa._pipe._landed.values():
            ev.synchronize()
        for p in experts:
            host = oa._grad_buf[id(p)]
            assert host.is_pinned() and host.dtype == bf16
            assert torch.equal(host, p.grad.cpu())
        for p, q in zip(a.parameters(), b.parameters()):
            q.grad = p.grad.clone()
        norms = [clip_grad_norm(m, 0.05, ctx, o.scale_grads) for m, o in ((a, oa), (b, ob))]
        assert norms[0] == norms[1] > 0.05
        syncs.clear()
        oa.step()
        assert not syncs, "the pipelined step synchronised the device"
        ob.step()
        # the counter counts: the serial update waits for the device (its own bound
        # synchronize, taken before the patch, is not seen; its direct one is)
        assert syncs, "the serial update's wait was not counted"
        real_sync()
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), (step, n)
            for k, t in oa.state[p].items():
                assert torch.equal(t, ob.state[q][k]), (step, n, k)
    assert oa._pipe._ring and all(t.is_pinned() for t in oa._pipe._ring)
    ms = oa._pipe.copy_ms()
    assert ms["d2h"] > 0 and ms["h2d"] > 0
    assert oa.pipe_times.update_s > 0
