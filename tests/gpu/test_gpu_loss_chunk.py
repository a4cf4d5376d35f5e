"""``--loss-chunk`` on CUDA: with Qwen3's 151,936-word vocabulary and 4,096 tokens, one
forward and backward of the loss under bf16 autocast peaks lower by most of the
micro-batch's logits (whole: ~10-12 bytes a token and word), and the loss and the head's
gradient agree with the whole path to bf16 tolerance."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_util import needs_cuda, report_dir  # noqa: E402

from lrmoe.model import MoEForCausalLM  # noqa: E402
from lrmoe.presets import get_preset  # noqa: E402

pytestmark = needs_cuda
V, B, T, CHUNK = 151_936, 4, 1024, 1024


def _peak_and_grads(model, ids, chunk):
    model.set_loss_chunk(chunk)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lm, obj = model.loss(ids[:, :-1], ids[:, 1:])
    obj.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, lm.detach(), model.lm_head.weight.grad.clone()


def test_chunked_loss_peaks_lower_by_the_logits():
    torch.manual_seed(0)
    cfg = dataclasses.replace(get_preset("tiny-qwen3"), vocab_size=V)
    model = MoEForCausalLM(cfg).cuda()
    ids = torch.randint(0, V, (B, T + 1), device="cuda")
    _peak_and_grads(model, ids, 0)  # warm-up: kernels and the allocator's pools
    whole, lm0, g0 = _peak_and_grads(model, ids, 0)
    chunked, lm1, g1 = _peak_and_grads(model, ids, CHUNK)
    N = B * T
    line = (f"peak above the model: whole {whole / 2**30:.2f} GiB, chunks of {CHUNK} "
            f"{chunked / 2**30:.2f} GiB; the whole logits in fp32 {N * V * 4 / 2**30:.2f} GiB")
    print(line)
    d = report_dir("loss_chunk")
    if d is not None:
        (d / "loss_chunk.json").write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), torch=torch.__version__, tokens=N, vocab=V,
            chunk=CHUNK, peak_whole_bytes=whole, peak_chunked_bytes=chunked, line=line)))
    assert whole - chunked >= 6 * (N - CHUNK) * V  # at least the fp32 logits and half more
    torch.testing.assert_close(lm1, lm0, rtol=1e-3, atol=0)
    assert (g1 - g0).abs().max() <= 2e-2 * g0.abs().max()
