"""Which row tensors are alive, at every point of a backward, on the CPU (test helper).

Ground truth for ``Ledger.rows_buffer_bytes`` and for the exchange's early frees: while
a :class:`LiveRows` is active, a ``TorchDispatchMode`` registers a weak reference to the
storage of every tensor an op creates (a storage's Python object lives exactly as long
as the storage), and the bytes of the registered *row* storages still alive are summed
at every **point**:

* every line (and return) of the traced functions (the exchange's backward and the
  functions it hands its rows to), i.e. after each statement, before the next frees
  anything;
* every op called from a traced function or from a seam (``permute_rows``,
  ``all_to_all``...), i.e. while the op's inputs and its output coexist (a statement
  like ``rows["x"] = rows["x"][idx]`` frees its input before the next line).

Ops inside the fused elementwise helpers and inside a GEMM are not points: their CPU
temporaries die within the call and are one kernel on the GPU. Rows are 2-D floating
tensors of one of the given widths (``H``, ``F``, ``2F``: what the ledger prices; index
vectors and ``[E, 2F, H]`` weight gradients are not rows). Storages alive when the
helper starts are not counted, but those of the tensors given as ``count`` (held weakly:
the caller drops its own references so that the code under test can free them).
"""

from __future__ import annotations

import gc
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)
_TORCH_DIR = torch.__file__.rsplit("/", 1)[0]


class LiveRows(TorchDispatchMode):
    """``with LiveRows(cols, traced, seams, count): loss.backward()``; then
    :attr:`points` holds ``(where, {storage id: bytes})`` for every point (module doc)."""

    def __init__(self, cols: Iterable[int], traced: Iterable[Callable],
                 seams: Iterable[Callable] = (), count: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.cols = set(cols)
        self.traced = {f.__code__ for f in traced}
        self.seams = {f.__code__ for f in seams}
        self.reg: dict[int, tuple[weakref.ref, int, bool]] = {}  # id -> (ref, bytes, counted)
        for t in count:  # counted whatever their shape; only weak references are kept
            self._register(t, True)
        self.points: list[tuple[str, dict[int, int]]] = []
        self.on_point: Callable[[str, dict[int, int]], None] | None = None

    # ---------------------------------------------------------------- storages
    def _register(self, t: torch.Tensor, counted: bool) -> None:
        s = t.untyped_storage()
        old = self.reg.get(id(s))
        if old is not None and old[0]() is s:
            return
        self.reg[id(s)] = (weakref.ref(s), s.nbytes(), counted)

    def is_row(self, t: torch.Tensor) -> bool:
        return t.dim() == 2 and t.is_floating_point() and t.shape[1] in self.cols and t.numel() > 0

    def alive(self) -> dict[int, int]:
        """Counted storages alive now: ``{id: bytes}``."""
        return {i: nb for i, (ref, nb, counted) in self.reg.items()
                if counted and ref() is not None}

    def storage_id(self, t: torch.Tensor) -> int:
        return id(t.untyped_storage())

    def _point(self, where: str) -> None:
        live = self.alive()
        self.points.append((where, live))
        if self.on_point is not None:
            self.on_point(where, live)

    # ---------------------------------------------------------------- hooks
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and self.is_row(t):
                self._register(t, True)
        f = sys._getframe(1)
        while f is not None and f.f_code.co_filename.startswith(_TORCH_DIR):
            f = f.f_back
        if f is not None and (f.f_code in self.traced or f.f_code in self.seams):
            self._point(f"op {func} in {f.f_code.co_name}:{f.f_lineno}")
        return out

    def _trace(self, frame, event, arg):
        if frame.f_code not in self.traced:
            return None

        def local(frame, event, arg):
            if event in ("line", "return"):
                self._point(f"{event} {frame.f_code.co_name}:{frame.f_lineno}")
            return local
        return local

    def __enter__(self):
        with warnings.catch_warnings():  # isinstance on deprecated module attributes warns
            warnings.simplefilter("ignore")
            found = [o for o in gc.get_objects()  # a dead weakref.proxy raises on isinstance
                     if not isinstance(o, _PROXIES) and isinstance(o, torch.Tensor)]
        for o in found:  # alive now: not counted (but ``count``, registered first)
            if o.device.type == "cpu" and not o.is_meta:
                self._register(o, False)
        self._prev_trace = sys.gettrace()
        sys.settrace(self._trace)
        return super().__enter__()

    def __exit__(self, *exc):
        sys.settrace(self._prev_trace)
        return super().__exit__(*exc)

    def peak(self) -> int:
        return max(sum(p.values()) for _, p in self.points)


def row_seams() -> list[Callable]:
    """The row copies the stages call (a permutation by runs, the all-to-all's stand-in):
    inside each, its input and output coexist."""
    from lrmoe.ops.rowops import Runs, gather_runs_reference
    from lrmoe.parallel.stages import permute_rows
    from onerank import OneRankComm

    return [permute_rows, Runs.apply, gather_runs_reference, OneRankComm.all_to_all]


def exchange_code() -> tuple[list[Callable], list[Callable]]:
    """``(forward, backward)``: the functions that hold one layer's rows in the
    exchange (:class:`lrmoe.parallel.exchange.ExpertExchange` and the stages it hands
    its rows to), the ones :class:`LiveRows` traces line by line."""
    import lrmoe.ops.experts as ops
    import lrmoe.parallel.exchange as exchange
    import lrmoe.parallel.stages as stages

    forward = [exchange.ExpertExchange.forward, exchange.forward_ranks, stages.experts_forward,
               ops.swiglu_forward]
    backward = [exchange.ExpertExchange.backward, exchange.backward_ranks, stages.home_backward,
                exchange._experts_backward_exchange, stages.experts_backward,
                stages._rebuild_gate_up, ops.swiglu_backward, stages.home_finish]
    return forward, backward
