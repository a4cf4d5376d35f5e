"""Refusals and hangs under torchrun (gloo on loopback): a refusal and a hung rank each end the job
with one readable line, printed once, not once per rank.

Each test launches ``torchrun --standalone`` as a subprocess; every wait is bounded and
every process it started is killed by pid at the end (see test_ep_faults.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lrmoe.train import checkpoint as ckpt
from lrmoe.train import rundir
from test_ep_faults import _state, _workers

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
ARGS = ["--preset", "tiny-qwen3", "--steps", "400", "--batch-size", "6", "--seq-len", "32",
        "--max-data-bytes", "60000", "--eval-batches", "1", "--eval-every", "0",
        "--ckpt-every", "2", "--log-every", "1", "--threads", "1", "--warmup", "1"]


def _launch(nproc: int, out: Path, extra: list[str], log: Path) -> subprocess.Popen:
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), "-m", "lrmoe",
           "train", "--out", str(out), *ARGS, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)


def _stop(agent: subprocess.Popen, pids: dict[int, int]) -> None:
    for pid in pids.values():
        if _state(pid) not in (None, "Z"):
            os.kill(pid, signal.SIGKILL)
    if agent.poll() is None:
        agent.kill()
    agent.wait()


def _error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "lrmoe: error:" in ln]


def test_locked_out_is_refused_once_under_torchrun(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    out, log = tmp_path / "busy", tmp_path / "lock.log"
    out.mkdir()
    (out / rundir.MARKER).write_text("x\n")
    (out / rundir.LOCK).write_text(json.dumps({"pid": holder.pid,
                                               "host": socket.gethostname()}))
    agent = _launch(2, out, ["--ep", "2"], log)
    try:
        rc = agent.wait(timeout=240)
    finally:
        _stop(agent, {})
        holder.kill()
        holder.wait()
    text = log.read_text(errors="replace")
    lines = _error_lines(text)
    assert rc != 0
    assert len(lines) == 1 and f"pid {holder.pid}" in lines[0], text[-3000:]
    assert "exitcode  : 2" in text  # every rank exits 2; torchrun reports it
    assert sorted(p.name for p in out.iterdir()) == [rundir.LOCK, rundir.MARKER]


def _run_without_cuda(nproc: int, script: str, out: Path, log: Path, extra=(),
                      **env: str) -> tuple[int, str]:
    """``lrmoe train --device cuda`` under torchrun on ``nproc`` ranks that see no CUDA
    device, ``script`` run in place of ``-m lrmoe``: torchrun's exit code and its log."""
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), "--no-python",
           sys.executable, "-c", script, "train", "--out", str(out), *ARGS[:10],
           "--device", "cuda", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="",
               **env)
    agent = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)
    try:
        rc = agent.wait(timeout=240)
    finally:
        _stop(agent, _workers(agent.pid) if agent.poll() is None else {})
    return rc, log.read_text(errors="replace")


# rank 0 of a job starts late: what runs under torchrun in place of ``-m lrmoe``
LATE_RANK_0 = ("import os, sys, time\n"
               "if os.environ['RANK'] == '0':\n"
               "    time.sleep(float(os.environ['LATE_S']))\n"
               "from lrmoe.cli import exit_process, main\n"
               "exit_process(main(sys.argv[1:]))")


def test_a_device_every_rank_refuses_is_said_once_when_rank_0_is_late(tmp_path):
    """--device cuda without a CUDA device: every rank refuses it, yet joins first, so
    rank 0 says it (one line) however late it starts; a rank that left before joining
    had torchrun stop rank 0 before it said anything. Nothing is written."""
    out = tmp_path / "run"
    rc, text = _run_without_cuda(3, LATE_RANK_0, out, tmp_path / "device.log", LATE_S="4")
    lines = _error_lines(text)
    assert rc == 1 and len(lines) == 1, text[-3000:]
    assert lines[0] == "lrmoe: error: --device cuda was asked for but no CUDA device is available"
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", text)
    assert "2" in codes and set(codes) <= {"2", "-15"}, text[-3000:]
    assert not re.search(r'File "[^"]*/lrmoe/[a-z_]+(/[a-z_]+)?\.py"', text), text[-3000:]
    assert not out.exists()


