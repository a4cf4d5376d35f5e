"""The causal LM: embedding -> decoder layers (attention + dense MLP or MoE) -> head.

One class serves Qwen3-MoE and GLM-4.5-MoE; the config decides which layers are MoE,
which router they use, and whether a shared expert is added. Legend: B batch, T seq,
H hidden, V vocab.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from lrmoe.config import ModelConfig
from lrmoe.model.checkpoint import check_mode, checkpoint
from lrmoe.model.layers import MLP, Attention, RMSNorm, Rotary
from lrmoe.model.moe import MoELayer, MoERuntime
from lrmoe.parallel.instances import HeldInstances


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, moe_index: int | None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (MoELayer(cfg, moe_index) if moe_index is not None
                               else MLP(cfg.hidden_size, cfg.intermediate_size))
        self.activation_checkpoint = "none"  # lrmoe.model.checkpoint.MODES

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        mode = self.activation_checkpoint if self.training and torch.is_grad_enabled() else "none"
        if mode == "full":
            moe = [self.mlp] if isinstance(self.mlp, MoELayer) else []
            return checkpoint(self._block, x, cos, sin, moe_layers=moe)
        if mode == "selective":
            return self._block(x, cos, sin, attention=lambda *a: checkpoint(self._attention, *a))
        return self._block(x, cos, sin)

    def _attention(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return self.self_attn(self.input_layernorm(x), cos, sin)

    def _block(self, x: Tensor, cos: Tensor, sin: Tensor, attention=None) -> Tensor:
        x = x + (attention or self._attention)(x, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class CausalLMOutput:
    """What ``model(input_ids, labels=...)`` returns (HF's field names): ``loss`` is the
    training objective (cross entropy plus the router's aux loss)."""

    loss: Tensor
    logits: Tensor
    lm_loss: Tensor
    aux_loss: Tensor


class MoEForCausalLM(nn.Module):
    """``forward(input_ids [B, T]) -> logits [B, T, V]``; with ``labels`` (HF's convention:
    shifted inside, ``-100`` ignored) a :class:`CausalLMOutput` whose ``loss`` is the training
    objective (so ``torch.compile(model)`` compiles the loss too). :meth:`aux_loss`: the
    last forward's load-balancing loss (zero for GLM, which balances by bias)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        moe_ids = {layer: k for k, layer in enumerate(cfg.moe_layers)}
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, moe_ids.get(i)) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
        self.loss_chunk = 0  # tokens a chunk of the head and loss in :meth:`loss` (0: all)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoELayer)]

    def set_runtime(self, runtime: MoERuntime) -> None:
        for m in self.moe_layers:
            m.runtime = runtime

    @contextlib.contextmanager
    def step_weights(self, micros: int = 1):
        """Inside, the ``micros`` micro-batches of one optimizer step
        (:func:`lrmoe.train.accum.accumulate`; the weights must not change meanwhile):
        every MoE layer casts its expert weights to the compute dtype once and reuses
        the cast; with ``micros > 1`` it also keeps its instance weights while their
        placement stays, and sends their gradients home once, in the last micro-batch's
        backward (:mod:`lrmoe.parallel.instances`). On leaving, what a held placement still
        accumulated is sent home (nothing, when the last backward ran); a step that
        raised drops it."""
        layers = self.moe_layers
        for m in layers:
            m.experts.casts = {}
            if micros > 1:
                m.held = HeldInstances((m.experts.gate_up_proj, m.experts.down_proj), micros)
        ok = False
        try:
            yield
            ok = True
        finally:
            for m in layers:
                m.experts.casts = None
                if m.held is not None and ok:
                    m.held.flush()
                m.held = None

    def set_micro_batch(self, m: int) -> None:
        """The index of the micro-batch about to run in its optimizer step (what a
        placement held for the step plans by, ``PlanInputs.micro``)."""
        for layer in self.moe_layers:
            layer.runtime.micro = m

    def set_activation_checkpoint(self, mode: str) -> None:
        """``none``, ``selective`` (each block's attention) or ``full`` (each whole block,
        MoE forward included): :mod:`lrmoe.model.checkpoint`."""
        check_mode(mode)
        for layer in self.layers:
            layer.activation_checkpoint = mode
        for m in self.moe_layers:
            m.checkpointed = mode == "full"

    def set_loss_chunk(self, tokens: int) -> None:
        """``--loss-chunk``: :meth:`loss` and :meth:`loss_sum` run the final norm, the head
        and the cross entropy ``tokens`` tokens at a time, each chunk re-run in backward, so
        only one chunk's logits exist at once (0: the whole micro-batch)."""
        self.loss_chunk = int(tokens)

    def hidden(self, input_ids: Tensor) -> Tensor:
        """The last decoder layer's output ``[B, T, H]`` (before the final norm)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(input_ids.shape[1], x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> Tensor | CausalLMOutput:
        logits = self.lm_head(self.norm(self.hidden(input_ids)))
        if labels is None:
            return logits
        lm, obj = self._objective(logits[:, :-1], labels[:, 1:])
        return CausalLMOutput(obj, logits, lm, obj - lm)

    def _objective(self, logits: Tensor, targets: Tensor, num_targets: float | None = None
                   ) -> tuple[Tensor, Tensor]:
        """``(lm_loss, lm_loss + aux)``: cross entropy in fp32 (``-100`` ignored) and the
        training objective. ``num_targets`` (HF's ``num_items_in_batch``): divide the
        summed cross entropy by it instead of taking the mean over this batch's targets
        (a masked batch's share of a larger batch: :mod:`lrmoe.loss_mask`)."""
        flat = logits.float().reshape(-1, logits.shape[-1])
        if num_targets is None:
            lm = F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100)
        else:
            lm = F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100,
                                 reduction="sum") / num_targets
        return self._with_aux(lm)

    def _with_aux(self, lm: Tensor) -> tuple[Tensor, Tensor]:
        """``(lm_loss, lm_loss + aux)``: the training objective beside the cross entropy."""
        return lm, lm + self.aux_loss().to(lm.device)

    def aux_loss(self) -> Tensor:
        losses = [m.last.aux_loss for m in self.moe_layers
                  if m.last is not None and m.last.aux_loss is not None]
        return torch.stack(losses).sum() if losses else torch.zeros(())

    def loss(self, input_ids: Tensor, targets: Tensor, num_targets: float | None = None
             ) -> tuple[Tensor, Tensor]:
        """``(lm_loss, lm_loss + aux)`` for ``targets`` already shifted (``targets[:, t]``
        follows ``input_ids[:, t]``): the trainer's form of ``model(ids, labels=ids)``."""
        if not self._chunked(input_ids):
            return self._objective(self(input_ids), targets, num_targets)
        total = self._chunked_sum(self.hidden(input_ids), targets)
        lm = total / (num_targets if num_targets is not None else (targets != -100).sum())
        return self._with_aux(lm)

    def loss_sum(self, input_ids: Tensor, targets: Tensor) -> Tensor:
        """The summed cross entropy over ``targets`` (``-100`` ignored), fp32: evaluation's."""
        if self._chunked(input_ids):
            return self._chunked_sum(self.hidden(input_ids), targets)
        logits = self(input_ids)
        with torch.autocast(logits.device.type, enabled=False):  # fp32, as outside autocast
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                   targets.reshape(-1), reduction="sum", ignore_index=-100)

    def _chunked(self, input_ids: Tensor) -> bool:
        return 0 < self.loss_chunk < input_ids.numel()

    def _chunked_sum(self, x_BTH: Tensor, targets: Tensor) -> Tensor:
        x_NH, t_N = x_BTH.reshape(-1, x_BTH.shape[-1]), targets.reshape(-1)
        total = None
        for a in range(0, len(t_N), self.loss_chunk):
            part = (x_NH[a:a + self.loss_chunk], t_N[a:a + self.loss_chunk])
            ce = (torch.utils.checkpoint.checkpoint(self._ce_sum, *part, use_reentrant=False)
                  if torch.is_grad_enabled() else self._ce_sum(*part))
            total = ce if total is None else total + ce
        return total

    def _ce_sum(self, x_NH: Tensor, t_N: Tensor) -> Tensor:
        logits = self.lm_head(self.norm(x_NH))
        return F.cross_entropy(logits.float(), t_N, reduction="sum", ignore_index=-100)

    @torch.no_grad()
    def end_step(self, reduce=None) -> list[Tensor | None]:
        """After the optimizer step: close per-layer counting (``reduce``: summed over
        the data-parallel replicas, under DP x EP), update GLM router biases."""
        counts = [m.end_step() for m in self.moe_layers]
        if reduce is not None:
            counts = [None if c is None else reduce(c.clone()) for c in counts]
            for m, c in zip(self.moe_layers, counts):
                if c is not None:
                    m.prev_counts_E = c
        rate = self.config.bias_update_rate
        for m, c in zip(self.moe_layers, counts):
            if c is not None and hasattr(m.router, "update_bias") and rate > 0:
                m.router.update_bias(c, rate)
        return counts
