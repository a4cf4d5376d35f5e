"""Nothing lost at the edges: a checkpoint that cannot be written, a model too big for
memory, integers beyond int64, messages that name the real problem, flags that would be
ignored. One process; the torchrun cases are in test_reliability_dist.py."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lrmoe.cli import main
from lrmoe.errors import LrmoeError
from lrmoe.train import checkpoint as ckpt
from lrmoe.train import rundir
from lrmoe.train.ckpt_write import BoundedFileWriter
from test_reliability import TINY, digest, one_error_line, train, write_corpus

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("data"))


class FullDiskWriter(BoundedFileWriter):
    """The checkpoint's writer on a disk that fills up while the checkpoint of step 4 is
    written."""

    def write_data(self, plan, planner):
        if "00000004" in str(self.path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return super().write_data(plan, planner)


# -------------------------------------------------- a checkpoint that cannot be written
def test_full_disk_during_a_checkpoint_keeps_the_last_one(tmp_path, text, capsys,
                                                          monkeypatch):
    monkeypatch.setattr(ckpt, "BoundedFileWriter", FullDiskWriter)
    monkeypatch.setattr(shutil, "disk_usage", lambda d: SimpleNamespace(free=5 * 2**30 + 2**19))
    out = tmp_path / "run"
    assert train(out, text, "--steps", "6", "--ckpt-every", "2") == 2
    line = one_error_line(capsys.readouterr().err, "cannot write checkpoint ckpt-00000004",
                          str(ckpt.ckpt_root(out)), "No space left on device",
                          "5120.5 MiB free there", "ckpt-00000002, is intact")
    assert "removed the partial save .ckpt-00000004.tmp" in line
    assert ckpt.latest_checkpoint(out).step == 2
    assert not ckpt.partial_dirs(out) and not (out / rundir.LOCK).exists()


def test_file_size_limit_on_the_first_checkpoint(tmp_path, text):
    """The real thing: ``ulimit -f`` makes torch's writer fail inside DCP."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lrmoe", "train", "--preset", "tiny-qwen3", "--out", str(out),
           "--data", str(text), "--steps", "2", *TINY]
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # noqa: E731
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), preexec_fn=limit)
    assert p.returncode == 2, p.stderr[-3000:]
    one_error_line(p.stderr, "cannot write checkpoint ckpt-00000002", "MiB free",
                   "no checkpoint was written")
    assert ckpt.checkpoint_dirs(out) == [] and not ckpt.partial_dirs(out)


