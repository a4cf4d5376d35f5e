"""A whole MoE layer through the virtual EP emulator, as :meth:`lrmoe.model.moe.MoELayer.forward`
runs it: the router, the routed experts over G virtual ranks
(:meth:`lrmoe.sim.virtual.VirtualEPLayer.routed`), the shared experts (tests only)."""

from __future__ import annotations

import torch
from torch import Tensor

from lrmoe.sim.virtual import VirtualEPLayer


class EmulatedLayer(VirtualEPLayer):
    """A :class:`VirtualEPLayer` called on the layer's global tokens ``[G*T, H]`` (or
    ``[B, L, H]``): the global output, differentiable w.r.t. ``x``, the router and the
    experts; ``generators``: per rank, the ``sampled`` estimator's generator (``None``: the
    global RNG)."""

    def __init__(self, *args, generators: list[torch.Generator | None] | None = None, **kw):
        super().__init__(*args, **kw)
        if generators is not None:
            self.generators = generators

    def __call__(self, x: Tensor) -> Tensor:
        layer, H = self.layer, x.shape[-1]
        x_NH = x.reshape(-1, H)
        r = layer.router(x_NH)
        out, step = self.routed(x_NH, r.idx_TK, r.gate_TK, r.probs_TE)
        self.stats = step.stats
        layer.take(step)
        out = out.view(x.shape).to(x.dtype)
        if layer.shared_experts is not None:
            out = out + layer.shared_experts(x)
        return out
