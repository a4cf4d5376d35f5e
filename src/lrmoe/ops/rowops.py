"""Row operations of the MoE layer's control plane, each one kernel on CUDA; the run
tables they read (:class:`Runs`) and a home layout's send positions (:func:`home_positions`,
compiled whole on CUDA by its caller).

Each is a torch reference (``*_reference``: what the CPU runs) and a Triton kernel
(:mod:`.rowops_triton`) registered as a custom op, sized from host arguments so nothing
waits for the device; ``LRMOE_NO_TRITON=1`` makes CUDA run the references. What is bit
for bit and what to fp32 rounding: docs/design.md §2, "Row kernels".

Legend: N source rows, R runs, T tokens, K top-k, P = T*K pairs, H row width.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lrmoe.ops.fused import gathered_dot, weighted_gather_sum

try:
    from torch.library import triton_op, wrap_triton

    from lrmoe.ops import rowops_triton as _k
except ImportError:  # no Triton on this install: the references serve every device
    _k = None

HAS_TRITON = _k is not None  # the custom operators exist (selection's too)
USE_TRITON = HAS_TRITON and os.environ.get("LRMOE_NO_TRITON") != "1"
# under Triton's interpreter (TRITON_INTERPRET=1) the kernels also serve CPU tensors: how
# they are checked on a machine without a GPU
INTERPRET = HAS_TRITON and _k.INTERPRET


def on_kernels(t: Tensor) -> bool:
    """Whether the Triton kernels serve ``t``: a CUDA tensor with Triton installed (or a
    CPU tensor under Triton's interpreter)."""
    return USE_TRITON and (t.is_cuda or (INTERPRET and t.device.type == "cpu"))


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """A small host tensor on ``device`` without a stream sync (staged in pinned memory,
    the copy queues behind the running kernels; a plain copy under a trace: Dynamo cannot
    trace ``pin_memory``)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device == device or torch.compiler.is_compiling():
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# ------------------------------------------------------------------------ gather_runs
def run_positions(dst_first_R: Tensor, src_first_R: Tensor, n_out: int) -> Tensor:
    """``src_first[k] + q - dst_first[k]`` for each ``q < n_out``, ``k`` the run holding
    ``q`` (the last with ``dst_first[k] <= q``): the source position of each output row."""
    q = torch.arange(n_out, device=dst_first_R.device, dtype=dst_first_R.dtype)
    k = (torch.searchsorted(dst_first_R, q, right=True) - 1).clamp(min=0)
    return src_first_R[k] + (q - dst_first_R[k])


def gather_runs_reference(src: Tensor, dst_first_R: Tensor, src_first_R: Tensor, n_out: int) -> Tensor:
    if n_out == 0:
        return src.new_empty((0,) + tuple(src.shape[1:]))
    return src[run_positions(dst_first_R, src_first_R, n_out)]


def gather_runs(src: Tensor, dst_first_R: Tensor, src_first_R: Tensor, n_out: int) -> Tensor:
    """Run-wise row copy: ``out[q] = src[src_first[k] + q - dst_first[k]]`` for the run ``k``
    holding ``q``; runs ordered by destination cover ``[0, n_out)`` (empty runs allowed).
    ``src`` is 1-D or rows ``[N, H]`` with unit column stride."""
    if on_kernels(src):
        return torch.ops.lrmoe.gather_runs(src, dst_first_R, src_first_R, n_out)
    return gather_runs_reference(src, dst_first_R, src_first_R, n_out)


@dataclass(frozen=True)
class Runs:
    """A row permutation made of contiguous chunks (:func:`gather_runs`): output rows
    ``[dst_first[k], dst_first[k+1])`` are source rows from ``src_first[k]`` on. The
    table lives on the device; ``n`` rows come out."""

    dst_first: Tensor
    src_first: Tensor
    n: int

    def apply(self, x: Tensor) -> Tensor:
        return gather_runs(x, self.dst_first, self.src_first, self.n)


def runs(starts, lengths, device: torch.device | str) -> Runs:
    """The chunks ``[starts[k], starts[k] + lengths[k])`` of a source, concatenated in
    order (host starts and lengths: one pinned copy of the table)."""
    return runs_many([(starts, lengths)], device)[0]


def runs_many(chunks: list[tuple], device: torch.device | str) -> list[Runs]:
    """:func:`runs` of several ``(starts, lengths)`` lists, in one copy to ``device``."""
    rows, n = [], []
    for st, ln in chunks:
        st, ln = np.asarray(st, dtype=np.int64), np.asarray(ln, dtype=np.int64)
        rows += [np.cumsum(ln) - ln, st]
        n.append(int(ln.sum()))
    sizes = [r.size for r in rows]
    flat = to_device(torch.from_numpy(np.concatenate(rows)), device).split(sizes)
    return [Runs(flat[2 * i], flat[2 * i + 1], n[i]) for i in range(len(chunks))]


# ---------------------------------------------------------------- invert_permutation
def invert_permutation_reference(perm_N: Tensor, n_out: int, fill: int | None = None) -> Tensor:
    dev, ar = perm_N.device, torch.arange(perm_N.numel(), device=perm_N.device)
    if fill is None:  # a full permutation: exactly n_out entries (what a caller may keep)
        return torch.empty(n_out, dtype=torch.long, device=dev).scatter_(0, perm_N.long(), ar)
    inv = torch.full((n_out + 1,), fill, dtype=torch.long, device=dev)
    idx = torch.where((perm_N >= 0) & (perm_N < n_out), perm_N.long(), n_out)
    return inv.scatter_(0, idx, ar)[:n_out]


def invert_permutation(perm_N: Tensor, n_out: int, fill: int | None = None) -> Tensor:
    """``inv[perm[i]] = i`` (int64, length ``n_out``), other positions ``fill`` (unspecified
    when None); entries outside ``[0, n_out)`` are ignored, the rest distinct. A plain store
    per entry: no atomics, no sort."""
    if on_kernels(perm_N):
        return torch.ops.lrmoe.invert_permutation(perm_N, n_out, fill)
    return invert_permutation_reference(perm_N, n_out, fill)


# -------------------------------------------------------------------------- combine
def combine_reference(src_NH: Tensor, row_TK: Tensor, w_TK: Tensor) -> Tensor:
    N = src_NH.shape[0]
    if N == 0:
        return src_NH.new_zeros(row_TK.shape[0], src_NH.shape[1])
    # a row past the end reads the last row with weight w * 0 (the runtime's clamp and mask)
    w = w_TK.float()
    return weighted_gather_sum(src_NH, row_TK.clamp(max=N - 1), torch.where(row_TK < N, w, w * 0.0))


def combine(src_NH: Tensor, row_TK: Tensor, w_TK: Tensor) -> Tensor:
    """``out[t] = sum_k w[t,k] * src[row[t,k]]`` in fp32 (k in order), in ``src``'s dtype;
    rows ``>= N`` (dropped pairs) weigh 0. Bit for bit the eager
    :func:`~lrmoe.ops.fused.weighted_gather_sum` over clamped rows and masked weights."""
    if on_kernels(src_NH):
        return torch.ops.lrmoe.combine(src_NH, row_TK, w_TK)
    return combine_reference(src_NH, row_TK, w_TK)


def combine_grad_gate_reference(src_NH: Tensor, row_TK: Tensor, d_TH: Tensor) -> Tensor:
    N = src_NH.shape[0]
    if N == 0:
        return torch.zeros(row_TK.shape, dtype=torch.float32, device=d_TH.device)
    return gathered_dot(src_NH, row_TK.clamp(max=N - 1), d_TH) * (row_TK < N).float()


def token_norm(d_TH: Tensor) -> Tensor:
    """``||d[t]||`` in fp32 (torch's reduction: the metric's norm, bit for bit)."""
    return torch.linalg.vector_norm(d_TH, dim=1, dtype=torch.float32)


def combine_grad_gate(src_NH: Tensor, row_TK: Tensor, d_TH: Tensor) -> Tensor:
    """``dot[t,k] = <d[t], src[row[t,k]]>`` in fp32, 0 for rows ``>= N``: the router
    gradient of each pair from the combined rows (fp32 rounding apart from the reference
    on CUDA: the kernel sums H in its own order)."""
    if on_kernels(src_NH):
        return torch.ops.lrmoe.combine_grad_gate(src_NH, row_TK, d_TH)
    return combine_grad_gate_reference(src_NH, row_TK, d_TH)


# ------------------------------------------------------------- send positions
def sort_key_by_expert_then_gate(idx_P: Tensor, gate_P: Tensor) -> Tensor:
    """An int64 key whose stable ascending sort orders pairs by expert, then by
    descending gate (ties in pair order): the expert in the high 32 bits, the gate's
    float32 bits made order-preserving (and flipped) in the low 32. float32 represents
    bf16/fp16 gates exactly; ``-0.0`` is folded into ``0.0`` so the two tie."""
    b = (gate_P.float() + 0.0).view(torch.int32).long()
    ordered = torch.where(b < 0, b ^ 0x7FFFFFFF, b)  # monotone in the float value
    return idx_P.long() * (1 << 32) + (0x7FFFFFFF - ordered)


def home_positions(idx_P: Tensor, gate_P: Tensor, first_N: Tensor, row0_N: Tensor,
                   j0_N: Tensor, like_send: Tensor,
                   by_gate: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The device part of :func:`lrmoe.parallel.stages.home_layout`:
    ``(send_row_P, src_pair_N, j_in_block_N)``.

    Per segment: its first sorted position (``first``), its first send row (``row0``;
    ``n_send`` for dropped pairs, which all land on that one spare row) and its first
    index inside its block (``j0``); ``n_send`` is ``len(like_send)`` (only its length is
    read). No host wait.
    """
    P, dev, n_send = idx_P.numel(), idx_P.device, like_send.shape[0]
    if by_gate and gate_P.dtype != torch.float64:
        order = torch.argsort(sort_key_by_expert_then_gate(idx_P, gate_P), stable=True)
    elif by_gate:  # float64 gates: two stable sorts keep their full order
        o1 = torch.argsort(gate_P, descending=True, stable=True)
        order = o1[torch.argsort(idx_P[o1], stable=True)]
    else:
        order = torch.argsort(idx_P, stable=True)
    p = torch.arange(P, device=dev)
    k = torch.searchsorted(first_N, p, right=True) - 1
    off, row0 = p - first_N[k], row0_N[k]
    dropped = row0 == n_send
    row = torch.where(dropped, row0, row0 + off)
    send_row = torch.empty_like(order)
    send_row[order] = row
    spare = int(P > n_send)  # dropped pairs all write one spare column, cut off after
    inv = torch.empty(2, n_send + spare, dtype=order.dtype, device=dev)
    inv[:, row] = torch.stack((order, j0_N[k] + off))
    if spare:  # copies: the kept buffers hold no spare entry (the ledger's pair_index)
        return send_row, inv[0, :n_send].clone(), inv[1, :n_send].clone()
    return send_row, inv[0], inv[1]


# ------------------------------------------------------------------- custom operators
if HAS_TRITON:
    @triton_op("lrmoe::gather_runs", mutates_args=())
    def _gather_runs_op(src: Tensor, dst_first_R: Tensor, src_first_R: Tensor, n_out: int) -> Tensor:
        return _k.launch_gather_runs(src, dst_first_R, src_first_R, n_out, wrap_triton)

    @triton_op("lrmoe::invert_permutation", mutates_args=())
    def _invert_op(perm_N: Tensor, n_out: int, fill: int | None) -> Tensor:
        return _k.launch_invert_permutation(perm_N, n_out, fill, wrap_triton)

    @triton_op("lrmoe::combine", mutates_args=())
    def _combine_op(src_NH: Tensor, row_TK: Tensor, w_TK: Tensor) -> Tensor:
        return _k.launch_combine(src_NH, row_TK, w_TK, wrap_triton)

    @triton_op("lrmoe::combine_grad_gate", mutates_args=())
    def _combine_grad_gate_op(src_NH: Tensor, row_TK: Tensor, d_TH: Tensor) -> Tensor:
        return _k.launch_combine_grad_gate(src_NH, row_TK, d_TH, wrap_triton)

    # a CPU tensor handed to an operator takes the reference (the interpreted kernel
    # under Triton's interpreter)
    def _cpu(op, reference, launch):
        op.register_kernel("cpu")(launch if INTERPRET else reference)

    _cpu(_gather_runs_op, gather_runs_reference, _k.launch_gather_runs)
    _cpu(_invert_op, invert_permutation_reference, _k.launch_invert_permutation)
    _cpu(_combine_op, combine_reference, _k.launch_combine)
    _cpu(_combine_grad_gate_op, combine_grad_gate_reference, _k.launch_combine_grad_gate)
