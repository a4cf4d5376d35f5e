"""A refused torchrun job ends cleanly on every rank: per-rank mismatches (a flag, an
invalid per-rank flag, ``--out`` directories that are not one shared directory) are
found before step 1, every rank exits 2 with one line for the job, and every rank has
left its process group (one left alive makes the process abort at exit: "terminate
called without an active exception", exit code -6).

In-process ranks (``torch.multiprocessing``, gloo on loopback, lrmoe joining the group
itself as under torchrun), and ``torchrun`` itself for the exit codes it reports."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from dist_util import free_port
from lrmoe.train import checkpoint as ckpt
from test_reliability import write_corpus

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
TINY = ["--preset", "tiny-qwen3", "--batch-size", "4", "--seq-len", "32", "--eval-batches",
        "1", "--threads", "1", "--eval-every", "0", "--warmup", "1", "--timeout-s", "30"]


def _rank(rank: int, world: int, port: int, argv: list[list[str]], res: str) -> None:
    """One rank of ``lrmoe`` as torchrun starts it: the environment names the job, lrmoe
    joins it. Writes its exit code, stderr and whether its process group is still up."""
    import contextlib
    import io

    import torch.distributed as dist

    from lrmoe.cli import main

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv[rank])
    Path(f"{res}.{rank}").write_text(json.dumps(
        {"rc": rc, "err": err.getvalue(), "group_alive": dist.is_initialized()}))


def _job(tmp_path: Path, argv: list[list[str]]) -> list[dict]:
    res = tmp_path / "res"
    mp.spawn(_rank, args=(len(argv), free_port(), argv, str(res)), nprocs=len(argv), join=True)
    return [json.loads(Path(f"{res}.{r}").read_text()) for r in range(len(argv))]


def _refused_once(ranks: list[dict], *words: str) -> str:
    lines = [ln for r in ranks for ln in r["err"].splitlines() if ln.startswith("lrmoe: error:")]
    assert [r["rc"] for r in ranks] == [2] * len(ranks), ranks
    assert not any(r["group_alive"] for r in ranks), ranks
    assert len(lines) == 1 and "Traceback" not in "".join(r["err"] for r in ranks), ranks
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("data"))


def _train(out: Path, text: Path, *extra: str) -> list[str]:
    return ["train", "--out", str(out), "--data", str(text), *TINY, "--ep", "2", *extra]


@pytest.mark.parametrize("extra, words", [
    ((["--lr", "0.003"], ["--lr", "0.0001"]), ["rank 1's --lr (0.0001) differs"]),
    ((["--threads", "1"], ["--threads", "0"]), ["rank 1:", "--threads 0"]),
    ((["--ep", "2"], ["--ep", "4"]), ["rank 1's --ep (4) differs from rank 0's (2)"]),
])
def test_a_rank_that_differs_ends_the_job_on_every_rank(tmp_path, text, extra, words):
    out = tmp_path / "run"
    ranks = _job(tmp_path, [_train(out, text, "--steps", "2", *e) for e in extra])
    _refused_once(ranks, *words)
    assert not out.exists()


def test_out_directories_that_are_not_one_shared_directory_are_refused_before_step_1(
        tmp_path, text):
    a, b = tmp_path / "node0" / "run", tmp_path / "node1" / "run"
    ranks = _job(tmp_path, [_train(a, text, "--steps", "2"), _train(b, text, "--steps", "2")])
    _refused_once(ranks, "rank 1:", f"--out {b}", "same directory")
    assert not a.exists() and not b.exists()  # nothing left: a new run can start there


def test_a_copy_of_the_run_on_another_rank_is_refused_and_the_run_resumes(tmp_path, text):
    """Each rank sees the same checkpoint, but rank 1's is a copy (not shared): refused
    before step 1; the run is left as it was and resumes."""
    from lrmoe.cli import main

    a = tmp_path / "node0" / "run"
    assert main(_train(a, text, "--steps", "2", "--ep", "1")) == 0
    b = tmp_path / "node1" / "run"
    shutil.copytree(a, b)
    before = (a / "metrics.jsonl").read_bytes(), (a / "config.json").read_bytes()
    resume = ["train", "--resume", "--steps", "4", "--ep", "2"]
    ranks = _job(tmp_path, [resume + ["--out", str(a)], resume + ["--out", str(b)]])
    _refused_once(ranks, "rank 1:", f"--out {b}", "same directory")
    assert ((a / "metrics.jsonl").read_bytes(), (a / "config.json").read_bytes()) == before
    assert main(["train", "--out", str(a), "--resume", "--steps", "3"]) == 0
    assert ckpt.latest_checkpoint(a).step == 3


_WRAPPER = """
import os, sys
from lrmoe.cli import exit_process, main
lr = {"0": "0.003", "1": "0.0001"}[os.environ["RANK"]]
exit_process(main(sys.argv[1:] + ["--lr", lr]))
"""


def test_under_torchrun_every_rank_exits_2(tmp_path, text):
    """torchrun's own summary: every worker's exit code is 2, none aborted (-6) or was
    stopped by torchrun (-15), in each of three launches."""
    script = tmp_path / "per_rank_lr.py"
    script.write_text(_WRAPPER)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    for i in range(3):
        cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(script),
               *_train(tmp_path / f"run{i}", text, "--steps", "2")]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        log = p.stdout + p.stderr
        codes = [ln.split(":")[1].split()[0] for ln in log.splitlines()
                 if ln.strip().startswith("exitcode")]
        assert p.returncode == 1 and codes == ["2", "2"], log[-3000:]
        assert "terminate called" not in log and log.count("lrmoe: error:") == 1, log[-3000:]
