"""Triton kernels of the row operations in :mod:`lrmoe.ops.rowops` (used on CUDA).

Each ``launch_*`` allocates its outputs from host sizes and launches one kernel; ``wrap``
is ``torch.library.wrap_triton`` under the custom ops, or the kernel itself under
Triton's interpreter (CPU tensors). :func:`launch_combine` rounds each product to fp32
(``mul.rn``: never fused into an FMA) and bf16 outputs to nearest-even, as the eager ops.

Legend: N source rows, R runs, T tokens, K top-k, P = T*K pairs, H row width.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# rounded fp32 products through PTX (NVIDIA only; elsewhere plain products)
EXACT_MUL = not INTERPRET and torch.version.hip is None


def direct(kernel):
    """The launcher of a kernel called directly (eager, or the interpreter)."""
    return kernel


def _search_steps(n) -> int:
    """Steps of :func:`last_at_or_below` over ``n`` sorted entries (32, enough for any
    table, when ``n`` is symbolic under ``torch.compile``)."""
    return max(n, 1).bit_length() if isinstance(n, int) else 32


def _rows_tile(H) -> tuple[int, int]:
    """``(BLOCK_Q, BLOCK_H)`` for copying rows of width ``H``: 1-D data as long strips,
    rows as up to 1,024-wide chunks (2 KB of bf16). Widths are compile-time constants
    (``int`` specialises a symbolic width: it never changes within a run)."""
    H = int(H)
    if H == 1:
        return 1024, 1
    bh = min(triton.next_power_of_2(H), 1024)
    return max(1, 4096 // bh), bh


@triton.jit
def last_at_or_below(first_ptr, n, q, steps):
    """Per lane, the last ``k < n`` with ``first[k] <= q`` (``first`` sorted ascending;
    0 when none): a binary search of ``steps`` rounds (``steps >= log2(n) + 1``)."""
    lo = tl.zeros_like(q)
    hi = lo + n
    for _ in range(steps):
        mid = (lo + hi) // 2
        ok = (tl.load(first_ptr + mid, mask=mid < hi, other=0) <= q) & (mid < hi)
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, tl.where(mid < hi, mid, hi))
    return lo


@triton.jit
def load_f32(ptr, offs, mask, BF16: tl.constexpr):
    """Values at ``ptr + offs`` as fp32; bf16 is read as its int16 bits and widened
    exactly (``ptr`` then points at an int16 view)."""
    if BF16:
        b = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (b << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0).to(tl.float32)


@triton.jit
def bf16_bits(x):
    """fp32 -> bf16 rounded to nearest, ties to even (torch's rounding; NaN -> 0x7FC0),
    as int16 bits."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    return r.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def mul_rn(a, b, EXACT: tl.constexpr):
    """``a * b`` rounded to fp32 on its own (never contracted into an FMA with a later add)."""
    if EXACT:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return a * b


@triton.jit(do_not_specialize=["n_out", "n_runs", "steps"])
def _gather_runs_kernel(src_ptr, out_ptr, dst_first_ptr, src_first_ptr, n_out, n_runs, steps,
                        H, src_stride, out_stride, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr):
    q = tl.program_id(0).to(tl.int64) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    qm = q < n_out
    k = last_at_or_below(dst_first_ptr, n_runs, q, steps)
    s = (tl.load(src_first_ptr + k, mask=qm, other=0) + q
         - tl.load(dst_first_ptr + k, mask=qm, other=0)).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        m = qm[:, None] & (h[None, :] < H)
        v = tl.load(src_ptr + s[:, None] * src_stride + h[None, :], mask=m)
        tl.store(out_ptr + q[:, None] * out_stride + h[None, :], v, mask=m)


def _as_rows(x: Tensor) -> Tensor:
    """``x`` as 2-D rows with unit column stride, bf16 as its int16 bits: the interpreter has
    no bf16 arithmetic, a copy needs none, and the arithmetic kernels widen the bits
    themselves (:func:`load_f32`, :func:`bf16_bits`)."""
    x2 = x.view(-1, 1) if x.dim() == 1 else x
    return x2.view(torch.int16) if x2.dtype == torch.bfloat16 else x2


def launch_gather_runs(src: Tensor, dst_first_R: Tensor, src_first_R: Tensor, n_out: int,
                       wrap=direct) -> Tensor:
    out = src.new_empty((n_out,) + tuple(src.shape[1:]))
    if n_out == 0:
        return out
    s2, o2 = _as_rows(src), _as_rows(out)
    H = s2.shape[1]
    bq, bh = _rows_tile(H)
    R = dst_first_R.numel()
    wrap(_gather_runs_kernel)[(triton.cdiv(n_out, bq),)](
        s2, o2, dst_first_R, src_first_R, n_out, R, _search_steps(R), H, s2.stride(0),
        o2.stride(0), BLOCK_Q=bq, BLOCK_H=bh)
    return out


@triton.jit(do_not_specialize=["n", "n_out"])
def _invert_kernel(perm_ptr, inv_ptr, n, n_out, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    p = tl.load(perm_ptr + i, mask=m, other=-1).to(tl.int64)
    tl.store(inv_ptr + p, i, mask=m & (p >= 0) & (p < n_out))


def launch_invert_permutation(perm_N: Tensor, n_out: int, fill: int | None, wrap=direct) -> Tensor:
    dev = perm_N.device
    inv = (torch.empty(n_out, dtype=torch.long, device=dev) if fill is None
           else torch.full((n_out,), fill, dtype=torch.long, device=dev))
    n = perm_N.numel()
    if n and n_out:
        wrap(_invert_kernel)[(triton.cdiv(n, 1024),)](perm_N, inv, n, n_out, BLOCK=1024)
    return inv


@triton.jit(do_not_specialize=["T", "N"])
def _combine_kernel(src_ptr, row_ptr, w_ptr, out_ptr, T, N, H, src_stride, out_stride,
                    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                    IN_BF16: tl.constexpr, OUT_BF16: tl.constexpr, EXACT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tm = t < T
    m = tm[:, None] & (h[None, :] < H)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(K):
        r = tl.load(row_ptr + t * K + k, mask=tm, other=0).to(tl.int64)
        w = tl.load(w_ptr + t * K + k, mask=tm, other=0).to(tl.float32)
        # a row past the source (a dropped pair) reads the last row with weight w * 0,
        # as the clamped row and 0/1 mask of the torch path do (so even the zero's sign agrees)
        w = tl.where(r < N, w, w * 0.0)
        r = tl.minimum(r, N - 1)
        x = load_f32(src_ptr, r[:, None] * src_stride + h[None, :], m, IN_BF16)
        p = mul_rn(x, w[:, None], EXACT)
        if k == 0:
            acc = p
        else:
            acc = acc + p
    o = t[:, None] * out_stride + h[None, :]
    if OUT_BF16:
        tl.store(out_ptr + o, bf16_bits(acc), mask=m)
    else:
        tl.store(out_ptr + o, acc.to(out_ptr.dtype.element_ty), mask=m)


def launch_combine(src_NH: Tensor, row_TK: Tensor, w_TK: Tensor, wrap=direct) -> Tensor:
    T, K = row_TK.shape
    N, H = src_NH.shape
    out = src_NH.new_empty(T, H)
    if T == 0 or H == 0:
        return out
    if N == 0:
        return out.zero_()
    bf16 = src_NH.dtype == torch.bfloat16
    s, o = _as_rows(src_NH), _as_rows(out)  # bf16 read and written as its int16 bits
    K, bh = int(K), min(triton.next_power_of_2(int(H)), 512)
    bt = max(1, 2048 // bh)
    wrap(_combine_kernel)[(triton.cdiv(T, bt), triton.cdiv(H, bh))](
        s, row_TK.contiguous(), w_TK.contiguous(), o, T, N, H, s.stride(0), o.stride(0), K=K,
        BLOCK_T=bt, BLOCK_H=bh, IN_BF16=bf16, OUT_BF16=bf16, EXACT=EXACT_MUL)
    return out


@triton.jit(do_not_specialize=["T", "N"])
def _combine_dot_kernel(src_ptr, row_ptr, d_ptr, dot_ptr, T, N, H, src_stride, d_stride,
                        K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_H: tl.constexpr, SRC_BF16: tl.constexpr, D_BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    kk = tl.arange(0, KP)
    acc = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        m = tm[:, None] & (h[None, :] < H)
        d = load_f32(d_ptr, t[:, None] * d_stride + h[None, :], m, D_BF16)
        for k in tl.static_range(K):
            r = tl.load(row_ptr + t * K + k, mask=tm, other=0).to(tl.int64)
            ok = r < N
            x = load_f32(src_ptr, tl.minimum(r, N - 1)[:, None] * src_stride + h[None, :],
                         m & ok[:, None], SRC_BF16)
            part = tl.sum(d * tl.where(ok[:, None], x, 0.0), axis=1)
            acc += tl.where(kk[None, :] == k, part[:, None], 0.0)
    tl.store(dot_ptr + t[:, None] * K + kk[None, :], acc, mask=tm[:, None] & (kk[None, :] < K))


def launch_combine_grad_gate(src_NH: Tensor, row_TK: Tensor, d_TH: Tensor, wrap=direct) -> Tensor:
    T, K = row_TK.shape
    H = d_TH.shape[1]
    dot = torch.empty(T, K, dtype=torch.float32, device=d_TH.device)
    if T == 0:
        return dot
    sb, db = src_NH.dtype == torch.bfloat16, d_TH.dtype == torch.bfloat16
    s, d = _as_rows(src_NH), _as_rows(d_TH)  # bf16 read as its int16 bits
    K, bh, bt = int(K), min(triton.next_power_of_2(max(int(H), 1)), 256), 16
    # with no source rows (N = 0) every row is past the end: each dot is 0
    wrap(_combine_dot_kernel)[(triton.cdiv(T, bt),)](
        s, row_TK.contiguous(), d, dot, T, src_NH.shape[0], H, s.stride(0), d.stride(0), K=K,
        KP=triton.next_power_of_2(K), BLOCK_T=bt, BLOCK_H=bh, SRC_BF16=sb, D_BF16=db)
    return dot
