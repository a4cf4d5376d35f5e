"""The whole-MoE-layer checkpoint (``Plan.layer_checkpoint``, docs/design.md §5).

Exact: the checkpointed layer's output and gradients equal the layer's without it (one
process, and EP over gloo). Priced: what autograd keeps for the checkpointed layer is
what the ledger's ``layer`` mode says (:meth:`lrmoe.ledger.Ledger.layer_terms`). Planned:
under a budget that per-row recompute cannot meet but the checkpoint can, the exact
policies return layer-checkpointed plans. Emulated: the emulator re-runs the layer's
forward in backward and charges what it measured there (``bwd_recompute``).
"""

from __future__ import annotations

import copy
import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

from dist_util import FixedRouter, hot_replica_plan, run_world
from lrmoe.config import ModelConfig
from lrmoe.errors import LrmoeError
from lrmoe.ledger import Ledger
from lrmoe.model.moe import MoELayer, MoERuntime
from lrmoe.parallel.comm import EPComm
from lrmoe.parallel.groups import ParallelContext, shard_experts
from lrmoe.policy.base import PlanInputs, Policy
from lrmoe.policy.capacity import CapacityPolicy
from lrmoe.policy.plan import layer_checkpoint_plan
from lrmoe.policy.plan_numpy import full_plan
from lrmoe.policy.static import StaticPolicy
from lrmoe.policy.symi import SymiPolicy
from references.plans import native_placement

T, H, E, K, F = 12, 16, 8, 2, 8


def _cfg(layers: int = 1) -> ModelConfig:
    return ModelConfig(model_type="qwen3_moe", vocab_size=32, hidden_size=H, num_attention_heads=2,
                       num_key_value_heads=1, moe_intermediate_size=F, num_experts=E,
                       num_experts_per_tok=K, num_hidden_layers=layers, intermediate_size=32)


class Checkpointed(Policy):
    """``inner``'s plan, whole-layer checkpointed (or not, ``on=False``)."""

    def __init__(self, inner, on: bool = True):
        self.inner, self.on, self.name = inner, on, "checkpointed-test"

    def plan(self, counts_GE, inputs):
        p = self.inner.plan(counts_GE, inputs)
        return dataclasses.replace(p, layer_checkpoint=self.on)


class Replicas(Policy):
    name = "replica-test"

    def plan(self, counts_GE, inputs):
        return hot_replica_plan(counts_GE, avoid_owner=False)


def _layer(world: int, seed: int = 0):
    gen = torch.Generator().manual_seed(1234 + seed)
    torch.manual_seed(seed)
    layer = MoELayer(_cfg(), 0)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(world * T)])
    idx[: world * T // 2, 0] = 1  # a hot expert: replicas, capacity drops
    layer.router = FixedRouter(idx, E, H)
    x = torch.randn(world * T, H, generator=gen)
    coeff = torch.randn(world * T, H, generator=gen)
    return layer, idx, x, coeff


def _run(layer, x, coeff):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y = layer(x.unsqueeze(0)).squeeze(0)
    (y * coeff).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "g13": layer.experts.gate_up_proj.grad,
            "g2": layer.experts.down_proj.grad, "gr": layer.router.weight.grad}


