"""Every command in the bash blocks of README.md and of the guides it links to (DOCS) runs
as written on a CPU-only machine after ``make run``, shortened only in ``--steps``.

The blocks are read from the files themselves, so the test follows them. They run in order,
in a directory laid out as a checkout (the repository's files linked, ``.venv`` the
environment running the tests, ``runs/`` its own) where ``make run`` has run (its
recipe, read from the Makefile, shortened in ``--steps``). A command that trains gets
``--steps 2`` in place of its own, or added when it has none (a ``--resume`` continues
the run as it was). What cannot run here, and what is checked instead:

- ``make test`` and ``make test-fast`` run this suite: checked to be Makefile targets;
- a command for a GPU (``--device cuda``): run; on a machine without one it must be
  refused with one line naming the missing device, exit 2 (under ``torchrun``: every
  worker refuses it, the job says so in one line, and torchrun exits 1); a later
  command that reads such a run's ``--out`` must be refused with one line saying it
  does not exist;
- the multi-node GPU ``torchrun`` and the ``sbatch`` line: checked for flag validity
  only (torchrun's own parser and ``lrmoe train``'s; the SLURM script exists and parses
  as bash), as there is no cluster here;
- ``benchmarks/gpu_run.sh`` (the GPU time-to-target runs): run with the CPU overrides the
  script documents (``DEVICE=cpu``, a tiny model and batch, ``STEPS`` its ``--steps``);
- a command to run once per node (``--nnodes N``) runs N times at once, its rendezvous
  port replaced by a free one (other jobs on this machine may hold the README's).

The ``torchrun`` examples run with the process counts the README gives (gloo on CPU).
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.dist]

ROOT = Path(__file__).resolve().parents[1]
STEPS = "2"
TIMEOUT_S = 600
GPU_RUN_ON_CPU = {"DEVICE": "cpu", "MODEL_ARGS": "--preset tiny-qwen3", "EP": "2",
                  "BATCH": "4", "SEQ": "32", "STEPS": STEPS}


DOCS = ("README.md", "docs/multinode.md", "docs/emulator.md")


@dataclass
class Block:
    source: str
    heading: str
    commands: list[str]


def readme_blocks(text: str, source: str = "README.md") -> list[Block]:
    """The ```bash blocks of one markdown file, each with the heading above it; continued
    lines joined, comment lines dropped."""
    blocks, heading, inside, lines = [], "", False, []
    for line in text.splitlines():
        if not inside and line.startswith("#"):
            heading = line.lstrip("# ").strip()
        if line.strip() == "```bash":
            inside, lines = True, []
        elif inside and line.strip() == "```":
            inside = False
            joined = "\n".join(lines).replace("\\\n", " ")
            cmds = [c.strip() for c in joined.splitlines()
                    if c.strip() and not c.strip().startswith("#")]
            blocks.append(Block(source, heading, cmds))
        elif inside:
            lines.append(line)
    return blocks


