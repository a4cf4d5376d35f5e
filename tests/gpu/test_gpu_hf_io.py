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


def _reset_peak_rss() -> bool:
    """Restart this process's ``VmHWM`` from its current RSS (Linux ``clear_refs`` 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def test_load_on_cuda_holds_one_tensor_on_the_host(tmp_path):
    """The loading rule on CUDA: the host holds one tensor's pages at a time, also where
    the file's dtype (bf16) differs from the parameter's (fp32): the conversion happens
    on the GPU, not in a host copy of the tensor."""
    import safetensors.torch

    from lrmoe.hf_load import empty_model, load_owned, open_checkpoint
    from lrmoe.train.metrics import host_peak_rss_bytes, host_rss_bytes

    pytest.importorskip("transformers")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hf_fixtures import QWEN

    cfg = Qwen3MoeConfig(**{**QWEN, "vocab_size": 131072, "hidden_size": 256,
                            "head_dim": 32, "tie_word_embeddings": False})
    d = tmp_path / "m"
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    ck = open_checkpoint(d)
    largest = max(t.numel() * 2 for t in safetensors.torch.load_file(
        next(d.glob("*.safetensors"))).values())
    model = empty_model(ck.config, None, "cuda")
    assert model.embed_tokens.weight.dtype == torch.float32
    torch.cuda.synchronize()
    if not _reset_peak_rss():
        pytest.skip("this kernel cannot reset VmHWM (/proc/self/clear_refs)")
    before = host_rss_bytes()
    report = load_owned(model, ck)
    grown = host_peak_rss_bytes() - before
    assert report.largest_bytes == largest
    # one tensor's pages plus allocator slack; a host fp32 copy would add 2x the tensor
    assert grown <= 1.5 * largest, (grown, largest)
