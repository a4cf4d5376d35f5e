"""docs/flags.md, rendered from the ``lrmoe`` parser: ``python scripts/docs_flags.py > docs/flags.md``.

One table per argument group: the flag, its default and its help, a help's trailing
``(default X)`` moved to the default column; ``tests/test_docs_flags.py`` fails when the
file is stale."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lrmoe.cli import build_parser  # noqa: E402

HEADER = """\
# Command-line flags

Every flag of every `lrmoe` command, with its default and what it does, as `--help` prints
them. This file is generated from the parsers (`src/lrmoe/commands/`, and
`src/lrmoe/cli_flags.py` for the policy and memory flags that `train`, `plan` and
`bench ttl` share); regenerate it after changing a flag:

    python scripts/docs_flags.py > docs/flags.md

Spelling: a knob only the lrmoe policy reads is `--lrmoe-NAME`; one that several policies
or the memory ledger read has no prefix. `lrmoe train` flags not given take their
defaults, and with `--resume` the run's values.
"""

_DEFAULT_IN_HELP = re.compile(r"\s*\(default:? (?P<value>[^()]*(?:\([^()]*\)[^()]*)*)\)$")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    names = ", ".join(action.option_strings)
    if action.nargs == 0:  # a switch
        return f"`{names}`"
    value = action.metavar or ("|".join(map(str, action.choices)) if action.choices else "")
    return f"`{names} {value}`" if value else f"`{names}`"  # argparse's DEST says nothing


def _default(action: argparse.Action) -> str:
    v = action.default
    if v is argparse.SUPPRESS or v is None or not action.option_strings or action.nargs == 0:
        return ""  # a switch is off until given
    return f"{v:g}" if isinstance(v, float) else str(v)


def _row(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    help_text = parser._get_formatter()._expand_help(action) if action.help else ""
    default = _default(action)
    m = _DEFAULT_IN_HELP.search(help_text)
    if m:  # the help's own wording of the default reads better than the raw value
        default, help_text = m["value"], help_text[:m.start()]
    return f"| {_cell(_flag(action))} | {_cell(default)} | {_cell(help_text)} |"


def _shown(action: argparse.Action) -> bool:
    return (action.help != argparse.SUPPRESS
            and not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)))


def _commands(parser: argparse.ArgumentParser, prefix: str):
    """(full name, one-line help, parser) of every command under ``parser``, depth first."""
    for action in parser._actions:  # argparse keeps its commands only privately
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {a.dest: a.help or "" for a in action._choices_actions}
        for name, sub in action.choices.items():
            full = f"{prefix} {name}"
            yield full, helps.get(name, ""), sub
            yield from _commands(sub, full)


def _section(name: str, summary: str, parser: argparse.ArgumentParser) -> list[str]:
    out = [f"## `{name}`", ""]
    about = parser.description or summary
    if about:
        out += [_cell(about), ""]
    for group in parser._action_groups:  # argparse keeps its groups only privately
        actions = [a for a in group._group_actions if _shown(a)]
        if not actions:
            continue
        out += [f"**{_cell(group.title or '')}**", "",
                "| flag | default | meaning |", "|---|---|---|"]
        out += [_row(parser, a) for a in actions]
        out.append("")
    return out


def render(root: argparse.ArgumentParser | None = None) -> str:
    """The whole of docs/flags.md, from ``root`` (default: the ``lrmoe`` parser)."""
    root = root if root is not None else build_parser()
    commands = [(name, summary, parser)
                for name, summary, parser in _commands(root, "lrmoe")
                if any(_shown(a) for a in parser._actions)
                or not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)]
    out = [HEADER]  # a bare group of commands (`lrmoe bench`) has no section of its own
    out += [f"- [`{name}`](#{name.replace(' ', '-')}): {_cell(summary)}"
            for name, summary, _ in commands]
    out.append("")
    for name, summary, parser in commands:
        out += _section(name, summary, parser)
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
