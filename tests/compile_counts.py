"""How much ``torch.compile`` compiled in this process (tests and ``benchmarks/``)."""

from __future__ import annotations

import torch


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