def test_manifest_without_files_and_a_truncated_shard(tmp_path, text, capsys):
    out = tmp_path / "run"
    assert train(out, text, "--steps", "2") == 0
    d = ckpt.latest_checkpoint(out).path
    man = json.loads((d / ckpt.MANIFEST).read_text())
    (d / ckpt.MANIFEST).write_text(json.dumps({**man, "files": {}}))
    shard = next(d.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    before = digest(out)
    assert main(["train", "--out", str(out), "--resume", "--steps", "4"]) == 2
    one_error_line(capsys.readouterr().err, str(d / ckpt.MANIFEST), "not an")
    assert digest(out) == before
    # a manifest that lists its files but a shard that DCP cannot read: one line too
    (d / ckpt.MANIFEST).write_text(json.dumps(man))
    ck = ckpt.latest_checkpoint(out)
    with pytest.raises(LrmoeError, match="cannot be loaded"):
        ckpt.merged_model_state(ck.__class__(ck.path, ck.step,
                                             {**man, "files": {".metadata": man["files"][
                                                 ".metadata"]}}))


# ---------------------------------------------------------- Ctrl-C, SIGTERM and SIGUSR1
def _cli(args: list[str], launch: tuple[str, ...] = ("-m", "lrmoe")) -> subprocess.Popen:
    # Ctrl-C as in a terminal, also where the tests run as a background job of a
    # non-interactive shell (which starts them with SIGINT ignored, and children inherit it)
    return subprocess.Popen([sys.executable, *launch, *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


# `python -m lrmoe`, and what the installed `lrmoe` script calls (pyproject.toml's entry)
LAUNCHES = {"module": ("-m", "lrmoe"), "script": ("-c", "from lrmoe.cli import run; run()")}


def _ctrl_c_during_torch_import(delay: float = 0.0, launch: str = "module"
                                ) -> tuple[subprocess.Popen, str, str]:
    """Ctrl-C ``delay`` seconds after torch's libraries are mapped. On a loaded machine the
    command can finish before that: such a try signals nothing, and another is made."""
    for _ in range(3):
        p = _cli(["presets"], LAUNCHES[launch])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and p.poll() is None:  # torch is being imported
            try:
                if "torch/lib" in Path(f"/proc/{p.pid}/maps").read_text():
                    break
            except OSError:
                pass
            time.sleep(0.005)
        time.sleep(delay)
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=60)
            return p, out, err
        p.communicate(timeout=60)
    raise AssertionError(f"lrmoe presets ended within {delay} s of importing torch, 3 times")


@pytest.mark.parametrize("delay, launch", [(0.0, "module"), (0.5, "module"), (0.5, "script")])
def test_ctrl_c_while_torch_imports_prints_no_traceback(delay, launch):
    """At the start of torch's import and inside it: an interrupt that lands in code torch
    runs of its own sets the interpreter to end by SIGINT; the status is still 130."""
    p, out, err = _ctrl_c_during_torch_import(delay, launch)
    assert p.returncode == 130, err
    assert err.strip() == "lrmoe: interrupted", err


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGUSR1, 138)])
def test_sigterm_saves_a_checkpoint_then_exits_128_plus_signal(tmp_path, text, sig, code):
    out = tmp_path / "run"
    p = _cli(["train", "--preset", "tiny-qwen3", "--out", str(out), "--data", str(text),
              "--steps", "400", "--ckpt-every", "100", *TINY])
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and p.poll() is None:
            m = out / "metrics.jsonl"
            if m.exists() and len(m.read_text().splitlines()) >= 2:
                break
            time.sleep(0.1)
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == code, err[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    step = rows[-1]["step"]
    line = [ln for ln in err.splitlines() if ln.startswith("lrmoe:")]
    assert line == [f"lrmoe: {sig.name} received: stopped after step {step} of 400; saved "
                    f"{ckpt.ckpt_dir(out, step)}; continue with --resume"], err[-3000:]
    assert "Traceback" not in err
    assert ckpt.latest_checkpoint(out).step == step and not (out / rundir.LOCK).exists()
    assert main(["train", "--out", str(out), "--resume", "--steps", str(step + 1)]) == 0


# ----------------------------------------------------------- a model too big for memory
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-glm"])
def test_state_estimate_matches_the_model(preset):
    from lrmoe.model import MoEForCausalLM
    from lrmoe.presets import get_preset
    from lrmoe.train.setup import state_bytes

    cfg = get_preset(preset)
    params = sum(p.numel() for p in MoEForCausalLM(cfg).parameters())
    assert state_bytes(cfg, 1) == (pytest.approx(16 * params, rel=1e-4), 0)
    expert = sum(p.numel() for n, p in MoEForCausalLM(cfg).named_parameters()
                 if ".experts." in n)
    assert state_bytes(cfg, 4)[0] == pytest.approx(16 * (params - expert * 3 // 4), rel=1e-4)
    # host offload on CUDA: bf16 weight and gradient of each expert on the device, fp32
    # master, two moments and the gradient buffer on the host (the pinned master and
    # buffer at the allocator's power-of-two sizes: tests/test_fullsize.py)
    dev, host = state_bytes(cfg, 4, offload=True)
    assert dev == pytest.approx(16 * (params - expert) + 4 * (expert // 4), rel=1e-4)
    assert 16 * (expert // 4) <= host <= 24 * (expert // 4)
    # on the CPU (fp32: each expert its own master, its gradient read in place) the
    # experts' fp32 weights and gradients, and on the host side only their moments
    dev, host = state_bytes(cfg, 4, offload=True, device="cpu")
    assert host == 8 * (expert // 4)
    assert dev + host == sum(state_bytes(cfg, 4))


def test_cpu_offload_precheck_asks_the_whole_state(monkeypatch):
    """On the CPU the parameters, gradients and host state share the host's memory: the
    pre-check asks all of it, and refuses a host one byte short."""
    from types import SimpleNamespace

    import torch

    import lrmoe.train.setup as setup
    from lrmoe.presets import get_preset

    cfg = get_preset("tiny-qwen3")
    need = sum(setup.state_bytes(cfg, 1, offload=True, device="cpu"))
    run = SimpleNamespace(optimizer_offload="host")
    ctx = SimpleNamespace(device=torch.device("cpu"), ep_size=1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(setup, "proc_kib", lambda path, key: need)
    setup.check_model_fits(cfg, run, ctx)
    monkeypatch.setattr(setup, "proc_kib", lambda path, key: need - 1)
    with pytest.raises(LrmoeError, match="MemAvailable"):
        setup.check_model_fits(cfg, run, ctx)


def test_proc_kib_reads_one_key_in_bytes(tmp_path):
    """The /proc reader behind the memory precheck and the peak resident set."""
    from lrmoe.train.metrics import proc_kib

    p = tmp_path / "meminfo"
    p.write_text("MemTotal:       64 kB\nMemAvailable:   48 kB\nVmHWM:  7 kB\n")
    assert proc_kib(str(p), "MemAvailable") == 48 * 1024
    assert proc_kib(str(p), "VmHWM") == 7 * 1024
    assert proc_kib(str(p), "Mem") is None  # whole keys only
    assert proc_kib(str(tmp_path / "none"), "MemAvailable") is None


def test_model_too_big_for_memory_is_refused_before_allocating(tmp_path, text, capsys):
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps({"hidden_size": 8192, "num_attention_heads": 64,
                                "num_key_value_heads": 8, "num_experts": 512,
                                "moe_intermediate_size": 8192, "num_hidden_layers": 64}))
    out = tmp_path / "out"
    assert train(out, text, "--config", str(huge), "--steps", "1") == 2
    one_error_line(capsys.readouterr().err, "GiB for its parameters, gradients and AdamW",
                   "MemAvailable", "larger --ep")
    assert not out.exists()


# ---------------------------------------------------------------- integers beyond int64
@pytest.mark.parametrize("flag, value", [("--batch-size", "99999999999999999999"),
                                         ("--eval-batches", str(2**64)), ("--threads", str(2**40)),
                                         ("--seed", str(2**64))])
def test_integers_beyond_range_are_one_line(tmp_path, text, capsys, flag, value):
    out = tmp_path / "out"
    assert train(out, text, "--steps", "1", flag, value) == 2
    one_error_line(capsys.readouterr().err, f"{flag} {value}", "must be an integer", "<=")
    assert not out.exists()


def test_a_64_bit_seed_trains(tmp_path, text):
    assert train(tmp_path / "out", text, "--steps", "1", "--seed", str(2**64 - 1)) == 0


# -------------------------------------------------- messages that name the real problem
@pytest.fixture(scope="module")
def run(tmp_path_factory, text) -> Path:
    """A finished 2-step run with its checkpoint."""
    d = tmp_path_factory.mktemp("run") / "run"
    assert train(d, text, "--steps", "2") == 0
    return d


@pytest.mark.parametrize("case, words, absent", [
    ("typed field", ["hidden_size=128.5", "must be an integer"], "divisible"),
    ("string field", ["num_experts='16'", "must be an integer"], "converted"),
    ("huge budget", ["1e400GiB", "too large"], "at least 1 byte"),
    ("dangling out", ["symlink to", "does not exist"], "File exists"),
    ("partial config on resume", ["has no model_type", "--preset"], "model_type=None"),
])
def test_messages_name_the_real_problem(tmp_path, text, run, capsys, case, words, absent):
    cfgs = {"typed field": {"hidden_size": 128.5}, "string field": {"num_experts": "16"},
            "partial config on resume": {"num_experts_per_tok": 2}}
    c = tmp_path / "c.json"
    c.write_text(json.dumps(cfgs.get(case, {})))
    out = tmp_path / "out"
    argv = ["--config", str(c)] if case in ("typed field", "string field") else []
    if case == "huge budget":
        argv = ["--mem-budget", "1e400GiB"]
    if case == "dangling out":
        out.symlink_to(tmp_path / "gone")
    if case == "partial config on resume":
        before = digest(run)
        assert main(["train", "--out", str(run), "--resume", "--config", str(c)]) == 2
        assert digest(run) == before
    else:
        assert train(out, text, "--steps", "1", *argv) == 2
        assert not out.exists()
    line = one_error_line(capsys.readouterr().err, *words)
    assert absent not in line


def test_unreadable_data_says_read(tmp_path, text, capsys, monkeypatch):
    from lrmoe import data

    def deny(path, *a, **kw):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    monkeypatch.setattr(data, "open", deny, raising=False)
    assert train(tmp_path / "out", text, "--steps", "1") == 2
    line = one_error_line(capsys.readouterr().err, "cannot read data path", str(text),
                          "Permission denied")
    assert "write" not in line.split("give")[0]


def test_load_hf_of_a_run_directory_says_so(run):
    from lrmoe.hf_load import load_hf

    with pytest.raises(LrmoeError, match="lrmoe train run directory, not a HF checkpoint"):
        load_hf(run)


@pytest.mark.parametrize("how", ["no room for a checkpoint", "write fails"])
def test_resume_on_a_full_disk_names_the_path_and_the_leftover(tmp_path, run, capsys,
                                                               monkeypatch, how):
    again = tmp_path / "again"
    shutil.copytree(run, again)
    left = ckpt.partial_dir(again, 3)
    left.mkdir()
    (left / "__0_0.distcp").write_bytes(b"x" * 2**20)
    if how == "write fails":
        real = os.write

        def full(fd, b):
            if b == b"lrmoe":  # the probe
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, b)
        monkeypatch.setattr(rundir.os, "write", full)
    else:
        real_du = shutil.disk_usage
        monkeypatch.setattr(rundir.shutil, "disk_usage", lambda p: real_du(p)._replace(free=9))
    assert main(["train", "--out", str(again), "--resume", "--steps", "4"]) == 2
    monkeypatch.undo()
    one_error_line(capsys.readouterr().err, str(again), str(left), "1.0 MiB: delete it",
                   "No space left" if how == "write fails" else "not enough space")


# ----------------------------------------------------------- flags the run would ignore
def test_ignored_flags_warn_once_each(tmp_path, text, capsys):
    assert train(tmp_path / "out", text, "--steps", "1", "--policy", "static",
                 "--lrmoe-min-keep", "0.8", "--capacity-factor", "2", "--recompute",
                 "--backend", "nccl") == 0
    warns = [ln for ln in capsys.readouterr().err.splitlines()
             if ln.startswith("lrmoe: warning:")]
    assert warns == [
        "lrmoe: warning: --lrmoe-min-keep 0.8 has no effect with --policy static (it "
        "applies to --policy lrmoe)",
        "lrmoe: warning: --capacity-factor 2.0 has no effect with --policy static (it "
        "applies to --policy capacity)",
        "lrmoe: warning: --recompute has no effect without --mem-budget (it recomputes only "
        "on a rank over the budget)",
        "lrmoe: warning: --backend nccl has no effect on one process (no collectives run)"]


def test_a_cut_off_metrics_row_is_reported_on_resume(tmp_path, run, capsys):
    again = tmp_path / "again"
    shutil.copytree(run, again)
    m = again / "metrics.jsonl"
    n = len(m.read_text().splitlines())
    m.write_text(m.read_text() + '{"kind": "train", "step": 3, "lo')
    assert main(["train", "--out", str(again), "--resume", "--steps", "3"]) == 0
    err = capsys.readouterr().err
    assert f"note: dropped 1 cut-off row(s) of {m} (line {n + 1}:" in err, err
    assert [json.loads(x)["step"] for x in m.read_text().splitlines()][-1] == 3


def test_the_lrmoe_script_ends_through_exit_process():
    """The installed ``lrmoe`` command calls :func:`lrmoe.cli.run` (which ends through
    ``exit_process``), not ``main`` (whose status ``sys.exit`` would pass on as is)."""
    text = (ROOT / "pyproject.toml").read_text()
    assert '[project.scripts]\nlrmoe = "lrmoe.cli:run"\n\n' in text
    assert (ROOT / "src/lrmoe/__main__.py").read_text().endswith("run()\n")


def test_a_probe_error_without_an_errno_keeps_its_message(tmp_path, monkeypatch):
    """An OSError raised with a message alone (no errno, no strerror) still names it."""
    def gone(fd, b):
        raise OSError("the device went away")
    monkeypatch.setattr(rundir.os, "write", gone)
    with pytest.raises(LrmoeError, match="not writable: cannot write .*: the device went away$"):
        rundir.probe_writable(tmp_path / "run")
    assert list((tmp_path / "run").iterdir()) == []  # the probe file removed
