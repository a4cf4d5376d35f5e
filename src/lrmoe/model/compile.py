"""``torch.compile`` for the model (``lrmoe train --compile``), and how much it compiled.

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


def compile_counts() -> dict[str, int]:
    """What Dynamo did in this process so far: ``graphs`` compiled (frames with ops),
    ``graph_breaks`` and ``recompiles`` (from :mod:`torch._dynamo.utils` counters)."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "recompiles": int(sum(v for k, v in counters["recompiles"].items()))}


def reset_compile_counts() -> None:
    """Forget what Dynamo compiled in this process and zero the counters that
    :func:`compile_counts` reads (so a later count covers only what follows)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
