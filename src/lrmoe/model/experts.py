"""The experts' weights as a module (stage ``experts``); the math lives in
:mod:`lrmoe.ops.experts` (grouped SwiGLU forward/backward, offsets)."""

from __future__ import annotations

import torch
from torch import nn

from lrmoe.config import ModelConfig
from lrmoe.parallel.instances import compute_copy


class Experts(nn.Module):
    """The experts this rank owns, stacked: ``gate_up_proj [E_own, 2F, H]``, ``down_proj [E_own, H, F]``.

    On one process every expert is owned. Under EP, rank r owns experts
    ``r*E/G .. (r+1)*E/G - 1`` (their master weights, gradients and optimizer state).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, Fd = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.first, self.count, self.num_experts = 0, E, E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * Fd, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, Fd))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)
        # the weights in the compute dtype, while the micro-batches of one optimizer step
        # share one cast (``MoEForCausalLM.step_weights``); ``None``: cast at each use
        self.casts: dict | None = None

    def compute_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up_proj, down_proj)`` in ``dtype`` (the gradients are the cast's, in
        the weights' dtype): cast once while :attr:`casts` holds a cache, else now."""
        if self.casts is None:
            return self.gate_up_proj.to(dtype), self.down_proj.to(dtype)
        return (compute_copy(self.gate_up_proj, dtype, self.casts),
                compute_copy(self.down_proj, dtype, self.casts))

    def instance_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one expert's weights in ``dtype`` (what a replica's scatter moves)."""
        per = self.gate_up_proj[0].numel() + self.down_proj[0].numel()
        return per * torch.empty((), dtype=dtype).element_size()
