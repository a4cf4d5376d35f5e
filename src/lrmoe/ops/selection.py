"""lrmoe's backward selection on one home rank: score, select, compact.

The candidates are a home rank's retained rows in send order, grouped by block (block
``b`` holds ``size_B[b]`` consecutive rows, sizes on the host). The metric is ``|gate| *
||dout[tok]||`` (``grad_norm``) or the gate (``gate``); per block :func:`select_topk`
keeps the ``quota_B[b]`` highest, :func:`select_sampled` each row with probability ``pi ∝
metric`` (capped at 1, ``sum(pi) = quota``), weighted by ``1 / pi``. On CUDA each is
three Triton kernels (:mod:`.selection_triton`), elsewhere the torch reference; how
exactly they agree: docs/design.md §2, "Row kernels".

Legend: N candidates, B blocks (= G ranks x S slots), T tokens, H width, S kept rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from lrmoe.ops.rowops import HAS_TRITON, on_kernels, run_positions, runs, to_device

if HAS_TRITON:
    from torch.library import triton_op, wrap_triton

    from lrmoe.ops import selection_triton as _k


@dataclass
class Selection:
    """One home rank's kept candidates: their indices (ascending), tokens and scales (``g``,
    times ``1/pi`` when sampled); ``sent_B`` kept rows per block and ``recv_GS`` those each
    source block sends this rank (host; ``None`` without a count exchange); ``dy_SH``
    ``dout[tok_S]`` when ``dout_TH`` was given; ``pi_N`` the sampled inclusion probabilities."""

    sel_idx_S: Tensor
    tok_S: Tensor
    scale_S: Tensor
    keep_N: Tensor
    sent_B: Tensor
    recv_GS: Tensor | None = None
    dy_SH: Tensor | None = None
    pi_N: Tensor | None = None


# ----------------------------------------------------------------- torch reference
METRICS = ("grad_norm", "gate")


def check_metric(metric: str, norm_T: Tensor | None) -> None:
    """The metric's inputs are there (its name is checked by ``BackwardOptions``)."""
    if metric == "grad_norm" and norm_T is None:
        raise ValueError("selection metric 'grad_norm' needs the token norms (norm_T)")


def metric_reference(metric: str, norm_T: Tensor | None, tok_N: Tensor, gate_N: Tensor) -> Tensor:
    """The candidates' metric (fp32): ``|gate| * norm[tok]`` or ``gate``."""
    if metric == "grad_norm":
        return gate_N.float().abs() * norm_T[tok_N]
    return gate_N.float()


def topk_indices(metric_N: Tensor, size_B: Tensor, quota_B: Tensor) -> Tensor:
    """Indices of the ``quota[b]`` highest-metric rows of each block, ascending: one stable
    sort on ``block + 0.5 * (1 - metric / max)`` (ties in row order)."""
    dev, n = metric_N.device, metric_N.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=dev)
    blk = torch.repeat_interleave(torch.arange(size_B.numel(), device=dev), to_device(size_B, dev),
                                  output_size=n)
    m = metric_N.double().clamp(min=0)
    key = blk.double() + 0.5 * (1 - m / (m.max() + 1e-300))
    order = torch.argsort(key, stable=True)
    first = (size_B.cumsum(0) - size_B).numpy()
    kept = runs(first, torch.minimum(quota_B, size_B).numpy(), dev)
    return torch.sort(order[run_positions(kept.dst_first, kept.src_first, kept.n)]).values


