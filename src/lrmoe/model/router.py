"""Routers: token -> top-k experts and gate weights (stage ``route``).

Legend: T tokens, H hidden, E experts, K top-k. Router math runs in fp32 (as HF does
for the probabilities) because top-k selection is sensitive to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lrmoe.config import ModelConfig


@dataclass
class Routing:
    """Output of a router for T tokens: expert ids ``idx_TK`` (int64), gates ``gate_TK`` (fp32,
    differentiable), and ``probs_TE`` when the router has an aux loss (the MoE layer turns
    them into the loss once the global counts are known), else ``None``."""

    idx_TK: Tensor
    gate_TK: Tensor
    probs_TE: Tensor | None = None


class SoftmaxRouter(nn.Module):
    """Qwen3-MoE: softmax over all experts, top-k, optional renormalisation.

    Aux loss (Switch Transformer, as HF's ``load_balancing_loss_func`` for one layer):
    ``coef * E * sum_e f_e * P_e`` with ``f_e`` = pairs routed to e / T and ``P_e`` the
    mean router probability of e over the T tokens; see :func:`aux_loss`.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.E, self.K = cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.aux_coef = cfg.router_aux_loss_coef
        self.weight = nn.Parameter(torch.empty(self.E, cfg.hidden_size))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x_TH: Tensor) -> Routing:
        logits = F.linear(x_TH, self.weight)  # HF: gate Linear in the model dtype
        probs = torch.softmax(logits.float(), dim=-1)
        gate, idx = torch.topk(probs, self.K, dim=-1)
        if self.norm_topk_prob:
            gate = gate / gate.sum(dim=-1, keepdim=True)
        return Routing(idx, gate, probs if self.aux_coef > 0 else None)


class SigmoidGroupRouter(nn.Module):
    """GLM-4.5: sigmoid scores, selection-only correction bias, group-limited top-k.

    The correction bias ``e_score_correction_bias`` only changes which experts are
    chosen, never the gate weights; it is updated outside autograd after each optimizer
    step (aux-loss-free balancing): ``bias += rate * sign(mean_count - count_e)``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.E, self.K = cfg.num_experts, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scale = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.E, cfg.hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        self.register_buffer("e_score_correction_bias", torch.zeros(self.E, dtype=torch.float32))

    def forward(self, x_TH: Tensor) -> Routing:
        logits = F.linear(x_TH.float(), self.weight.float())
        scores = torch.sigmoid(logits)
        choice = scores.detach() + self.e_score_correction_bias
        if self.n_group > 1:
            T = x_TH.shape[0]
            grouped = choice.view(T, self.n_group, self.E // self.n_group)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
            keep = torch.zeros_like(group_score).scatter_(
                1, group_score.topk(self.topk_group, dim=-1).indices, 1.0)
            mask = keep.unsqueeze(-1).expand_as(grouped).reshape(T, self.E)
            # -inf, as HF: choice scores can be negative (correction bias), and a 0.0
            # fill would let experts of dropped groups win over them.
            choice = choice.masked_fill(mask == 0, float("-inf"))
        idx = torch.topk(choice, self.K, dim=-1, sorted=False).indices
        gate = scores.gather(1, idx)
        if self.norm_topk_prob:
            gate = gate / (gate.sum(dim=-1, keepdim=True) + 1e-20)
        gate = gate * self.scale
        return Routing(idx, gate, None)

    @torch.no_grad()
    def update_bias(self, counts_E: Tensor, rate: float) -> None:
        c = counts_E.to(self.e_score_correction_bias.device).float()
        self.e_score_correction_bias += rate * torch.sign(c.mean() - c)


def aux_loss(probs_TE: Tensor, global_counts_E: Tensor, global_tokens: int, coef: float) -> Tensor:
    """``coef * E * sum_e f_e * P_e`` with ``f_e`` from the global counts (not differentiable,
    as in Switch) and ``P_e`` the mean local probability. Averaged over equal-sized
    ranks this equals the single-process loss on the whole batch."""
    E = probs_TE.shape[1]
    frac = global_counts_E.to(probs_TE.device, torch.float32) / global_tokens
    return coef * E * (frac * probs_TE.mean(0)).sum()


def make_router(cfg: ModelConfig) -> nn.Module:
    return SigmoidGroupRouter(cfg) if cfg.router_kind == "sigmoid_group" else SoftmaxRouter(cfg)
