"""``model(input_ids, labels=...)`` returns the training objective as HF models do, and
``torch.compile(model)`` then traces the loss itself."""

from __future__ import annotations

import torch

from lrmoe.model.transformer import CausalLMOutput, MoEForCausalLM
from lrmoe.presets import get_preset


def _model():
    torch.manual_seed(0)
    return MoEForCausalLM(get_preset("tiny-qwen3")).train()


def test_labels_give_the_objective_of_loss():
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    out = model(ids, labels=ids)
    assert isinstance(out, CausalLMOutput)
    logits = model(ids)
    lm = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                           ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.lm_loss, lm)
    torch.testing.assert_close(out.loss, lm + model.aux_loss())
    assert float(out.aux_loss.detach()) > 0  # Qwen3's load-balancing loss is in the objective
    assert out.logits.shape == (2, 17, model.config.vocab_size)
    labels = ids.clone()
    labels[:, 9:] = -100  # ignored positions change the mean
    part = model(ids, labels=labels).lm_loss
    assert abs(float(part.detach()) - float(lm.detach())) > 1e-6
    lm9 = torch.nn.functional.cross_entropy(logits[:, :8].reshape(-1, logits.shape[-1]),
                                            ids[:, 1:9].reshape(-1))
    torch.testing.assert_close(part, lm9)


def test_compiled_model_traces_the_loss():
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    out = torch.compile(model, backend=backend)(ids, labels=ids)
    traced = [str(n.target) for g in graphs for n in g.graph.nodes]
    assert any("cross_entropy" in t for t in traced), traced
    torch.testing.assert_close(out.loss, model(ids, labels=ids).loss)


def test_aux_loss_is_the_sum_of_each_moe_layers_switch_loss():
    """The objective's aux loss adds up every MoE layer's ``coef * E * sum_e f_e * P_e``,
    each computed here from that layer's router outputs (one process: T tokens)."""
    model = _model()
    cfg = model.config
    seen = []
    hooks = [m.router.register_forward_hook(lambda mod, args, out: seen.append(out))
             for m in model.moe_layers]
    ids = torch.randint(0, cfg.vocab_size, (2, 17))
    out = model(ids, labels=ids)
    for h in hooks:
        h.remove()
    assert len(seen) == len(model.moe_layers) >= 2
    want = 0.0
    for r in seen:
        T, E = r.probs_TE.shape
        f = torch.bincount(r.idx_TK.reshape(-1), minlength=E).double() / T
        want += cfg.router_aux_loss_coef * E * float((f * r.probs_TE.detach().double().mean(0)).sum())
    assert abs(float(out.aux_loss.detach()) - want) < 1e-6 * max(want, 1.0)