# rank 1 has no CUDA device, rank 0 has one (stood in for: its device is cuda:0, and its
# process group is built on gloo whatever backend it asks for, which is printed)
ONE_RANK_WITHOUT_CUDA = (
    "import os, sys, torch\n"
    "import torch.distributed as dist\n"
    "from lrmoe.errors import LrmoeError\n"
    "from lrmoe.parallel import groups\n"
    "rank, real = os.environ['RANK'], dist.init_process_group\n"
    "def init(backend, **kw):\n"
    "    os.write(1, f'rank {rank} joins on {backend}\\n'.encode())  # one write a line\n"
    "    kw.pop('device_id', None)\n"
    "    return real('gloo', **kw)\n"
    "def device(name, local):\n"
    "    if rank == '1':\n"
    "        raise LrmoeError('--device cuda was asked for but no CUDA device is available')\n"
    "    return torch.device('cuda', 0)\n"
    "dist.init_process_group, groups._device = init, device\n"
    "from lrmoe.cli import exit_process, main\n"
    "exit_process(main(sys.argv[1:]))")


def test_a_rank_without_the_device_stops_the_job_before_any_backend_waits(tmp_path):
    """A rank without CUDA beside a rank with it: the ranks learn it over the rendezvous
    store and every rank joins on gloo (an NCCL rank would wait for the gloo rank until
    --timeout-s); rank 0 names the rank and its refusal in one line. Nothing is written."""
    out = tmp_path / "run"
    rc, text = _run_without_cuda(2, ONE_RANK_WITHOUT_CUDA, out, tmp_path / "mixed.log",
                                 extra=["--ep", "2"])
    assert sorted(re.findall(r"rank \d joins on (?:gloo|nccl)", text)) == [
        "rank 0 joins on gloo", "rank 1 joins on gloo"], text[-3000:]
    lines = _error_lines(text)
    assert rc == 1 and lines == ["lrmoe: error: rank 1: --device cuda was asked for but no "
                                 "CUDA device is available"], text[-3000:]
    assert not out.exists()


def test_hung_rank_is_named_once_with_the_last_checkpoint(tmp_path):
    """3 data-parallel ranks; rank 2 stops (SIGSTOP). Ranks 0 and 1 both time out; one
    line names rank 2, the collective and the last complete checkpoint."""
    out, log = tmp_path / "run", tmp_path / "hang.log"
    agent = _launch(3, out, ["--ep", "1", "--timeout-s", "5"], log)
    pids: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 240  # a loaded 2-core CI machine starts slowly
        while time.monotonic() < deadline and agent.poll() is None:
            pids = _workers(agent.pid)
            ck = ckpt.latest_checkpoint(out) if (out / "checkpoints").exists() else None
            if len(pids) == 3 and ck is not None and ck.step >= 2:
                break
            time.sleep(0.2)
        assert agent.poll() is None and len(pids) == 3, log.read_text()[-3000:]
        os.kill(pids[2], signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all(_state(pids[r]) in (None, "Z") for r in (0, 1)):
                break
            time.sleep(0.3)
        survivors_done = all(_state(pids[r]) in (None, "Z") for r in (0, 1))
    finally:
        _stop(agent, pids)
    text = log.read_text(errors="replace")
    assert survivors_done, text[-3000:]
    lines = _error_lines(text)
    assert len(lines) == 1, text[-4000:]
    line = lines[0]
    # the first survivor to notice reports: the one whose own collective timed out, or
    # the one whose connection dropped when that first survivor exited (a race)
    assert ("timed out after --timeout-s 5" in line or "lost its connection to a peer" in line)
    assert "rank(s) 2 stopped responding" in line, line
    assert " in all_" in line or " in broadcast" in line or " in barrier" in line, line
    last = ckpt.latest_checkpoint(out)
    assert str(last.path) in line and "--resume" in line, line
    assert "RuntimeError" not in text and "Timed out waiting" not in text, text[-4000:]


# ----------------------------------------------------------------------------- in-process ranks
def _train_rank(rank: int, world: int, out: str, data: str, extra: list[str], res: str,
                setup=None) -> None:
    """One gloo rank of ``lrmoe train`` (``extra``: per-rank flags); writes its exit code
    and stderr to ``res.RANK``."""
    import contextlib
    import io

    from lrmoe.cli import main

    if setup is not None:
        setup(rank)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["train", "--preset", "tiny-qwen3", "--out", out, "--data", data,
                   "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1",
                   "--threads", "1", "--eval-every", "0", "--warmup", "1", *extra[rank]])
    Path(f"{res}.{rank}").write_text(json.dumps({"rc": rc, "err": err.getvalue()}))


