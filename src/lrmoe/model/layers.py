"""Dense building blocks: RMSNorm, rotary embedding, GQA attention, SwiGLU MLP.

Math follows HF transformers' Qwen3-MoE / GLM-4.5-MoE definitions so checkpoints
interoperate. Legend: B batch, T sequence, H hidden, N heads, K kv heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lrmoe.config import ModelConfig
from lrmoe.ops.fused import fused


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's RMSNorm through torch's fused ``rms_norm`` (on the CPU bit for bit the formula): an
    fp32 input takes the weight inside the kernel, a reduced-precision one is rounded back to
    its dtype before the weight, as HF rounds it."""
    shape = (weight.shape[0],)
    if x.dtype == weight.dtype:
        return F.rms_norm(x, shape, weight, eps)
    return weight * F.rms_norm(x, shape, eps=eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary embedding over the first ``rotary_dim`` channels of each head (rotate-half)."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rotary_dim = rotary_dim

    def cos_sin(self, T: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        pos = torch.arange(T, device=device, dtype=torch.float)
        freqs = pos[:, None] * self.inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, rotary_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x_BNTD: Tensor, cos_TR: Tensor, sin_TR: Tensor) -> Tensor:
    r = cos_TR.shape[-1]
    rot, rest = x_BNTD[..., :r], x_BNTD[..., r:]
    rot = rot * cos_TR + _rotate_half(rot) * sin_TR
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot


def qk_rotary(q_BTND: Tensor, k_BTKD: Tensor, cos_TR: Tensor, sin_TR: Tensor,
              q_w: Tensor | None, k_w: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """q and k from their projections' layout to SDPA's (``[B, heads, T, D]``): the q/k
    RMSNorm (with weights ``q_w``, ``k_w``; none without), the transpose and the
    rotary embedding. The glue between the projections and SDPA, written once: one
    compiled region on CUDA (:meth:`Attention.forward`), these ops elsewhere."""
    if q_w is not None:
        q_BTND, k_BTKD = rms_norm(q_BTND, q_w, eps), rms_norm(k_BTKD, k_w, eps)
    q, k = q_BTND.transpose(1, 2), k_BTKD.transpose(1, 2)
    return apply_rotary(q, cos_TR, sin_TR), apply_rotary(k, cos_TR, sin_TR)


class Attention(nn.Module):
    """Causal GQA attention through SDPA, with optional q/k RMSNorm and q/k/v bias."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(H, self.n_kv * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(H, self.n_kv * D, bias=cfg.attention_bias)
        # HF: Qwen3-MoE's o_proj takes attention_bias too; GLM-4.5's never has a bias.
        self.o_proj = nn.Linear(self.n_heads * D, H,
                                bias=cfg.attention_bias and cfg.model_type == "qwen3_moe")
        self.use_qk_norm = cfg.use_qk_norm
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x_BTH: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x_BTH.shape
        q = self.q_proj(x_BTH).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x_BTH).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x_BTH).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        norm = ((self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.use_qk_norm
                else (None, None, 0.0))
        # in eager mode on CUDA the glue runs as one compiled region (a few fused kernels
        # instead of ~20 small ones); inside an outer torch.compile it is traced as is
        glue = qk_rotary if torch.compiler.is_compiling() else fused("qk_rotary", qk_rotary, q)
        q, k = glue(q, k, cos, sin, *norm)  # [B, N, T, D]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU MLP (dense layers and GLM's shared expert)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
