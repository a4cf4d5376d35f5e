"""Triton's interpreter on the CPU (tests and ``benchmarks/op_count.py``): the row kernels
run as Triton kernels on CPU tensors. ``TRITON_INTERPRET=1`` must be set before Triton is
first imported."""

from __future__ import annotations


def patch_interpreter() -> None:
    """Triton 3.6's interpreter reads a loop bound with int() of a one-element array,
    which NumPy >= 2.4 refuses; read its one element instead (later Triton does the same)."""
    from triton.runtime import interpreter as _interp

    if getattr(_interp, "_lrmoe_patched", False):
        return
    patch_tensor = _interp._patch_lang_tensor

    def patch_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = patch_index
    _interp._lrmoe_patched = True
