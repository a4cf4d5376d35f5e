"""Resume on another EP size on CUDA/NCCL (:mod:`reshard_check`), on every GPU of the
machine (at least 2): each resume's next-step loss matches the same-size resume's."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import reshard_check
import torch
from gpu_util import needs_cuda, report_dir

pytestmark = [*needs_cuda, pytest.mark.dist]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_resume_on_another_ep_size_keeps_the_loss():
    d = report_dir("reshard") or Path(tempfile.mkdtemp()) / "reshard"
    n = torch.cuda.device_count()
    report = reshard_check.main(["--out", str(d), "--nproc", str(n - n % 2), "--device", "cuda"])
    assert report["rel_diff_to_same_size"], report
    for name, rel in report["rel_diff_to_same_size"].items():
        assert rel < 1e-2, (name, rel)
