"""``lrmoe`` command line: one module per subcommand in ``lrmoe.commands``.

Every :class:`LrmoeError` becomes one line on stderr and exit code 2 (3 when a torchrun
peer hung or died); so does an OS error (a full disk, a read-only directory). Ctrl-C
at any moment prints ``lrmoe: interrupted`` (once under torchrun) and exits 130;
``lrmoe train`` stops on SIGTERM / SIGUSR1 after a checkpoint (:mod:`lrmoe.train.faults`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading

from lrmoe.errors import LrmoeError

COMMANDS = ("train", "eval", "export", "report", "presets", "plan", "bench")
INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C's exit status, 130


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lrmoe", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"lrmoe.commands.{name}").register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    try:  # Ctrl-C at any moment (torch takes seconds to import): one line, no traceback
        return _main(argv)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: no traceback either
        _say_interrupted()
        return INTERRUPTED


def _say_interrupted() -> None:
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank gets it: one line
        print("lrmoe: interrupted", file=sys.stderr)


def _end_at_once(*_) -> None:
    _say_interrupted()
    exit_process(INTERRUPTED)


def _importing_commands() -> argparse.ArgumentParser:
    """:func:`build_parser`, whose imports bring torch, with Ctrl-C ending the process at
    once: a KeyboardInterrupt raised in a Python callback that torch's C++ makes while it
    imports cannot unwind through that C++, and the process aborts (SIGABRT)."""
    if (signal.getsignal(signal.SIGINT) is not signal.default_int_handler
            or threading.current_thread() is not threading.main_thread()):
        return build_parser()  # Ctrl-C ignored, or handled by the caller: left as it is
    signal.signal(signal.SIGINT, _end_at_once)
    try:
        return build_parser()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _main(argv: list[str] | None) -> int:
    parser = _importing_commands()
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


def exit_process(code: int) -> None:
    """End ``python -m lrmoe`` with ``code``. A torchrun worker that failed leaves at once
    (streams flushed, its process group already left by the command): torchrun stops
    the workers still running with SIGTERM as soon as one has exited non-zero, and an
    interpreter's teardown can take long enough for a peer's clean exit 2 to become a
    SIGTERM death. So does an interrupted command: a Ctrl-C that lands while torch's
    import runs code of its own makes the interpreter end by SIGINT at its exit, whatever
    status was asked for."""
    if code == INTERRUPTED or (code and os.environ.get("WORLD_SIZE", "1") != "1"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # it is ending with this code anyway
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    sys.exit(code)


def run() -> None:
    """The ``lrmoe`` command and ``python -m lrmoe``: :func:`main`, its status given to
    :func:`exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    run()
