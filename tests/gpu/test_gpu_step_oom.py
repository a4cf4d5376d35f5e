"""A real CUDA out-of-memory inside a training step: one line naming the micro-batch and
what would fit, exit 2, the checkpoint of the run before it intact (CPU twin with the
host allocator: tests/test_step_oom.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpu_util import needs_cuda, report_dir

pytestmark = needs_cuda

ROOT = Path(__file__).resolve().parents[2]


def test_cuda_out_of_memory_in_a_step_is_one_line(tmp_path):
    """tiny-qwen3 with 32768 x 4096 tokens a micro-batch: its bf16 logits alone are 64
    GiB and their fp32 loss 128 GiB, more than an H200 holds."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lrmoe", "train", "--preset", "tiny-qwen3", "--device", "cuda",
           "--out", str(out), "--steps", "1", "--batch-size", "32768", "--seq-len", "4096",
           "--eval-batches", "1", "--max-data-bytes", "8MiB"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    d = report_dir("step_oom")
    if d is not None:
        (d / "stderr.txt").write_text(p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("lrmoe: error:")]
    assert p.returncode == 2, p.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    for w in ("GPU out of memory at step 1", "micro-batch 1 of 1",
              "32768 sequences x 4096 tokens", "Tried to allocate", "no checkpoint was written",
              "--activation-checkpoint full", "--grad-accum 2"):
        assert w in lines[0], lines[0]
