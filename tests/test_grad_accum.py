"""Gradient accumulation: N micro-batches give the gradient of one step on the N-times
larger batch, for every policy, on one process and under expert parallelism (gloo);
the router counts (SYMI's popularity, GLM's bias update) close once per optimizer step;
a resumed accumulating run repeats the uninterrupted one bit for bit."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from lrmoe.config import ModelConfig
from lrmoe.model import MoEForCausalLM
from lrmoe.model.moe import MoERuntime
from lrmoe.presets import PRESETS, get_preset
from lrmoe.train.accum import accumulate

N, B, T = 3, 4, 16  # micro-batches, sequences per micro-batch (global), tokens
POLICIES = ["static", "symi", "lrmoe", "capacity"]


def tiny(model: str, aux: float | None = 0.0) -> ModelConfig:
    d = dict(PRESETS[{"qwen": "tiny-qwen3", "glm": "tiny-glm"}[model]], num_hidden_layers=2)
    if aux is not None:
        d["router_aux_loss_coef"] = aux
    return ModelConfig.from_hf_dict(d)


def make_policy(name: str, cfg: ModelConfig, G: int):
    """Every policy in a setting where its output is exact (so one step on the
    concatenated batch is a reference): lrmoe keeps every pair, capacity drops none."""
    from lrmoe.policy.lrmoe import LrmoeConfig
    from lrmoe.policy.registry import PolicyConfig, make_policy

    pc = PolicyConfig(name=name, capacity_factor=100.0, slots_per_rank=cfg.num_experts // G + 2,
                      lrmoe=LrmoeConfig(selection=False))
    return make_policy(pc, cfg, G)


def ledger_for(name: str, cfg: ModelConfig, G: int):
    if name != "lrmoe":
        return None
    from lrmoe.ledger import Ledger

    return Ledger.for_dtype(cfg, G, 2**30, "fp32")


def skew(cfg: ModelConfig) -> torch.Tensor:
    """A previous step's popularity with two hot experts (SYMI then places replicas)."""
    c = torch.full((cfg.num_experts,), 4, dtype=torch.long)
    c[3], c[11] = 200, 120
    return c


def batches(cfg: ModelConfig, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g) for _ in range(N)]


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(got: dict, want: dict, rtol: float = 1e-4) -> None:
    assert got.keys() == want.keys()
    for n in want:
        d = float((got[n] - want[n]).norm())
        scale = float(want[n].norm())
        assert d <= rtol * scale + 1e-7, f"{n}: |diff| {d:.3e} vs |grad| {scale:.3e}"


def reference(ref, mbs: list[torch.Tensor], aux_per_micro: bool) -> dict:
    """One backward on the concatenated batch; with ``aux_per_micro`` the objective's aux
    loss is the mean of each micro-batch's (the semantics accumulation implements)."""
    big = torch.cat(mbs)
    lm, obj = ref.loss(big[:, :-1], big[:, 1:])
    if aux_per_micro:
        auxes = []
        for b in mbs:
            ref(b[:, :-1])
            auxes.append(ref.aux_loss())
        obj = lm + torch.stack(auxes).mean()
    obj.backward()
    return grads(ref)


# ----------------------------------------------------------------------------- one process
@pytest.mark.parametrize("model", ["qwen", "glm"])
@pytest.mark.parametrize("policy", POLICIES)
def test_accumulated_gradient_equals_the_concatenated_batch(model, policy):
    cfg = tiny(model)
    torch.manual_seed(0)
    ref = MoEForCausalLM(cfg)
    acc = copy.deepcopy(ref)
    for m in (ref, acc):
        m.set_runtime(MoERuntime(policy=make_policy(policy, cfg, 1),
                                 ledger=ledger_for(policy, cfg, 1), fast_local=False))
        for layer in m.moe_layers:
            layer.prev_counts_E = skew(cfg)
    mbs = batches(cfg, 1)
    sums = accumulate(acc, lambda i: mbs[i], N)
    want = reference(ref, mbs, aux_per_micro=False)
    assert_same_grads(grads(acc), want)
    # the reported loss is the mean over the micro-batches = the big batch's mean
    big = torch.cat(mbs)
    with torch.no_grad():
        lm = ref.loss(big[:, :-1], big[:, 1:])[0]
    assert float(sums[0]) / N == pytest.approx(float(lm), rel=1e-5)
    # one optimizer step's counts: the micro-batches' sum, closed once by end_step
    c_acc = acc.end_step()
    ref.end_step()  # (ref's counts include the loss above's extra forward: not compared)
    pairs = N * B * T * cfg.num_experts_per_tok
    assert all(int(c.sum()) == pairs for c in c_acc)
    assert all(torch.equal(layer.prev_counts_E, c) for layer, c in zip(acc.moe_layers, c_acc))


