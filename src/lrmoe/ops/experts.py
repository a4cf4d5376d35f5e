"""SwiGLU experts as variable-size grouped GEMMs (stage ``experts``).

Legend: R rows (pairs, in contiguous per-instance segments), I instances, H hidden, F
expert width. Weights in HF's fused layout: ``w13_IFH`` is ``gate_up_proj [I, 2F, H]``
(gate rows, then up), ``w2_IHF`` ``down_proj [I, H, F]``; ``counts_I`` the segment sizes,
``offs_I`` their inclusive cumulative sums (int32, as grouped_mm expects). ``counts`` may
be ``None`` where only the device holds them: the grouped GEMM reads ``offs`` alone, the
per-expert loop fallback reads the counts off ``offs`` once (:func:`counts_from_offsets`).
Plain functions, not autograd: the backward sees a compacted subset of the rows. The
per-instance loop reference: ``tests/references/moe.py``.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from lrmoe.ops.fused import fused as _fused
from lrmoe.ops.rowops import to_device

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_GROUPED_BROKEN: set[tuple] = set()


def _grouped_ok(a: Tensor, b: Tensor) -> bool:
    """Whether torch's grouped GEMM accepts these operands (else we take the loop)."""
    if _grouped_mm is None or a.dtype != b.dtype:
        return False
    if a.dtype not in (torch.float32, torch.bfloat16) or (a.is_cuda and a.dtype != torch.bfloat16):
        return False
    if (a.device.type, a.dtype) in _GROUPED_BROKEN:
        return False
    # grouped_mm needs 16-byte aligned strides on every operand.
    es = a.element_size()
    return all(t.data_ptr() % 16 == 0 and all(s == 1 or s * es % 16 == 0 for s in t.stride())
               for t in (a, b))


def counts_from_offsets(offs_I: Tensor) -> list[int]:
    """Rows per instance as host ints from the inclusive offsets: one device-to-host copy,
    which only the per-expert loop pays."""
    ends = offs_I.tolist()
    return [b - a for a, b in zip([0, *ends[:-1]], ends)]


def _loop_counts(counts: list[int] | None, offs: Tensor, a: Tensor, b: Tensor
                 ) -> list[int] | None:
    """``counts``, read from ``offs`` if only the device has them and the per-expert loop
    is to run on ``a``, ``b`` (once for the GEMMs of a direction); else as given."""
    if counts is None and not _grouped_ok(a, b):
        return counts_from_offsets(offs)
    return counts


def _gmm(a: Tensor, b: Tensor, offs: Tensor, counts: list[int] | None) -> Tensor:
    """Grouped matmul: ``a [R, K] x b [I, K, N] -> [R, N]`` or ``a [K, R] x b [R, N] -> [I, K, N]``.

    Falls back to the per-instance loop when grouped_mm is unavailable for the operands.
    """
    if _grouped_ok(a, b):
        try:
            return _grouped_mm(a, b, offs=offs)
        except RuntimeError as e:  # unsupported on this build/device: remember, then loop
            _GROUPED_BROKEN.add((a.device.type, a.dtype))
            warnings.warn(f"grouped_mm unavailable ({e}); using the per-expert loop", stacklevel=2)
    return _loop_mm(a, b, counts if counts is not None else counts_from_offsets(offs))


def _loop_mm(a: Tensor, b: Tensor, counts: list[int]) -> Tensor:
    if b.dim() == 3:  # [R, K] x [I, K, N]
        outs, start = [], 0
        for i, n in enumerate(counts):
            outs.append(a[start:start + n] @ b[i])
            start += n
        return torch.cat(outs) if outs else a.new_zeros(0, b.shape[-1])
    # [K, R] x [R, N] -> [I, K, N]
    out = a.new_zeros(len(counts), a.shape[0], b.shape[1])
    start = 0
    for i, n in enumerate(counts):
        if n:
            out[i] = a[:, start:start + n] @ b[start:start + n]
        start += n
    return out


def _act_eager(gu: Tensor) -> Tensor:
    Fd = gu.shape[1] // 2
    return F.silu(gu[:, :Fd]) * gu[:, Fd:]


def _act_scaled_eager(gu: Tensor, scale: Tensor) -> Tensor:
    """``scale[r] * silu(g) * u``: the activation with each row's output-gradient scale."""
    Fd = gu.shape[1] // 2
    return (F.silu(gu[:, :Fd].float()) * gu[:, Fd:].float() * scale[:, None]).to(gu.dtype)


def _dgu(d: Tensor, g: Tensor, u: Tensor, sg: Tensor, dtype: torch.dtype) -> Tensor:
    """``d(silu(g) * u) / d[g, u]`` in fp32 given the activation gradient ``d`` and
    ``sg = sigmoid(g)``, cast to ``dtype``."""
    dg = d * u * (sg * (1 + g * (1 - sg)))
    du = d * g * sg
    return torch.cat((dg, du), dim=1).to(dtype)