BLOCKS = [b for doc in DOCS for b in readme_blocks((ROOT / doc).read_text(), doc)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shortened(argv: list[str]) -> list[str]:
    """``argv`` with ``--steps STEPS`` (replacing its own, or added to a command that
    trains or benches and is no resume)."""
    out = list(argv)
    if "--steps" in out:
        out[out.index("--steps") + 1] = STEPS
    elif "--resume" not in out and ("train" in out or "ttl" in out):
        out += ["--steps", STEPS]
    return out


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A directory laid out as a checkout where ``make run`` has run."""
    d = tmp_path_factory.mktemp("readme")
    for p in ROOT.iterdir():
        if p.name not in (".venv", "runs", ".git"):
            (d / p.name).symlink_to(p)
    (d / ".venv").symlink_to(Path(sys.prefix))
    recipe = _make_recipe("run")
    assert len(recipe) == 1, recipe
    _run(d, _shortened(shlex.split(recipe[0])))
    return d


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1")


def _run(cwd: Path, argv: list[str], env: dict | None = None, expect: int = 0,
         copies: int = 1) -> str:
    procs = [subprocess.Popen(argv, cwd=cwd, env=env or _env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for _ in range(copies)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    for p, out in zip(procs, outs):
        assert p.returncode == expect, f"{shlex.join(argv)} exited {p.returncode}:\n{out[-4000:]}"
    return "\n".join(outs)


def _make_recipe(target: str) -> list[str]:
    """The recipe lines of a Makefile target, ``$(BIN)`` expanded."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"{target}:"))
    out = []
    for ln in lines[start + 1:]:
        if not ln.startswith("\t"):
            break
        out.append(ln.strip().replace("$(BIN)", ".venv/bin"))
    return out


def _check_flags_only(argv: list[str]) -> None:
    """A cluster command: torchrun's and ``lrmoe train``'s parsers take its flags."""
    from lrmoe.cli import build_parser

    if argv[0] == "sbatch":
        script = ROOT / argv[argv.index("--nodes") + 2]
        assert script.is_file()
        subprocess.run(["bash", "-n", str(script)], check=True)
        train = ["train", *argv[argv.index("--nodes") + 3:]]  # the script runs lrmoe train
    else:
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(argv[1:])
        assert args.module and args.training_script == "lrmoe"
        train = args.training_script_args
    ns = build_parser().parse_args(train)
    assert ns.command == "train"


NOT_MADE: set[str] = set()  # the --out of each GPU run refused on this machine


def _one(cwd: Path, command: str) -> None:
    words = shlex.split(command, comments=True)
    env = _env()
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):  # VAR=value before a command
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    for argv in _split_and(words):
        if argv[0] == "make":
            assert _make_recipe(argv[1]), argv  # make run: the fixture; the others: this suite
        elif argv[0] in ("sbatch",) or (argv[0] == "torchrun" and "--device" in argv):
            _check_flags_only(argv)
        elif "--device" in argv and argv[argv.index("--device") + 1] == "cuda":
            import torch

            if torch.cuda.is_available():  # a GPU machine runs it
                _run(cwd, _shortened(argv), env)
                continue
            if Path(argv[0]).name == "torchrun":  # exits 1 when a worker exits non-zero
                _refused_under_torchrun(_run(cwd, _shortened(argv), env, expect=1))
            else:
                out = _run(cwd, _shortened(argv), env, expect=2)
                assert out.count("lrmoe: error:") == 1 and "CUDA" in out, out
            if "--out" in argv:
                NOT_MADE.add(argv[argv.index("--out") + 1])
        elif NOT_MADE & set(argv):  # reads a run a refused GPU command did not make
            out = _run(cwd, argv, env, expect=2)
            assert out.count("lrmoe: error:") == 1 and "does not exist" in out, out
        elif argv[:2] == ["bash", "benchmarks/gpu_run.sh"]:
            _run(cwd, argv, {**env, **GPU_RUN_ON_CPU})
        elif "--nnodes" in argv:
            n = int(argv[argv.index("--nnodes") + 1])
            at = argv.index("--rdzv-endpoint") + 1
            argv[at] = f"{argv[at].rsplit(':', 1)[0]}:{_free_port()}"
            _run(cwd, _shortened(argv), env, copies=n)
        else:
            _run(cwd, _shortened(argv), env)


def _refused_under_torchrun(out: str) -> None:
    """Every worker refused the missing device (exit 2, or torchrun's SIGTERM once a peer
    had), with no lrmoe traceback, and the job said so in one line (every rank joins
    before it refuses, so rank 0 says it before any rank leaves)."""
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
    assert codes and "2" in codes and set(codes) <= {"2", "-15"}, out
    assert not re.search(r'File ".*/lrmoe/', out), out  # torchrun's own traceback only
    lines = [ln for ln in out.splitlines() if ln.startswith("lrmoe: error:")]
    assert len(lines) == 1 and "CUDA" in lines[0], out


def _split_and(words: list[str]) -> list[list[str]]:
    out = [[]]
    for w in words:
        if w == "&&":
            out.append([])
        else:
            out[-1].append(w)
    return out


def test_the_docs_have_the_blocks_this_test_reads():
    assert all(b.commands for b in BLOCKS)
    assert {b.source for b in BLOCKS} == set(DOCS), "a guide without a bash block"
    readme = [b for b in BLOCKS if b.source == "README.md"]
    assert len(readme) >= 5 and readme[0].commands[0].startswith("make run")
    linked = (ROOT / "README.md").read_text()
    assert all(f"]({doc})" in linked for doc in DOCS[1:]), "a guide the README no longer links"


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{i}-{b.heading[:30]}" for i, b in
                                               enumerate(BLOCKS)])
def test_readme_block_runs_as_written(checkout, block):
    for command in block.commands:
        _one(checkout, command)
