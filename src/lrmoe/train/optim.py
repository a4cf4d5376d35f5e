"""AdamW with decoupled weight decay on matrices only, and a warmup + cosine schedule.

Weight decay applies to weight matrices and embeddings (tensors of rank >= 2) and to
the stacked expert weights; norms, biases and anything named ``bias`` (attention
biases, GLM's router correction bias if it ever becomes a parameter) are not decayed.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lrmoe.errors import require


def no_decay(name: str, p: torch.Tensor) -> bool:
    """Norm gains, biases and 1-D tensors are not weight-decayed."""
    return p.ndim < 2 or "norm" in name or name.endswith("bias")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, plain = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (plain if no_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": plain, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                    offload: str = "device", host: str | torch.device = "cpu"
                    ) -> torch.optim.AdamW:
    """AdamW over ``model``; ``offload="host"`` steps the expert weights in host memory
    (:class:`lrmoe.train.offload.HostOffloadAdamW`, its state on ``host``), same update."""
    if offload == "host":
        from lrmoe.train.offload import HostOffloadAdamW, offloaded_params
        return HostOffloadAdamW(param_groups(model, weight_decay), offloaded_params(model),
                                lr=lr, betas=betas, eps=eps, host=host)
    require(offload == "device", f"optimizer offload {offload!r}: use device or host")
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps)


def lr_scale(step: int, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Multiplier of the peak lr for update ``step`` (0-based).

    Linear warmup ``(step+1)/warmup`` over the first ``warmup`` updates, then a cosine
    from 1 down to ``min_ratio`` at update ``total``; flat at ``min_ratio`` beyond it
    (a resumed run given more steps than planned keeps the floor).
    """
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    t = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def build_scheduler(opt: torch.optim.Optimizer, warmup: int, total: int,
                    min_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_scale(s, warmup, total, min_ratio))
