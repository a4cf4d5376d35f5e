"""Collectives of the expert-parallel group, behind small functions (docs/design.md §1 conventions).

``EPComm(None)`` is the single-process group: every exchange is the identity, so the
one-process and the distributed runtimes run the same code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class EPComm:
    """The EP process group (or ``None`` for one process) and its collectives."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0

    def all_gather_counts(self, counts_E: Tensor) -> Tensor:
        """Per-rank expert counts ``[E]`` -> ``[G, E]`` int64 on the CPU (identical on all ranks)."""
        c = counts_E.detach().long()
        if self.group is None:
            return c.cpu().unsqueeze(0)
        out = [torch.empty_like(c) for _ in range(self.size)]
        dist.all_gather(out, c, group=self.group)
        return torch.stack(out).cpu()

    def all_to_all(self, x: Tensor, send: list[int], recv: list[int]) -> Tensor:
        """Exchange rows: ``send[r]`` rows go to rank r, ``recv[r]`` rows arrive from r."""
        if self.group is None:
            return x
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out

    def exchange_counts(self, counts_GS: Tensor) -> Tensor:
        """Row ``r`` of ``counts_GS`` goes to rank r; returns the rows received, ``[G, S]``."""
        if self.group is None:
            return counts_GS
        G, S = counts_GS.shape
        return self.all_to_all(counts_GS.reshape(-1), [S] * G, [S] * G).reshape(G, S)
