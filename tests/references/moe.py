"""The MoE layer and its experts read plainly: one process, every expert local, a loop
over experts (the references of :class:`lrmoe.model.moe.MoELayer`'s exchange path and of
:mod:`lrmoe.ops.experts`' grouped GEMMs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def moe_layer_reference(layer, x_BTH: Tensor, keep=None, dropped_E=None) -> Tensor:
    """Straightforward dense-dispatch reference (one process, all experts local).

    ``keep(gate_N) -> bool_N``, if given, picks which of an expert's N pairs carry
    gradient into the expert (weights and input); the others' outputs are detached, so
    the forward and every pair's router gradient stay exact (the masking reference of a
    trimmed backward). ``dropped_E``, if given, leaves each expert's ``dropped_E[e]``
    lowest-gate pairs (ties: the later pair) out of the output, as the capacity policy
    drops them."""
    B, T, H = x_BTH.shape
    x = x_BTH.reshape(-1, H)
    r = layer.router(x)
    Fd = layer.cfg.moe_intermediate_size
    out = torch.zeros_like(x)
    for e in range(layer.cfg.num_experts):
        tok, k = torch.nonzero(r.idx_TK == e, as_tuple=True)
        if dropped_E is not None:
            order = torch.argsort(r.gate_TK[tok, k].detach(), descending=True, stable=True)
            kept = order[:tok.numel() - int(dropped_E[e])]
            tok, k = tok[kept], k[kept]
        if tok.numel() == 0:
            continue
        gu = x[tok] @ layer.experts.gate_up_proj[e].t()
        y = (torch.nn.functional.silu(gu[:, :Fd]) * gu[:, Fd:]) @ layer.experts.down_proj[e].t()
        g = r.gate_TK[tok, k]
        if keep is not None:
            y = torch.where(keep(g.detach())[:, None], y, y.detach())
        out = out.index_add(0, tok, y * g[:, None].to(y.dtype))
    out = out.view(B, T, H)
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(x_BTH)
    return out


def swiglu_loop_reference(x_RH: Tensor, w13_IFH: Tensor, w2_IHF: Tensor,
                          counts: list[int]) -> Tensor:
    """Plain per-instance loop with autograd: the reference for tests (docs/design.md §1 conventions)."""
    outs, start = [], 0
    Fd = w2_IHF.shape[-1]
    for i, n in enumerate(counts):
        xi = x_RH[start:start + n]
        gu = xi @ w13_IFH[i].t()
        outs.append((F.silu(gu[:, :Fd]) * gu[:, Fd:]) @ w2_IHF[i].t())
        start += n
    return torch.cat(outs) if outs else x_RH.new_zeros(0, w2_IHF.shape[1])