def test_aux_loss_is_the_mean_over_micro_batches():
    """Qwen3's load-balancing loss is per micro-batch (its gradient needs the whole
    batch's expert fractions, known only after the last forward): the accumulated
    gradient is the big batch's LM gradient plus the micro-batches' mean aux gradient."""
    cfg = tiny("qwen", aux=0.5)  # large, so a wrong aux scale shows above fp noise
    torch.manual_seed(0)
    ref = MoEForCausalLM(cfg)
    acc = copy.deepcopy(ref)
    mbs = batches(cfg, 2)
    sums = accumulate(acc, lambda i: mbs[i], N)
    assert float(sums[1] - sums[0]) > 0  # the aux loss is on
    assert_same_grads(grads(acc), reference(ref, mbs, aux_per_micro=True))


def test_glm_bias_updates_once_per_optimizer_step():
    cfg = tiny("glm")
    torch.manual_seed(0)
    ref = MoEForCausalLM(cfg)
    acc = copy.deepcopy(ref)
    mbs = batches(cfg, 3)
    accumulate(acc, lambda i: mbs[i], N)
    big = torch.cat(mbs)
    ref.loss(big[:, :-1], big[:, 1:])[1].backward()
    acc.end_step()
    ref.end_step()
    for a, r in zip(acc.moe_layers, ref.moe_layers):
        assert not torch.equal(r.router.e_score_correction_bias, torch.zeros_like(
            r.router.e_score_correction_bias))
        torch.testing.assert_close(a.router.e_score_correction_bias,
                                   r.router.e_score_correction_bias, rtol=0, atol=0)


# ----------------------------------------------------------------------------- EP on gloo
def _ep_worker(rank: int, world: int, model: str, policies: list[str]) -> None:
    import torch.distributed as dist

    from lrmoe.parallel.groups import ParallelContext, is_expert_param, shard_experts, sync_grads

    torch.set_num_threads(1)
    cfg = tiny(model)
    ctx = ParallelContext(world=world, rank=rank, ep_size=world, ep_group=dist.group.WORLD)
    mbs = batches(cfg, 4)
    per, pr = B // world, cfg.num_experts // world
    for policy in policies:
        torch.manual_seed(0)
        ref = MoEForCausalLM(cfg)
        ep = copy.deepcopy(ref)
        shard_experts(ep, ctx)
        ep.set_runtime(MoERuntime(comm=ctx.comm(), policy=make_policy(policy, cfg, world),
                                  ledger=ledger_for(policy, cfg, world)))
        for layer in ep.moe_layers:
            layer.prev_counts_E = skew(cfg)
        accumulate(ep, lambda i: mbs[i][rank * per:(rank + 1) * per], N)
        sync_grads(ep, ctx)
        want = reference(ref, mbs, aux_per_micro=False)
        for n in want:  # this rank's expert shard
            if is_expert_param(n):
                want[n] = want[n][rank * pr:(rank + 1) * pr]
        assert_same_grads(grads(ep), want)
        if policy == "symi":  # the skewed popularity placed replicas: the exchange ran them
            assert all(st["plan_replicas"] > 0 for st in ep.moe_layers[0].runtime.stats.values())


def test_hooks_run_in_order_and_each_micro_batch_plans_with_its_index():
    """``accumulate`` calls ``on_micro(m, None)`` before micro-batch ``m`` and
    ``on_micro(m, pair)`` after its backward, ``before_last_backward`` once, just before
    the last micro-batch's backward; every MoE layer's plan of micro-batch ``m`` is given
    ``PlanInputs.micro == m`` (what a placement held for the step plans by)."""
    from lrmoe.policy import StaticPolicy

    events = []

    class Recording(StaticPolicy):  # a subclass: the exchange runs, and asks for a plan
        def plan(self, counts_GE, inputs):
            events.append(("plan", inputs.layer, inputs.micro))
            return super().plan(counts_GE, inputs)

    cfg = tiny("qwen")
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    model.set_runtime(MoERuntime(policy=Recording()))
    mbs = batches(cfg, 4)

    def on_micro(m, pair):
        events.append(("before", m) if pair is None else ("after", m, tuple(pair.shape)))

    accumulate(model, lambda i: mbs[i], N, on_micro=on_micro,
               before_last_backward=lambda: events.append(("last backward",)))
    L = len(model.moe_layers)
    want = []
    for m in range(N):
        want += [("before", m)] + [("plan", layer, m) for layer in range(L)]
        want += [("last backward",)] * (m == N - 1) + [("after", m, (2,))]
    assert events == want


