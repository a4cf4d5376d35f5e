"""At most one host wait per MoE layer per direction on CUDA, for every policy, as
``torch.cuda.set_sync_debug_mode`` sees them (the CPU test, ``tests/test_host_waits.py``,
counts the same reads by lineage). One rank of a 4-rank group with synthetic peers, bf16,
the second step (the first compiles the fused kernels)."""

from __future__ import annotations

import sys
import traceback
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_util import needs_cuda  # noqa: E402

from lrmoe.model.moe import MoERuntime  # noqa: E402
from lrmoe.policy.capacity import CapacityPolicy  # noqa: E402
from onerank import one_rank_layer  # noqa: E402
from test_host_waits import SAMPLED, _cases  # noqa: E402
from test_ledger_truth import T, _layer_and_tokens, _policy_and_ledger  # noqa: E402

pytestmark = needs_cuda


def _syncs(layer, x) -> tuple[list[str], list[str]]:
    """Sync warnings of one training step's forward and backward, each named by the
    lrmoe lines that issued it."""
    out_w = []
    for phase in ("forward", "backward"):
        seen: list[str] = []

        def show(message, category, filename, lineno, file=None, line=None, seen=seen):
            if "synchroniz" in str(message):
                st = [f for f in traceback.extract_stack()[:-1] if "/lrmoe/" in f.filename]
                seen.append(" <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                                        for f in st[::-1][:3]))
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                if phase == "forward":
                    out = layer(x)
                else:
                    aux = layer.last.aux_loss if layer.last.aux_loss is not None else 0
                    (out.float().square().mean() + aux).backward()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        out_w.append(seen)
    return out_w[0], out_w[1]


def _step(layer, x):
    layer.zero_grad(set_to_none=True)
    return _syncs(layer, x.detach().clone().requires_grad_(True))


@pytest.mark.parametrize("case,opts", list(_cases()),
                         ids=[f"{c}-{'sampled' if o else 'topk'}" for c, o in _cases()])
def test_one_sync_per_direction_on_cuda(case, opts):
    layer, x, counts = _layer_and_tokens()
    pol, ledger = ((CapacityPolicy(capacity_factor=0.7), None) if case == "capacity"
                   else _policy_and_ledger(case, counts))
    rank = one_rank_layer(layer, 0, counts, pol, ledger, opts).cuda().to(torch.bfloat16)
    rank.train()
    x0 = x[:T].view(1, T, -1).cuda().to(torch.bfloat16)
    _step(rank, x0)  # warm-up: compiles
    fwd, bwd = _step(rank, x0)
    print(case, "sampled" if opts else "topk", "forward", fwd, "backward", bwd)
    assert len(fwd) <= 1, fwd
    assert len(bwd) <= int(opts is SAMPLED and "lrmoe" in case), bwd


def test_one_process_path_has_no_sync_on_cuda():
    layer, x, _ = _layer_and_tokens()
    layer = layer.cuda().to(torch.bfloat16)
    layer.runtime = MoERuntime()
    layer.train()
    x0 = x[:T].view(1, T, -1).cuda().to(torch.bfloat16)
    _step(layer, x0)
    fwd, bwd = _step(layer, x0)
    print("local", fwd, bwd)
    assert layer.last.path == "local"
    assert fwd == [] and bwd == [], (fwd, bwd)
