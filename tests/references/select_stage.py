"""The select stage as first written (tests only): water-filling with three sorts and a
compaction that writes each kept row's index at its rank. The runtime's
:func:`lrmoe.ops.selection.inclusion_probs` and
:func:`lrmoe.parallel.stages.select_and_compact` must give the same tensors, bit for
bit (tests/test_select_fast.py). The water-filling is a copy, not shared with the
runtime, so that a change there cannot move both sides of the comparison.

Legend: N candidate rows, B blocks, G ranks, S slots.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import Tensor

from lrmoe.ops.rowops import to_device
from lrmoe.parallel.options import BackwardOptions
from lrmoe.parallel.stages import HomeLayout
from references.layout import block_ids
from references.select_runtime import (
    METRICS,
    ht_weight,
    kept_counts,
    poisson_keep,
    select_and_compact,
)


def inclusion_probs_reference(metric_N: Tensor, block_N: Tensor, quota_B: Tensor,
                              size_B: Tensor | None = None, stable: bool = False) -> Tensor:
    """Probabilities ``pi ∝ metric`` capped at 1 with ``sum(pi) = quota`` per block: rows
    sorted by metric descending, then stably by block; the capped rows are each block's
    prefix that passes ``(q - r) m_r > R_r``; back to row order through ``argsort``.

    The first sort is torch's default one, whose order among equal metrics is the
    kernel's own (on the CPU not row order past 32 rows; on CUDA row order past 32).
    That order shows in the result only when equal metrics straddle the cap (a row whose
    share is 1 within rounding gets 1.0 capped, or 1 - 2^-53 free); ``stable=True``
    ranks them in row order, as the runtime does."""
    dev = metric_N.device
    m = metric_N.double().clamp(min=0)
    N = m.numel()
    if N == 0:
        return m
    B = quota_B.numel()
    blk = block_N.to(dev).long()
    order = torch.argsort(m, descending=True, stable=stable)
    order = order[torch.sort(blk[order], stable=True).indices]  # block asc, metric desc
    m_s, b_s = m[order], blk[order]
    n_B = (torch.bincount(b_s, minlength=B) if size_B is None else size_B).cpu().numpy()
    if n_B.size != B or int(n_B.sum()) != N:
        raise ValueError(f"inclusion_probs: block sizes {n_B.size} summing to "
                         f"{int(n_B.sum())}, for {B} blocks and {N} rows")
    first = np.cumsum(n_B) - n_B
    q = quota_B.cpu().double().numpy()
    tab = to_device(torch.from_numpy(np.stack((n_B, np.maximum(first + n_B - 1, 0), q + first - 1, q))
                                     .astype(np.float64)), dev)
    nl, last_B = tab[:2].long()
    u_s = m_s / torch.segment_reduce(m_s, "sum", lengths=nl, unsafe=True).clamp(min=1e-300)[b_s]
    C_s = torch.cumsum(u_s, 0)
    capped_s = torch.addcmul(C_s, tab[2][b_s] - torch.arange(N, device=dev), u_s) > C_s[last_B][b_s]
    c = torch.segment_reduce(capped_s.double(), "sum", lengths=nl, unsafe=True)
    mass = torch.segment_reduce(torch.where(capped_s, 0.0, m_s), "sum", lengths=nl, unsafe=True)
    rem = (tab[3] - c).clamp(min=0.0)
    has = mass > 0
    per_mass = torch.where(has, rem / torch.where(has, mass, 1.0), 0.0)
    uniform = torch.where(has, 0.0, rem / (tab[0] - c).clamp(min=1.0))
    fg = torch.stack((per_mass, uniform), 1)[b_s]
    pi_s = torch.where(capped_s, 1.0, torch.addcmul(fg[:, 1], fg[:, 0], m_s)).clamp_(0.0, 1.0)
    return pi_s[torch.argsort(order)]


def select_and_compact_reference(dout_TH: Tensor, tok_c: Tensor, g_c: Tensor, gate_c: Tensor,
                                 home: HomeLayout, opts: BackwardOptions, generator, exact: bool,
                                 exchange_counts: Callable[[Tensor], Tensor] | None = None):
    """:func:`lrmoe.parallel.exchange.select_and_compact`'s sampled branch with
    :func:`inclusion_probs_reference`, compacting by writing each kept row's index at its
    rank (``cumsum`` of the keep mask) once the kept count is on the host; the other
    branches are the runtime's own."""
    if exact or opts.estimator != "sampled":
        return select_and_compact(dout_TH, tok_c, g_c, gate_c, home, opts, generator, exact,
                                  exchange_counts)
    m = METRICS[opts.metric](dout_TH, tok_c, gate_c)
    pi = inclusion_probs_reference(m, block_ids(home.retain_I, dout_TH.device), home.select_I,
                                   home.retain_I)
    keep = poisson_keep(pi, generator)
    if not opts.compaction:
        return tok_c, g_c * torch.where(keep, ht_weight(pi), 0.0).float(), home.retain_I, None, keep, None
    sent_I, recv_GS = kept_counts(keep, home, exchange_counts)
    n_sel = int(sent_I.sum())
    dest = torch.where(keep, torch.cumsum(keep, 0) - 1, n_sel)
    sel_idx = torch.empty(n_sel + 1, dtype=torch.long, device=keep.device)
    sel_idx[dest] = torch.arange(keep.numel(), device=keep.device)
    sel_idx = sel_idx[:n_sel]
    return tok_c[sel_idx], g_c[sel_idx] * ht_weight(pi[sel_idx]).float(), sent_I, recv_GS, keep, sel_idx
