"""The exchange's backward drops what the forward kept, and its own transients, at their
last use: at the dx GEMM (the old peak) only the activation-input gradient ``dgu`` and
the layer's output gradient are alive among the row tensors (:mod:`live_rows`).

Cases: one process (every exchange the identity) with the router gradient at home and at
the experts, and one rank of a 4-rank group (:class:`onerank.OneRankComm`, ``tests/onerank.py``) for
an exact plan, a trimmed lrmoe plan (saved rows gathered) and a recompute plan (gate_up
rows rebuilt in backward).
"""

from __future__ import annotations

import weakref

import pytest
import torch

import lrmoe.ops.experts as ops
import test_ledger_truth as truth
from live_rows import LiveRows
from lrmoe.ledger import Ledger
from lrmoe.model.moe import MoERuntime
from lrmoe.parallel.exchange import BackwardOptions
from onerank import one_rank_layer

H, F, T = truth.H, truth.F, truth.T
CASES = ["one_process", "one_process_router_grad_experts", "static", "lrmoe_trimmed",
         "static_recompute"]


def _layers(case: str):
    """``(rank, layer)`` for every rank the case runs, and the layer inputs."""
    layer, x, counts = truth._layer_and_tokens()
    if case.startswith("one_process"):
        rg = "experts" if case.endswith("experts") else "home"
        layer.runtime = MoERuntime(backward=BackwardOptions(router_grad=rg), fast_local=False)
        return [(0, layer)], x
    policy, ledger = truth._policy_and_ledger(case, counts)
    return [(me, one_rank_layer(layer, me, counts, policy, ledger)) for me in range(truth.G)], x


@pytest.mark.parametrize("case", CASES)
def test_only_dgu_and_dout_alive_at_the_dx_gemm(case, monkeypatch):
    gmm = ops._gmm
    at_dx: list = []
    state: dict = {}

    def gmm_hook(a, b, *rest):
        if a.dim() == 2 and b.dim() == 3 and a.shape[1] == 2 * F and b.shape[1] == 2 * F:
            # the dx GEMM: dgu [R, 2F] x w13 [I, 2F, H]
            live = state["live"]
            at_dx.append((set(live.alive()), {live.storage_id(a)} if a.numel() else set(),
                          [name for name, ref in state["kept"].items() if ref() is not None]))
        return gmm(a, b, *rest)
    monkeypatch.setattr(ops, "_gmm", gmm_hook)
    seen = {"rec": False, "gathered": False}
    layers, x = _layers(case)
    for me, layer in layers:
        xin = x[me * T:(me + 1) * T].clone().requires_grad_()
        out = layer(xin.view(1, T, H))
        node = truth.exchange_node(out)
        plan = node.st.plan
        seen["rec"] |= bool(node.keep_G[0].n_rec)
        seen["gathered"] |= Ledger.backward_rows(plan, me).gathered
        rows = {k: t for k, t in node.kept[0].items() if t.numel()}  # y_send is empty at experts
        state["kept"] = {k: weakref.ref(t.untyped_storage()) for k, t in rows.items()}
        dout = torch.ones_like(out)
        state["live"] = live = LiveRows((H, F, 2 * F), [], count=[*rows.values(), dout])
        del rows
        at_dx.clear()
        with live:
            out.backward(dout)
        assert len(at_dx) == 1, (case, me, len(at_dx))
        alive, dgu, kept_alive = at_dx[0]
        assert not kept_alive, (case, me, kept_alive)
        assert alive == dgu | {live.storage_id(dout)}, (case, me, len(alive))
    if case == "lrmoe_trimmed":
        assert seen["gathered"]
    if case == "static_recompute":
        assert seen["rec"]


def test_a_second_backward_is_one_readable_error():
    """The kept rows are gone after the first backward: ``retain_graph`` cannot reuse them."""
    [(_, layer)], x = _layers("one_process")
    out = layer(x[:T].view(1, T, H))
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        out.sum().backward()
