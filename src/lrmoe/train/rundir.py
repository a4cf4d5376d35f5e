"""The run directory: whose it is (the ``.lrmoe-run`` marker), who writes into it (the
``.lrmoe-lock`` of rank 0's process, a stale one taken over), and whether it can be
written (a probe file and the free space, before the first step). ``lrmoe bench ttl
--out`` follows the same rules with its own marker. The rules: docs/design.md §7.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from lrmoe.errors import LrmoeError
from lrmoe.files import pid_alive

MARKER = ".lrmoe-run"
BENCH_MARKER = ".lrmoe-bench"  # lrmoe bench ttl's output directory
BENCH_RESULTS = ("ttl.json", "ttl_partial.json")
LOCK = ".lrmoe-lock"
_PROBE = ".lrmoe-write-probe"
_OURS = {MARKER, LOCK}  # a directory holding only these is lrmoe's (a crash at start)


def os_error_line(e: OSError, doing: str) -> str:
    """One readable line for an OS error: what failed, on which path, why."""
    where = f" {e.filename}" if e.filename else ""
    return f"{doing}{where}: {e.strerror or e}"


def _legacy_run(run_dir: Path) -> bool:
    """A run directory written before the marker: its config.json says so."""
    p = run_dir / "config.json"
    try:
        return json.loads(p.read_text()).get("format") == "lrmoe-run-v1"
    except (OSError, ValueError, AttributeError):
        return False


def is_run_dir(run_dir: str | os.PathLike) -> bool:
    """True if lrmoe wrote this directory (marker, legacy config, or only our files)."""
    d = Path(run_dir)
    if not d.is_dir():
        return False
    if (d / MARKER).is_file() or _legacy_run(d):
        return True
    names = {p.name for p in d.iterdir()}
    return bool(names) and names <= _OURS


def _names(d: Path) -> list[str]:
    """The names in ``--out`` ``d``; a file or a dangling symlink is refused."""
    if d.is_symlink() and not d.exists():
        raise LrmoeError(f"--out {d} is a symlink to {os.readlink(d)}, which does not exist; "
                         "create that directory or give another --out")
    if d.exists() and not d.is_dir():
        raise LrmoeError(f"--out {d} is a file, not a directory; give a directory")
    if not d.exists():
        return []
    try:
        return sorted(p.name for p in d.iterdir())
    except OSError as e:
        raise LrmoeError(os_error_line(e, "--out: cannot list")) from None


def check_out(run_dir: Path, resume: bool, has_checkpoint: bool) -> None:
    """Refuse an ``--out`` this run may not write into (reads only)."""
    names = _names(run_dir)
    if not names:
        return
    if (run_dir / BENCH_MARKER).is_file():
        raise LrmoeError(f"--out {run_dir} is the output directory of lrmoe bench ttl, not a "
                         "training run; give another --out")
    if not is_run_dir(run_dir):
        raise _foreign(run_dir, names)
    check_lock(run_dir)
    if resume or has_checkpoint:
        return  # --resume continues it; a new run over checkpoints is refused by the caller
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            rows = sum(1 for line in f if line.strip())
    except FileNotFoundError:
        rows = 0
    except OSError as e:
        raise LrmoeError(os_error_line(e, "cannot read")) from None
    if rows:
        raise LrmoeError(f"--out {run_dir} holds the metrics of a run that wrote no checkpoint "
                         f"({rows} rows in metrics.jsonl). Continue that run with --resume "
                         "(it starts again from step 0 and rewrites them), delete the "
                         "directory, or give another --out")


def _foreign(d: Path, names: list[str]) -> LrmoeError:
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return LrmoeError(f"--out {d} holds files lrmoe did not write ({shown}); it is not an "
                      f"lrmoe output directory (no {MARKER} or {BENCH_MARKER}). Give a new or "
                      "empty directory")


def check_bench_out(out: Path, reuse: bool) -> None:
    """Refuse an ``lrmoe bench ttl --out`` it may not write into (reads only)."""
    names = _names(out)
    if not names:
        return
    if (out / MARKER).is_file() or _legacy_run(out):
        raise LrmoeError(f"--out {out} is an lrmoe train run directory; bench ttl writes its "
                         "results elsewhere: give another --out")
    if not (out / BENCH_MARKER).is_file() and not set(names) <= {LOCK}:
        raise _foreign(out, names)
    check_lock(out)
    done = [n for n in BENCH_RESULTS if n in names]
    if done and not reuse:
        raise LrmoeError(f"--out {out} holds an earlier bench ttl run's results "
                         f"({', '.join(done)}), which this run would replace; give a new "
                         f"--out, or --reuse {out / done[0]} to keep the policies it finished")


def take(d: Path) -> bool:
    """Create ``d`` if needed and take its lock; True if ``d`` was created here."""
    created = not d.exists()
    try:
        d.mkdir(parents=True, exist_ok=True)
        acquire_lock(d)
    except OSError as e:
        raise LrmoeError(os_error_line(e, "--out: cannot create")) from None
    return created


def give_up(d: Path, created: bool, subdirs: tuple[Path, ...] = ()) -> None:
    """Release ``d``'s lock; if :func:`take` created ``d``, remove the markers and the
    (empty) directories again, so a run refused at start leaves nothing behind."""
    release_lock(d)
    if created:
        for m in (MARKER, BENCH_MARKER):
            (d / m).unlink(missing_ok=True)
        for sub in (*subdirs, d):
            with contextlib.suppress(OSError):
                os.rmdir(sub)


# ----------------------------------------------------------------------------- lock
def read_lock(p: Path) -> dict | None:
    """What lock file ``p`` says of its holder (pid, host, since), None without one."""
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable or half-written: held by someone we cannot name
    return d if isinstance(d, dict) else {}


def _holder(info: dict) -> str:
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}"


def _stale(info: dict) -> bool:
    """A lock left by a process that no longer runs on this host."""
    pid = info.get("pid")
    return (info.get("host") == socket.gethostname() and isinstance(pid, int)
            and pid != os.getpid() and not pid_alive(pid))


def check_lock(run_dir: Path) -> None:
    """Refuse if another live run holds ``run_dir``'s lock (reads only)."""
    info = read_lock(run_dir / LOCK)
    if info is None or _stale(info) or info.get("pid") == os.getpid():
        return
    raise LrmoeError(f"--out {run_dir} is in use by another lrmoe run ({_holder(info)}, lock "
                     f"file {run_dir / LOCK}); wait for it to end or give another --out. If "
                     "that process is gone, delete the lock file")


