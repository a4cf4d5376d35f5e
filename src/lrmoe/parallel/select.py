"""LRMoE's backward **select** and **compact** stages on one home rank: which retained
pairs ship to the experts, with what output-gradient scale (docs/design.md §2; the
kernels are :mod:`lrmoe.ops.selection`'s).

Legend: T tokens, H hidden, N candidate rows, B blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from lrmoe.ops.rowops import token_norm
from lrmoe.ops.selection import METRICS, ht_weight, select_sampled, select_topk
from lrmoe.parallel.layout import HomeLayout
from lrmoe.parallel.options import BackwardOptions

__all__ = ["METRICS", "BackwardOptions", "Picked", "select_and_compact"]


@dataclass
class Picked:
    """The candidates one home rank ships.

    Attributes:
        idx: the shipped candidates' indices (ascending: send order); ``None``: every
            candidate ships (the compaction-off ablation, unselected ones weighing 0).
        scale: each shipped row's output-gradient scale (fp32).
        dy: each shipped row's ``dout[t]`` (unscaled).
        sent_B: rows shipped per block (host).
        recv_GS: with the sampled estimator's count exchange, the rows each (source,
            slot) block sends this rank (host); ``None``: known from the plan.
    """

    idx: Tensor | None
    scale: Tensor
    dy: Tensor
    sent_B: Tensor
    recv_GS: Tensor | None = None


def select_and_compact(dout_TH: Tensor, tok_c: Tensor, g_c: Tensor, gate_c: Tensor,
                       home: HomeLayout, opts: BackwardOptions, generator,
                       exchange_counts: Callable[[Tensor], Tensor] | None = None) -> Picked:
    """Select among one home rank's candidates (token ``tok_c``, scale ``g_c``, gate
    ``gate_c``) and compact the kept ones (see module doc).

    No host wait but one: the sampled estimator's kept rows per block, exchanged with
    the peers on the device (``exchange_counts``, sent ``[G, S]`` -> received ``[G, S]``)
    and read together with them in one copy: the split sizes of the backward exchange.
    """
    norm_T = token_norm(dout_TH) if opts.metric == "grad_norm" else None
    gather = dout_TH if opts.compaction else None
    if opts.estimator == "sampled":
        sel = select_sampled(opts.metric, norm_T, tok_c, g_c, gate_c, home.retain_I,
                             home.select_I, generator, exchange_counts, home.splits_shape,
                             gather)
    else:
        sel = select_topk(opts.metric, norm_T, tok_c, g_c, gate_c, home.retain_I,
                          home.select_I, gather)
    if not opts.compaction:  # every retained row ships, the unselected ones weighing 0
        w = (sel.keep_N.float() if sel.pi_N is None
             else torch.where(sel.keep_N, ht_weight(sel.pi_N), 0.0).float())
        return Picked(None, g_c * w, dout_TH[tok_c], home.retain_I)
    return Picked(sel.sel_idx_S, sel.scale_S, sel.dy_SH, sel.sent_B, sel.recv_GS)