@pytest.mark.parametrize("inner", ["static", "replicas", "capacity"])
def test_one_process_checkpoint_is_exact(inner):
    """The same plan with and without the checkpoint: same output and gradients; the
    checkpointed forward keeps no expert rows and its backward re-ran every row."""
    layer, _, x, coeff = _layer(1)
    pol = {"static": StaticPolicy, "replicas": Replicas,
           "capacity": lambda: CapacityPolicy(0.75)}[inner]()
    runs = []
    for on in (False, True):
        lay = copy.deepcopy(layer)
        lay.runtime = MoERuntime(policy=Checkpointed(pol, on), fast_local=False)
        runs.append((_run(lay, x, coeff), lay.runtime.stats[0]))
    (ref, st0), (got, st1) = runs
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)
    assert st1["layer_checkpoint"] and not st0["layer_checkpoint"]
    assert st0["saved_act_bytes"] > 0 and st1["saved_act_bytes"] == 0
    assert st1["fwd_rows"] == st1["bwd_rows"] > 0
    # backward re-sent the dispatch and the combine, row for row
    for k in ("dispatch_bytes_sent", "combine_bytes_sent"):
        assert st1["recompute_" + k] == st1["fwd_" + k] > 0
    assert st1["recomputed_rows"] == st1["fwd_rows"] and st0["recomputed_rows"] == 0
    if inner == "capacity":
        assert st1["plan_replicas"] == 0 and stats_dropped(layer, x)


def stats_dropped(layer, x) -> bool:
    """The capacity case drops pairs (so the checkpoint re-runs a dropping layout)."""
    lay = copy.deepcopy(layer)
    lay.runtime = MoERuntime(policy=CapacityPolicy(0.75), fast_local=False)
    counts = torch.bincount(lay.router.idx.flatten(), minlength=E)[None]
    return bool(lay.runtime.policy.plan(counts, PlanInputs()).dropped_GE.sum() > 0)


def _ep_worker(rank, world):
    layer, idx, x, coeff = _layer(world)
    ref = _run(copy.deepcopy(layer), x, coeff)  # one process, all tokens, no checkpoint
    sl = slice(rank * T, (rank + 1) * T)
    layer.router.idx = idx[sl]
    shard_experts(layer, ParallelContext(world=world, rank=rank, ep_size=world,
                                         ep_group=dist.group.WORLD))
    layer.runtime = MoERuntime(comm=EPComm(dist.group.WORLD), policy=Checkpointed(Replicas()))
    got = _run(layer, x[sl], coeff[sl])
    per = E // world
    own = slice(rank * per, (rank + 1) * per)
    dist.all_reduce(got["gr"])
    torch.testing.assert_close(got["y"], ref["y"][sl], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["dx"], ref["dx"][sl], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["g13"], ref["g13"][own], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["g2"], ref["g2"][own], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["gr"], ref["gr"], rtol=1e-5, atol=1e-6)
    st = layer.runtime.stats[0]
    assert st["layer_checkpoint"] and st["saved_act_bytes"] == 0 and st["plan_replicas"] > 0
    # backward re-sent the dispatch and the combine, row for row
    for k in ("dispatch_bytes_sent", "dispatch_bytes_recv", "combine_bytes_sent"):
        assert st["recompute_" + k] == st["fwd_" + k] > 0


def test_ep_checkpoint_is_exact(tmp_path):
    """Two gloo ranks, replicas across them, the checkpoint's re-run all-to-alls in backward:
    the gradients of one process without the checkpoint."""
    run_world(2, _ep_worker, tmp_path=tmp_path)


