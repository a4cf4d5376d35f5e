"""Nothing lost, nothing cryptic: lrmoe never writes over files it does not own,
one run at a time per directory, write errors and hung peers end in one readable line,
bad data and blow-ups are refused. The torchrun cases are in test_reliability_dist.py."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lrmoe.cli import main
from lrmoe.errors import LrmoeError
from lrmoe.train import checkpoint as ckpt
from lrmoe.train import rundir
from lrmoe.train.divergence import DivergenceGuard

TINY = ["--batch-size", "4", "--seq-len", "32", "--eval-batches", "1", "--threads", "1",
        "--eval-every", "0", "--warmup", "1"]


def digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def write_corpus(d: Path) -> Path:
    """About 40 KB of varied ASCII lines (faster to load than the stdlib)."""
    g = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "expert", "router", "token", "rank", "loss",
             "step", "the", "of", "and", "moe", "layer"]
    idx = torch.randint(len(words), (6000,), generator=g).tolist()
    lines = [" ".join(words[i] for i in idx[k:k + 8]) for k in range(0, len(idx), 8)]
    p = d / "corpus.txt"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("data"))


def train(out: Path, text: Path, *extra: str) -> int:
    return main(["train", "--preset", "tiny-qwen3", "--out", str(out), "--data", str(text),
                 *TINY, *extra])


@pytest.fixture(scope="module")
def run(tmp_path_factory, text) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    d = tmp_path_factory.mktemp("run") / "run"
    assert train(d, text, "--steps", "4", "--ckpt-every", "2") == 0
    return d


def one_error_line(err: str, *words: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("lrmoe: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


# -------------------------------------------------- --out: lrmoe's own directories only
def test_out_holding_a_hf_model_is_refused(tmp_path, text, capsys):
    from lrmoe.config import ModelConfig
    from lrmoe.hf import save_hf
    from lrmoe.hf_load import load_hf
    from lrmoe.model import MoEForCausalLM
    from lrmoe.presets import get_preset

    hf = tmp_path / "hf"
    save_hf(MoEForCausalLM(get_preset("tiny-qwen3")), hf)
    before = digest(hf)
    rc = main(["train", "--config", str(hf / "config.json"), "--out", str(hf), "--data",
               str(text), "--steps", "2", *TINY])
    assert rc == 2
    one_error_line(capsys.readouterr().err, "did not write", "config.json")
    assert digest(hf) == before
    assert isinstance(load_hf(hf).config, ModelConfig)


def test_run_that_died_before_its_first_checkpoint_keeps_its_metrics(tmp_path, text, run,
                                                                      capsys):
    import shutil

    died = tmp_path / "died"
    shutil.copytree(run, died)
    shutil.rmtree(died / "checkpoints")  # as if killed before the first checkpoint
    before = digest(died)
    assert train(died, text, "--steps", "2") == 2
    one_error_line(capsys.readouterr().err, "metrics", "no checkpoint")
    assert digest(died) == before


def test_empty_out_is_taken_and_marked(tmp_path, text):
    out = tmp_path / "empty"
    out.mkdir()
    assert train(out, text, "--steps", "1") == 0
    assert (out / rundir.MARKER).is_file() and not (out / rundir.LOCK).exists()


# -------------------------------------------------- save_hf: never over a run directory
def test_save_hf_refuses_a_run_directory(run):
    from lrmoe.hf import save_hf
    from lrmoe.model import MoEForCausalLM
    from lrmoe.presets import get_preset

    before = digest(run)
    with pytest.raises(LrmoeError, match="run directory.*config.json"):
        save_hf(MoEForCausalLM(get_preset("tiny-qwen3")), run)
    assert digest(run) == before


# --------------------------------------------- resume: the finished step and the preset
def test_resume_below_the_finished_step_is_refused(run, capsys):
    before = digest(run)
    assert main(["train", "--out", str(run), "--resume", "--steps", "2"]) == 2
    one_error_line(capsys.readouterr().err, "--steps 2", "finished step 4")
    assert digest(run) == before


def test_resume_at_the_end_adds_nothing_and_keeps_the_preset(tmp_path, run, capsys):
    import shutil

    again = tmp_path / "again"
    shutil.copytree(run, again)
    for _ in range(2):
        assert main(["train", "--out", str(again), "--resume"]) == 0
    rows = [json.loads(x) for x in (again / "metrics.jsonl").read_text().splitlines()]
    vals = [r["step"] for r in rows if r["kind"] == "val"]
    assert vals == [4], vals
    saved = json.loads((again / "config.json").read_text())["train"]
    assert saved["preset"] == "tiny-qwen3" and saved["steps"] == 4
    assert "final val_loss=" in capsys.readouterr().out


# ------------------------------------------------------ one run per directory: the lock
def _lock(out: Path, pid: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / rundir.MARKER).write_text("x\n")
    (out / rundir.LOCK).write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))


def test_second_run_into_a_locked_out_is_refused(tmp_path, text, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = tmp_path / "busy"
        _lock(out, holder.pid)
        before = digest(out)
        assert train(out, text, "--steps", "1") == 2
        one_error_line(capsys.readouterr().err, f"pid {holder.pid}", "in use")
        assert digest(out) == before
    finally:
        holder.kill()
        holder.wait()


def test_stale_lock_is_taken_over_with_a_warning(tmp_path, text, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "stale"
    _lock(out, dead.pid)
    assert train(out, text, "--steps", "1") == 0
    assert "stale lock" in capsys.readouterr().err
    assert not (out / rundir.LOCK).exists()  # released at the end


# ------------------------------------------------ writes that fail: --out unwritable, disk full
def test_out_that_is_a_file_or_below_one(tmp_path, text, capsys):
    f = tmp_path / "file"
    f.write_text("mine")
    assert train(f, text, "--steps", "1") == 2
    one_error_line(capsys.readouterr().err, "is a file")
    assert train(f / "sub", text, "--steps", "1") == 2
    one_error_line(capsys.readouterr().err, "Not a directory")
    assert f.read_text() == "mine"


def test_read_only_out_fails_before_training(tmp_path, text, capsys, monkeypatch):
    out = tmp_path / "ro"
    out.mkdir()
    if os.geteuid() != 0:
        out.chmod(0o555)
    else:  # root writes anywhere: make the file system refuse instead
        real_open = os.open

        def ro_open(path, flags, *a, **kw):
            if str(path).startswith(str(out)) and flags & (os.O_WRONLY | os.O_RDWR):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_open(path, flags, *a, **kw)
        monkeypatch.setattr(rundir.os, "open", ro_open)
    try:
        assert train(out, text, "--steps", "1") == 2
    finally:
        out.chmod(0o755)
    one_error_line(capsys.readouterr().err, "not writable", str(out))
    assert not (out / "metrics.jsonl").exists()


def test_too_little_space_fails_before_training(tmp_path, text, capsys, monkeypatch):
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(rundir.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=1000))
    out = tmp_path / "full"
    assert train(out, text, "--steps", "1") == 2
    one_error_line(capsys.readouterr().err, "one checkpoint needs")
    assert not out.exists()  # a new --out is not left behind


def test_disk_full_mid_run_is_one_line(tmp_path, text, capsys, monkeypatch):
    from lrmoe.train import metrics

    real = metrics.MetricsWriter.write

    def write(self, row):
        if row.get("step") == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        real(self, row)
    monkeypatch.setattr(metrics.MetricsWriter, "write", write)
    out = tmp_path / "fills"
    assert train(out, text, "--steps", "6", "--ckpt-every", "2") == 2
    line = one_error_line(capsys.readouterr().err, "No space left on device", "ckpt-00000002")
    assert "intact" in line
    assert ckpt.latest_checkpoint(out).step == 2
    assert not (out / rundir.LOCK).exists()


# ---------------------------------------------------------------- data that is not text
def test_binary_data_file_is_refused(tmp_path, capsys):
    b = tmp_path / "weights.bin"
    b.write_bytes(bytes(range(256)) * 200)
    assert train(tmp_path / "out", b, "--steps", "1") == 2
    one_error_line(capsys.readouterr().err, "weights.bin", "not text")
    assert not (tmp_path / "out").exists()


def test_invalid_utf8_without_nul_is_refused(tmp_path):
    from lrmoe.data import load_corpus

    b = tmp_path / "latin1.txt"
    b.write_bytes("caf\xe9 ".encode("latin-1") * 1000)
    with pytest.raises(LrmoeError, match="not UTF-8 text"):
        load_corpus(b)


def test_jsonl_lines_without_text_are_counted(tmp_path, capsys):
    from lrmoe.data import load_corpus

    p = tmp_path / "d.jsonl"
    lines = [{"text": f"document {i} " * 20} for i in range(30)] + [{"body": "x"}] * 7
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    c = load_corpus(p)
    assert c.notes == [f"{p}: skipped 7 line(s) without a 'text' field"]
    assert train(tmp_path / "out", p, "--steps", "1", "--seq-len", "16") == 0
    assert "skipped 7 line(s) without a 'text' field" in capsys.readouterr().err


# ----------------------------------------------------------------- the divergence guard
def test_divergence_guard_fires_on_a_finite_blow_up():
    g = DivergenceGuard(10.0)
    assert all(g.check(x) is None for x in [5.5, 5.0, 4.0, 3.0, 2.5, 2.4, 2.6])
    msgs = [g.check(x) for x in [40.0] * 30]
    first = next(i for i, m in enumerate(msgs) if m)
    assert 0 < first < 15 and "running minimum" in msgs[first]  # ema catches up
    off = DivergenceGuard(0.0)
    assert all(off.check(x) is None for x in [5.0, 1.0, 1e6, 1e9])
    # the state round-trips (saved in checkpoints)
    a = DivergenceGuard(10.0)
    for x in [5.0, 4.0, 3.0]:
        a.check(x)
    b = DivergenceGuard(10.0, json.loads(json.dumps(a.state())))
    assert [a.check(x) for x in [3.0, 31.0, 60.0]] == [b.check(x) for x in [3.0, 31.0, 60.0]]


def test_divergence_guard_checks_losses_below_one_from_its_second_step():
    """A fine-tuning loss starts below 1: it is guarded all the same, from the step after
    the first, which only sets the running minimum."""
    g = DivergenceGuard(2.0)
    assert g.check(0.5) is None
    msg = g.check(10.0)  # ema 0.8 * 0.5 + 0.2 * 10 = 2.4 > 2 * 0.5
    assert msg is not None and "2.4 is 4.8x its running minimum 0.5" in msg


def test_divergence_guard_resumes_with_its_step_count_and_minimum():
    """A guard rebuilt from its saved state checks the very next step as the saved one
    would: past its warm-up, and against the running minimum (not the latest average)."""
    a = DivergenceGuard(2.0)
    a.check(0.5)
    b = DivergenceGuard(2.0, json.loads(json.dumps(a.state())))
    msg = b.check(10.0)  # ema 0.8 * 0.5 + 0.2 * 10 = 2.4 > 2 * 0.5
    assert msg is not None and "2.4 is 4.8x its running minimum 0.5" in msg
    a = DivergenceGuard(2.0)
    assert a.check(5.0) is None and a.check(6.0) is None  # ema 5.2, minimum 5
    b = DivergenceGuard(2.0, json.loads(json.dumps(a.state())))
    msg = b.check(30.0)  # ema 0.8 * 5.2 + 0.2 * 30 = 10.16 > 2 * 5 (but < 2 * 5.2)
    assert msg is not None and "10.16 is 2.03x its running minimum 5 " in msg


def test_divergence_guard_minimum_is_of_the_smoothed_loss():
    """One low step lowers the running minimum only through the average: losses 4, 1, 4
    (averages 4, 3.4, 3.52) stay under twice the minimum 3.4."""
    g = DivergenceGuard(2.0)
    assert [g.check(x) for x in [4.0, 1.0, 4.0]] == [None, None, None]
    assert g.state()["min"] == pytest.approx(3.4)


def test_run_that_blows_up_stops_with_its_checkpoint_intact(tmp_path, text, capsys):
    out = tmp_path / "blowup"
    assert train(out, text, "--steps", "20", "--lr", "30", "--ckpt-every", "1") == 2
    one_error_line(capsys.readouterr().err, "diverged", "--divergence-factor", "intact")
    ck = ckpt.latest_checkpoint(out)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "train"]
    assert ck is not None and ck.step == steps[-1]["step"]
    assert max(r["loss"] for r in steps) < 10 * steps[0]["loss"]  # no blown-up step saved


# --------------------------------------------------------- one-line messages and --help
@pytest.mark.parametrize("argv, words, absent", [
    (["train", "--preset", "tiny-qwen3", "--backend", "mpi"], ["--backend", "gloo, nccl"],
     "None"),
    (["train", "--preset", "tiny-qwen3", "--lr", "inf"], ["--lr inf", "finite"], None),
    (["bench", "ttl", "--preset", "tiny-qwen3", "--link", "wifi"], ["wifi", "nvlink"], None),
    (["train", "--preset", "tiny-qwen3", "--divergence-factor", "0.5"],
     ["--divergence-factor", "0 to disable"], None),
])
def test_messages(argv, words, absent, tmp_path, capsys):
    out = tmp_path / "new"
    assert main([*argv, "--out", str(out)]) == 2
    line = one_error_line(capsys.readouterr().err, *words)
    assert absent is None or absent not in line
    assert not out.exists()


def test_unsupported_config_field_at_a_non_default_value(tmp_path, capsys):
    from lrmoe.config import ModelConfig

    d = {"model_type": "qwen3_moe", "attention_dropout": 0.0}
    ModelConfig.from_hf_dict(d)
    with pytest.raises(LrmoeError, match="attention_dropout=0.1 is not supported"):
        ModelConfig.from_hf_dict({**d, "attention_dropout": 0.1})


def test_eval_of_a_file_says_it_is_a_file(tmp_path, capsys):
    f = tmp_path / "metrics.jsonl"
    f.write_text("{}\n")
    assert main(["eval", str(f)]) == 2
    line = one_error_line(capsys.readouterr().err, "is a file")
    assert "does not exist" not in line


def test_help_says_what_max_data_bytes_0_means(capsys):
    assert main(["train", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "0 or all = all the data" in out and "--divergence-factor" in out
