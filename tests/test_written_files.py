"""Files lrmoe writes: they follow the umask, save_hf cleans up after its own killed saves
(and only after those), and a file-size limit met while writing metrics.jsonl names the
file and the phase and leaves no cut-off row."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lrmoe.cli import main
from lrmoe.model import MoEForCausalLM
from lrmoe.presets import get_preset
from lrmoe.train import checkpoint as ckpt
from test_reliability import TINY, one_error_line, train, write_corpus

ROOT = Path(__file__).resolve().parents[1]
UMASK = 0o027  # not the usual 022, so a file that ignores the umask shows


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("data"))


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(d: Path) -> dict[str, int]:
    """Permission bits of every file and directory under ``d`` (``d`` included)."""
    return {str(p.relative_to(d)): stat.S_IMODE(p.stat().st_mode)
            for p in [d, *d.rglob("*")] if not p.is_symlink()}


def assert_umask(d: Path) -> None:
    got = modes(d)
    want = {k: (0o777 if (d / k).is_dir() else 0o666) & ~UMASK for k in got}
    bad = {k: oct(v) for k, v in got.items() if v != want[k]}
    assert not bad, f"not {oct(0o666 & ~UMASK)} / {oct(0o777 & ~UMASK)}: {bad}"


def test_a_run_directory_follows_the_umask(tmp_path, text):
    out = tmp_path / "run"
    with umask(UMASK):
        assert train(out, text, "--steps", "1", "--tokenizer", "bpe:300") == 0
    assert {"config.json", "metrics.jsonl", "checkpoints/ckpt-00000001/manifest.json"} <= \
        set(modes(out))
    assert_umask(out)


def test_save_hf_follows_the_umask(tmp_path):
    from lrmoe.hf import save_hf

    with umask(UMASK):
        save_hf(MoEForCausalLM(get_preset("tiny-qwen3")), tmp_path / "hf",
                max_shard_bytes=4 << 20)
    assert len([n for n in modes(tmp_path / "hf") if n.endswith(".safetensors")]) > 1
    assert_umask(tmp_path / "hf")
    # a file written over one that exists keeps that file's mode, not the umask's
    os.chmod(tmp_path / "hf" / "config.json", 0o604)
    save_hf(MoEForCausalLM(get_preset("tiny-qwen3")), tmp_path / "hf", max_shard_bytes=4 << 20)
    assert stat.S_IMODE((tmp_path / "hf" / "config.json").stat().st_mode) == 0o604


def test_bench_ttl_outputs_follow_the_umask(tmp_path):
    out = tmp_path / "ttl"
    with umask(UMASK):
        assert main(["bench", "ttl", "--preset", "tiny-qwen3", "--ep", "2", "--steps", "1",
                     "--batch-size", "4", "--seq-len", "16", "--max-data-bytes", "100000",
                     "--eval-batches", "1", "--threads", "1", "--policies", "static",
                     "--out", str(out)]) == 0
    assert "ttl.json" in modes(out)
    assert_umask(out)


# ----------------------------------------------------------------------------- save_hf leftovers
_KILLED_SAVE = """
import os, signal, sys
from pathlib import Path
import safetensors.torch
from lrmoe.hf import save_hf
from lrmoe.model import MoEForCausalLM
from lrmoe.presets import get_preset

real = safetensors.torch.save_file

def killed(tensors, path, metadata=None):
    # safetensors writes a .tmpXXXXXX file beside its target, then renames it: be killed
    # in the middle of that write
    Path(path).parent.joinpath(".tmpK1LLED").write_bytes(b"half a shard")
    os.kill(os.getpid(), signal.SIGKILL)

safetensors.torch.save_file = killed
save_hf(MoEForCausalLM(get_preset("tiny-qwen3")), sys.argv[1])
"""


def test_save_hf_removes_the_leftovers_of_its_own_killed_save_only(tmp_path):
    from lrmoe.hf import save_hf

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "tokenizer.json").write_text("{}")  # the user's
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(hf)], env=env, timeout=300)
    assert p.returncode == -signal.SIGKILL
    left = sorted(n for n in os.listdir(hf) if n != "tokenizer.json")
    assert left, "the killed save left nothing: the test did not kill it mid-save"
    # a save still running (a live pid), another host's, a killed save's left as a file,
    # and files that only look alike
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    kept = [f".lrmoe-save-{host}-{alive.pid}-0123abcd",
            f".lrmoe-save-elsewhere-{dead.pid}-0123abcd",
            f".lrmoe-save-{host}-{dead.pid}-notatag", ".model.safetensors.tmp-notapid",
            ".tmpUSER01"]
    try:
        (hf / kept[0]).mkdir()
        (hf / kept[0] / "model.safetensors").write_bytes(b"live")
        (hf / kept[1]).mkdir()
        for name in kept[2:]:
            (hf / name).write_bytes(b"user")
        (hf / f".lrmoe-save-{host}-{dead.pid}-89abcdef").write_bytes(b"killed")
        save_hf(MoEForCausalLM(get_preset("tiny-qwen3")), hf)
        names = sorted(os.listdir(hf))
    finally:
        alive.kill()
        alive.wait()
    assert names == sorted(kept + ["config.json", "model.safetensors", "tokenizer.json"]), names
    assert (hf / kept[0] / "model.safetensors").read_bytes() == b"live"


# ----------------------------------------------------------------------------- ulimit -f
def test_file_size_limit_while_writing_metrics_names_the_file(tmp_path, text):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lrmoe", "train", "--preset", "tiny-qwen3", "--out", str(out),
           "--data", str(text), "--steps", "40", "--ckpt-every", "0", *TINY]
    limit = 12_000
    lim = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # noqa: E731
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), preexec_fn=lim)
    assert p.returncode == 2, p.stderr[-3000:]
    m = out / "metrics.jsonl"
    one_error_line(p.stderr, f"cannot write {m}", "File too large", "during the metrics row, step",
                   "no checkpoint was written")
    raw = m.read_bytes()
    assert raw.endswith(b"\n") and all(json.loads(x) for x in raw.decode().splitlines())
    assert ckpt.checkpoint_dirs(out) == []