def _ranks(tmp_path: Path, extra: list[list[str]], setup=None) -> list[dict]:
    from dist_util import run_world
    from test_reliability import write_corpus

    data = write_corpus(tmp_path)
    res = tmp_path / "res"
    run_world(len(extra), _train_rank, str(tmp_path / "run"), str(data), extra, str(res),
              setup, tmp_path=tmp_path)
    return [json.loads(Path(f"{res}.{r}").read_text()) for r in range(len(extra))]


def _full_disk_on_rank_1(rank: int) -> None:
    from test_reliability_edges import FullDiskWriter

    if rank == 1:
        ckpt.BoundedFileWriter = FullDiskWriter


def test_full_disk_on_one_rank_is_one_line_for_the_job(tmp_path):
    """DCP's write step is collective: rank 1's full disk fails the save on every rank;
    rank 0 alone prints it, both exit 2, checkpoint 2 stays the latest."""
    flags = ["--ep", "2", "--steps", "6", "--ckpt-every", "2"]
    r0, r1 = _ranks(tmp_path, [flags, flags], _full_disk_on_rank_1)
    assert (r0["rc"], r1["rc"]) == (2, 2), (r0, r1)
    lines = _error_lines(r0["err"] + r1["err"])
    assert len(lines) == 1 and "Traceback" not in r0["err"] + r1["err"], (r0, r1)
    assert "No space left on device" in lines[0] and "ckpt-00000002, is intact" in lines[0]
    out = tmp_path / "run"
    assert ckpt.latest_checkpoint(out).step == 2 and not ckpt.partial_dirs(out)


@pytest.mark.parametrize("flag, values, words", [
    ("--lr", ("0.003", "0.0001"), "rank 1's --lr (0.0001) differs from rank 0's (0.003)"),
    ("--seed", ("0", "1"), "rank 1's --seed (1) differs from rank 0's (0)"),
])
def test_flags_that_differ_between_ranks_end_the_job_at_start(tmp_path, flag, values, words):
    base = ["--ep", "2", "--steps", "2"]
    r0, r1 = _ranks(tmp_path, [base + [flag, values[0]], base + [flag, values[1]]])
    assert (r0["rc"], r1["rc"]) == (2, 2), (r0, r1)
    lines = _error_lines(r0["err"] + r1["err"])
    assert len(lines) == 1 and words in lines[0], (r0, r1)
    assert "give every rank the same flags" in lines[0]
    assert not (tmp_path / "run").exists()  # refused before anything is written


# ----------------------------------------------------------------------------- signals
@pytest.mark.parametrize("how", ["SIGTERM to torchrun", "Ctrl-C to the job"])
def test_signal_under_torchrun_is_one_line(tmp_path, how):
    """SIGTERM to the agent: torchrun forwards it, the workers save a checkpoint at the
    next step boundary and rank 0 prints one line. Ctrl-C (SIGINT to the whole process
    group): one 'interrupted' line, no lrmoe traceback. torchrun itself exits 1 after
    logging its own SignalException (docs/reliability.md says so)."""
    out, log = tmp_path / "run", tmp_path / "sig.log"
    agent = _launch(2, out, ["--ep", "2", "--ckpt-every", "100"], log)
    pids: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and agent.poll() is None:
            pids = _workers(agent.pid)
            if len(pids) == 2 and "step 2/" in log.read_text(errors="replace"):
                break
            time.sleep(0.2)
        assert agent.poll() is None and len(pids) == 2, log.read_text()[-3000:]
        if how.startswith("SIGTERM"):
            os.kill(agent.pid, signal.SIGTERM)
        else:
            os.killpg(agent.pid, signal.SIGINT)
        rc = agent.wait(timeout=120)
    finally:
        _stop(agent, pids)
    text = log.read_text(errors="replace")
    ours = [ln for ln in text.splitlines() if ln.startswith("lrmoe:")]
    assert rc == 1, text[-3000:]
    assert len(ours) == 1, text[-4000:]
    assert "Traceback" not in text.split("Received ")[0]  # none from lrmoe's workers
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    if how.startswith("SIGTERM"):
        step = max(r["step"] for r in rows)
        assert ours[0].startswith("lrmoe: SIGTERM received: stopped after step"), ours
        assert str(ckpt.ckpt_dir(out, step)) in ours[0]
        assert ckpt.latest_checkpoint(out).step == step
    else:
        assert ours[0] == "lrmoe: interrupted"
    assert not (out / rundir.LOCK).exists()
