"""What the GPU checks share: the ``gpu`` marker that skips without CUDA, and where a
check writes its table (``$LRMOE_GPU_OUT``, set by ``benchmarks/gpu_run.sh``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

needs_cuda = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def report_dir(name: str) -> Path | None:
    """``$LRMOE_GPU_OUT/name`` (created), or None when the variable is not set."""
    root = os.environ.get("LRMOE_GPU_OUT")
    if not root:
        return None
    d = Path(root) / name
    d.mkdir(parents=True, exist_ok=True)
    return d