def _act_grad_eager(dact: Tensor, gu: Tensor, scale: Tensor | None = None) -> Tensor:
    """``d(silu(g) * u) / d[g, u]`` given the activation gradient (times ``scale[r]``)."""
    Fd = gu.shape[1] // 2
    g, u = gu[:, :Fd].float(), gu[:, Fd:].float()
    d = dact.float() if scale is None else dact.float() * scale[:, None]
    return _dgu(d, g, u, torch.sigmoid(g), gu.dtype)


def _act_grad_rowdot_eager(dact: Tensor, gu: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`_act_grad_eager` with the scale, plus ``<dact[r], silu(g) * u>`` per row
    (fp32): with ``dact = dy @ w2`` that is ``<dy[r], y[r]>``, the router gradient of the
    row's pair, so the combined expert output need not be kept for it. One sigmoid and
    one widening of ``g``, ``u`` and ``dact`` serve both."""
    Fd = gu.shape[1] // 2
    g, u = gu[:, :Fd].float(), gu[:, Fd:].float()
    sg = torch.sigmoid(g)
    d = dact.float()
    rowdot = (d * (g * sg * u)).sum(1)
    return _dgu(d * scale[:, None], g, u, sg, gu.dtype), rowdot


def offsets(counts: list[int], device: torch.device) -> Tensor:
    """``offs_I`` on ``device`` from host ``counts`` (int32 inclusive cumsum, one pinned
    copy: no stream sync)."""
    return to_device(torch.tensor(counts, dtype=torch.long).cumsum(0).to(torch.int32), device)


def gate_up(x_RH: Tensor, w13_IFH: Tensor, counts: list[int] | None,
            offs: Tensor | None = None) -> Tensor:
    """``gu_R2F``: the gate/up pre-activation of rows grouped by instance (``counts``, or
    ``offs`` alone)."""
    if offs is None:
        offs = offsets(counts, x_RH.device)
    return _gmm(x_RH, w13_IFH.transpose(1, 2), offs, counts)


def swiglu_forward(x_RH: Tensor, w13_IFH: Tensor, w2_IHF: Tensor, counts: list[int] | None,
                   offs: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Returns ``(y_RH, gu_R2F)``; ``gu`` is the gate/up pre-activation saved for backward."""
    if offs is None:
        offs = offsets(counts, x_RH.device)
    # w13 itself, not the transposed view gate_up multiplies by: the same pointer and
    # strides (permuted), so the same verdict, without a view op a call
    counts = _loop_counts(counts, offs, x_RH, w13_IFH)
    gu = gate_up(x_RH, w13_IFH, counts, offs)
    act = _fused("act", _act_eager, gu)(gu)
    y = _gmm(act, w2_IHF.transpose(1, 2), offs, counts)
    return y, gu


def swiglu_backward(rows: dict[str, Tensor], w13_IFH: Tensor, w2_IHF: Tensor,
                    counts: list[int] | None, offs: Tensor | None = None,
                    scale: Tensor | None = None, rowdot: bool = False) -> tuple:
    """``(dx_RH, dw13_IFH, dw2_IHF)`` for rows ``x`` with saved ``gu`` and output gradient
    ``scale[r] * dy[r]`` (``scale`` None: 1); with ``rowdot`` also ``dot_R = <dy[r], y[r]>``
    (fp32). Only the given rows contribute. ``rows = {"x": x_RH, "gu": gu_R2F, "dy": dy_RH}``
    is handed over: the dict is emptied and each row tensor is dropped at its last use
    (``act`` after dw2, ``dy`` after ``dact``, ``gu`` and ``dact`` after ``dgu``, ``x``
    after dw13), so a caller that holds no other reference gets that memory back there:
    at the dx GEMM only ``dgu`` and ``dx`` are alive. Same kernels, same order."""
    x_RH, gu_R2F, dy_RH = rows.pop("x"), rows.pop("gu"), rows.pop("dy")
    if offs is None:
        offs = offsets(counts, x_RH.device)
    counts = _loop_counts(counts, offs, dy_RH, w2_IHF)
    if scale is None:
        act = _fused("act", _act_eager, gu_R2F)(gu_R2F)
    else:
        act = _fused("act_scaled", _act_scaled_eager, gu_R2F)(gu_R2F, scale.float())
    dw2 = _gmm(dy_RH.t(), act, offs, counts)               # [I, H, F]
    del act
    dact = _gmm(dy_RH, w2_IHF, offs, counts)              # [R, F]
    del dy_RH
    dot = None
    if scale is None:
        dgu = _fused("act_grad", _act_grad_eager, gu_R2F)(dact, gu_R2F)  # [R, 2F]
    elif rowdot:
        dgu, dot = _fused("act_grad_rowdot", _act_grad_rowdot_eager, gu_R2F)(dact, gu_R2F, scale.float())
    else:
        dgu = _fused("act_grad_scaled", _act_grad_eager, gu_R2F)(dact, gu_R2F, scale.float())
    del dact, gu_R2F
    dw13 = _gmm(dgu.t(), x_RH, offs, counts)               # [I, 2F, H]
    del x_RH
    dx = _gmm(dgu, w13_IFH, offs, counts)                  # [R, H]
    return (dx, dw13, dw2, dot) if rowdot else (dx, dw13, dw2)
