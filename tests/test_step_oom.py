"""Out of memory during a step: the allocator's (host or CUDA) as one line naming the
micro-batch and what would fit, exit 2, checkpoints intact; and the ledger's verdict
with one need, the same in the verdict and in its rank's line."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lrmoe.cli import main
from lrmoe.errors import OutOfMemory
from lrmoe.ledger import Ledger
from lrmoe.train import checkpoint as ckpt
from lrmoe.train import rundir
from lrmoe.train.step_oom import verdict
from lrmoe.units import fmt_bytes
from test_reliability import digest, one_error_line, train, write_corpus

ROOT = Path(__file__).resolve().parents[1]
HOST_OOM = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
            "allocate memory: you tried to allocate 86146560 bytes. Error code 12 (Cannot "
            "allocate memory)")


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def run(tmp_path_factory, text) -> Path:
    """A finished 2-step run (2 micro-batches a step) with its checkpoint."""
    d = tmp_path_factory.mktemp("run") / "run"
    assert train(d, text, "--steps", "2", "--grad-accum", "2") == 0
    return d


def _fail_in_micro_batch(monkeypatch, error: BaseException, at_call: int) -> None:
    """The model's loss raises ``error`` on its ``at_call``-th call (1-based)."""
    from lrmoe.model import MoEForCausalLM

    real, calls = MoEForCausalLM.loss, [0]

    def loss(self, *a, **kw):
        calls[0] += 1
        if calls[0] == at_call:
            raise error
        return real(self, *a, **kw)

    monkeypatch.setattr(MoEForCausalLM, "loss", loss)


@pytest.mark.parametrize("error, words", [
    (RuntimeError(HOST_OOM), ["host out of memory", "DefaultCPUAllocator", "86146560 bytes"]),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                            "total capacity of 139.8 GiB of which 1.1 GiB is free. Of the "
                            "allocated memory ..."),
     ["GPU out of memory", "Tried to allocate 2.00 GiB"]),
])
def test_out_of_memory_in_a_micro_batch_is_one_line(tmp_path, run, capsys, monkeypatch,
                                                    error, words):
    import shutil

    again = tmp_path / "again"
    shutil.copytree(run, again)
    before = digest(again / "checkpoints")
    _fail_in_micro_batch(monkeypatch, error, at_call=2)  # step 3, its second micro-batch
    capsys.readouterr()
    assert main(["train", "--out", str(again), "--resume", "--steps", "4"]) == 2
    line = one_error_line(capsys.readouterr().err, *words, "at step 3",
                          "micro-batch 2 of 2", "4 sequences x 32 tokens",
                          f"{ckpt.ckpt_dir(again, 2)}, is intact",
                          "--activation-checkpoint full", "--grad-accum", "lrmoe plan")
    assert "Of the allocated memory" not in line  # the allocator's first sentences only
    assert digest(again / "checkpoints") == before
    assert not (again / rundir.LOCK).exists()