def acquire_lock(run_dir: Path) -> Path:
    """Create ``run_dir/.lrmoe-lock`` for this process (taking over a stale one)."""
    p = run_dir / LOCK
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    for _ in range(2):
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            info = read_lock(p)
            if info is not None and not _stale(info):
                check_lock(run_dir)  # raises, naming the holder
                raise LrmoeError(f"--out {run_dir}: cannot take the lock {p}") from None
            print(f"lrmoe: warning: taking over the stale lock {p} of {_holder(info or {})}, "
                  "which no longer runs", file=sys.stderr, flush=True)
            p.unlink(missing_ok=True)  # then O_EXCL again: a racing taker loses
            continue
        except OSError as e:
            raise LrmoeError(os_error_line(
                e, "--out is not writable: cannot create the lock file")) from None
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(me))
        return p
    raise LrmoeError(f"--out {run_dir}: another run took the lock {p} first")


def check_shared(run_dir: Path, holder: dict | None, tries: int = 10) -> None:
    """Refuse unless ``run_dir`` holds the lock ``holder`` (rank 0's, just taken): then
    this rank's ``--out`` is rank 0's run directory, on a file system both see. A
    network file system may show a new file a moment late: a few looks, 0.2 s apart."""
    for i in range(tries):
        if read_lock(run_dir / LOCK) == holder:
            return
        time.sleep(0.2 if i + 1 < tries else 0)
    raise LrmoeError(f"--out {run_dir} is not the run directory rank 0 opened (it does not "
                     f"hold rank 0's lock, {_holder(holder or {})}): every rank must name the "
                     "same directory, on a file system all ranks share")


def release_lock(run_dir: Path) -> None:
    """Remove the lock if this process holds it."""
    p = run_dir / LOCK
    info = read_lock(p)
    if info and info.get("pid") == os.getpid() and info.get("host") == socket.gethostname():
        p.unlink(missing_ok=True)


def mark(run_dir: Path, marker: str = MARKER, by: str = "lrmoe train") -> None:
    """Write the marker into the run directory :func:`take` created."""
    try:
        if not (run_dir / marker).exists():
            (run_dir / marker).write_text(f"written by {by}; do not delete\n")
    except OSError as e:
        raise LrmoeError(os_error_line(e, "--out: cannot create")) from None


# ----------------------------------------------------------------------------- writability
def _held_by(leftovers: list[Path]) -> str:
    """"; .ckpt-00000004.tmp (an interrupted save) holds 12.0 MiB: delete it to free
    the space" for the leftovers in ``d``; "" if none."""
    if not leftovers:
        return ""
    size = sum(f.stat().st_size for d in leftovers for f in d.rglob("*") if f.is_file())
    names = ", ".join(str(p) for p in leftovers)
    return (f"; {names} (interrupted checkpoint save{'s' if len(leftovers) > 1 else ''}) "
            f"hold{'s' if len(leftovers) == 1 else ''} {size / 2**20:.1f} MiB: delete "
            f"{'it' if len(leftovers) == 1 else 'them'} to free the space")


def probe_writable(d: Path, need_bytes: int = 0, leftovers: list[Path] = ()) -> None:
    """Create ``d``, write + fsync + remove a probe file there, and check free space;
    ``leftovers`` (interrupted saves in ``d``) are named when space is short."""
    p = d / f"{_PROBE}-{os.getpid()}"
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"lrmoe")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(p)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(p)
        raise LrmoeError(f"the run directory is not writable: cannot write {e.filename or p}: "
                         f"{e.strerror or e}" + (_held_by(list(leftovers))
                                                 if e.errno == errno.ENOSPC else "")) from None
    if need_bytes:
        free = shutil.disk_usage(d).free
        if free < need_bytes:
            raise LrmoeError(f"not enough space in {d}: {free / 2**20:.1f} MiB free, one "
                             f"checkpoint needs about {need_bytes / 2**20:.1f} MiB"
                             + _held_by(list(leftovers)))
