"""lrmoe.ops.fused: the compiled helpers take rows as the only dynamic dimension.

The compiled path runs on CUDA only; here Dynamo traces the same functions on CPU with
a recording backend, so the shapes each graph was compiled for can be read back."""

import torch

from lrmoe.ops.experts import _act_grad_rowdot_eager
from lrmoe.ops.fused import gathered_dot, rows_dynamic, weighted_gather_sum


def _recording_backend(graphs: list):
    def backend(gm, example_inputs):  # the traced (fake) shapes of the tensor inputs
        vals = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        graphs.append([tuple(v.shape) for v in vals if isinstance(v, torch.Tensor)])
        return gm.forward
    return backend


def _symbolic(shape) -> list[bool]:
    return [not isinstance(d, int) for d in shape]


def test_rows_dynamic_keeps_widths_static_and_does_not_recompile_on_rows():
    torch._dynamo.reset()
    graphs: list = []
    f = rows_dynamic(_act_grad_rowdot_eager, backend=_recording_backend(graphs))
    F = 24
    for R in (37, 53, 11):  # new row counts: no new graph
        dact, gu, scale = torch.randn(R, F), torch.randn(R, 2 * F), torch.rand(R)
        got = f(dact, gu, scale)
        ref = _act_grad_rowdot_eager(dact, gu, scale)
        torch.testing.assert_close(got[0], ref[0])
        torch.testing.assert_close(got[1], ref[1])
    assert len(graphs) == 1, graphs
    # every input's rows symbolic, every width a constant
    for shape in graphs[0]:
        assert _symbolic(shape)[0] and not any(_symbolic(shape)[1:]), graphs[0]
    f(torch.randn(9, 40), torch.randn(9, 80), torch.rand(9))  # a new width: its own graph
    assert len(graphs) == 2 and all(not any(_symbolic(s)[1:]) for s in graphs[1]), graphs


def test_rows_dynamic_compiles_no_graph_for_zero_or_one_row():
    """Dynamo specializes 0 and 1 rows: such calls run eager (equal to rounding) instead of
    compiling a graph each at whatever step first meets them."""
    torch._dynamo.reset()
    graphs: list = []
    f = rows_dynamic(_act_grad_rowdot_eager, backend=_recording_backend(graphs))
    F = 24
    for R in (37, 1, 0, 53, 1, 0):
        dact, gu, scale = torch.randn(R, F), torch.randn(R, 2 * F), torch.rand(R)
        got, ref = f(dact, gu, scale), _act_grad_rowdot_eager(dact, gu, scale)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r)
    assert len(graphs) == 1 and all(_symbolic(s)[0] for s in graphs[0]), graphs


def test_rows_dynamic_combine_helpers_match_eager():
    torch._dynamo.reset()
    graphs: list = []
    combine = rows_dynamic(weighted_gather_sum, backend=_recording_backend(graphs))
    dot = rows_dynamic(gathered_dot, backend=_recording_backend(graphs))
    H, K = 16, 4
    for T in (5, 13):
        src = torch.randn(T * K + 3, H)
        row = torch.randperm(T * K + 3)[:T * K].view(T, K)
        w, d = torch.rand(T, K), torch.randn(T, H)
        ref = (src[row] * w[..., None]).sum(1)
        torch.testing.assert_close(combine(src, row, w), ref)
        torch.testing.assert_close(dot(src, row, d), (src[row] * d[:, None]).sum(-1))
    assert len(graphs) == 2, graphs  # one graph each, rows symbolic
    assert all(_symbolic(s)[0] and not any(_symbolic(s)[1:]) for g in graphs for s in g), graphs


def test_fused_is_eager_off_cuda_when_asked_and_after_a_compiler_failure(monkeypatch):
    """``fused`` hands back the eager function on the CPU, with ``LRMOE_NO_COMPILE=1``, and
    once a compiled call failed; that failed call is answered by the eager function, with
    a warning, and the failure is remembered."""
    import types
    import warnings

    from lrmoe.ops import fused as fz

    monkeypatch.setattr(fz, "_COMPILED", {})
    monkeypatch.delenv("LRMOE_NO_COMPILE", raising=False)

    def fn(x):
        return x + 1

    def broken(_fn):
        def call(*args):
            raise RuntimeError("no compiler here")
        return call

    monkeypatch.setattr(fz, "rows_dynamic", broken)
    cuda = types.SimpleNamespace(is_cuda=True)  # fused reads only the device
    assert fz.fused("f", fn, torch.zeros(2)) is fn and fz._COMPILED == {}
    monkeypatch.setenv("LRMOE_NO_COMPILE", "1")
    assert fz.fused("f", fn, cuda) is fn and fz._COMPILED == {}
    monkeypatch.delenv("LRMOE_NO_COMPILE")
    safe = fz.fused("f", fn, cuda)
    assert safe is not fn
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert torch.equal(safe(torch.zeros(2)), torch.ones(2))
    assert "compiled f failed (RuntimeError); using eager" in str(seen[0].message)
    assert fz._COMPILED["f"] is False and fz.fused("f", fn, cuda) is fn