def test_a_real_host_allocation_failure_is_one_line(tmp_path, text):
    """The CPU allocator's own error: an address-space limit a little above what the
    process holds before training, and a micro-batch whose logits alone exceed it."""
    code = (
        "import resource, sys\n"
        "import lrmoe.cli, torch\n"
        "vm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmSize'))\n"
        "lim = vm * 1024 + (3 << 30)\n"
        "resource.setrlimit(resource.RLIMIT_AS, (lim, lim))\n"
        "sys.exit(lrmoe.cli.main(sys.argv[1:]))\n")
    out = tmp_path / "run"
    cmd = [sys.executable, "-c", code, "train", "--preset", "tiny-qwen3", "--out", str(out),
           "--data", str(text), "--steps", "1", "--batch-size", "2048", "--seq-len", "1024",
           "--eval-batches", "1", "--threads", "1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 2, p.stderr[-3000:]
    one_error_line(p.stderr, "host out of memory at step 1", "micro-batch 1 of 1",
                   "2048 sequences x 1024 tokens", "DefaultCPUAllocator",
                   "no checkpoint was written")


def test_ledger_out_of_memory_names_one_need():
    """lrmoe's ladder: the bytes of its verdict are those its rank's line names."""
    from lrmoe.policy.lrmoe import LrmoeConfig, plan_lrmoe
    from lrmoe.presets import get_preset
    from lrmoe.routing_loads import synthetic_counts

    cfg = get_preset("tiny-qwen3")
    counts = synthetic_counts(4, cfg.num_experts, 64, cfg.num_experts_per_tok, 1.5, 1)
    free = Ledger.for_dtype(cfg, 4, None, "fp32", num_moe_layers=48)
    for whole_layer in (True, False):
        with pytest.raises(OutOfMemory) as e:
            plan_lrmoe(counts, LrmoeConfig(whole_layer=whole_layer),
                      dataclasses.replace(free, budget_bytes=1 << 20))
        need = fmt_bytes(e.value.needs_bytes)
        assert f"needs {need} > budget" in e.value.detail, (need, e.value.detail)
        assert f"(needs {need}, budget" in verdict(e.value, 1)


@pytest.mark.parametrize("policy, recompute, offered", [
    ("static", False, True), ("symi", False, True), ("static", True, False),
    ("symi", True, False), ("lrmoe", False, False), ("capacity", False, False)])
def test_the_ledger_verdict_offers_recompute_to_the_exact_policies_only(policy, recompute,
                                                                      offered):
    """--recompute is the exact policies' fallback: offered while it is off, never to a
    policy it does not apply to."""
    from lrmoe.train.config import TrainConfig
    from lrmoe.train.step_oom import StepMemory

    cfg = TrainConfig.from_flat(policy=policy, recompute=recompute)
    mem = StepMemory(cfg, 2, 3, ["--out", "r", "--resume"], [], "the checkpoint is intact")
    e = OutOfMemory("over", 3 << 30, 2 << 30, "rank 0 needs 3.0 GiB > budget 2.0 GiB")
    line = mem.ledger_line(e)
    assert "out of memory at step 3 (needs 3.0 GiB, budget 2.0 GiB)" in line
    assert "--mem-budget 3GiB" in line
    assert ("--recompute instead, if recomputing fits" in line) == offered, line


@pytest.mark.parametrize("vocab, chunk, compiled, offered", [
    (151_936, 0, False, True), (151_936, 512, False, False), (256, 0, False, False),
    (32_768, 0, False, True), (32_767, 0, False, False), (151_936, 0, True, False)])
def test_a_large_vocabulary_is_offered_the_chunked_loss(vocab, chunk, compiled, offered):
    """The allocator's line offers ``--loss-chunk`` where the logits are worth chunking: a
    large vocabulary, not chunked yet, not compiled (compiled, chunks lowered no measured
    peak); the commands it names continue the run, a compiled one eager under the
    activation checkpoint."""
    from lrmoe.train.config import TrainConfig
    from lrmoe.train.step_oom import StepMemory

    cfg = TrainConfig(preset="tiny-qwen3", batch_size=4, loss_chunk=chunk, compile=compiled)
    mem = StepMemory(cfg, 1, 3, ["--out", "runs/x", "--resume"], [], "runs/x/checkpoints",
                     vocab=vocab)
    line = mem.allocator_line("GPU", "CUDA out of memory")
    assert ("`lrmoe train --out runs/x --resume --loss-chunk 1024`" in line) == offered, line
    eager = " --no-compile" if compiled else ""
    assert f"`lrmoe train --out runs/x --resume{eager} --activation-checkpoint full`" in line


@pytest.mark.parametrize("batch, world, accum, offered", [
    (8, 2, 3, "a new run with --batch-size 4 and --grad-accum 6"),
    (4, 1, 1, "a new run with --batch-size 2 and --grad-accum 2"),
    (6, 2, 1, None), (5, 1, 2, None)])
def test_the_allocator_line_halves_the_batch_only_where_the_ranks_share_it(batch, world, accum,
                                                                         offered):
    """Half the batch and twice the accumulation keeps a step's sequences; it is named only
    where the half is whole and splits evenly over the ranks, else the line says how to
    choose."""
    from lrmoe.train.config import TrainConfig
    from lrmoe.train.step_oom import StepMemory

    cfg = TrainConfig(preset="tiny-qwen3", batch_size=batch, grad_accum=accum)
    mem = StepMemory(cfg, world, 3, ["--out", "r", "--resume"], [], "r/checkpoints")
    line = mem.allocator_line("GPU", "CUDA out of memory")
    generic = "a new run with a smaller --batch-size (a multiple of the world size)"
    assert (offered or generic) in line, line
    assert (generic in line) == (offered is None) and line.count("a new run") == 1, line
    assert f"({batch // world} sequences x " in line
