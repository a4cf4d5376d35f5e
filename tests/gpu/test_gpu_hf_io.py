"""``--init-from`` and ``lrmoe export`` on CUDA with ``--optimizer-offload host``: the
rank's model is allocated on the GPU and filled there; the GPU keeps bf16 expert
weights, the host their fp32 masters, and the export takes the masters (exactly), not
the bf16 copies."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gpu_util import needs_cuda

pytestmark = needs_cuda
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: hf_fixtures


def test_init_from_on_cuda_with_host_offload_exports_the_masters(tmp_path):
    from hf_fixtures import hf_dir, write_rows
    from lrmoe.cli import main
    from lrmoe.hf_load import load_hf
    from lrmoe.train import checkpoint as ckpt

    pytest.importorskip("transformers")
    d, _ = hf_dir(tmp_path, "qwen3")
    data = write_rows(tmp_path / "rows.jsonl")
    run = tmp_path / "run"
    assert main(["train", "--init-from", str(d), "--data", str(data), "--out", str(run),
                 "--device", "cuda", "--optimizer-offload", "host", "--steps", "3",
                 "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1",
                 "--warmup", "1"]) == 0
    ck = ckpt.latest_checkpoint(run)
    md = ckpt.checkpoint_metadata(ck)
    name = "layers.1.mlp.experts.gate_up_proj"
    assert md[f"model/{name}/e0"].properties.dtype == torch.bfloat16  # the GPU's copy
    masters = ckpt.read_tensors(ck, [f"optim/{name}/master/e{e}" for e in range(8)], md)
    assert main(["export", str(run), str(tmp_path / "x")]) == 0
    got = load_hf(tmp_path / "x").state_dict()[name]
    want = torch.stack([masters[f"optim/{name}/master/e{e}"] for e in range(8)])
    assert torch.equal(got, want)
    assert not torch.equal(want, want.bfloat16().float())  # fp32 values the bf16 copy lacks
