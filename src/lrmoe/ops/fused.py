"""Fused elementwise helpers: torch.compile'd on CUDA, eager everywhere else
(``LRMOE_NO_COMPILE=1``: eager on CUDA too).

Only the leading (row) dimension is dynamic; widths compile as constants, one graph per
width: with every dimension symbolic the kernels divide flat indices by a runtime width,
and the SwiGLU kernels ran ~2.5x slower on an H200 (``benchmarks/JOURNAL.md``). Calls with
0 or 1 rows run eager: Dynamo specializes those sizes, so each would compile a graph of its
own (about a second on an H200) at whichever step first met it. Eager and compiled agree to
rounding, not bit for bit.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import Tensor

_COMPILED: dict[str, object] = {}


def fused(name: str, fn, x: Tensor):
    """The callable to use for ``fn`` on ``x``'s device (see module doc)."""
    if not x.is_cuda or os.environ.get("LRMOE_NO_COMPILE") == "1" or _COMPILED.get(name) is False:
        return fn
    if name not in _COMPILED:
        try:
            compiled = rows_dynamic(fn)
        except Exception as e:  # no compiler on this install
            warnings.warn(f"torch.compile unavailable ({e}); using eager {name}", stacklevel=2)
            _COMPILED[name] = False
            return fn

        def safe(*args, _c=compiled, _n=name, _f=fn):
            try:
                return _c(*args)
            except Exception as e:  # a compiler failure must not change results
                warnings.warn(f"compiled {_n} failed ({type(e).__name__}); using eager", stacklevel=2)
                _COMPILED[_n] = False
                return _f(*args)
        _COMPILED[name] = safe
    return _COMPILED[name]


def rows_dynamic(fn, backend: str = "inductor"):
    """``fn`` compiled with each tensor argument's dim 0 dynamic and every other dim
    static (see module doc): rows change every step, widths never do."""
    compiled = torch.compile(fn, dynamic=False, backend=backend)

    def call(*args):
        if torch.compiler.is_compiling() or _few_rows(args):  # see module doc
            return fn(*args)
        for a in args:
            if isinstance(a, Tensor) and a.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return compiled(*args)
    return call


def _few_rows(args) -> bool:
    return any(isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] < 2 for a in args)


def weighted_gather_sum(src_NH: Tensor, row_TK: Tensor, w_TK: Tensor) -> Tensor:
    """``out[t] = sum_k w[t,k] * src[row[t,k]]`` in fp32, returned in ``src``'s dtype; an
    unrolled sum over k, so the compiler emits one pointwise kernel."""
    w = w_TK.float()
    acc = src_NH[row_TK[:, 0]].float() * w[:, 0:1]
    for k in range(1, row_TK.shape[1]):
        acc = acc + src_NH[row_TK[:, k]].float() * w[:, k:k + 1]
    return acc.to(src_NH.dtype)


def gathered_dot(src_NH: Tensor, row_TK: Tensor, d_TH: Tensor) -> Tensor:
    """``out[t,k] = <d[t], src[row[t,k]]>`` in fp32."""
    return (src_NH[row_TK].float() * d_TH.float().unsqueeze(1)).sum(-1)
