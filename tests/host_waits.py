"""Counting the host's waits on device data, on the CPU (tests only).

On CUDA a host wait is a device-to-host copy or a sync (``torch.cuda.set_sync_debug_mode``
flags them). On the CPU every tensor is a host tensor, so :class:`HostWaits` tells them
apart by lineage: the tensors given to :meth:`HostWaits.device` and everything computed
from them stand for device tensors; host tensors built from plain numbers (a plan made
from counts the host already read) do not. Reading a device-standing tensor on the host
(``.cpu()``, ``.tolist()``, ``.numpy()``, ``.item()``, ``bool()``/``int()``/``float()``)
or running an op whose output size or value the host must read (``nonzero``, boolean
masks, ``equal``, ``repeat_interleave`` without ``output_size``, ``bincount``,
``unique``, ``masked_select``) counts as one wait, and so does indexing device data with
a host-built index tensor (on CUDA a copy from pageable memory, which waits for the
device; :func:`lrmoe.ops.rowops.to_device`'s pinned copies do not, and what it
returns stands for a device tensor here). What ``.cpu()`` returns is a host
tensor. Tensors a factory (``torch.arange``, ``zeros``, ...) makes with an explicit
``device=`` stand for device tensors; ``torch.tensor(data, device=...)`` is a copy of
host data from pageable memory (a wait on CUDA). Each wait records the op and a short
stack, so a failing test names the line.
"""

from __future__ import annotations

import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from lrmoe.ops import rowops

aten = torch.ops.aten
# ops whose result the host must read before it can go on (on CUDA: a sync)
_WAITING_OPS = {aten._local_scalar_dense.default, aten.equal.default, aten.nonzero.default,
                aten.masked_select.default, aten.bincount.default, aten.is_nonzero.default,
                aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default,
                aten.allclose.default, aten.repeat_interleave.Tensor}

_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
             aten.index_select.default, aten.index_add_.default, aten.index_add.default,
             aten.index_copy_.default}

_FACTORIES = ("arange", "zeros", "ones", "full", "empty", "rand", "randn", "randint", "tensor",
              "as_tensor")


class HostWaits(TorchDispatchMode):
    """Count host waits on device-standing tensors inside the ``with`` block."""

    def __init__(self):
        super().__init__()
        self._dev = WeakIdKeyDictionary()
        self.waits: list[tuple[str, str]] = []
        self._patched: dict[str, object] = {}

    def device(self, *tensors: torch.Tensor) -> None:
        """Mark ``tensors`` as device tensors."""
        for t in tensors:
            self._dev[t] = True

    def is_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self._dev

    def _wait(self, what: str) -> None:
        # frames of the runtime, and of the synthetic peers' comm that stands in for its
        # parallel/comm.py (tests/onerank.py)
        stack = [f for f in traceback.extract_stack()[:-2]
                 if "/lrmoe/" in f.filename or f.filename.endswith("/onerank.py")]
        where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in stack[::-1][:3])
        self.waits.append((what, where))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        from_device = any(self.is_device(a) for a in flat)
        if from_device and (func in _WAITING_OPS or _bool_index(func, args)
                            or self._host_index(func, args)):
            if not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None):
                self._wait(str(func))
        out = func(*args, **kwargs)
        if from_device:
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    self._dev[o] = True
        return out

    def _host_index(self, func, args) -> bool:
        """Device data indexed by a host-built index tensor (not a 0-d scalar)."""
        if func not in _INDEXING or not self.is_device(args[0]):
            return False
        put = func in (aten.index_put_.default, aten.index_put.default)
        if put and isinstance(args[2], torch.Tensor) and not self.is_device(args[2]):
            return True  # a host value written into device data (even a 0-d one) is copied
        idx = args[1] if put or func is aten.index.Tensor else [args[2]]
        return any(isinstance(i, torch.Tensor) and i.dim() > 0 and not self.is_device(i)
                   for i in idx)

    def __enter__(self):
        mode = self

        def reader(name):
            orig = getattr(torch.Tensor, name)

            def read(t, *a, **kw):
                if mode.is_device(t):
                    mode._wait(f"Tensor.{name}")
                    if name == "cpu":  # a fresh host tensor
                        with torch.utils._python_dispatch._disable_current_modes():
                            return orig(t, *a, **kw).clone()
                return orig(t, *a, **kw)
            return orig, read

        for name in ("cpu", "tolist", "numpy"):
            self._patched[name], fn = reader(name)
            setattr(torch.Tensor, name, fn)
        # a pinned copy to the device: what it returns is a (fresh) device tensor
        real = rowops.to_device

        def to_device(t, device):
            out = real(t, device)
            with torch.utils._python_dispatch._disable_current_modes():
                out = out.clone()
            mode._dev[out] = True
            return out
        self._factories = {}
        for name in _FACTORIES:
            real_f = getattr(torch, name)

            def factory(*a, _f=real_f, _n=name, **kw):
                out = _f(*a, **kw)
                if kw.get("device") is not None:
                    if _n in ("tensor", "as_tensor"):
                        mode._wait(f"torch.{_n}(host data, device=...)")
                    mode._dev[out] = True
                return out
            self._factories[name] = real_f
            setattr(torch, name, factory)
        self._modules = [m for m in list(sys.modules.values())
                         if getattr(m, "__name__", "").startswith("lrmoe")
                         and getattr(m, "to_device", None) is real]
        for m in self._modules:
            m.to_device = to_device
        self._real_to_device = real
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._patched.items():
            setattr(torch.Tensor, name, fn)
        self._patched = {}
        for m in self._modules:
            m.to_device = self._real_to_device
        for name, f in self._factories.items():
            setattr(torch, name, f)
        return super().__exit__(*exc)


def _bool_index(func, args) -> bool:
    """An indexing op with a boolean mask among its indices (its size depends on the mask)."""
    if func not in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
        return False
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in args[1])
