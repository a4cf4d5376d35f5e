"""The select stage as the runtime ran it before its row kernels (tests only): the
metric, ``topk`` (one stable sort on a block + metric key), ``sampled`` (water-filling
from one sort, Poisson keep, the kept counts read once, ``nonzero_static``) and the
compaction. :func:`lrmoe.parallel.stages.select_and_compact` must give the same tensors
(bit for bit on the CPU; ``sampled``'s probabilities to float64 rounding on CUDA,
``tests/gpu/test_gpu_select.py``). A frozen copy, not shared with the runtime, so that
a change there cannot move both sides of the comparison.

Legend: T tokens, H hidden, N candidate rows (retained pairs, block-major), B blocks.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import Tensor

from lrmoe.ops.rowops import to_device
from lrmoe.parallel.options import BackwardOptions
from lrmoe.parallel.stages import HomeLayout
from references.layout import block_ids, excl_cumsum, ranges


# ----------------------------------------------------------------------------- metric
# A metric scores each candidate pair from the output gradient at its home rank:
# ``metric(dout_TH, tok_N, gate_N) -> [N]`` for pairs (tok_N[n], gate_N[n]).
def metric_grad_norm(dout_TH: Tensor, tok_N: Tensor, gate_N: Tensor) -> Tensor:
    """``g[t,e]*||dy[t]||``: the norm of the pair's output gradient, which bounds its
    contribution to the expert's weight gradient. Norms are taken per token (T rows,
    not T*k pairs) in fp32."""
    tn = torch.linalg.vector_norm(dout_TH, dim=1, dtype=torch.float32)
    return gate_N.float().abs() * tn[tok_N]


def metric_gate(dout_TH: Tensor, tok_N: Tensor, gate_N: Tensor) -> Tensor:
    """Gate weight alone (ignores the gradient): a cheap, gradient-blind baseline."""
    return gate_N.float()


METRICS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "grad_norm": metric_grad_norm,
    "gate": metric_gate,
}


# -------------------------------------------------------------------------- selection
def select_topk_idx(metric_N: Tensor, size_B: Tensor, quota_B: Tensor) -> Tensor:
    """Indices of the ``quota[b]`` highest-metric rows of each block.

    Rows come grouped by block (block b holds ``size_B[b]`` consecutive rows, sizes on
    the host). One stable sort on ``block + 0.5*(1 - metric/max)`` orders every block by
    descending metric; the kept rows are each block's prefix, whose length is known on
    the host, so no device-to-host sync is needed. Returned indices are ascending (so
    block-grouped, and in send order inside each block).
    """
    dev = metric_N.device
    n = metric_N.numel()
    B = size_B.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=dev)
    blk = torch.repeat_interleave(torch.arange(B, device=dev), to_device(size_B, dev), output_size=n)
    m = metric_N.double().clamp(min=0)
    key = blk.double() + 0.5 * (1 - m / (m.max() + 1e-300))
    order = torch.argsort(key, stable=True)
    kept = order[ranges(excl_cumsum(size_B), torch.minimum(quota_B, size_B), dev)]
    # ascending = send order: the receiver relies on rows arriving in saved (j) order
    # when a block is shipped whole
    return torch.sort(kept).values


def inclusion_probs(metric_N: Tensor, block_N: Tensor, quota_B: Tensor,
                    size_B: Tensor | None = None) -> Tensor:
    """Probabilities ``pi ∝ metric`` capped at 1 with ``sum(pi) = quota`` per block.

    Water-filling in closed form (no loop). With a block's metrics sorted descending,
    ``m_0 >= m_1 >= ...``, and ``R_r`` the mass from rank ``r`` on, rank ``r`` is capped
    iff ``(q - r) * m_r > R_r``; that test holds for a prefix of the block (``(q - r) *
    m_r - R_r`` does not increase with ``r`` while ``r < q``, and is ``<= 0`` from
    ``r = q`` on), so the capped count ``c`` is how many rows pass it, and the free rows
    get ``(q - c) * m / M`` with ``M`` their mass: the unique fixed point of capping
    every row whose share reaches 1 (a row whose share is exactly 1 is left free, with
    the same result). Free rows with no metric mass share the rest of the quota
    uniformly. Negative metrics count as 0; rows need not come grouped by block; equal
    metrics of a block rank in row order (so the result, to the last bit, does not hang
    on a sort's tie order). ``size_B`` (rows per block, host) spares a device count when
    the caller knows it.

    Built for few kernels (the select stage is host-bound: each op costs ~30 us of launch
    on the H200's host against ~0.5 ms of device work in all, RESULTS.md): one sort for
    a float32 metric (:func:`_block_order`). The suffix test is one global scan of
    metrics normalised per block (a light block's sums do not round against a heavy
    block's mass): with ``C`` that inclusive scan, ``(q - r) u_r > R_r`` reads
    ``(q + first - 1 - i) u_i + C_i > C_last`` per row ``i``.
    Block quantities stay on the device: no host wait.
    Only sorts, searches, gathers, scans and segmented reductions: none of the ops that
    ``torch.use_deterministic_algorithms`` switches to slower kernels (``index_add_``,
    ``index_put_``, ``index_copy_``, ``scatter``).
    """
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
    """``(m, order, inverse)``: the metric clamped at 0 in float64; the rows ordered by
    block (ascending), then metric (descending), then row (ascending); and the inverse
    permutation (``order[inverse] = rows``, with ``rows = arange(N)``).

    A float32 (or narrower) metric takes one sort, on a unique int64 key: the bits of a
    non-negative float32 read as an int32 grow with its value, so ``N * (2^31 * block -
    bits) + row`` orders the rows as wanted while ``B * N < 2^32``; the inverse is where
    each row's key falls among the sorted keys (a search, no scatter). Another metric
    takes two stable sorts and an ``argsort`` of the order.
    """
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
    """The Horvitz-Thompson weight ``1/pi`` of a kept row (``pi`` of a kept row is > 0;
    the floor only guards the division)."""
    return 1.0 / pi.clamp(min=1e-12)


def poisson_keep(pi: Tensor, generator: torch.Generator | None) -> Tensor:
    """Each row kept with probability ``pi``, independently (``u < pi`` with ``u`` uniform
    on [0, 1): a row with ``pi = 0`` is never kept)."""
    return torch.rand(pi.shape, dtype=pi.dtype, device=pi.device, generator=generator) < pi



def select_and_compact(dout_TH: Tensor, tok_c: Tensor, g_c: Tensor, gate_c: Tensor,
                       home: HomeLayout, opts: BackwardOptions, generator, exact: bool,
                       exchange_counts: Callable[[Tensor], Tensor] | None = None):
    """One home rank's backward **select** and **compact** stages.

    Candidates are the retained rows in send order (token ``tok_c``, output-gradient scale
    ``g_c``, gate ``gate_c``): block-major, ``home.retain_I`` of them per block. Returns
    ``(tok_s, scale, sent_I, recv_GS, keep, sel_idx)``: the token and scale of every row
    to ship (in send order), rows per block (host), the rows each (source, slot) block
    sends this rank (host; only for the sampled estimator, whose counts are known only
    here, else ``None``), the keep mask over the candidates (``None`` for an exact plan)
    and the shipped candidates' indices (``None`` when every candidate is shipped: exact
    plan, or the compaction-off ablation, which ships all retained rows with the
    unselected ones' scale zeroed).

    No host wait but one: the sampled estimator's kept rows per block, exchanged with
    the peers on the device (``exchange_counts``, sent ``[G, S]`` -> received ``[G, S]``)
    and read together with them in one copy: the split sizes of the backward exchange.
    """
    pi = keep = sel_idx = None
    if not exact:
        m = METRICS[opts.metric](dout_TH, tok_c, gate_c)
        if opts.estimator == "sampled":
            # the candidates are each block's retained rows: retain_I of them
            blocks = block_ids(home.retain_I, dout_TH.device)
            pi = inclusion_probs(m, blocks, home.select_I, home.retain_I)
            keep = poisson_keep(pi, generator)
        else:
            sel_idx = select_topk_idx(m, home.retain_I, home.select_I)
            # a scalar fill: ``keep[sel_idx] = True`` would copy a host tensor (a sync on CUDA)
            keep = torch.zeros(m.numel(), dtype=torch.bool, device=m.device).index_fill_(
                0, sel_idx, True)
    if keep is None:
        return tok_c, g_c, home.retain_I, None, None, None
    if not opts.compaction:
        w = keep.float() if pi is None else torch.where(keep, ht_weight(pi), 0.0).float()
        return tok_c, g_c * w, home.retain_I, None, keep, None
    sent_I, recv_GS = home.select_I, None
    if sel_idx is None:  # sampled: count the kept rows, then compact them
        sent_I, recv_GS = kept_counts(keep, home, exchange_counts)
        # the kept count is on the host now: compacting needs no second wait
        sel_idx = torch.nonzero_static(keep, size=int(sent_I.sum())).view(-1)
    scale = g_c[sel_idx]
    if pi is not None:
        scale = scale * ht_weight(pi[sel_idx]).float()
    return tok_c[sel_idx], scale, sent_I, recv_GS, keep, sel_idx


def kept_counts(keep: Tensor, home: HomeLayout,
                exchange_counts: Callable[[Tensor], Tensor] | None) -> tuple[Tensor, Tensor | None]:
    """``(sent_I, recv_GS)``: the kept rows of each block and, with ``exchange_counts``,
    the rows each (source, slot) block sends this rank (else ``None``), both on the host.
    Counted and exchanged on the device, then read in one copy: the select stage's one
    host wait."""
    lengths = to_device(home.retain_I, keep.device)
    sent_dev = torch.segment_reduce(keep.double(), "sum", lengths=lengths, unsafe=True).long()
    recv_dev = (exchange_counts(sent_dev.reshape(home.splits_shape)) if exchange_counts
                else sent_dev.new_zeros(0))
    both = torch.cat((sent_dev, recv_dev.reshape(-1))).cpu()  # the one host wait
    B = sent_dev.numel()
    return both[:B], both[B:].reshape(home.splits_shape) if exchange_counts else None