def inclusion_probs(metric_N: Tensor, block_N: Tensor, quota_B: Tensor,
                    size_B: Tensor | None = None) -> Tensor:
    """Probabilities ``pi ∝ metric`` capped at 1 with ``sum(pi) = quota`` per block.

    Water-filling in closed form: with a block's metrics sorted descending and ``R_r`` the
    mass from rank ``r`` on, rank ``r`` is capped iff ``(q - r) * m_r > R_r``, which holds for
    a prefix of the block; the free rows get ``(q - c) * m / M`` (uniform when ``M = 0``).
    Negative metrics count as 0; equal metrics rank in row order. One sort, one scan of the
    per-block normalised metrics, no host wait and no op that deterministic mode slows."""
    dev = metric_N.device
    N = metric_N.numel()
    if N == 0:
        return metric_N.double()
    B = quota_B.numel()
    blk = block_N.to(dev).long()
    rows = torch.arange(N, device=dev)
    m, order, inverse = _block_order(metric_N, blk, rows, B)
    m_s, b_s = m[order], blk[order]
    n_B = (torch.bincount(b_s, minlength=B) if size_B is None else size_B).cpu().numpy()
    if n_B.size != B or int(n_B.sum()) != N:  # host values: no sync
        raise ValueError(f"inclusion_probs: block sizes {n_B.size} summing to "
                         f"{int(n_B.sum())}, for {B} blocks and {N} rows")
    first = np.cumsum(n_B) - n_B
    q = quota_B.cpu().double().numpy()
    # one copy of the per-block constants (float64 holds the counts exactly)
    tab = to_device(torch.from_numpy(np.stack((n_B, np.maximum(first + n_B - 1, 0), q + first - 1, q))
                                     .astype(np.float64)), dev)
    nl, last_B = tab[:2].long()
    u_s = m_s / torch.segment_reduce(m_s, "sum", lengths=nl, unsafe=True).clamp(min=1e-300)[b_s]
    C_s = torch.cumsum(u_s, 0)
    capped_s = torch.addcmul(C_s, tab[2][b_s] - rows, u_s) > C_s[last_B][b_s]
    c = torch.segment_reduce(capped_s.double(), "sum", lengths=nl, unsafe=True)
    mass = torch.segment_reduce(torch.where(capped_s, 0.0, m_s), "sum", lengths=nl, unsafe=True)
    # per block, on the device (no host wait): free rows get rem * m / M, or rem / n_free
    # when the block's free rows carry no metric mass (a scalar fill goes in place on a
    # fresh tensor: one kernel)
    rem = (tab[3] - c).clamp(min=0.0)
    has = mass > 0
    per_mass = torch.where(has, rem / mass, 0.0)
    uniform = (rem / (tab[0] - c).clamp(min=1.0)).masked_fill_(has, 0.0)
    fg = torch.stack((per_mass, uniform), 1)[b_s]
    pi_s = torch.addcmul(fg[:, 1], fg[:, 0], m_s).masked_fill_(capped_s, 1.0).clamp_(0.0, 1.0)
    return pi_s[inverse]  # back to the input's row order (a gather)


