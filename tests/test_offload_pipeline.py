"""The host optimizer's pipeline (:mod:`lrmoe.train.host_pipe`) against the serial update
it replaced (``tests/references/offload_adamw.py``): the same masters, moments, steps and
device weights, bit for bit, on fresh inputs, with and without clipping, with gradient
accumulation, on one process and under expert parallelism (gloo). On the CPU the
pipeline's copies are plain copies; its CUDA streams and pinned buffers are checked by
``tests/gpu/test_gpu_offload.py``.

The trainer's CUDA setting is forced on the CPU: bf16 expert weights and gradients on
the "device", fp32 masters and moments on the host, bf16 autocast.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from lrmoe.model import MoEForCausalLM
from lrmoe.parallel.groups import ParallelContext, clip_grad_norm, sync_grads
from lrmoe.presets import get_preset
from lrmoe.train.accum import accumulate
from lrmoe.train.offload import (
    HostOffloadAdamW,
    last_backward_hook,
    offloaded_params,
    presynced,
)
from lrmoe.train.optim import param_groups
from references.offload_adamw import SerialHostOffloadAdamW, staging_bytes

VOCAB = get_preset("tiny-qwen3").vocab_size
BF16 = torch.bfloat16
CHUNK = 7 * 64
# expert tensors of 13,320 and 6,660 elements: not multiples of AdamW's vector width
# (their last elements take its scalar path) nor of CHUNK
ODD = dataclasses.replace(get_preset("tiny-qwen3"), hidden_size=36, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=18, num_experts=5,
                          num_experts_per_tok=2, moe_intermediate_size=37, num_hidden_layers=2)
CONFIGS = {"tiny-qwen3": get_preset("tiny-qwen3"), "odd": ODD}


def _pair(cfg=CONFIGS["tiny-qwen3"], chunk=CHUNK):
    """Two copies of one model: one stepped by the pipeline, one by the serial update."""
    torch.manual_seed(0)
    a = MoEForCausalLM(cfg)
    b = copy.deepcopy(a)
    opts = []
    for m, cls in ((a, HostOffloadAdamW), (b, SerialHostOffloadAdamW)):
        kw = {"chunk": chunk} if cls is HostOffloadAdamW else {}
        opts.append(cls(param_groups(m, 0.1), offloaded_params(m), lr=3e-3,
                        compute_dtype=BF16, **kw))
    return (a, opts[0]), (b, opts[1])


def _trainer_step(model, opt, mbs, clip, arm=True):
    """The trainer's step (``lrmoe.train.loop._Run.step``) under CUDA's numerics on the
    CPU: micro-batches under bf16 autocast, the last one's backward armed, sync, clip
    with the optimizer's ``scale_grads``, AdamW. Returns the gradient norm."""
    ctx = ParallelContext()
    opt.zero_grad(set_to_none=True)
    armed = last_backward_hook(opt, ctx) if arm else None
    accumulate(model, lambda m: mbs[m], len(mbs),
               lambda: torch.autocast("cpu", dtype=BF16), before_last_backward=armed)
    sync_grads(model, ctx, presynced(opt))
    norm = clip_grad_norm(model, clip, ctx, opt.scale_grads)
    opt.step()
    return norm


def _assert_same(new, ref):
    """Every parameter and every state tensor (masters, moments, steps) bit for bit."""
    (a, oa), (b, ob) = new, ref
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
        for k, t in oa.state[p].items():
            assert torch.equal(t, ob.state[q][k]), (n, k)
    assert any(k == "master" for p in offloaded_params(a) for k in oa.state[p])