def test_update_refused_by_the_norm_check_leaves_the_weights():
    """``update`` hands ``check_norm`` the gradient norm before clipping (computed here
    from the gradients) and, when it raises, the optimizer never runs: every weight stays
    as it was."""
    from lrmoe.parallel.groups import ParallelContext
    from lrmoe.train.accum import update

    cfg = tiny("qwen")
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    mbs = batches(cfg, 5)
    accumulate(model, lambda i: mbs[i], N)
    grads_flat = [p.grad.double().flatten() for p in model.parameters() if p.grad is not None]
    norm = float(torch.cat(grads_flat).norm())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    seen = []

    def refuse(gnorm: float) -> None:
        seen.append(gnorm)
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):
        update(model, opt, sched, 1e-3, ParallelContext(), refuse)
    assert seen == [pytest.approx(norm, rel=1e-5)]
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


@pytest.mark.parametrize("model", ["qwen", "glm"])
def test_accumulated_gradient_under_ep_equals_the_concatenated_batch(model, tmp_path):
    """EP 2 on gloo, every policy: each rank accumulates its share of N micro-batches;
    after the gradient sync, each rank's gradients are the one-process gradients of the
    concatenated batch (expert gradients: its own experts' rows)."""
    from dist_util import run_world

    run_world(2, _ep_worker, model, POLICIES, tmp_path=tmp_path)


# ----------------------------------------------------------------------------- the trainer
def test_trainer_resume_with_accumulation_is_bit_exact(tmp_path):
    """GLM + SYMI (router bias and popularity evolve per optimizer step), 2 micro-batches
    a step: stopping after step 3 and resuming repeats the uninterrupted run bit for bit;
    each row counts the step's N micro-batches."""
    from lrmoe.train import TrainConfig, train
    from lrmoe.train.metrics import read_metrics

    base = dict(preset="tiny-glm", policy="symi", steps=6, grad_accum=2, batch_size=2,
                seq_len=32, max_data_bytes=100_000, eval_batches=1, eval_every=0,
                ckpt_every=3, threads=1, warmup=1)
    a = train(TrainConfig.from_flat(out=str(tmp_path / "a"), **base))
    train(TrainConfig.from_flat(out=str(tmp_path / "b"), stop_after=3, **base))
    b = train(TrainConfig.from_flat(out=str(tmp_path / "b"), resume=True, **base))
    assert a["final_val_loss"] == b["final_val_loss"]
    ra, rb = ([r for r in read_metrics(tmp_path / x / "metrics.jsonl") if r["kind"] == "train"]
              for x in ("a", "b"))
    assert [r["step"] for r in rb] == list(range(1, 7))
    for key in ("loss", "grad_norm", "counts"):
        assert [r[key] for r in ra] == [r[key] for r in rb], key
    k = PRESETS["tiny-glm"]["num_experts_per_tok"]
    for i, r in enumerate(ra):
        assert r["micro_batches"] == 2 and r["tokens"] == (i + 1) * 2 * 2 * 32
        assert all(sum(c) == 2 * 2 * 32 * k for c in r["counts"])
        assert all(m["pairs"] == 2 * 32 * k for m in r["moe"])  # the last micro-batch's
    # a resume may change --grad-accum: the change is recorded at the step it continues from
    train(TrainConfig.from_flat(out=str(tmp_path / "b"), resume=True,
                                **dict(base, grad_accum=3, steps=7)))
    rows = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r for r in rows if r["kind"] == "change"] == [
        {"kind": "change", "step": 6, "changes": {"grad_accum": [2, 3]}}]
    assert [r["micro_batches"] for r in rows if r["kind"] == "train"][-1] == 3


