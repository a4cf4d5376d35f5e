"""GLM-4.5 (``glm4_moe``) through the emulator's trimmed backward equals a masked reference.

The model ``bench ttl`` trains: a dense layer, then two MoE layers with sigmoid scores,
the selection-only ``e_score_correction_bias`` (set here so a few experts are hot),
``norm_topk_prob``, ``routed_scaling_factor != 1``, group-limited top-k and a shared
expert, every MoE layer run by :class:`lrmoe.sim.vmodel.Emulator` over G virtual
ranks. With lrmoe's plans (replicas, backward quotas well below 1; under a budget also
retention quotas and recompute) every parameter's gradient must equal, in fp32, that of
a one-process model whose MoE layers are :func:`moe_layer_reference` with the pairs the
emulator dropped detached, and the pairs it kept must be the ones the design names
(docs/design.md §4): per instance block, the retained pairs are the highest-gate ones and the
selected pairs the retained ones of highest ``g * ||dy||``, ``dy`` the layer's output
gradient in the reference. The exact policies with ``router_grad="experts"`` must equal
the unmasked model.

Legend: N global tokens, K top-k, G virtual ranks, T tokens per rank, E experts.
"""

from __future__ import annotations

import copy

import pytest
import torch

import lrmoe.parallel.stages as stages
from budgets import balanced_budget
from lrmoe.config import ModelConfig
from lrmoe.ledger import Ledger
from lrmoe.model.transformer import MoEForCausalLM
from lrmoe.parallel.exchange import BackwardOptions
from lrmoe.policy.lrmoe import LrmoeConfig, LrmoePolicy
from lrmoe.policy.static import StaticPolicy
from lrmoe.policy.symi import SymiPolicy
from lrmoe.sim.vmodel import Emulator
from references.moe import moe_layer_reference

G, B, L = 4, 8, 33  # virtual ranks; batch x (sequence + 1): 256 tokens, T = 64 per rank
CFG = ModelConfig(
    model_type="glm4_moe", vocab_size=64, hidden_size=32, intermediate_size=48,
    num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    attention_bias=True, partial_rotary_factor=0.5, use_qk_norm=False,
    moe_intermediate_size=16, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
    n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    first_k_dense_replace=1)
HOT = {0: 0.8, 1: 0.6, 4: 0.5, 5: 0.3}  # correction bias: these experts are hot


def make_model(seed: int) -> tuple[MoEForCausalLM, torch.Tensor]:
    torch.manual_seed(seed)
    model = MoEForCausalLM(CFG)
    for i, m in enumerate(model.moe_layers):
        with torch.no_grad():
            m.router.weight.normal_(0, 0.3)  # scores spread over (0, 1), not all ~0.5
            m.router.e_score_correction_bias.normal_(0, 0.05)
            for e, b in HOT.items():
                m.router.e_score_correction_bias[(e + 4 * i) % CFG.num_experts] += b
    return model, torch.randint(0, CFG.vocab_size, (B, L))


def emulated(model, ids, policy, opts, ledger=None):
    """Gradients of ``model`` trained through the emulator, the plan of each MoE layer
    and, per MoE layer, the mask ``[N, K]`` of the pairs its backward sent to an expert."""
    vm = Emulator(model, G, policy, opts, ledger)
    calls: list = []  # shipped pairs, per call: G home ranks in turn, layer by layer
    real = stages.home_backward

    def spy(dout, comb, home, *a, **kw):
        dgate, sh = real(dout, comb, home, *a, **kw)
        calls.append(home.src_pair if sh.pairs is None else sh.pairs)
        return dgate, sh

    stages.home_backward = spy
    try:
        model.train()
        model.loss(ids[:, :-1], ids[:, 1:])[1].backward()
    finally:
        stages.home_backward = real
    # the backward runs the MoE layers last to first, each over its G home ranks in order
    assert len(calls) == G * len(vm.layers)
    sent = {id(v.stats.plan): [(g, calls[j * G + g]) for g in range(G)]
            for j, v in enumerate(reversed(vm.layers))}
    K = CFG.num_experts_per_tok
    T = B * (L - 1) // G
    plans, masks = [], []
    for v in vm.layers:
        plan = v.stats.plan
        mask = torch.zeros(G, T * K, dtype=torch.bool)
        for g, kept in sent[id(plan)]:
            mask[g, kept] = True
        plans.append(plan)
        masks.append(mask.view(G * T, K))
    return {n: p.grad.clone() for n, p in model.named_parameters()}, plans, masks


def reference(model, ids, masks=None):
    """Gradients of ``model`` with every MoE layer run by :func:`moe_layer_reference`,
    the pairs outside ``masks[layer]`` detached on the expert side; and, per MoE layer,
    its routing and output gradient."""
    seen = []
    for i, m in enumerate(model.moe_layers):
        def forward(x, m=m, i=i):
            r = m.router(x.reshape(-1, x.shape[-1]))
            keep = None
            if masks is not None:  # moe_layer_reference asks expert by expert, in id order
                per = iter([masks[i][r.idx_TK == e] for e in range(CFG.num_experts)
                            if bool((r.idx_TK == e).any())])
                keep = lambda g: next(per)  # noqa: E731
            y = moe_layer_reference(m, x, keep=keep)
            rec = {"idx": r.idx_TK, "gate": r.gate_TK.detach()}
            y.register_hook(lambda d, rec=rec: rec.__setitem__("dy", d.reshape(-1, d.shape[-1])))
            seen.append(rec)
            return y
        m.forward = forward
    model.train()
    model.loss(ids[:, :-1], ids[:, 1:])[1].backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, seen


