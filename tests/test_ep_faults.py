"""Faults under expert parallelism (torchrun, gloo on loopback): a dead or stalled rank ends
the job with a non-zero exit and a readable message instead of a hang, and the run then
resumes from its last complete checkpoint.

Each test launches ``torchrun --standalone --nproc-per-node 2 -m lrmoe train --ep 2`` as a
subprocess, waits for the first steps and a checkpoint, then signals one worker (found
through ``/proc``: the agent's children, by their ``RANK``). Every wait is bounded; on
failure every process the test started is killed by its pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lrmoe.train import checkpoint as ckpt
from lrmoe.train.metrics import read_metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
TIMEOUT_S = 20  # --timeout-s: how long a collective may wait for a peer
ARGS = ["--preset", "tiny-qwen3", "--ep", "2", "--steps", "400", "--batch-size", "8",
        "--seq-len", "32", "--max-data-bytes", "100000", "--eval-batches", "1",
        "--eval-every", "0", "--ckpt-every", "2", "--log-every", "1", "--threads", "1",
        "--warmup", "1"]


# ----------------------------------------------------------------------------- processes
def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _state(pid: int) -> str | None:
    """``/proc`` state letter (``Z`` zombie, ``T`` stopped, ...); None once reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"RANK="):
            return int(kv[5:])
    return None


def _workers(agent: int) -> dict[int, int]:
    """``{rank: pid}`` of the torchrun agent's worker processes."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and _ppid(int(d.name)) == agent:
            r = _rank_of(int(d.name))
            if r is not None:
                out[r] = int(d.name)
    return out


class Job:
    """One torchrun launch; ``stop()`` kills what is left of it (by pid)."""

    def __init__(self, run: Path, extra: list[str], tag: str):
        self.log_path = run.parent / f"{run.name}-{tag}.log"
        self.log = open(self.log_path, "w")
        cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "lrmoe", "train",
               "--out", str(run), *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.p = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                  env=env, start_new_session=True)
        self.pids: dict[int, int] = {}

    def workers(self, deadline: float) -> dict[int, int]:
        while time.monotonic() < deadline and self.p.poll() is None:
            self.pids = _workers(self.p.pid)
            if len(self.pids) == 2:
                return self.pids
            time.sleep(0.2)
        raise AssertionError(f"no 2 workers under torchrun:\n{self.text()[-3000:]}")

    def text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int | None:
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        # workers run in their own sessions: kill them by pid, then the agent
        for pid in self.pids.values():
            if _ppid(pid) == self.p.pid:
                os.kill(pid, signal.SIGKILL)
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        self.log.close()


def _train_rows(run: Path) -> list[dict]:
    p = run / "metrics.jsonl"
    if not p.exists():
        return []
    return [r for r in read_metrics(p) if r.get("kind") == "train"]


def _wait_for_progress(job: Job, run: Path, deadline: float, rows: int = 3) -> None:
    """At least ``rows`` steps logged and a complete checkpoint written."""
    while time.monotonic() < deadline:
        assert job.p.poll() is None, f"training ended early:\n{job.text()[-3000:]}"
        ck = ckpt.latest_checkpoint(run) if run.exists() else None
        if ck is not None and len(_train_rows(run)) >= rows:
            return
        time.sleep(0.2)
    raise AssertionError(f"no progress in time:\n{job.text()[-3000:]}")


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("victim", [1, 0])
def test_killed_rank_fails_fast_then_resumes(tmp_path, victim):
    run = tmp_path / "run"
    job = Job(run, [*ARGS, "--timeout-s", str(TIMEOUT_S)], "killed")
    try:
        pids = job.workers(time.monotonic() + 60)
        _wait_for_progress(job, run, time.monotonic() + 90)
        os.kill(pids[victim], signal.SIGKILL)
        t_kill = time.monotonic()
        rc = job.wait(90)
        took = time.monotonic() - t_kill
        assert rc is not None, f"the job hung for 90 s after rank {victim} was killed"
    finally:
        job.stop()
    log = job.text()
    print(f"rank {victim} killed: torchrun exited {rc} after {took:.1f}s")
    assert rc != 0, log[-3000:]
    # torchrun names the dead rank and its signal as the root cause
    assert "Root Cause" in log, log[-3000:]
    cause = log[log.index("Root Cause"):]
    assert f"rank      : {victim}" in cause and "SIGKILL" in cause, log[-3000:]
    assert took < 60, f"took {took:.0f}s to fail"
    before = {r["step"]: r for r in _train_rows(run)}
    ck = ckpt.latest_checkpoint(run)
    assert ck is not None and ck.step >= 2 and (ck.world, ck.ep_size) == (2, 2)

    # --resume takes every flag from the run's config.json; stop two steps on
    stop = ck.step + 2
    job = Job(run, ["--resume", "--threads", "1", "--stop-after", str(stop)], "resumed")
    try:
        rc = job.wait(120)
        assert rc == 0, f"resume exited {rc}:\n{job.text()[-4000:]}"
    finally:
        job.stop()
    after = _train_rows(run)
    assert [r["step"] for r in after] == list(range(1, stop + 1))
    assert ckpt.latest_checkpoint(run).step == stop
    for r in after:  # rows before the checkpoint kept; steps the killed run also made repeat
        if r["step"] in before:
            assert (r["loss"], r["grad_norm"], r["counts"]) == (
                before[r["step"]]["loss"], before[r["step"]]["grad_norm"],
                before[r["step"]]["counts"]), r["step"]


def test_stalled_rank_times_out(tmp_path):
    """A rank that stops responding (SIGSTOP: alive, silent) is not seen by torchrun's
    agent; the peer must give up after --timeout-s on whatever collective it waits in."""
    timeout = 10
    run = tmp_path / "run"
    job = Job(run, [*ARGS, "--timeout-s", str(timeout)], "stalled")
    try:
        pids = job.workers(time.monotonic() + 60)
        _wait_for_progress(job, run, time.monotonic() + 90)
        os.kill(pids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout + 20 and _state(pids[0]) not in (None, "Z"):
            time.sleep(0.5)
        survivor_done = _state(pids[0]) in (None, "Z")
        took = time.monotonic() - t0
    finally:
        job.stop()
    assert survivor_done, f"rank 0 still waits {took:.0f}s after its peer stalled " \
                          f"(--timeout-s {timeout})"
    log = job.text()
    assert "Timed out" in log or "timed out" in log.lower(), log[-3000:]
