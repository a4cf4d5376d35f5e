"""docs/flags.md is what ``python scripts/docs_flags.py`` renders from the parsers today, so
a flag added, removed or reworded without regenerating the file fails here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from lrmoe.cli import build_parser
from lrmoe.cli_flags import KNOBS, TRAIN, _shown

ROOT = Path(__file__).resolve().parents[1]
FLAGS_MD = ROOT / "docs" / "flags.md"
sys.path.insert(0, str(ROOT / "scripts"))

from docs_flags import render  # noqa: E402


def _train_parser(root):
    sub = next(a for a in root._actions if a.dest == "command")
    return sub.choices["train"]


def test_flags_md_is_generated_from_the_parsers():
    assert FLAGS_MD.read_text() == render(), (
        "docs/flags.md is stale: run python scripts/docs_flags.py > docs/flags.md")


def test_the_script_prints_the_same_file():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_flags.py")],
                         capture_output=True, text=True, check=True).stdout
    assert out == FLAGS_MD.read_text()


def test_every_train_knob_has_a_row_with_its_default():
    text = FLAGS_MD.read_text()
    train = text.split("## `lrmoe train`")[1].split("\n## ")[0]
    for name in TRAIN:
        k = KNOBS[name]
        rows = [ln for ln in train.splitlines() if re.match(rf"\| `{re.escape(k.flag)}[ `]", ln)]
        assert len(rows) == 1, (k.flag, rows)
        assert rows[0].split(" | ")[1] == _shown(k.default_value()), rows[0]


def test_a_new_flag_changes_the_rendered_file():
    root = build_parser()
    _train_parser(root).add_argument("--new-knob", metavar="N", help="a new knob (default 7)")
    text = render(root)
    assert "| `--new-knob N` | 7 | a new knob |" in text
    assert text != FLAGS_MD.read_text()


def test_a_pipe_in_a_help_stays_inside_its_cell():
    root = build_parser()
    _train_parser(root).add_argument("--piped", metavar="a|b", help="one | two")
    row = next(ln for ln in render(root).splitlines() if ln.startswith("| `--piped"))
    assert row == "| `--piped a\\|b` |  | one \\| two |"