@pytest.mark.parametrize("case", ["static", "symi_replicas"])
def test_ledger_equals_what_autograd_keeps(case):
    """One rank of four (synthetic peers, a real router), its forward under
    ``saved_tensors_hooks``: the checkpoint keeps the layer input and the expert ids (the
    router's own saved tensors, outside the ledger), the instance weights (the owned
    parameters themselves on the native plan) and the gates, ``pair_index`` of
    :meth:`Ledger.layer_terms`; nothing else of the exchange (no rows, no layouts)."""
    import test_ledger_truth as lt
    from onerank import one_rank_layer

    layer, x, counts = lt._layer_and_tokens()
    inner = StaticPolicy() if case == "static" else SymiPolicy(slots_per_rank=E // lt.G + 1)
    one = Ledger(lt._cfg(), lt.G, num_moe_layers=1)
    seen_copy = False
    for me in range(lt.G):
        lay = one_rank_layer(layer, me, counts, Checkpointed(inner))
        xin = x[me * lt.T:(me + 1) * lt.T].clone().requires_grad_()
        hooked: list = []
        with torch.autograd.graph.saved_tensors_hooks(_keep(hooked),
                                                      lambda t: t):
            out = lay(xin.view(1, lt.T, lt.H))
        mine, other, found = {}, {}, False
        for n in lt._nodes([out.grad_fn, lay.last.aux_loss.grad_fn]):
            if type(n).__name__ == "ExpertExchangeBackward":
                found = True
                for t in n.saved_tensors:
                    mine.setdefault(*lt._storage(t))
                continue
            for k in dir(n):
                if k.startswith("_saved_") and isinstance(getattr(n, k), torch.Tensor):
                    other.setdefault(*lt._storage(getattr(n, k)))
        plan = Checkpointed(inner).plan(counts, PlanInputs(prev_counts_E=layer.prev_counts_E))
        assert found and plan.layer_checkpoint
        assert {lt._storage(t)[0] for t in hooked} <= set(mine) | set(other)
        params = {lt._storage(p)[0]: p.untyped_storage().nbytes() for p in lay.parameters()}
        t = one.rank_terms(plan)[me]
        assert t == one.layer_terms(*one._rank_counts(plan)[me][:3])
        assert t["retained_acts"] == t["combine_rows"] == 0
        shared = {p for p in mine if p in other}  # the router's: the input, the expert ids
        assert lt._storage(xin)[0] in shared and sum(mine[p] for p in shared) == (
            lt.T * lt.H * 4 + lt.T * lt.K * 8)
        as_params = sum(nb for p, nb in mine.items() if p in params)
        own = sum(nb for p, nb in mine.items() if p not in params and p not in shared)
        if as_params:  # the instance weights are the owned parameters (native plan)
            assert as_params == t["instance_weights"]
            assert own == t["pair_index"]
        else:
            seen_copy = True
            assert own == t["instance_weights"] + t["pair_index"]
        # the forward ran with no graph inside: nothing else is kept
        assert sum(other[p] for p in other if p not in mine and p not in params) == (
            lt.router_bytes() - lt.T * lt.H * 4 - lt.T * lt.K * 8)
    assert seen_copy == (case == "symi_replicas")



def _budgets(plan, L: int = 8):
    """For ``plan`` with L MoE layers: the least each rank needs with per-row recompute
    (any count) and with the layer checkpoint."""
    free = Ledger(_cfg(), plan.G, num_moe_layers=L)
    rows = free._rank_counts(plan)
    rec = [min(free.terms(n, R, h, k, m, exact=True)["total"] for m in range(k + 1))
           for n, R, h, k in rows]
    layer = [free.layer_terms(n, R, h)["total"] for n, R, h, _ in rows]
    return rec, layer


@pytest.mark.parametrize("name", ["static", "symi"])
def test_exact_policies_fall_back_to_the_layer_checkpoint(name):
    """A budget that no per-row recompute meets on the hot rank but the checkpoint does:
    static and symi with recompute plan the checkpoint, within the budget (without
    recompute they refuse, as before); below the checkpoint's need static refuses and
    symi gives replicas up, refusing only below static's own checkpoint."""
    G = 2
    counts = torch.tensor([[30, 9, 1, 1, 9, 1, 1, 1], [25, 2, 0, 1, 3, 1, 1, 1]])
    make = {"static": StaticPolicy, "symi": lambda recompute=False: SymiPolicy(
        slots_per_rank=E // G + 1, recompute=recompute)}[name]
    plain = make().plan(counts, PlanInputs(prev_counts_E=counts.sum(0)))
    rec, layer = _budgets(plain)
    assert max(layer) < max(rec)  # the checkpoint keeps less than any recompute count
    budget = (max(layer) + max(rec)) // 2
    led = Ledger(_cfg(), G, budget, num_moe_layers=8)
    inputs = PlanInputs(prev_counts_E=counts.sum(0), ledger=led)
    plan = make(recompute=True).plan(counts, inputs)
    plan.check(counts)
    assert plan.layer_checkpoint and plan.exact and plan.recompute_G is None
    assert torch.equal(plan.inst_expert_GS, plain.inst_expert_GS)
    assert max(t["total"] for t in led.rank_terms(plan)) <= budget
    assert led.exact_fit(plain)[0] == "layer"
    with pytest.raises(LrmoeError, match="does not fit"):
        make().plan(counts, inputs)
    tight = Ledger(_cfg(), G, max(layer) - 1, num_moe_layers=8)
    if name == "symi":  # it gives replicas up instead (tests/test_symi_fallback.py) ...
        fewer = make(recompute=True).plan(counts, dataclasses.replace(inputs, ledger=tight))
        assert fewer.replicas_given_up > 0 and fewer.given_up_for == "memory"
        assert max(t["total"] for t in tight.rank_terms(fewer)) <= tight.budget_bytes
        # ... down to static's placement, whose own checkpoint is the floor
        static = StaticPolicy().plan(counts, PlanInputs())
        tight = Ledger(_cfg(), G, max(_budgets(static)[1]) - 1, num_moe_layers=8)
    with pytest.raises(LrmoeError, match="whole-layer checkpoint"):
        make(recompute=True).plan(counts, dataclasses.replace(inputs, ledger=tight))


def test_layer_checkpoint_plan_for_planners():
    """The planners' last resort: any plan (here a trimmed one with drops of nothing)
    made exact and checkpointed on its own placement."""
    G = 2
    counts = torch.tensor([[30, 9, 1, 1, 9, 1, 1, 1], [25, 2, 0, 1, 3, 1, 1, 1]])
    full = full_plan(counts, native_placement(G, E))
    trimmed = dataclasses.replace(full, retain_GGS=full.assign_GGS // 2,
                                  select_GGS=full.assign_GGS // 3,
                                  recompute_G=torch.ones(G, dtype=torch.long))
    lc = layer_checkpoint_plan(trimmed)
    lc.check(counts)
    assert lc.layer_checkpoint and lc.exact and lc.recompute_G is None
    assert torch.equal(lc.inst_expert_GS, full.inst_expert_GS)
    assert torch.equal(lc.assign_GGS, full.assign_GGS)
    with pytest.raises(LrmoeError, match="exact"):
        dataclasses.replace(trimmed, layer_checkpoint=True).check(counts)


def _keep(into: list):
    """A pack hook that records every tensor autograd saves."""
    def pack(t):
        into.append(t)
        return t
    return pack


def test_emulator_charges_the_rerun_as_measured(monkeypatch):
    """The emulator re-runs a checkpointed layer's forward in backward: its expert
    kernels (slowed by a known sleep under a clock only sleeps advance) are charged to
    ``bwd_recompute`` on every rank, beside the re-sent dispatch and combine; the step
    costs that much more than without the checkpoint, and the gradients are the same."""
    import test_stage_charges as sc
    from emulated import EmulatedLayer
    from lrmoe.parallel import stages
    from lrmoe.sim.cost import rank_stage_seconds, step_times
    from lrmoe.sim.links import LINKS

    sc.FakeClock(monkeypatch)
    inner = stages.swiglu_forward

    def slow_forward(*a, **kw):
        time.sleep(sc.SLEEP)
        return inner(*a, **kw)
    monkeypatch.setattr(stages, "swiglu_forward", slow_forward)
    runs = []
    for on in (False, True):
        layer, x = sc._layer()
        v = EmulatedLayer(layer, sc.G, Checkpointed(Replicas(), on))
        x = x.clone().requires_grad_()
        v(x).sum().backward()
        runs.append((step_times(v.stats, LINKS["nvlink"]), v.stats, x.grad,
                     layer.experts.gate_up_proj.grad))
    (base, bst, bdx, bg), (ck, cst, cdx, cg) = runs
    torch.testing.assert_close(cdx, bdx)
    torch.testing.assert_close(cg, bg)
    assert cst.recompute_mode == "layer" and cst.saved_act_bytes == [0] * sc.G
    assert cst.expert_ms["recompute"] == pytest.approx([sc.SLEEP * 1e3] * sc.G, rel=1e-9)
    per = rank_stage_seconds(cst, LINKS["nvlink"])
    resend = [a + b for a, b in zip(per["fwd_dispatch"], per["fwd_combine"])]
    assert min(resend) > 0
    assert per["bwd_recompute"] == pytest.approx(
        [sc.SLEEP + s for s in resend], rel=1e-9)
    assert base.bwd_recompute == 0.0
    assert ck.total - base.total == pytest.approx(ck.bwd_recompute, rel=1e-9)


def test_buffers_equal_the_rows_alive():
    """:meth:`Ledger.layer_checkpoint_buffer_bytes` against the code, as ``test_ledger_truth`` does
    for the other modes (:class:`live_rows.LiveRows`: the row tensors alive at every line
    and op of the exchange): the forward without a graph peaks at the exact forward's
    largest point plus the rows it would keep; the re-run in backward at that beside the
    output gradient; the backward after it at the exact backward's largest point plus
    the re-run's kept rows and its output (the layer input, the router's, is counted
    throughout here and taken off)."""
    import lrmoe.parallel.stages as stages
    import test_ledger_truth as lt
    from live_rows import LiveRows, exchange_code, row_seams
    from onerank import one_rank_layer

    layer, x, counts = lt._layer_and_tokens()
    one = Ledger(lt._cfg(), lt.G, num_moe_layers=1)
    b, Hd, Fd = one.bytes_act, lt.H, lt.F
    seams = row_seams()
    fwd_code, bwd_code = exchange_code()
    policy = Checkpointed(StaticPolicy())
    for me in range(lt.G):
        lay = one_rank_layer(layer, me, counts, policy)
        xin = x[me * lt.T:(me + 1) * lt.T].clone().requires_grad_()
        live = LiveRows((Hd, Fd, 2 * Fd), fwd_code, seams, count=[xin])
        with live:
            out = lay(xin.view(1, lt.T, Hd))
        plan = policy.plan(counts, PlanInputs())
        n, R, h, _ = one._rank_counts(plan)[me]
        Tt = -(-h // lt.K)
        kept = R * Hd + R * 2 * Fd + h * Hd  # the rows an exact forward keeps
        fpts = one.forward_points(Tt, R, h, R, 0, h)
        assert live.peak() == b * (max(fpts.values()) + kept), me
        dout = torch.ones_like(out)
        live = LiveRows((Hd, Fd, 2 * Fd), fwd_code + bwd_code, seams, count=[xin, dout])
        start = []  # the point where the exact backward begins (after the re-run)
        inner = stages.combine_grad_gate

        def mark(*a, live=live, start=start, inner=inner, **kw):
            start.append(len(live.points))
            return inner(*a, **kw)
        stages.combine_grad_gate = mark
        try:
            with live:
                out.backward(dout)
        finally:
            stages.combine_grad_gate = inner
        rerun = max(sum(p.values()) for _, p in live.points[:start[0]])
        back = max(sum(p.values()) for _, p in live.points[start[0]:])
        assert rerun == b * (Tt * Hd + max(fpts.values()) + kept), me
        bpts = one.backward_points(Tt, R, h, R, 0, h, False)
        assert back - b * Tt * Hd == b * (max(bpts.values()) + kept + Tt * Hd), me
        assert one.layer_checkpoint_buffer_bytes(R, h) == max(
            b * (max(fpts.values()) + kept), rerun + h * 24,
            back - b * Tt * Hd + R * 20 + h * 24)