def design_mask(plan, rec) -> torch.Tensor:
    """The pairs docs/design.md §4 sends to an expert in backward, from the reference's
    routing and output gradient: per home g and expert e, e's pairs (token order when
    home g retains every pair, else descending gate with the retained ones first) fill
    e's instances in slot order; each instance keeps its ``select`` highest ``g*||dy||``
    among its retained pairs."""
    K = CFG.num_experts_per_tok
    N = rec["idx"].shape[0]
    T = N // G
    metric = rec["gate"] * rec["dy"].norm(dim=1, keepdim=True)
    ie = plan.inst_expert_GS.reshape(-1)
    mask = torch.zeros(N * K, dtype=torch.bool)
    for g in range(G):
        assign, retain = plan.assign_GGS[g].reshape(-1), plan.retain_GGS[g].reshape(-1)
        select = plan.select_GGS[g].reshape(-1)
        by_gate = not torch.equal(assign, retain)
        for e in range(CFG.num_experts):
            flat = torch.nonzero(rec["idx"][g * T:(g + 1) * T].reshape(-1) == e).flatten()
            pairs = flat + g * T * K
            if by_gate:
                pairs = pairs[torch.argsort(rec["gate"].reshape(-1)[pairs], descending=True,
                                            stable=True)]
            inst = [i for i in range(ie.numel()) if int(ie[i]) == e]
            n_ret = int(retain[inst].sum())
            ret, non = pairs[:n_ret], pairs[n_ret:]
            r0 = n0 = 0
            for i in inst:
                block = ret[r0:r0 + int(retain[i])]
                r0 += int(retain[i])
                n0 += int(assign[i] - retain[i])
                m = metric.reshape(-1)[block]
                top = torch.argsort(m, descending=True, stable=True)[:int(select[i])]
                mask[block[top]] = True
            assert r0 == ret.numel() and n0 == non.numel()
    return mask.view(N, K)


def assert_same_grads(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for n in want:
        rel = float((got[n] - want[n]).norm() / want[n].norm().clamp(min=1e-30))
        assert rel < 1e-5, f"{what}: {n} differs by {rel:.2e} (relative)"


def lrmoe_case(name: str):
    """``(policy, planner ledger)`` of an lrmoe case."""
    # one replica per layer and step: the forward stays skewed, so backward quotas trim
    knobs = dict(min_keep=0.2, max_slots_per_rank=CFG.num_experts // G + 1,
                 max_replicas_per_step=1)
    if name == "lrmoe":  # no budget: every pair retained
        return LrmoePolicy(LrmoeConfig(**knobs)), None
    # 10% over a balanced rank that retains everything: the hot ranks must recompute
    # and drop pairs from retention
    budget = int(1.1 * balanced_budget(CFG, G, B * (L - 1) // G, 1.0, "fp32"))
    return LrmoePolicy(LrmoeConfig(recompute=True, **knobs)), Ledger.for_dtype(CFG, G, budget,
                                                                              "fp32")


@pytest.mark.parametrize("case", ["lrmoe", "lrmoe_recompute_budget"])
def test_glm_trimmed_backward_matches_masked_reference(case):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh inputs every run
    model, ids = make_model(seed)
    ref_model = copy.deepcopy(model)
    policy, ledger = lrmoe_case(case)
    got, plans, masks = emulated(model, ids, policy, BackwardOptions(), ledger)
    want, seen = reference(ref_model, ids, masks)
    msg = f"{case} seed={seed}"
    for i, (plan, mask, rec) in enumerate(zip(plans, masks, seen)):
        kept = float(mask.float().mean())
        assert kept < 0.9, f"{msg}: MoE layer {i} sent {kept:.2f} of its pairs: not trimmed"
        assert plan.num_replicas() > 0, f"{msg}: MoE layer {i} has no replica"
        assert torch.equal(mask, design_mask(plan, rec)), f"{msg}: MoE layer {i}: wrong pairs"
    if case != "lrmoe":  # the budget binds: retention quotas and recompute
        assert any(not torch.equal(p.retain_GGS, p.assign_GGS) for p in plans), msg
        assert sum(int(p.recompute_G.sum()) for p in plans if p.recompute_G is not None), msg
    assert_same_grads(got, want, msg)
    # not the exact gradient: the trimming changed every expert and upstream gradient
    exact, _ = reference(copy.deepcopy(ref_model), ids)
    for n in ("layers.0.self_attn.q_proj.weight", "layers.1.mlp.experts.gate_up_proj",
              "layers.2.mlp.experts.down_proj", "embed_tokens.weight"):
        rel = float((got[n] - exact[n]).norm() / exact[n].norm())
        assert rel > 1e-3, f"{msg}: {n} is the exact gradient ({rel:.1e})"


@pytest.mark.parametrize("name", ["static", "symi"])
def test_glm_exact_policies_with_router_grad_at_experts_match_the_model(name):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    model, ids = make_model(seed)
    ref_model = copy.deepcopy(model)
    policy = StaticPolicy() if name == "static" else SymiPolicy(CFG.num_experts // G + 2)
    got, plans, _ = emulated(model, ids, policy, BackwardOptions(router_grad="experts"))
    assert all(p.exact for p in plans) and (name == "static") == all(
        p.num_replicas() == 0 for p in plans)
    want, _ = reference(ref_model, ids)
    assert_same_grads(got, want, f"{name} seed={seed}")
