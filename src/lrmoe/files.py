"""Files lrmoe writes: the mode a new file gets, its flush to disk, and the staging directory of a save
(``.lrmoe-save-HOST-PID-TAG`` in the target, its files renamed into place once all are
written; the rules: docs/reliability.md)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import uuid
from pathlib import Path

STAGING_PREFIX = ".lrmoe-save-"
_STAGING = re.compile(r"^\.lrmoe-save-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def umask() -> int:
    """The process's umask (read without changing it where ``/proc`` tells)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no /proc: read it by setting it (and put it back)
    os.umask(mask)
    return mask


def mode_for(final: Path) -> int:
    """The mode a file written over ``final`` takes: ``final``'s own where it exists, else
    the one ``open`` gives a new file (``0666 & ~umask``; a temporary file's ``0600``
    would survive its rename)."""
    try:
        return final.stat().st_mode & 0o7777
    except OSError:
        return 0o666 & ~umask()


def fsync(path: Path) -> None:
    """Flush file or directory ``path`` (a directory: the names renamed into it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or not a pid we can ask about: keep
    return True


def staging_dir(target: Path) -> Path:
    """Create and return this save's staging directory inside ``target``."""
    d = target / f"{STAGING_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    return d


def remove_dead_leftovers(target: Path) -> None:
    """Remove the staging directories in ``target`` that a killed save on this host
    left (its pid no longer runs); a running save's, another host's, or files that only
    look alike stay."""
    host = socket.gethostname()
    try:
        names = os.listdir(target)
    except OSError:
        return
    for name in names:
        m = _STAGING.match(name)
        if m is None or m["host"] != host:
            continue
        if int(m["pid"]) == os.getpid() or pid_alive(int(m["pid"])):
            continue
        p = target / name
        with contextlib.suppress(OSError):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
