"""``lrmoe`` command line: one module per subcommand in ``lrmoe.commands``.

Every :class:`LrmoeError` becomes one line on stderr and exit code 2 (3 when a torchrun
peer hung or died); so does an OS error (a full disk, a read-only directory).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from lrmoe.errors import LrmoeError

COMMANDS = ("train", "eval", "report", "presets", "plan", "bench")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lrmoe", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"lrmoe.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"lrmoe.commands.{name}":
                continue  # not built yet
            raise
        mod.register(sub)
    return p



def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed one line; usage errors exit 2
        return int(e.code or 0)
    try:
        return int(args.func(args) or 0)
    except LrmoeError as e:
        if not e.quiet:
            print(f"lrmoe: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # a write the command did not foresee: one line, not a traceback
        where = f" ({e.filename})" if e.filename else ""
        print(f"lrmoe: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lrmoe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
