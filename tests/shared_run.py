"""A module-scoped run made once per test session, also across pytest-xdist workers.

Under ``make test`` (two xdist workers) the tests reading one run may land on both
workers; each would make its own. Here the first worker to ask makes it in the session's
shared temporary folder, under a file lock, and the others wait for it and read it.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Callable


def run_once(tmp_path_factory, name: str, make: Callable[[Path], dict]) -> tuple[Path, dict]:
    """``(folder, record)``: ``make(folder)`` run once per session; its record (JSON) is
    kept beside the folder for the workers that did not run it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' folders share this parent
        root = root.parent
    folder, done = root / name, root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            folder.mkdir(exist_ok=True)
            done.write_text(json.dumps(make(folder)))
    return folder, json.loads(done.read_text())
