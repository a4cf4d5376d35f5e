"""``bench ttl`` on CUDA records each policy's device peak of the emulating process, a
positive byte count below the device's capacity (on the CPU it records none)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_util import needs_cuda  # noqa: E402

from lrmoe.sim import ttl  # noqa: E402

pytestmark = needs_cuda


def test_ttl_records_each_policys_device_peak():
    cfg = ttl.TTLConfig.from_flat(preset="tiny-qwen3", ep=2, steps=2, batch_size=4, seq_len=16,
                                  eval_every=0, eval_batches=1, max_data_bytes=100_000,
                                  device="cuda", policies=("static", "symi"))
    rep = ttl.bench_ttl(cfg, log=lambda *a: None)
    cap = torch.cuda.get_device_properties(0).total_memory
    for name, r in rep["policies"].items():
        peak = r["emulator_device_peak_bytes"]
        assert isinstance(peak, int) and 0 < peak < cap, name
