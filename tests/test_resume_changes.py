"""No dead ends on resume: a run stopped out of memory continues with more memory or more
recompute, the micro-batch count may change without skipping or repeating data, and a
run whose only checkpoint save was interrupted continues from step 0.

One process, tiny-qwen3; the out-of-memory stop is the ledger's (``--mem-budget``).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from lrmoe.cli import main
from lrmoe.ledger import Ledger
from lrmoe.presets import get_preset
from lrmoe.train import checkpoint as ckpt
from lrmoe.train import rundir
from lrmoe.train.metrics import read_metrics
from test_reliability import TINY, one_error_line, train, write_corpus


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("data"))


def _rows(out: Path, kind: str) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == kind]


def _saved_train(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["train"]


def _too_small() -> int:
    """A budget static's one-rank plan (tiny-qwen3, TINY's 4 x 32 tokens) is over as is."""
    cfg = get_preset("tiny-qwen3")
    led = Ledger.for_dtype(cfg, 1, None, "fp32")
    P = 4 * 32 * cfg.num_experts_per_tok
    return led.terms(cfg.num_experts, P, P, P, exact=True)["total"] - 1


def test_resume_may_change_the_memory_knobs_and_records_each(tmp_path, text):
    out = tmp_path / "run"
    assert train(out, text, "--steps", "2") == 0
    assert main(["train", "--out", str(out), "--resume", "--steps", "3", "--mem-budget", "1GiB",
                 "--recompute", "--activation-checkpoint", "full", "--grad-accum", "2",
                 "--loss-chunk", "64"]) == 0
    changes = _rows(out, "change")
    assert len(changes) == 1 and changes[0]["step"] == 2, changes
    assert changes[0]["changes"] == {
        "mem_budget": [None, "1GiB"], "recompute": [False, True],
        "activation_checkpoint": ["none", "full"], "grad_accum": [1, 2], "loss_chunk": [0, 64]}
    saved = _saved_train(out)
    assert (saved["mem_budget"], saved["recompute"], saved["grad_accum"]) == ("1GiB", True, 2)
    assert [r["step"] for r in _rows(out, "train")] == [1, 2, 3]
    assert _rows(out, "train")[-1]["micro_batches"] == 2
    # a plain resume continues with the run's new values: no new change
    assert main(["train", "--out", str(out), "--resume", "--steps", "4"]) == 0
    assert len(_rows(out, "change")) == 1


def test_resume_refuses_a_change_of_the_model_or_data_naming_what_may_change(tmp_path, text,
                                                                             capsys):
    out = tmp_path / "run"
    assert train(out, text, "--steps", "2") == 0
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--steps", "3", "--lr", "0.001"]) == 2
    one_error_line(capsys.readouterr().err, "lr=0.001", "--mem-budget", "--recompute",
                   "--activation-checkpoint", "--grad-accum")


def test_a_changed_micro_batch_count_continues_the_data_where_it_stopped(tmp_path, text,
                                                                         monkeypatch):
    """Micro-batches read global batches in order, each once: 2 steps of 1, then 2 of 3
    read batches 0..7, whatever the count was before."""
    from lrmoe.data import PackedBatches

    seen: list[int] = []
    real = PackedBatches.batch

    def batch(self, step, rank=0, world=1):
        seen.append(step)
        return real(self, step, rank, world)

    monkeypatch.setattr(PackedBatches, "batch", batch)
    out = tmp_path / "run"
    assert train(out, text, "--steps", "2") == 0
    assert main(["train", "--out", str(out), "--resume", "--steps", "4",
                 "--grad-accum", "3"]) == 0
    assert seen == list(range(8)), seen
    # a resume from step 2's checkpoint (written at 1 micro-batch a step) reads them again
    import shutil
    again = tmp_path / "again"
    shutil.copytree(out, again)
    shutil.rmtree(ckpt.ckpt_dir(again, 4))
    seen.clear()
    assert main(["train", "--out", str(again), "--resume", "--steps", "4"]) == 0
    assert seen == list(range(2, 8)), seen


def test_out_of_memory_says_how_to_continue_and_that_command_works(tmp_path, text, capsys):
    out = tmp_path / "run"
    assert train(out, text, "--steps", "2", "--policy", "static") == 0
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--steps", "4",
                 "--mem-budget", str(_too_small())]) == 2
    line = one_error_line(capsys.readouterr().err, "out of memory at step 3",
                          f"{ckpt.ckpt_dir(out, 2)}, is intact", "--resume")
    assert "--budget-" not in line  # names only flags this command takes
    # one need: the verdict's and the rank's line say the same bytes
    need = line.split("(needs ")[1].split(",")[0]
    assert f"needs {need} >" in line, line
    cmd = shlex.split(line.split("continue with `")[1].split("`")[0])
    assert cmd[:2] == ["lrmoe", "train"] and "--resume" in cmd, cmd
    assert main(cmd[1:]) == 0
    assert [r["step"] for r in _rows(out, "train")] == [1, 2, 3, 4]
    assert [c["changes"]["mem_budget"][1] for c in _rows(out, "change")][-1] == \
        cmd[cmd.index("--mem-budget") + 1]


def test_ctrl_c_during_the_only_checkpoint_then_resume_continues(tmp_path, text, capsys,
                                                                 monkeypatch):
    """Ctrl-C while the final (and only) checkpoint is written: ``--resume`` starts the run
    again from step 0, and the refusal of a new run there says so."""
    real = ckpt.save_checkpoint

    def interrupted(run_dir, step, *a, **kw):
        ckpt.partial_dir(run_dir, step).mkdir(parents=True)
        raise KeyboardInterrupt

    out = tmp_path / "run"
    monkeypatch.setattr(ckpt, "save_checkpoint", interrupted)
    assert train(out, text, "--steps", "2", "--ckpt-every", "0") == 130
    monkeypatch.setattr(ckpt, "save_checkpoint", real)
    assert ckpt.partial_dirs(out) and not ckpt.checkpoint_dirs(out)
    assert not (out / rundir.LOCK).exists()
    capsys.readouterr()
    assert train(out, text, "--steps", "2", "--ckpt-every", "0") == 2  # a new run: refused,
    one_error_line(capsys.readouterr().err, "--resume")  # naming the way on
    assert main(["train", "--out", str(out), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "from step 0" in err, err
    assert ckpt.latest_checkpoint(out).step == 2 and not ckpt.partial_dirs(out)
    assert [r["step"] for r in _rows(out, "train")] == [1, 2]


def test_resume_of_a_directory_that_holds_no_run_says_what_works(tmp_path, text, capsys):
    out = tmp_path / "nothing"
    assert main(["train", "--out", str(out), "--resume", "--preset", "tiny-qwen3",
                 "--data", str(text), *TINY]) == 2
    one_error_line(capsys.readouterr().err, str(out), "drop --resume")
    assert train(out, text, "--steps", "1") == 0  # the advice works
    (out / "config.json").unlink()  # checkpoints without their run config: refused too
    assert main(["train", "--out", str(out), "--resume"]) == 2
    one_error_line(capsys.readouterr().err, str(out / "config.json"), "is missing")
