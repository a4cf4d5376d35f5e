"""AdamW with decoupled weight decay on matrices only, and a warmup + cosine schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from lrmoe.errors import require

BETAS = (0.9, 0.95)  # AdamW's, on the device and the host alike
EPS = 1e-8


def no_decay(name: str, p: torch.Tensor) -> bool:
    """Norm gains, biases and 1-D tensors are not weight-decayed."""
    return p.ndim < 2 or "norm" in name or name.endswith("bias")


def param_groups(model: nn.Module, weight_decay: float, lr: float | None = None,
                 router_lr_scale: float = 1.0) -> list[dict]:
    """Decayed and not-decayed groups. With ``router_lr_scale != 1`` the routers'
    parameters get their own groups at ``lr · router_lr_scale`` (a router's logit for a
    token moves by up to about lr·‖x‖₁ a step under Adam, which grows with the width)."""
    split = router_lr_scale != 1.0
    require(not split or lr is not None, "param_groups: a router lr scale needs the lr")
    buckets: dict[tuple[bool, bool], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        key = (split and ".router." in f".{name}", no_decay(name, p))  # ...mlp.router.weight
        buckets.setdefault(key, []).append(p)
    groups = []  # decay, no_decay, router_decay, router_no_decay: the keys' sorted order
    for (router, plain), ps in sorted(buckets.items()):
        g = {"params": ps, "weight_decay": 0.0 if plain else weight_decay,
             "name": ("router_" if router else "") + ("no_decay" if plain else "decay")}
        if router:
            g["lr"] = lr * router_lr_scale
        groups.append(g)
    return groups


def build_optimizer(model: nn.Module, lr: float, weight_decay: float,
                    offload: str = "device", host: str | torch.device = "cpu",
                    router_lr_scale: float = 1.0,
                    compute_dtype: torch.dtype | None = None) -> torch.optim.AdamW:
    """AdamW over ``model``; ``offload="host"`` steps the expert weights in host memory
    (:class:`lrmoe.train.offload.HostOffloadAdamW`, its state on ``host``), same update.
    ``compute_dtype`` (offload only): the device keeps the offloaded weights in it."""
    require(router_lr_scale > 0, f"router lr scale {router_lr_scale!r} must be > 0")
    groups = param_groups(model, weight_decay, lr, router_lr_scale)
    if offload == "host":
        from lrmoe.train.offload import HostOffloadAdamW, offloaded_params
        return HostOffloadAdamW(groups, offloaded_params(model), lr=lr, betas=BETAS,
                                eps=EPS, host=host, compute_dtype=compute_dtype)
    require(offload == "device", f"optimizer offload {offload!r}: use device or host")
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS)


def lr_scale(step: int, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Multiplier of the peak lr for update ``step`` (0-based): linear warmup, cosine to
    ``min_ratio`` at ``total``, flat beyond (a resumed run given more steps keeps the floor)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    t = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def build_scheduler(opt: torch.optim.Optimizer, warmup: int, total: int,
                    min_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_scale(s, warmup, total, min_ratio))
