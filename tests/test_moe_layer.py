"""The MoE layer on one process: against a dense reference, with replicas, and with
LRMoE-style partial retention/selection (compaction on vs off)."""

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from lrmoe.config import ModelConfig
from lrmoe.model import MoEForCausalLM
from lrmoe.model.moe import MoELayer, MoERuntime, MoEStep, _compute_dtype
from lrmoe.parallel.exchange import BackwardOptions
from lrmoe.policy.base import Policy
from lrmoe.policy.plan import Plan
from lrmoe.policy.plan_numpy import full_plan
from lrmoe.presets import get_preset
from references.moe import moe_layer_reference


class ReplicaPolicy(Policy):
    name = "replicas"

    def plan(self, counts, inputs):
        E = counts.shape[1]
        ie = torch.cat([torch.arange(E), torch.tensor([0, 0, 3, -1])]).reshape(1, -1)
        return full_plan(counts, ie)


class PartialPolicy(Policy):
    name = "partial"
    extra = [0, 1]  # the slots after the natives: replicas of experts 0 and 1

    def plan(self, counts, inputs):
        E = counts.shape[1]
        p = full_plan(counts, torch.cat([torch.arange(E), torch.tensor(self.extra)]).reshape(1, -1))
        r = (p.assign_GGS * 4) // 5
        return Plan(p.inst_expert_GS, p.assign_GGS, r, (r * 3) // 5)


def run(layer, x, ref=False):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y = moe_layer_reference(layer, x) if ref else layer(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return [y.detach(), x.grad, layer.experts.gate_up_proj.grad.clone(),
            layer.experts.down_proj.grad.clone(), layer.router.weight.grad.clone()]


@pytest.fixture(params=["tiny-qwen3", "tiny-glm"])
def layer(request):
    torch.manual_seed(0)
    return copy.deepcopy(MoEForCausalLM(get_preset(request.param)).moe_layers[0])


def test_static_matches_reference(layer):
    x = torch.randn(2, 24, layer.cfg.hidden_size)
    for a, b in zip(run(layer, x), run(layer, x, ref=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_replicas_change_placement_not_math(layer):
    x = torch.randn(2, 24, layer.cfg.hidden_size)
    ref = run(layer, x, ref=True)
    layer.runtime = MoERuntime(policy=ReplicaPolicy())
    for a, b in zip(run(layer, x), ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert layer.runtime.stats[0]["plan_replicas"] == 3


@pytest.mark.parametrize("estimator", ["topk", "sampled"])
def test_partial_selection_compaction_on_off(layer, estimator):
    """Compaction ships only the selected rows; without it every retained row ships, the
    unselected ones weighing 0 (and the sampled ones their Horvitz-Thompson weight): the
    same gradients from the same draws."""
    x = torch.randn(2, 24, layer.cfg.hidden_size)
    ref = run(layer, x, ref=True)
    out = {}
    for comp in (True, False):
        layer.runtime = MoERuntime(policy=PartialPolicy(), generator=torch.Generator().manual_seed(3),
                                   backward=BackwardOptions(compaction=comp, estimator=estimator))
        out[comp] = run(layer, x)
        out[comp].append(dict(layer.runtime.stats[0]))
    on, off = out[True], out[False]
    # forward output and router gradient stay exact whatever the selection
    torch.testing.assert_close(on[0], ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(on[4], ref[4], rtol=1e-5, atol=1e-6)
    # the expert gradients are approximations ...
    assert (on[2] - ref[2]).abs().max() > 1e-4
    # ... identical with and without compaction, which ships only the selected rows
    for a, b in zip(on[1:4], off[1:4]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert on[5]["bwd_rows"] == on[5]["selected_rows"] < off[5]["bwd_rows"]
    assert on[5]["bwd_dispatch_bytes_sent"] < off[5]["bwd_dispatch_bytes_sent"]
    H, F = layer.cfg.hidden_size, layer.cfg.moe_intermediate_size
    assert on[5]["saved_act_bytes"] == on[5]["retained_rows"] * (H + 2 * F) * 4  # x and gu, fp32
    assert on[5]["retained_rows"] < on[5]["fwd_rows"]


def test_whole_model_gradients_match_reference_path():
    """A full tiny model: replicas on one process give the static model's gradients."""
    torch.manual_seed(1)
    m = MoEForCausalLM(get_preset("tiny-qwen3"))
    ids = torch.randint(0, 256, (2, 17))
    m2 = copy.deepcopy(m)
    m2.set_runtime(MoERuntime(policy=ReplicaPolicy()))
    for model in (m, m2):
        model.train()
        _, obj = model.loss(ids[:, :-1], ids[:, 1:])
        obj.backward()
    for (n, a), (_, b) in zip(m.named_parameters(), m2.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("extra", [[0, 1], [0, -1]])
def test_fidelity_monitor_compares_with_the_exact_gradient(layer, extra):
    """The monitor's 'exact' gradient is the static one (all pairs, even unretained), an
    expert's replicas summed, with every slot held or one left empty."""
    x = torch.randn(2, 24, layer.cfg.hidden_size)
    ref = run(layer, x, ref=True)
    policy = PartialPolicy()
    policy.extra = extra
    layer.runtime = MoERuntime(policy=policy, backward=BackwardOptions(fidelity=True))
    got = run(layer, x)
    a = torch.cat([got[2].flatten(), got[3].flatten()])
    b = torch.cat([ref[2].flatten(), ref[3].flatten()])
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    st = layer.runtime.stats[0]
    assert st["fidelity_cosine"] == pytest.approx(cos, abs=1e-5)
    assert st["fidelity_rel_err"] == pytest.approx(float((a - b).norm() / b.norm()), rel=1e-4)
    assert cos < 0.999  # the selection really approximates
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)  # forward unchanged


class HalfSelectPolicy(Policy):
    """Static placement, everything retained, the top 60% (ceil) of each expert selected."""

    name = "half-select"

    def plan(self, counts, inputs):
        E = counts.shape[1]
        p = full_plan(counts, torch.arange(E).reshape(1, E))
        sel = torch.ceil(p.retain_GGS.double() * 0.6).long()
        return Plan(p.inst_expert_GS, p.assign_GGS, p.retain_GGS, sel)


def test_compacted_backward_equals_masking_reference(layer):
    """The compacted backward equals a plain masking reference (docs/design.md §1
    conventions) in which unselected pairs' expert outputs are detached (forward and router gradient exact,
    no expert-weight or input gradient through them)."""
    torch.manual_seed(3)
    x = torch.randn(1, 40, layer.cfg.hidden_size)
    coeff = torch.randn(1, 40, layer.cfg.hidden_size)
    layer.runtime = MoERuntime(policy=HalfSelectPolicy())
    got = []
    layer.zero_grad()
    xg = x.clone().requires_grad_()
    (layer(xg) * coeff).sum().backward()
    got = [xg.grad, layer.experts.gate_up_proj.grad.clone(), layer.experts.down_proj.grad.clone(),
           layer.router.weight.grad.clone()]

    # reference: dense per-expert loop, selection recomputed from the formula
    layer.zero_grad()
    xr = x.clone().requires_grad_()
    xt = xr.view(-1, layer.cfg.hidden_size)
    r = layer.router(xt)
    Fd = layer.cfg.moe_intermediate_size
    out = torch.zeros_like(xt)
    dout = coeff.view(-1, layer.cfg.hidden_size)  # d loss / d out
    tok_norm = dout.norm(dim=1)
    for e in range(layer.cfg.num_experts):
        tok, k = torch.nonzero(r.idx_TK == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        g = r.gate_TK[tok, k]
        m = g.detach().abs() * tok_norm[tok]
        n_sel = int(torch.ceil(torch.tensor(tok.numel() * 0.6)))
        sel = torch.zeros(tok.numel(), dtype=torch.bool)
        sel[torch.argsort(m, descending=True, stable=True)[:n_sel]] = True
        gu = xt[tok] @ layer.experts.gate_up_proj[e].t()
        y = (torch.nn.functional.silu(gu[:, :Fd]) * gu[:, Fd:]) @ layer.experts.down_proj[e].t()
        y = torch.where(sel[:, None], y, y.detach())
        out = out.index_add(0, tok, y * g[:, None])
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(xt)
    (out.view_as(x) * coeff).sum().backward()
    ref = [xr.grad, layer.experts.gate_up_proj.grad, layer.experts.down_proj.grad,
           layer.router.weight.grad]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class TrimmedRetentionPolicy(Policy):
    """Natives only; each expert retains (and selects) 60% of its pairs: on one rank
    the kept pairs must be each expert's highest-gate ones."""

    name = "trimmed"

    def plan(self, counts, inputs):
        p = full_plan(counts, torch.arange(counts.shape[1]).reshape(1, -1))
        r = (p.assign_GGS * 3) // 5
        return Plan(p.inst_expert_GS, p.assign_GGS, r, r)


def top_three_fifths(g):
    """Each expert's top ``⌊3/5·n⌋`` pairs by gate (what TrimmedRetentionPolicy keeps)."""
    kept = torch.zeros(g.numel(), dtype=torch.bool)
    kept[torch.argsort(g, descending=True)[:(g.numel() * 3) // 5]] = True
    return kept


def test_retention_keeps_each_experts_highest_gate_pairs(layer):
    """A retention quota is filled by the highest-gate pairs (docs/design.md §4): the
    runtime's gradients equal a masked reference that keeps exactly those, and differ
    from one that keeps the lowest-gate pairs."""
    x = torch.randn(2, 24, layer.cfg.hidden_size)
    layer.runtime = MoERuntime(policy=TrimmedRetentionPolicy())
    got = run(layer, x)
    layer.zero_grad()
    xr = x.clone().requires_grad_()
    y = moe_layer_reference(layer, xr, keep=top_three_fifths)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    want = [y.detach(), xr.grad, layer.experts.gate_up_proj.grad.clone(),
            layer.experts.down_proj.grad.clone(), layer.router.weight.grad.clone()]
    for name, a, b in zip(("out", "dx", "dgate_up", "ddown", "drouter"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert (got[2] - run(layer, x, ref=True)[2]).abs().max() > 1e-4  # not the exact gradient


def test_router_gradient_exact_only_in_the_last_moe_layer():
    """What is exact (docs/design.md §4): each MoE layer's router gradient is exact
    *given its output gradient*. Dropped pairs change dx, so every layer below the last
    MoE layer sees a different output gradient: its router gradient differs."""
    torch.manual_seed(2)
    m = MoEForCausalLM(get_preset("tiny-qwen3"))
    ids = torch.randint(0, 256, (2, 33))
    m2 = copy.deepcopy(m)
    m2.set_runtime(MoERuntime(policy=TrimmedRetentionPolicy()))
    grads = []
    for model in (m, m2):
        model.train()
        loss, obj = model.loss(ids[:, :-1], ids[:, 1:])
        obj.backward()
        grads.append([ml.router.weight.grad.clone() for ml in model.moe_layers])
    rel = [float((b - a).norm() / a.norm()) for a, b in zip(*grads)]
    assert rel[-1] < 1e-5, rel
    assert all(r > 1e-3 for r in rel[:-1]), rel


def test_aux_loss_counts_the_tokens_of_every_ep_and_dp_rank():
    """The layer's aux loss divides the global counts by the tokens of all ranks, ``T`` per
    rank times the EP size times the DP size (by hand: T = 2, EP 2, DP 3: 12 tokens)."""
    cfg = ModelConfig(model_type="qwen3_moe", hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                      num_experts=4, num_experts_per_tok=1, moe_intermediate_size=4, num_hidden_layers=1,
                      router_aux_loss_coef=0.01)
    layer = MoELayer(cfg, 0).train()
    layer.runtime = MoERuntime(comm=SimpleNamespace(size=2), dp_size=3)
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0]])  # P = .5, .25, .25, 0
    got = layer.aux_loss(torch.tensor([6, 3, 2, 1]), probs, T=2)  # f = 1/2, 1/4, 1/6, 1/12
    assert abs(float(got) - 0.01 * 17 / 12) < 1e-7
    assert layer.eval().aux_loss(torch.tensor([6, 3, 2, 1]), probs, T=2) is None


def test_a_steps_counts_sum_its_forwards_and_become_the_next_steps_popularity():
    cfg = get_preset("tiny-qwen3")
    layer = MoEForCausalLM(cfg).moe_layers[0].train()
    E = cfg.num_experts
    a, b = torch.arange(E), torch.ones(E, dtype=torch.long)
    layer.take(MoEStep("local", a, None, {}))
    layer.take(MoEStep("local", b, None, {}))
    assert layer.end_step().tolist() == (a + b).tolist()
    assert layer.prev_counts_E.tolist() == (a + b).tolist() and layer.step_counts_E is None


def test_end_step_keeps_the_data_parallel_sum_of_the_counts():
    """Under DP x EP the next step's popularity is the counts summed over the replicas
    (``reduce``; here three replicas with equal counts)."""
    cfg = get_preset("tiny-qwen3")
    model = MoEForCausalLM(cfg).train()
    a = torch.arange(cfg.num_experts)
    for m in model.moe_layers:
        m.take(MoEStep("local", a.clone(), None, {}))
    counts = model.end_step(reduce=lambda c: c * 3)
    assert [c.tolist() for c in counts] == [(3 * a).tolist()] * len(model.moe_layers)
    assert all(m.prev_counts_E.tolist() == (3 * a).tolist() for m in model.moe_layers)


def test_experts_compute_in_the_autocast_dtype():
    """Under autocast the routed experts run in autocast's dtype, not the fp32 input's."""
    x = torch.randn(3, 4)
    assert _compute_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _compute_dtype(x) == torch.bfloat16


def test_end_step_moves_glm_biases_towards_the_less_used_experts():
    """After a step the correction bias of each GLM router grows by ``rate`` for experts
    below the mean count and shrinks by ``rate`` for those above it."""
    cfg = dataclasses.replace(get_preset("tiny-glm"), bias_update_rate=0.01)
    model = MoEForCausalLM(cfg).train()
    E = cfg.num_experts
    a = torch.full((E,), 2, dtype=torch.long)
    a[0], a[1] = 4, 0  # mean 2: expert 0 above, expert 1 below, the rest at it
    for m in model.moe_layers:
        m.take(MoEStep("local", a.clone(), None, {}))
    model.end_step()
    want = torch.zeros(E)
    want[0], want[1] = -0.01, 0.01
    for m in model.moe_layers:
        torch.testing.assert_close(m.router.e_score_correction_bias, want)