@pytest.mark.parametrize("clip", [0.05, 1e6], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_pipeline_steps_as_the_serial_update(cfg, clip, accum):
    """Several trainer steps on fresh inputs: the pipeline (gradients sent by the hooks
    during the last backward, chunks of 448 elements: many chunk boundaries inside each
    expert tensor, and a last chunk shorter than the rest) leaves what the serial update
    leaves."""
    new, ref = _pair(CONFIGS[cfg])
    assert all(p.numel() % CHUNK for p in offloaded_params(new[0]))
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        mbs = [torch.randint(0, VOCAB, (2, 17), generator=gen) for _ in range(accum)]
        norms = [_trainer_step(m, o, mbs, clip) for m, o in (new, ref)]
        assert norms[0] == norms[1]
        assert (norms[0] > clip) == (clip < 1)  # clipping acts, or never does
        _assert_same(new, ref)


def test_pipeline_without_early_sends_and_with_one_chunk():
    """Gradients sent at the step (the DP x EP order) and whole tensors as one chunk:
    still the serial update's values."""
    new, ref = _pair(ODD, chunk=1 << 21)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        mbs = [torch.randint(0, VOCAB, (2, 17), generator=gen) for _ in range(2)]
        _trainer_step(*new, mbs, 0.05, arm=False)
        _trainer_step(*ref, mbs, 0.05)
        _assert_same(new, ref)


def test_gradients_go_to_the_host_during_the_last_backward_only():
    """Armed before the last micro-batch's backward, each expert gradient is in its host
    buffer when the backward returns, equal to the final gradient; the earlier
    micro-batches' backward sent nothing, and nothing is left armed after the step."""
    (model, opt), _ = _pair()
    pipe = opt._pipe
    gen = torch.Generator().manual_seed(1)
    mbs = [torch.randint(0, VOCAB, (2, 17), generator=gen) for _ in range(3)]
    seen = []

    def arm():
        seen.append(len(pipe._landed))  # sent by the first two backwards: none
        pipe.arm(lambda g: None)
    opt.zero_grad(set_to_none=True)
    accumulate(model, lambda m: mbs[m], 3, lambda: torch.autocast("cpu", dtype=BF16),
               before_last_backward=arm)
    experts = offloaded_params(model)
    assert seen == [0]
    assert presynced(opt) == {id(p) for p in experts}
    for p in experts:
        assert p.grad.dtype == BF16 and opt._grad_buf[id(p)].dtype == BF16
        assert torch.equal(opt._grad_buf[id(p)], p.grad)
    opt.step()
    assert presynced(opt) == frozenset() and pipe._finish is None
    times = opt.pipe_times
    assert times.update_s > 0 and times.update_s >= times.grad_wait_s


def test_host_state_is_bf16_gradients_and_a_chunk_of_scratch():
    """The host holds each gradient in its own dtype (bf16: 2 bytes a parameter) and one
    chunk of fp32 scratch (on the CPU no staging ring); nothing is widened on the
    device."""
    (model, opt), _ = _pair(chunk=256)
    gen = torch.Generator().manual_seed(2)
    _trainer_step(model, opt, [torch.randint(0, VOCAB, (2, 17), generator=gen)], 0.05)
    experts = offloaded_params(model)
    assert {id(p) for p in experts} == set(opt._grad_buf)
    assert all(opt._grad_buf[id(p)].dtype == BF16 for p in experts)
    assert staging_bytes(opt) == 4 * 256


def test_chunk_must_keep_the_kernel_vectors_whole():
    from lrmoe.errors import LrmoeError

    torch.manual_seed(0)
    m = MoEForCausalLM(get_preset("tiny-qwen3"))
    for chunk in (100, 0, -64):
        with pytest.raises(LrmoeError, match=f"chunk {chunk}: use a positive multiple of 64"):
            HostOffloadAdamW(param_groups(m, 0.1), offloaded_params(m), compute_dtype=BF16,
                             chunk=chunk)


# ----------------------------------------------------------------------------- the trainer
def _serial_optimizer(model, lr, weight_decay, offload="device", host="cpu",
                      router_lr_scale=1.0, compute_dtype=None):
    return SerialHostOffloadAdamW(param_groups(model, weight_decay, lr, router_lr_scale),
                                  offloaded_params(model), lr=lr, host=host,
                                  compute_dtype=BF16)


def _train_both(tmp_path, monkeypatch, **over):
    """``lrmoe train`` (bf16 device experts and bf16 autocast forced on the CPU) with the
    pipeline and with the serial update: each run's metrics rows and its final model and
    optimizer."""
    import lrmoe.parallel.groups as groups
    import lrmoe.train.loop as loop
    from lrmoe.train import TrainConfig, train
    from lrmoe.train.metrics import read_metrics
    from lrmoe.train.optim import build_optimizer

    built, synced_early = [], []
    real_build, real_sync = loop._build, groups.sync_grads

    def keep(*a, **k):
        built.append(real_build(*a, **k))
        return built[-1]

    def sync(model, ctx, finished=()):
        synced_early.append(len(finished))
        return real_sync(model, ctx, finished)
    monkeypatch.setattr(loop, "_build", keep)
    monkeypatch.setattr(groups, "sync_grads", sync)
    monkeypatch.setattr(loop, "make_autocast",
                        lambda device: lambda: torch.autocast("cpu", dtype=BF16))
    base = dict(preset="tiny-qwen3", steps=3, batch_size=2, seq_len=32, max_data_bytes=100_000,
                eval_batches=1, eval_every=0, ckpt_every=0, threads=1, warmup=1,
                optimizer_offload="host", **over)
    rows, early = [], []
    for name, build in (("pipe", lambda *a, **k: build_optimizer(
            *a, **{**k, "compute_dtype": BF16})), ("serial", _serial_optimizer)):
        monkeypatch.setattr(loop, "build_optimizer", build)
        synced_early.clear()
        train(TrainConfig.from_flat(out=str(tmp_path / name), **base))
        rows.append([r for r in read_metrics(tmp_path / name / "metrics.jsonl")
                     if r["kind"] == "train"])
        early.append(list(synced_early))
    return rows, [(s.model, s.opt) for s in built], early


@pytest.mark.parametrize("clip", [1.0, 1e6], ids=["clipped", "unclipped"])
def test_trainer_with_the_pipeline_trains_as_the_serial_update(tmp_path, monkeypatch, clip):
    """``lrmoe train`` with 2 micro-batches a step: the same losses and gradient norms,
    and the same final weights and host state, bit for bit."""
    rows, runs, early = _train_both(tmp_path, monkeypatch, grad_accum=2, clip=clip)
    assert isinstance(runs[0][1], HostOffloadAdamW) and runs[0][1].pipelined
    # one process: every expert gradient went to the host during the last backward
    assert early == [[len(offloaded_params(runs[0][0]))] * 3, [0] * 3]
    assert isinstance(runs[1][1], SerialHostOffloadAdamW)
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in rows[0]] == [r[key] for r in rows[1]], key
    assert all((r["grad_norm"] > clip) == (clip < 10) for r in rows[0])
    _assert_same(*runs)


