"""``torch.compile`` for the model (``lrmoe train --compile``).

Everything but the MoE layers' host-driven stages (:meth:`lrmoe.model.moe.MoELayer.routed`,
one graph break per MoE layer) is compiled, so a new plan never recompiles
(docs/design.md §8).
"""

from __future__ import annotations

import torch
from torch import nn


def compile_model(model: nn.Module, backend: str = "inductor", **kw) -> nn.Module:
    """Compile ``model`` in place (parameter names, and so checkpoints, are unchanged):
    its ``forward`` and, when it has one, its ``loss`` (forward + cross entropy, one
    region up to the first MoE layer's break). Returns ``model``."""
    model.compile(backend=backend, **kw)
    if hasattr(model, "loss"):
        model.loss = torch.compile(model.loss, backend=backend, **kw)
    return model
