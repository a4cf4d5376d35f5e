"""The row and selection kernels on the CPU, through Triton's interpreter: runs
tests/rowops_interp_cases.py in a process of its own with ``TRITON_INTERPRET=1`` (Triton
reads the variable when a kernel is defined, so this process, which may have imported
the kernels already, cannot switch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

TESTS = Path(__file__).resolve().parent


def test_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS.parent / "src"), str(TESTS)] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist",
                        str(TESTS / "rowops_interp_cases.py")],
                       env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=600)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail, tail
