"""At most one host wait per MoE layer per direction, for every policy: the count
all-gather in forward (the split sizes of the dispatch), and in backward only the
sampled estimator's kept-row counts (the split sizes of its compacted exchange).

One rank of a 4-rank EP group runs the real runtime with synthetic peers
(:class:`onerank.OneRankComm`, ``tests/onerank.py``); :class:`host_waits.HostWaits` counts, on the
CPU, every read of data that would be on the GPU (tensors computed from the layer's
input and weights). The one-process path is counted the same way."""

from __future__ import annotations

import pytest
import torch

from host_waits import HostWaits
from lrmoe.model.moe import MoERuntime
from lrmoe.parallel.exchange import BackwardOptions
from lrmoe.policy.capacity import CapacityPolicy
from onerank import one_rank_layer
from test_ledger_truth import CASES, T, _layer_and_tokens, _policy_and_ledger

SAMPLED = BackwardOptions(estimator="sampled")


def _count(layer, x):
    """(forward waits, backward waits) of one training step of ``layer`` on ``x``. The
    instance routes' device indices are cached across steps (copied once, through pinned
    memory); the cache is emptied first so that the copy is seen made in this step."""
    from lrmoe.parallel.instances import _route

    _route.cache_clear()
    hw = HostWaits()
    hw.device(x, *layer.parameters())
    with hw:
        out = layer(x)
    fwd, hw.waits = hw.waits, []
    loss = out.float().square().mean() + (layer.last.aux_loss if layer.last.aux_loss is not None else 0)
    hw.device(loss)
    with hw:
        loss.backward()
    return fwd, hw.waits


def _cases():
    for case in CASES:
        yield case, None
    yield "lrmoe_trimmed", SAMPLED
    yield "lrmoe_recompute", SAMPLED
    yield "capacity", None


@pytest.mark.parametrize("case,opts", list(_cases()),
                         ids=[f"{c}-{'sampled' if o else 'topk'}" for c, o in _cases()])
def test_one_host_wait_per_direction(case, opts):
    layer, x, counts = _layer_and_tokens()
    if case == "capacity":
        pol, ledger = CapacityPolicy(capacity_factor=0.7), None
    else:
        pol, ledger = _policy_and_ledger(case, counts)
    rank = one_rank_layer(layer, 0, counts, pol, ledger, opts)
    rank.train()
    x0 = x[:T].view(1, T, -1).clone().requires_grad_(True)
    fwd, bwd = _count(rank, x0)
    plan_trimmed = rank.runtime.stats[0].get("retained_rows", 0) < rank.runtime.stats[0]["fwd_rows"]
    assert len(fwd) == 1, fwd  # the count all-gather
    assert fwd[0][0] == "Tensor.cpu" and ("comm.py" in fwd[0][1] or "onerank.py" in fwd[0][1]), fwd
    sampled_trim = opts is SAMPLED and "lrmoe" in case
    assert len(bwd) == int(sampled_trim), bwd
    if case.startswith("lrmoe_trimmed"):
        assert plan_trimmed  # the case exercises selection


@pytest.mark.parametrize("gemm", ["grouped", "loop"])
def test_one_process_path_waits_only_for_the_loop_fallback(gemm, monkeypatch):
    """The local path reads no device data but for the per-expert loop fallback's row
    counts (the grouped GEMM reads the device offsets): none with the grouped GEMM, and
    with the loop one read a direction, for all its GEMMs, where the loop reads them."""
    from lrmoe.ops import experts as ops

    grouped = []
    if gemm == "loop":
        monkeypatch.setattr(ops, "_grouped_ok", lambda a, b: False)
    elif ops._grouped_mm is None:
        pytest.skip("this torch build has no grouped_mm: its experts always take the loop")
    else:
        real = ops._grouped_mm
        monkeypatch.setattr(ops, "_grouped_mm", lambda *a, **kw: grouped.append(1) or real(*a, **kw))
    layer, x, _ = _layer_and_tokens()
    layer.runtime = MoERuntime()
    layer.train()
    fwd, bwd = _count(layer, x[:T].view(1, T, -1).clone().requires_grad_(True))
    assert layer.last.path == "local"
    if gemm == "grouped":
        assert fwd == [] and bwd == [], (fwd, bwd)
        assert len(grouped) == 6  # 2 GEMMs forward, 4 backward: none took the loop
        return
    assert len(fwd) == 1 and len(bwd) == 1, (fwd, bwd)
    assert all(w[0] == "Tensor.tolist" and w[1].startswith("experts.py") for w in fwd + bwd), \
        (fwd, bwd)


def test_the_counter_sees_a_host_read():
    """The counter itself: device data read back, a mask, a host index into device data
    and a pageable copy wait; host-built tensors and explicit-device factories do not."""
    hw = HostWaits()
    d = torch.arange(6)
    hw.device(d)
    with hw:
        y = d * 2
        _ = y[y > 3]           # boolean mask: a wait
        _ = int(y.sum())       # a read: a wait
        h = torch.tensor([1, 2]) + 1  # host-built: no wait
        _ = h.tolist()
        _ = y[h]               # host index into device data: a wait
        _ = y[torch.arange(2, device=y.device)]  # a device index: no wait
        _ = torch.tensor([0, 1], device=y.device)  # host data copied over: a wait
        host = y.cpu()         # a wait; the copy is a host tensor
        _ = host.tolist()
    assert [w[0] for w in hw.waits] == [
        "aten.index.Tensor", "aten._local_scalar_dense.default", "aten.index.Tensor",
        "torch.tensor(host data, device=...)", "Tensor.cpu"]
