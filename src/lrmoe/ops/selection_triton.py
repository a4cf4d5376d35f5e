"""Triton kernels of lrmoe's backward selection (:mod:`lrmoe.ops.selection`), used on CUDA.

A selection kernel runs one program per block and writes, per row, whether it is kept
and its rank among its block's kept rows (``slot``), and per block how many; the
compaction kernel writes each kept row at its block's offset plus its slot. No kernel
sorts: how ``topk`` and ``sampled`` find their kept sets by a binary search over the
fp32 metrics' bits is docs/design.md §2, "Row kernels".

Legend: N candidate rows, B blocks, T tokens, H width, S selected rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lrmoe.ops.rowops_triton import INTERPRET, _as_rows, _search_steps, direct, last_at_or_below

# rows of a block scanned per step (the interpreter takes small chunks so that tiny tests
# cross chunk boundaries)
CHUNK = 32 if INTERPRET else 1024


@triton.jit
def metric_bits(tok_ptr, gate_ptr, norm_ptr, i, mask, GRAD_NORM: tl.constexpr):
    """The metric of rows ``i`` as the int32 bits of a non-negative fp32 (negatives and
    -0.0 read as +0.0): ``|gate| * norm[tok]`` (``grad_norm``) or ``gate`` (``gate``)."""
    g = tl.load(gate_ptr + i, mask=mask, other=0).to(tl.float32)
    if GRAD_NORM:
        tok = tl.load(tok_ptr + i, mask=mask, other=0)
        m = tl.abs(g) * tl.load(norm_ptr + tok, mask=mask, other=0.0)
    else:
        m = g
    return tl.maximum(m.to(tl.int32, bitcast=True), 0)


@triton.jit
def _bits_f64(bits):
    return bits.to(tl.float32, bitcast=True).to(tl.float64)


@triton.jit(do_not_specialize=["N"])
def _topk_metric_kernel(tok_ptr, gate_ptr, norm_ptr, bits_ptr, pmax_ptr, N, BLOCK: tl.constexpr,
                        GRAD_NORM: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    bits = metric_bits(tok_ptr, gate_ptr, norm_ptr, i, m, GRAD_NORM)
    tl.store(bits_ptr + i, bits, mask=m)
    tl.store(pmax_ptr + tl.program_id(0), tl.max(tl.where(m, bits, 0), axis=0))


@triton.jit(do_not_specialize=["n_pmax", "B"])
def _topk_select_kernel(bits_ptr, pmax_ptr, n_pmax, tab_ptr, B, keep_ptr, slot_ptr, sent_ptr,
                        CH: tl.constexpr):
    b = tl.program_id(0)
    first = tl.load(tab_ptr + b)
    n = tl.load(tab_ptr + B + b)
    q = tl.minimum(tl.load(tab_ptr + 2 * B + b), n)
    mx = tl.zeros([], dtype=tl.int32)
    for j in range(0, n_pmax, CH):
        jj = j + tl.arange(0, CH)
        mx = tl.maximum(mx, tl.max(tl.load(pmax_ptr + jj, mask=jj < n_pmax, other=0), axis=0))
    mp = _bits_f64(mx) + 1e-300
    bf = b.to(tl.float64)
    # the q-th largest metric: the largest t with #{bits >= t} >= q
    lo = tl.zeros([], dtype=tl.int64)
    hi = lo + 0x7F800001  # past the bits of +inf: above every metric
    for _ in range(31):
        mid = (lo + hi) // 2
        cnt = tl.zeros([], dtype=tl.int32)
        for c0 in range(0, n, CH):
            i = c0 + tl.arange(0, CH)
            x = tl.load(bits_ptr + first + i, mask=i < n, other=0)
            cnt += tl.sum(((i < n) & (x >= mid)).to(tl.int32), axis=0)
        lo = tl.where(cnt >= q, mid, lo)
        hi = tl.where(cnt >= q, hi, mid)
    kstar = bf + 0.5 * (1.0 - _bits_f64(lo.to(tl.int32)) / mp)
    below = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, n, CH):
        i = c0 + tl.arange(0, CH)
        key = bf + 0.5 * (1.0 - _bits_f64(tl.load(bits_ptr + first + i, mask=i < n, other=0)) / mp)
        below += tl.sum(((i < n) & (key < kstar)).to(tl.int32), axis=0)
    need = q - below  # rows of key == kstar to keep, in row order
    n_eq = tl.zeros([], dtype=tl.int32)
    n_kept = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, n, CH):
        i = c0 + tl.arange(0, CH)
        im = i < n
        key = bf + 0.5 * (1.0 - _bits_f64(tl.load(bits_ptr + first + i, mask=im, other=0)) / mp)
        eq = im & (key == kstar)
        eq_rank = n_eq + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        sel = (im & (key < kstar)) | (eq & (eq_rank < need))
        sel = sel & (q > 0)
        rank = n_kept + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(slot_ptr + first + i, tl.where(sel, rank, -1), mask=im)
        tl.store(keep_ptr + first + i, sel.to(tl.int8), mask=im)
        n_eq += tl.sum(eq.to(tl.int32), axis=0)
        n_kept += tl.sum(sel.to(tl.int32), axis=0)
    tl.store(sent_ptr + b, n_kept.to(tl.int64))


@triton.jit(do_not_specialize=["B"])
def _sampled_select_kernel(tok_ptr, gate_ptr, norm_ptr, u_ptr, tab_ptr, B, pi_ptr, keep_ptr,
                           slot_ptr, sent_ptr, CH: tl.constexpr, GRAD_NORM: tl.constexpr):
    b = tl.program_id(0)
    first = tl.load(tab_ptr + b)
    n = tl.load(tab_ptr + B + b)
    q = tl.load(tab_ptr + 2 * B + b).to(tl.float64)
    # the smallest bits t with F(t) > 0: rows with bits >= t are capped at pi = 1
    lo = tl.zeros([], dtype=tl.int64)
    hi = lo + 0x7F800000  # the bits of +inf: no finite metric capped
    for _ in range(31):
        mid = (lo + hi) // 2
        cnt = tl.zeros([], dtype=tl.int32)
        low = tl.zeros([], dtype=tl.float64)
        for c0 in range(0, n, CH):
            i = c0 + tl.arange(0, CH)
            im = i < n
            bits = metric_bits(tok_ptr, gate_ptr, norm_ptr, first + i, im, GRAD_NORM)
            ge = im & (bits >= mid)
            cnt += tl.sum(ge.to(tl.int32), axis=0)
            low += tl.sum(tl.where(im & ~ge, _bits_f64(bits), 0.0), axis=0)
        f = (q - cnt.to(tl.float64)) * _bits_f64(mid.to(tl.int32)) - low
        hi = tl.where(f > 0, mid, hi)
        lo = tl.where(f > 0, lo, mid)
    capped = tl.zeros([], dtype=tl.int32)
    mass = tl.zeros([], dtype=tl.float64)
    for c0 in range(0, n, CH):
        i = c0 + tl.arange(0, CH)
        im = i < n
        bits = metric_bits(tok_ptr, gate_ptr, norm_ptr, first + i, im, GRAD_NORM)
        capped += tl.sum((im & (bits >= hi)).to(tl.int32), axis=0)
        mass += tl.sum(tl.where(im & (bits < hi), _bits_f64(bits), 0.0), axis=0)
    # the reference's free rows: rem * m / mass, or rem / n_free when they carry no mass
    rem = tl.maximum(q - capped.to(tl.float64), 0.0)
    has = mass > 0
    per_mass = tl.where(has, rem / tl.where(has, mass, 1.0), 0.0)
    uniform = tl.where(has, 0.0, rem / tl.maximum((n - capped).to(tl.float64), 1.0))
    n_kept = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, n, CH):
        i = c0 + tl.arange(0, CH)
        im = i < n
        bits = metric_bits(tok_ptr, gate_ptr, norm_ptr, first + i, im, GRAD_NORM)
        p = tl.minimum(tl.maximum(per_mass * _bits_f64(bits) + uniform, 0.0), 1.0)
        p = tl.where(bits >= hi, 1.0, p)
        keep = im & (tl.load(u_ptr + first + i, mask=im, other=1.0) < p)
        rank = n_kept + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(pi_ptr + first + i, p, mask=im)
        tl.store(slot_ptr + first + i, tl.where(keep, rank, -1), mask=im)
        tl.store(keep_ptr + first + i, keep.to(tl.int8), mask=im)
        n_kept += tl.sum(keep.to(tl.int32), axis=0)
    tl.store(sent_ptr + b, n_kept.to(tl.int64))


@triton.jit(do_not_specialize=["B", "steps", "N"])
def _compact_kernel(slot_ptr, tab_ptr, B, steps, sent_ptr, tok_ptr, g_ptr, pi_ptr, d_ptr,
                    sel_ptr, tok_out_ptr, scale_ptr, dy_ptr, N, H, d_stride, dy_stride,
                    BP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                    SAMPLED: tl.constexpr, DY: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    im = i < N
    slot = tl.load(slot_ptr + i, mask=im, other=-1)
    kept = im & (slot >= 0)
    b = last_at_or_below(tab_ptr, B, i, steps)  # tab's first row: the blocks' first rows
    jb = tl.arange(0, BP)
    sent = tl.load(sent_ptr + jb, mask=jb < B, other=0)
    start = tl.gather(tl.cumsum(sent, axis=0) - sent, b.to(tl.int32), axis=0)
    pos = start + slot
    tok = tl.load(tok_ptr + i, mask=kept, other=0)
    g = tl.load(g_ptr + i, mask=kept, other=0.0)
    if SAMPLED:  # the Horvitz-Thompson weight 1/pi, in float64, then fp32 as the reference
        g = g * (1.0 / tl.maximum(tl.load(pi_ptr + i, mask=kept, other=1.0), 1e-12)).to(tl.float32)
    tl.store(sel_ptr + pos, i, mask=kept)
    tl.store(tok_out_ptr + pos, tok, mask=kept)
    tl.store(scale_ptr + pos, g, mask=kept)
    if DY:
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            m = kept[:, None] & (h[None, :] < H)
            v = tl.load(d_ptr + tok[:, None].to(tl.int64) * d_stride + h[None, :], mask=m)
            tl.store(dy_ptr + pos[:, None] * dy_stride + h[None, :], v, mask=m)


def launch_topk_select(metric: str, tok_N: Tensor, gate_N: Tensor, norm_T: Tensor | None,
                       tab_3B: Tensor, wrap=direct) -> tuple[Tensor, Tensor, Tensor]:
    """``(keep_N, slot_N, sent_B)`` of the top-k estimator (two kernels)."""
    N, B, dev = tok_N.numel(), tab_3B.shape[1], tok_N.device
    keep = torch.empty(N, dtype=torch.bool, device=dev)
    slot = torch.empty(N, dtype=torch.int32, device=dev)
    sent = torch.empty(B, dtype=torch.long, device=dev)
    if B == 0:
        return keep, slot, sent
    grad_norm = metric == "grad_norm"
    norm = norm_T if grad_norm else gate_N  # unread for the gate metric
    n_pmax = max(triton.cdiv(N, CHUNK), 1)
    bits = torch.empty(N, dtype=torch.int32, device=dev)
    pmax = torch.zeros(n_pmax, dtype=torch.int32, device=dev) if N == 0 else \
        torch.empty(n_pmax, dtype=torch.int32, device=dev)
    if N:
        wrap(_topk_metric_kernel)[(n_pmax,)](tok_N, gate_N, norm, bits, pmax, N, BLOCK=CHUNK,
                                             GRAD_NORM=grad_norm)
    wrap(_topk_select_kernel)[(B,)](bits, pmax, n_pmax, tab_3B, B, keep.view(torch.int8), slot, sent,
                                    CH=CHUNK)
    return keep, slot, sent


def launch_sampled_select(metric: str, tok_N: Tensor, gate_N: Tensor, norm_T: Tensor | None,
                          u_N: Tensor, tab_3B: Tensor, wrap=direct) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(pi_N, keep_N, slot_N, sent_B)`` of the sampled estimator, given the uniform
    draws ``u_N`` (one kernel)."""
    N, B, dev = tok_N.numel(), tab_3B.shape[1], tok_N.device
    pi = torch.empty(N, dtype=torch.float64, device=dev)
    keep = torch.empty(N, dtype=torch.bool, device=dev)
    slot = torch.empty(N, dtype=torch.int32, device=dev)
    sent = torch.empty(B, dtype=torch.long, device=dev)
    if B:
        grad_norm = metric == "grad_norm"
        norm = norm_T if grad_norm else gate_N  # unread for the gate metric
        wrap(_sampled_select_kernel)[(B,)](tok_N, gate_N, norm, u_N, tab_3B, B, pi,
                                           keep.view(torch.int8), slot, sent, CH=CHUNK,
                                           GRAD_NORM=grad_norm)
    return pi, keep, slot, sent


