"""Bad input: exit code 2, one readable stderr line naming the problem, and an existing
run directory (checkpoints included) left byte for byte as it was; a new --out is never
created."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from lrmoe.cli import main

SMALL = ["--batch-size", "4", "--seq-len", "64", "--max-data-bytes", "200000",
         "--eval-batches", "2", "--threads", "1"]


def digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """An existing run with checkpoints, and the bad inputs."""
    d = tmp_path_factory.mktemp("errs")
    run = d / "run"
    assert main(["train", "--preset", "tiny-qwen3", "--out", str(run), "--steps", "4",
                 "--ckpt-every", "2", "--eval-every", "0", *SMALL]) == 0
    (d / "malformed.json").write_text('{"model_type": "qwen3_moe", ')
    (d / "list.json").write_text("[1, 2]")
    (d / "topk.json").write_text(json.dumps({"num_experts": 4, "num_experts_per_tok": 8}))
    (d / "heads.json").write_text(json.dumps({"hidden_size": 130}))
    (d / "vocab.json").write_text(json.dumps({"vocab_size": 100}))
    (d / "unsupported.json").write_text(json.dumps({"rope_scaling": {"type": "yarn"}}))
    (d / "empty_dir").mkdir()
    (d / "empty.txt").write_text("")
    (d / "blank.txt").write_text("  \n\n  ")
    return d


# (argv after "train", words expected in stderr). ``RUN`` is the existing run,
# ``NEW`` a fresh --out that must not be created, ``D`` the fixture directory.
CASES = {
    "unknown preset": (["--preset", "nope", "--out", "RUN"], ["unknown preset", "nope"]),
    "unreadable config": (["--preset", "tiny-qwen3", "--config", "D/missing.json",
                           "--out", "RUN"], ["cannot read config", "missing.json"]),
    "malformed config": (["--preset", "tiny-qwen3", "--config", "D/malformed.json",
                          "--out", "RUN"], ["not valid JSON", "malformed.json"]),
    "config not an object": (["--preset", "tiny-qwen3", "--config", "D/list.json",
                              "--out", "RUN"], ["list.json", "JSON object"]),
    "unsupported config field": (["--preset", "tiny-qwen3", "--config", "D/unsupported.json",
                                  "--out", "RUN"], ["rope_scaling", "not supported"]),
    "top-k above experts": (["--preset", "tiny-qwen3", "--config", "D/topk.json",
                             "--out", "RUN"], ["num_experts_per_tok=8", "exceeds"]),
    "hidden not divisible": (["--preset", "tiny-qwen3", "--config", "D/heads.json",
                              "--out", "RUN"], ["hidden_size=130", "not divisible"]),
    "zero steps": (["--preset", "tiny-qwen3", "--steps", "0", "--out", "RUN"],
                   ["--steps", ">= 1"]),
    "zero batch": (["--preset", "tiny-qwen3", "--batch-size", "0", "--out", "RUN"],
                   ["--batch-size", ">= 1"]),
    "negative seq len": (["--preset", "tiny-qwen3", "--seq-len", "-5", "--out", "RUN"],
                         ["--seq-len", ">= 1"]),
    "bad lr": (["--preset", "tiny-qwen3", "--lr", "-1", "--out", "RUN"], ["--lr"]),
    "bad router lr scale": (["--preset", "tiny-qwen3", "--router-lr-scale", "0", "--out", "RUN"],
                            ["--router-lr-scale"]),
    "bpe too small": (["--preset", "tiny-qwen3", "--tokenizer", "bpe:100", "--out", "RUN"],
                      ["bpe:100", "too small"]),
    "unknown policy": (["--preset", "tiny-qwen3", "--policy", "magic", "--out", "RUN"],
                       ["--policy", "magic"]),
    "bad mem budget": (["--preset", "tiny-qwen3", "--mem-budget", "lots", "--out", "RUN"],
                       ["lots", "memory size"]),
    "ep without torchrun": (["--preset", "tiny-qwen3", "--ep", "2", "--out", "RUN"],
                            ["--ep 2", "torchrun"]),
    "no model": (["--out", "NEW"], ["--preset"]),
    "new run over checkpoints": (["--preset", "tiny-qwen3", "--out", "RUN"],
                                 ["already holds checkpoints", "--resume"]),
    "resume without checkpoint": (["--preset", "tiny-qwen3", "--resume", "--out", "NEW"],
                                  ["no checkpoint", "--resume"]),
    "data missing": (["--preset", "tiny-qwen3", "--data", "D/nowhere", "--out", "NEW"],
                     ["nowhere", "does not exist"]),
    "data dir without text": (["--preset", "tiny-qwen3", "--data", "D/empty_dir",
                               "--out", "NEW"], ["empty_dir", "no text"]),
    "data empty file": (["--preset", "tiny-qwen3", "--data", "D/empty.txt", "--out", "NEW"],
                        ["empty.txt", "no text"]),
    "data blank file": (["--preset", "tiny-qwen3", "--data", "D/blank.txt", "--out", "NEW"],
                        ["blank.txt", "no text"]),
    "config vocab below tokenizer": (["--preset", "tiny-qwen3", "--config", "D/vocab.json",
                                      "--out", "NEW"], ["vocab_size 100", "256"]),
    "seq len above data": (["--preset", "tiny-qwen3", "--seq-len", "10000000",
                            "--out", "NEW"], ["seq_len"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, files, tmp_path, capsys):
    argv, words = CASES[name]
    run, new = files / "run", tmp_path / "new"
    sub = {"RUN": str(run), "NEW": str(new)}
    argv = [sub.get(a, a.replace("D/", f"{files}/")) for a in argv]
    before = digest(run)
    rc = main(["train", *SMALL, *argv])  # the case's flags win
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("lrmoe: error: ")
    for w in words:
        assert w in err, (w, err)
    assert out == ""
    assert digest(run) == before
    assert not new.exists()


def test_resume_with_the_runs_ep_on_one_process(files, tmp_path, capsys, monkeypatch):
    """--resume inherits --ep from the run: on a world it does not fit, say to pass --ep."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(files / "run", run)
    cfg = json.loads((run / "config.json").read_text())
    cfg["train"]["ep"] = 2
    (run / "config.json").write_text(json.dumps(cfg))
    before = digest(run)
    rc = main(["train", "--out", str(run), "--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and "--ep 2" in err and "pass --ep N" in err
    assert len(err.strip().splitlines()) == 1
    assert digest(run) == before


def test_eval_and_report_errors(files, tmp_path, capsys):
    for argv, word in ((["eval", str(tmp_path / "none")], "does not exist"),
                       (["eval", str(files / "empty_dir")], "not an lrmoe run"),
                       (["report", str(files / "empty_dir")], "metrics.jsonl")):
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and word in err, err


def test_an_os_error_without_its_strerror_is_one_line_of_its_message(capsys, monkeypatch):
    """An ``OSError`` a library raised with a message alone (no errno, no file name) is
    still one readable line, exit 2."""
    import lrmoe.commands.presets as presets

    def fails(args):
        raise OSError("the device went away")

    monkeypatch.setattr(presets, "run", fails)
    assert main(["presets"]) == 2
    assert capsys.readouterr().err == "lrmoe: error: the device went away\n"
