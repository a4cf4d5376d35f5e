"""``torch.compile`` numerics on the device: the compiled MoE layer against the loop
reference, and the compiled whole model against the eager one.

The CPU tests (``tests/test_compile.py``) compile with ``aot_eager``; inductor, which
generates the kernels that run on a GPU, is checked here, on the GPU, in fp32 (so the
tolerances mean something):

* **layer**: tiny-qwen3's MoE layer (softmax router, aux loss) compiled with ``--backend``
  against :func:`references.moe.moe_layer_reference` (plain per-expert loop) on two
  batches that route differently: output, input gradient, expert and router gradients;
  graphs compiled and recompiles;
* **model**: a 3-layer tiny-glm (a dense layer, two MoE layers with the sigmoid group
  router and a shared expert) under :func:`lrmoe.model.compile.compile_model` against an
  eager copy over two SGD steps: losses and every parameter's gradient.

``tests/gpu/test_gpu_compile.py`` runs both checks with inductor on CUDA (``pytest -m gpu
tests/gpu``; skipped without CUDA) and writes :func:`markdown`'s table (the largest
relative error of each quantity, the tolerance, PASS/FAIL) to ``$LRMOE_GPU_OUT`` when set;
``tests/test_compile.py`` runs the layer check on the CPU with Dynamo's eager backend.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the references

from compile_counts import compile_counts, reset_compile_counts  # noqa: E402
from lrmoe.model import MoEForCausalLM  # noqa: E402
from lrmoe.model.compile import compile_model  # noqa: E402
from lrmoe.presets import get_preset  # noqa: E402
from references.moe import moe_layer_reference  # noqa: E402

# fp32 throughout; inductor may fuse and reorder reductions, so the bounds are a few
# hundred ulps of the values involved, not bit equality
LAYER_TOL = 1e-4
MODEL_TOL = 1e-3
NAMES = ("out", "dx", "d_gate_up", "d_down", "d_router")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def layer_grads(layer, x, coeff, fn) -> list[torch.Tensor]:
    """``fn(x)``'s output and, for the loss ``sum(out * coeff)``, the gradients of ``x``,
    the experts and the router (also used by ``tests/test_compile.py``)."""
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y = fn(x)
    (y * coeff).sum().backward()
    return [y.detach(), x.grad, layer.experts.gate_up_proj.grad.clone(),
            layer.experts.down_proj.grad.clone(), layer.router.weight.grad.clone()]


def check_layer(dev: str, backend: str, tokens: int) -> dict:
    torch.manual_seed(0)
    layer = copy.deepcopy(MoEForCausalLM(get_preset("tiny-qwen3")).moe_layers[0]).to(dev)
    reset_compile_counts()
    compiled = torch.compile(layer, backend=backend)
    worst = dict.fromkeys(NAMES, 0.0)
    for seed in (1, 2):  # the second batch routes differently: a new plan, same graphs
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(2, tokens, layer.cfg.hidden_size, generator=g).to(dev)
        coeff = torch.randn(x.shape, generator=g).to(dev)
        got = layer_grads(layer, x, coeff, compiled)
        ref = layer_grads(layer, x, coeff, lambda v: moe_layer_reference(layer, v))
        for n, a, b in zip(NAMES, got, ref):
            worst[n] = max(worst[n], rel(a, b))
    return {"rel_err": worst, "tol": LAYER_TOL, **compile_counts(),
            "ok": all(v <= LAYER_TOL for v in worst.values())}


def check_model(dev: str, backend: str, tokens: int) -> dict:
    torch.manual_seed(0)
    model = MoEForCausalLM(dataclasses.replace(get_preset("tiny-glm"), num_hidden_layers=3)).to(dev)
    eager = copy.deepcopy(model)
    reset_compile_counts()
    compile_model(model, backend=backend)
    # SGD: Adam would turn rounding noise in exactly-zero gradients into full steps
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, eager)]
    g = torch.Generator().manual_seed(3)
    loss_err, grad_err, worst_param = 0.0, 0.0, ""
    for _ in range(2):
        ids = torch.randint(0, model.config.vocab_size, (2, tokens + 1), generator=g).to(dev)
        losses = []
        for m, opt in zip((model, eager), opts):
            opt.zero_grad()
            _, obj = m.loss(ids[:, :-1], ids[:, 1:])
            obj.backward()
            losses.append(obj.detach())
        loss_err = max(loss_err, rel(losses[0], losses[1]))
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            if q.grad is not None and float(q.grad.norm()) > 0:
                e = rel(p.grad, q.grad)
                if e > grad_err:
                    grad_err, worst_param = e, n
        for m, opt in zip((model, eager), opts):
            opt.step()
            m.end_step()
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    return {"loss_rel_err": loss_err, "grad_rel_err": grad_err, "worst_param": worst_param,
            "tol": MODEL_TOL, **compile_counts(), "break_reasons": sorted(breaks),
            "ok": loss_err <= MODEL_TOL and grad_err <= MODEL_TOL
            and all("MoELayer.routed" in r for r in breaks)}


def markdown(meta: dict, layer: dict, model: dict) -> str:
    v = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
    lines = [f"# torch.compile numerics ({meta['device']}, backend {meta['backend']}, fp32)", "",
             "| check | largest relative error | tolerance | graphs / breaks / recompiles | result |",
             "|---|---|---|---|---|"]
    errs = ", ".join(f"{k} {x:.1e}" for k, x in layer["rel_err"].items())
    lines.append(f"| MoE layer vs loop reference | {errs} | {layer['tol']:.0e} | "
                 f"{layer['graphs']} / {layer['graph_breaks']} / {layer['recompiles']} | "
                 f"{v(layer['ok'])} |")
    lines.append(f"| whole model vs eager (2 SGD steps) | loss {model['loss_rel_err']:.1e}, "
                 f"grads {model['grad_rel_err']:.1e} ({model['worst_param']}) | "
                 f"{model['tol']:.0e} | {model['graphs']} / {model['graph_breaks']} / "
                 f"{model['recompiles']} | {v(model['ok'])} |")
    return "\n".join(lines) + "\n"