def launch_compact(slot_N: Tensor, tab_3B: Tensor, sent_B: Tensor, tok_N: Tensor, g_N: Tensor,
                   pi_N: Tensor | None, dout_TH: Tensor | None, n_sel: int, wrap=direct,
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(sel_idx_S, tok_S, scale_S, dy_SH)`` (one kernel); ``dy`` is ``[0, 0]`` without
    ``dout_TH`` (an operator returns tensors only)."""
    dev, N, B = slot_N.device, slot_N.numel(), tab_3B.shape[1]
    sel = torch.empty(n_sel, dtype=torch.long, device=dev)
    tok = torch.empty(n_sel, dtype=tok_N.dtype, device=dev)
    scale = torch.empty(n_sel, dtype=torch.float32, device=dev)
    dy = scale.new_empty(0, 0) if dout_TH is None else dout_TH.new_empty(n_sel, dout_TH.shape[1])
    if n_sel == 0:
        return sel, tok, scale, dy
    # without DY the row arguments are unread: g_N stands in for them, one column wide
    d2, dy2 = (g_N, g_N) if dout_TH is None else (_as_rows(dout_TH), _as_rows(dy))
    H = 1 if dout_TH is None else d2.shape[1]
    bn, bh = 32, min(triton.next_power_of_2(int(H)), 1024)
    wrap(_compact_kernel)[(triton.cdiv(N, bn),)](
        slot_N, tab_3B, B, _search_steps(B), sent_B, tok_N, g_N, g_N if pi_N is None else pi_N, d2,
        sel, tok, scale, dy2, N, H, d2.stride(0), dy2.stride(0), BP=triton.next_power_of_2(int(B)),
        BLOCK_N=bn, BLOCK_H=bh, SAMPLED=pi_N is not None, DY=dout_TH is not None)
    return sel, tok, scale, dy

