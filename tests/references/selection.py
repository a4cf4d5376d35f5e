"""The backward selection as masks over the candidates (the runtime's select stage,
:func:`lrmoe.parallel.exchange.select_and_compact`, works on indices and compacts).

Legend: N candidate rows, B blocks (rows sorted by block id for :func:`select_topk`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from references.select_runtime import ht_weight, inclusion_probs, poisson_keep, select_topk_idx


def select_topk(metric_N: Tensor, block_N: Tensor, quota_B: Tensor) -> Tensor:
    """Boolean mask form of :func:`lrmoe.parallel.exchange.select_topk_idx` for rows sorted by block id."""
    size_B = torch.bincount(block_N.cpu(), minlength=quota_B.numel())
    keep = torch.zeros(metric_N.numel(), dtype=torch.bool, device=metric_N.device)
    keep[select_topk_idx(metric_N, size_B, quota_B.cpu())] = True
    return keep


def select_sampled(metric_N: Tensor, block_N: Tensor, quota_B: Tensor,
                   generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Poisson sampling with ``pi`` from :func:`lrmoe.parallel.exchange.inclusion_probs`;
    kept rows weigh ``1/pi``.

    The expected weighted sum of any per-row quantity equals the full sum (Horvitz-
    Thompson), so the expected expert weight gradient is the exact one.
    """
    pi = inclusion_probs(metric_N, block_N, quota_B)
    keep = poisson_keep(pi, generator)
    return keep, torch.where(keep, ht_weight(pi), 0.0)