# ----------------------------------------------------------------------------- two ranks
def _ranks_train(rank, world, out, ep, accum):
    import pytest as _pytest

    mp = _pytest.MonkeyPatch()
    try:
        from pathlib import Path
        rows, runs, early = _train_both(Path(out), mp, ep=ep, grad_accum=accum, clip=1.0)
        if rank == 0:
            for key in ("loss", "grad_norm"):
                assert [r[key] for r in rows[0]] == [r[key] for r in rows[1]], key
        _assert_same(*runs)
        # EP alone: every expert gradient synced and sent in the last backward; DP x EP
        # (here DP 2, EP 1): none before the sync
        sent = len(offloaded_params(runs[0][0])) if ep == world else 0
        assert early == [[sent] * 3, [0] * 3]
    finally:
        mp.undo()


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("ep", [2, 1], ids=["ep2", "dp2"])
def test_two_ranks_train_as_the_serial_update(tmp_path, ep):
    """Two gloo ranks: under EP alone the hooks divide each expert gradient by the world
    as it becomes final and the sync leaves it alone; under data parallelism (the expert
    gradients all-reduced over the ranks) nothing is sent before the sync. Both train as
    the serial update, bit for bit on every rank."""
    from dist_util import run_world

    run_world(2, _ranks_train, str(tmp_path), ep, 2, tmp_path=tmp_path)


