"""Refusals and hangs under torchrun (gloo on loopback): a refusal and a hung rank each end the job
with one readable line, printed once, not once per rank.

Each test launches ``torchrun --standalone`` as a subprocess; every wait is bounded and
every process it started is killed by pid at the end (see test_ep_faults.py).
"""

from __future__ import annotations

import json
import os
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