def _block_order(metric_N: Tensor, blk: Tensor, rows: Tensor, B: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(m, order, inverse)``: the metric clamped at 0 (float64), the rows ordered by block,
    then metric descending, then row, and the inverse permutation. A float32 metric takes
    one sort on the unique int64 key ``N * (2^31 * block - bits) + row`` (while ``B * N <
    2^32``); another takes two stable sorts."""
    N = rows.numel()
    if metric_N.dtype in (torch.float32, torch.bfloat16, torch.float16) and B * N < 2**32:
        # a negative metric (and -0.0) reads as +0.0: the clamp at 0, on the bits
        bits = metric_N.float().view(torch.int32).clamp(min=0)
        key = torch.add(torch.sub(rows, bits, alpha=N), blk, alpha=N << 31)
        key_s, order = torch.sort(key)
        return bits.view(torch.float32).double(), order, torch.searchsorted(key_s, key)
    m = metric_N.double().clamp(min=0)
    order = torch.sort(m, descending=True, stable=True).indices
    order = order[torch.sort(blk[order], stable=True).indices]
    return m, order, torch.argsort(order)


def ht_weight(pi: Tensor) -> Tensor:
    """The Horvitz-Thompson weight ``1/pi`` of a kept row (the floor guards the division)."""
    return 1.0 / pi.clamp(min=1e-12)


def _read_counts(sent_B: Tensor, exchange_counts: Callable[[Tensor], Tensor] | None,
                 shape_GS: tuple[int, int] | None) -> tuple[Tensor, Tensor | None]:
    """``(sent_B, recv_GS)`` on the host: the kept counts, exchanged with the peers on the
    device when ``exchange_counts`` is given, and read in one copy (the one host wait)."""
    recv = exchange_counts(sent_B.reshape(shape_GS)) if exchange_counts else sent_B.new_zeros(0)
    both = torch.cat((sent_B, recv.reshape(-1))).cpu()
    B = sent_B.numel()
    return both[:B], both[B:].reshape(shape_GS) if exchange_counts else None


# ------------------------------------------------------------------------ public
def _table(size_B: Tensor, quota_B: Tensor, device) -> Tensor:
    """``[3, B]`` int64 on ``device`` (one copy): each block's first row, size, quota."""
    n = size_B.numpy().astype(np.int64)
    return to_device(torch.from_numpy(np.stack((np.cumsum(n) - n, n, quota_B.numpy()))), device)


def select_topk(metric: str, norm_T: Tensor | None, tok_N: Tensor, g_N: Tensor, gate_N: Tensor,
                size_B: Tensor, quota_B: Tensor, dout_TH: Tensor | None = None) -> Selection:
    """Keep each block's ``quota`` highest-metric candidates (see module doc). No host
    wait: the kept counts are the quotas (capped at the block sizes)."""
    check_metric(metric, norm_T)
    if not on_kernels(tok_N):  # the torch reference
        m = metric_reference(metric, norm_T, tok_N, gate_N)
        sel = topk_indices(m, size_B, quota_B)
        keep = torch.zeros(m.numel(), dtype=torch.bool, device=m.device).index_fill_(0, sel, True)
        tok = tok_N[sel]
        return Selection(sel, tok, g_N[sel], keep, quota_B, None,
                         None if dout_TH is None else dout_TH[tok])
    tab = _table(size_B, quota_B, tok_N.device)
    keep, slot, sent = torch.ops.lrmoe.topk_select(metric, tok_N, gate_N, norm_T, tab)
    n_sel = int(np.minimum(quota_B.numpy(), size_B.numpy()).sum())  # host arithmetic
    sel, tok, scale, dy = torch.ops.lrmoe.compact_selected(slot, tab, sent, tok_N, g_N, None,
                                                           dout_TH, n_sel)
    return Selection(sel, tok, scale, keep, quota_B, None, None if dout_TH is None else dy)


def select_sampled(metric: str, norm_T: Tensor | None, tok_N: Tensor, g_N: Tensor, gate_N: Tensor,
                   size_B: Tensor, quota_B: Tensor, generator: torch.Generator | None,
                   exchange_counts: Callable[[Tensor], Tensor] | None = None,
                   shape_GS: tuple[int, int] | None = None,
                   dout_TH: Tensor | None = None) -> Selection:
    """Keep each candidate with its inclusion probability (draws: ``torch.rand(N, float64,
    generator)``). One host wait: the kept counts, after ``exchange_counts`` (``[G, S]`` sent
    -> received) has run on the device."""
    check_metric(metric, norm_T)
    if not on_kernels(tok_N):  # the torch reference
        m = metric_reference(metric, norm_T, tok_N, gate_N)
        lengths = to_device(size_B, m.device)
        blk = torch.repeat_interleave(torch.arange(size_B.numel(), device=m.device), lengths,
                                      output_size=m.numel())
        pi = inclusion_probs(m, blk, quota_B, size_B)
        keep = torch.rand(pi.shape, dtype=pi.dtype, device=pi.device, generator=generator) < pi
        sent_dev = torch.segment_reduce(keep.double(), "sum", lengths=lengths, unsafe=True).long()
        sent, recv = _read_counts(sent_dev, exchange_counts, shape_GS)
        sel = torch.nonzero_static(keep, size=int(sent.sum())).view(-1)
        tok = tok_N[sel]
        return Selection(sel, tok, g_N[sel] * ht_weight(pi[sel]).float(), keep, sent, recv,
                         None if dout_TH is None else dout_TH[tok], pi)
    dev = tok_N.device
    tab = _table(size_B, quota_B, dev)
    u = torch.rand(tok_N.shape, dtype=torch.float64, device=dev, generator=generator)
    pi, keep, slot, sent_dev = torch.ops.lrmoe.sampled_select(metric, tok_N, gate_N, norm_T, u, tab)
    sent, recv = _read_counts(sent_dev, exchange_counts, shape_GS)
    sel, tok, scale, dy = torch.ops.lrmoe.compact_selected(slot, tab, sent_dev, tok_N, g_N, pi,
                                                           dout_TH, int(sent.numpy().sum()))
    return Selection(sel, tok, scale, keep, sent, recv, None if dout_TH is None else dy, pi)


if HAS_TRITON:
    @triton_op("lrmoe::topk_select", mutates_args=())
    def _topk_op(metric: str, tok_N: Tensor, gate_N: Tensor, norm_T: Tensor | None,
                 tab_3B: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return _k.launch_topk_select(metric, tok_N, gate_N, norm_T, tab_3B, wrap_triton)

    @triton_op("lrmoe::sampled_select", mutates_args=())
    def _sampled_op(metric: str, tok_N: Tensor, gate_N: Tensor, norm_T: Tensor | None, u_N: Tensor,
                    tab_3B: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return _k.launch_sampled_select(metric, tok_N, gate_N, norm_T, u_N, tab_3B, wrap_triton)

    @triton_op("lrmoe::compact_selected", mutates_args=())
    def _compact_op(slot_N: Tensor, tab_3B: Tensor, sent_B: Tensor, tok_N: Tensor, g_N: Tensor,
                    pi_N: Tensor | None, dout_TH: Tensor | None, n_sel: int
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return _k.launch_compact(slot_N, tab_3B, sent_B, tok_N, g_N, pi_N, dout_TH, n_sel, wrap_triton)

    # CPU tensors reach these operators only under Triton's interpreter (the public
    # functions take the reference on the CPU otherwise)
    _topk_op.register_kernel("cpu")(_k.launch_topk_select)
    _sampled_op.register_kernel("cpu")(_k.launch_sampled_select)
    _compact_op.register_kernel("cpu")(_k.launch_compact)