# ----------------------------------------------------------------------------- the emulator
def test_emulator_charges_the_measured_overlap(monkeypatch):
    """No overlap recorded: the offload stages are charged back to back, in full, and the
    description says the overlap is not measured; a recorded one scales every stage by
    its exposed fraction and names its source. Bytes: the compute dtype each way."""
    import lrmoe.sim.offload as so

    E, G, P = 8, 4, 1000
    serial = so.OffloadModel(E, G, P, 2, "owner")
    assert serial.overlap is None and "not measured yet" in so.assumptions()
    b = serial.rank_bytes()
    assert b["opt_d2h"] == b["opt_h2d"] == [E // G * P * 2] * G  # bf16 down and up
    full = serial.rank_seconds(None, None)
    link = so.PCIE5_X16
    assert full["opt_d2h"][0] == pytest.approx(E // G * P * 2 / link.effective_Bps
                                               + link.latency_s)
    monkeypatch.setattr(so, "MEASURED_OVERLAP", so.MeasuredOverlap(0.4, "offload_step.py, test"))
    m = so.OffloadModel(E, G, P, 2, "owner")
    part = m.rank_seconds(None, None)
    for k in ("opt_d2h", "opt_host_update", "opt_h2d"):
        assert part[k][0] == pytest.approx(0.4 * full[k][0]), k
    assert "0.400" in so.assumptions() and "offload_step.py, test" in so.assumptions()
    assert so.OffloadModel(E, G, P, 2, "owner", overlap=None).rank_seconds(None, None) == full
    from lrmoe.errors import LrmoeError
    with pytest.raises(LrmoeError, match="exposed fraction"):
        so.MeasuredOverlap(0.0, "x")


@pytest.mark.slow
def test_offload_step_benchmark_logic(tmp_path):
    """benchmarks/offload_step.py on the CPU at tiny shapes (its times are not results):
    the three modes run the trainer, the pipeline and serial modes train alike, and the
    tables are written; bad input is one line, exit 2, nothing written."""
    import json

    from dist_util import load_benchmark

    mod = load_benchmark("offload_step", "benchmarks")
    out = tmp_path / "os"
    assert mod.main(["--out", str(out), "--device", "cpu", "--workloads", "tiny", "--steps", "3",
                     "--warmup", "1", "--batch-size", "2", "--seq-len", "32",
                     "--max-data-bytes", "100000", "--threads", "1", "--chunks", "448"]) == 0
    res = json.loads((out / "offload_step.json").read_text())["results"]
    modes = {r["mode"]: r for r in res if "mode" in r}
    assert set(modes) == {"pipeline", "serial", "none", "pipeline@448"}
    assert modes["pipeline@448"]["losses"] == modes["pipeline"]["losses"]  # chunks: same math
    assert modes["pipeline"]["median_busy_ms"] > 0 and "median_host_ms" in modes["serial"]
    summary = [r for r in res if "exposed_fraction" in r]
    assert summary and summary[0]["same_losses_pipeline_serial"]
    assert modes["none"]["losses"] != modes["pipeline"]["losses"]  # its experts stood still
    assert "exposed fraction" in (out / "offload_step.md").read_text()
    assert mod.main(["--out", str(tmp_path / "x"), "--workloads", "nope", "--device", "cpu"]) == 2
    assert not (tmp_path / "x").exists()


def test_host_adamw_benchmark_logic(tmp_path):
    """benchmarks/host_adamw.py at the tiny shapes (its times are not results): every variant
    on both threads, each chunk size named; bad input is one line, exit 2."""
    import json

    from dist_util import load_benchmark

    mod = load_benchmark("host_adamw", "benchmarks")
    out = tmp_path / "ha"
    assert mod.main(["--out", str(out), "--workloads", "tiny", "--reps", "1",
                     "--chunks", "4096,65536"]) == 0
    rows = json.loads((out / "host_adamw.json").read_text())["results"]
    assert {(r["variant"], r["thread"]) for r in rows} == {
        (v, t) for v in ("one call, all tensors", "one call a tensor", "chunks of 4096",
                         "chunks of 4096, bf16 widened", "chunks of 65536",
                         "chunks of 65536, bf16 widened") for t in ("main", "worker")}
    assert all(r["median_ms"] > 0 for r in rows)
    assert mod.main(["--out", str(tmp_path / "x"), "--chunks", "many"]) == 2
    assert not (tmp_path / "x").exists()