# ----------------------------------------------------------------------------- the emulator
def _symi_micro(pop: torch.Tensor, n: int, G: int = 4, seed: int = 0):
    """n micro-batches' modelled stats of one layer: SYMI plans from ``pop`` (so one
    placement for the step), each from its own random counts."""
    from lrmoe.policy.symi import plan_symi
    from lrmoe.presets import get_preset
    from lrmoe.sim.analytic import modelled_stats

    cfg = get_preset("tiny-qwen3")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        counts = torch.randint(1, 50, (G, cfg.num_experts), generator=g)
        out.append(modelled_stats(plan_symi(counts, cfg.num_experts // G + 2, pop), cfg,
                                  1e12, 4, 4, [0] * G))
    return cfg, out


def _pop(cfg, hot: int) -> torch.Tensor:
    p = torch.ones(cfg.num_experts, dtype=torch.long)
    p[hot] = 100
    return p


def test_emulator_charges_the_optimizer_and_symi_exchanges_once_per_step():
    """Closed form: 3 micro-batches of one SYMI layer, host offload (sharded layout).
    The host traffic and update, and SYMI's sharded scatter and reduce, are charged once
    in the optimizer step's times; every micro-batch pays its own dispatch and experts."""
    from lrmoe.presets import get_preset
    from lrmoe.sim.cost import accumulated_times, step_times
    from lrmoe.sim.links import LINKS
    from lrmoe.sim.offload import HOST_MEM_BPS, PCIE5_X16, OffloadModel
    cfg = get_preset("tiny-qwen3")
    G, E = 4, cfg.num_experts
    _, micro = _symi_micro(_pop(cfg, 5), 3, G)
    link = LINKS["ib"]
    P = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    off = OffloadModel(E, G, P, 4, "sharded")
    outs, step = accumulated_times([[s] for s in micro], link, [0.1, 0.2, 0.3], 0.5, off, terms={})
    hl = PCIE5_X16
    pcie = E // G * P * 4 / hl.effective_Bps + hl.latency_s
    assert step.opt_d2h == pytest.approx(pcie) and step.opt_h2d == pytest.approx(pcie)
    assert step.opt_host_update == pytest.approx(E // G * P * 32 / HOST_MEM_BPS)
    # each rank gathers (G-1)/G of its E/G + 2 slots' weights, once
    want = (E // G + 2) * P * 4 * (G - 1) / G / link.effective_Bps + link.latency_s * (G - 1)
    assert step.weight_scatter == pytest.approx(want)
    assert step.grad_reduce == pytest.approx(want)  # the same bytes the other way
    for o, s in zip(outs, micro):
        one = step_times(s, link)
        assert o.weight_scatter == o.grad_reduce == o.opt_d2h == o.opt_host_update == 0
        for k in ("fwd_dispatch", "fwd_experts", "bwd_dispatch", "bwd_experts", "fwd_combine"):
            assert getattr(o, k) == getattr(one, k) > 0, k
    assert [o.non_moe for o in outs] == [0.1, 0.2, 0.3] and step.non_moe == 0.5
    # one micro-batch: the step costs what step_times charges it
    outs1, step1 = accumulated_times([[micro[0]]], link, offload=off, terms={})
    whole = step_times(micro[0], link, offload=off)
    assert outs1[0].total + step1.total == pytest.approx(whole.total)


def test_emulator_placement_stages_once_only_when_the_placement_holds():
    """Without offload: a layer whose placement is the same in every micro-batch sends
    its replicas' weights once (the first micro-batch's bytes) and their gradients home
    once (the last's); a placement that changes pays both in every micro-batch."""
    from lrmoe.presets import get_preset
    from lrmoe.sim.cost import accumulated_times, step_times
    from lrmoe.sim.links import LINKS
    cfg = get_preset("tiny-qwen3")
    link = LINKS["nvlink"]
    _, fixed = _symi_micro(_pop(cfg, 5), 3)
    outs, step = accumulated_times([[s] for s in fixed], link, terms={})
    assert step.weight_scatter == step_times(fixed[0], link).weight_scatter > 0
    assert step.grad_reduce == step_times(fixed[-1], link).grad_reduce > 0
    assert all(o.weight_scatter == o.grad_reduce == 0 for o in outs)
    moving = [_symi_micro(_pop(cfg, h), 1, seed=h)[1][0] for h in (1, 6, 12)]
    outs, step = accumulated_times([[s] for s in moving], link, terms={})
    assert step.weight_scatter == step.grad_reduce == 0
    for o, s in zip(outs, moving):
        assert o.weight_scatter == step_times(s, link).weight_scatter > 0
        assert o.grad_reduce == step_times(s, link).grad_reduce > 0


def test_emulator_charges_a_placement_changing_within_the_step_per_run():
    """A placement shared by micro-batches 0 and 1 and left at 2 is charged as the
    runtime moves it (parallel/instances.py): its weights arrive at micro-batch 0, its
    gradients leave at 1; micro-batch 2's placement pays both itself."""
    from lrmoe.presets import get_preset
    from lrmoe.sim.cost import accumulated_times, step_times
    from lrmoe.sim.links import LINKS
    cfg = get_preset("tiny-qwen3")
    link = LINKS["ib"]
    _, held = _symi_micro(_pop(cfg, 5), 2)
    other = _symi_micro(_pop(cfg, 12), 1, seed=3)[1][0]
    micro = held + [other]
    outs, step = accumulated_times([[s] for s in micro], link, terms={})
    assert step.weight_scatter == step.grad_reduce == 0
    one = [step_times(s, link) for s in micro]
    assert [o.weight_scatter for o in outs] == [one[0].weight_scatter, 0, one[2].weight_scatter]
    assert [o.grad_reduce for o in outs] == [0, one[1].grad_reduce, one[2].grad_reduce]
    assert all(x.weight_scatter > 0 and x.grad_reduce > 0 for x in one)


def test_sharded_offload_charges_a_changing_placement_every_micro_batch():
    """SYMI under host offload giving replicas up at one micro-batch: its placement
    changes within the step, so each micro-batch pays the sharded gather and
    reduce-scatter of its own slots (not a refusal); the host traffic stays once."""
    from lrmoe.presets import get_preset
    from lrmoe.sim.cost import accumulated_times
    from lrmoe.sim.links import LINKS
    from lrmoe.sim.offload import OffloadModel
    cfg = get_preset("tiny-qwen3")
    G, E = 4, cfg.num_experts
    _, micro = _symi_micro(_pop(cfg, 5), 2, G)
    fewer = copy.copy(micro[1])  # one slot of rank 0 left empty: a replica given up
    inst = micro[1].plan.inst_expert_GS.clone()
    inst[0, -1] = -1
    fewer.plan = dataclasses.replace(micro[1].plan, inst_expert_GS=inst)
    link = LINKS["ib"]
    P = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    off = OffloadModel(E, G, P, 4, "sharded")
    terms: dict = {}
    outs, step = accumulated_times([[micro[0]], [fewer]], link, offload=off, terms=terms)
    assert step.weight_scatter == step.grad_reduce == 0
    for o, s in zip(outs, (micro[0], fewer)):
        own = off.rank_seconds(s.plan.inst_expert_GS, link)
        assert o.weight_scatter == pytest.approx(max(own["weight_scatter"]))
        assert o.grad_reduce == pytest.approx(max(own["grad_reduce"]))
    assert outs[1].weight_scatter > 0
    assert step.opt_d2h > 0 and all(o.opt_d2h == 0 for o in outs)
    assert len(terms["weight_scatter"]) == 2  # one charge per micro-batch


def test_bench_ttl_with_grad_accum(tmp_path):
    """2 micro-batches a step under host offload: rows per micro-batch and per optimizer
    step, the offload stages once a step (the same as without accumulation), the
    micro-batches' expert work twice."""
    import json

    from lrmoe.cli import main

    common = ["bench", "ttl", "--preset", "tiny-qwen3", "--ep", "2", "--steps", "2",
              "--batch-size", "4", "--seq-len", "32", "--eval-every", "2",
              "--max-data-bytes", "200000", "--threads", "1", "--policies", "static,symi",
              "--optimizer-offload", "host"]
    assert main(common + ["--grad-accum", "2", "--out", str(tmp_path / "a")]) == 0
    assert main(common + ["--out", str(tmp_path / "one")]) == 0
    rep = json.loads((tmp_path / "a/ttl.json").read_text())
    one = json.loads((tmp_path / "one/ttl.json").read_text())
    assert rep["config"]["grad_accum"] == 2
    for name in ("static", "symi"):
        for s, s1 in zip(rep["policies"][name]["steps"], one["policies"][name]["steps"]):
            assert s["micro_batches"] == 2 and len(s["micro_batch_emulated_s"]) == 2
            once = s["optimizer_step_emulated_s"]
            for k in ("opt_d2h", "opt_host_update", "opt_h2d"):
                assert once["stages_emulated_s"][k] == s["stages_emulated_s"][k] > 0
                assert s["stages_emulated_s"][k] == pytest.approx(s1["stages_emulated_s"][k])
                assert all(m["stages_emulated_s"][k] == 0 for m in s["micro_batch_emulated_s"])
            total = sum(m["step_emulated_s"] for m in s["micro_batch_emulated_s"])
            assert s["step_emulated_s"] == pytest.approx(total + once["step_emulated_s"])
            assert all(m["stages_emulated_s"]["fwd_experts"] > 0
                       for m in s["micro_batch_emulated_s"])
        # the routing trace: each step's global pairs per MoE layer, both micro-batches'
        trace = json.loads((tmp_path / f"a/routing_trace_{name}.json").read_text())["steps"]
        k = get_preset("tiny-qwen3").num_experts_per_tok
        assert len(trace) == 2 and all(sum(layer) == 2 * 4 * 32 * k
                                       for step in trace for layer in step)
