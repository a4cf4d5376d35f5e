"""The whole training step on one GPU: lrmoe's model vs HF transformers' (Qwen3MoeForCausalLM,
Glm4MoeForCausalLM), eager and under ``torch.compile``, with the same weights.

A few full-width layers of Qwen3-30B-A3B (4, all MoE) and GLM-4.5-Air (3: one dense, two
MoE), vocabulary 32k, batch 4 x 2,048 tokens, in two regimes: ``fp32-autocast`` (fp32
master weights, bf16 autocast, fused AdamW: HF Trainer's ``bf16=True``) and ``bf16``
(bf16 weights, fused AdamW on them). A step = forward, loss (fp32 cross entropy, plus
Qwen3's router aux loss in both models), backward, optimizer step, zero_grad. Reported:
median step time (CUDA events, after warm-up steps that include compilation), tokens/s,
model TFLOP/s (6 x active non-embedding parameters x tokens: a label, attention's T^2
excluded), the absolute peak of one step, and the dense bf16 ceiling of the same run.
HF's ``--hf-impls`` run eager and ``--hf-compile-impl`` under ``model.compile()``; ours
compiled is :func:`lrmoe.model.compile.compile_model` (``lrmoe train --compile``).

Usage (GPU):  python3 benchmarks/train_step.py --out DIR
Smoke (CPU):  python3 benchmarks/train_step.py --out DIR --smoke   (tiny models; logic only)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from gc import collect
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # compile_counts

import gpu_common as gc  # noqa: E402
from gpu_common import bench, fmt, gib, peak_of  # noqa: E402

from compile_counts import compile_counts  # noqa: E402
from lrmoe.hf import _hf_name, hf_config_dict  # noqa: E402
from lrmoe.model import MoEForCausalLM  # noqa: E402
from lrmoe.model.compile import compile_model  # noqa: E402
from lrmoe.model.moe import MoERuntime  # noqa: E402
from lrmoe.parallel.exchange import BackwardOptions  # noqa: E402
from lrmoe.presets import get_preset, param_counts  # noqa: E402

SHAPES = {"qwen3": ("qwen3-30b-a3b", 4), "glm": ("glm-4.5-air", 3)}
SMOKE = {"qwen3": ("tiny-qwen3", 2), "glm": ("tiny-glm", 2)}
REGIMES = ("fp32-autocast", "bf16")
DEADLINE: float | None = None  # --budget-s


def model_config(shape: str, a):
    preset, layers = (SMOKE if a.smoke else SHAPES)[shape]
    cfg = get_preset(preset)
    over = dict(num_hidden_layers=a.layers or layers, vocab_size=a.vocab)
    return dataclasses.replace(cfg, **over)


def hf_model(cfg, impl: str, state: dict, dtype: torch.dtype, dev: str):
    """HF's model for ``cfg`` on ``dev`` holding ``state`` (our weights, HF names)."""
    import transformers

    d = hf_config_dict(cfg)
    hc = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    hc._attn_implementation = "sdpa"
    hc._experts_implementation = impl
    if cfg.model_type == "qwen3_moe":
        hc.output_router_logits = cfg.router_aux_loss_coef > 0  # the aux loss ours computes too
    cls = (transformers.Qwen3MoeForCausalLM if cfg.model_type == "qwen3_moe"
           else transformers.Glm4MoeForCausalLM)
    with torch.device(dev):
        m = cls(hc).to(dtype)
    missing, unexpected = m.load_state_dict({_hf_name(k): v for k, v in state.items()},
                                            strict=False)
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"weights do not map onto HF: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}")
    return m


def run_variant(name: str, model, loss_fn, batch: torch.Tensor, dtype: torch.dtype, a, dev: str) -> dict:
    """Time one training step of ``model`` (``loss_fn(model, ids) -> loss``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ctx = (lambda: torch.autocast(dev, dtype=torch.bfloat16)) if dtype == torch.float32 else None
    end_step = getattr(model, "end_step", None)

    def step():
        with ctx() if ctx else contextlib.nullcontext():
            loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if end_step is not None:
            end_step()
        return loss

    t0 = time.time()
    first = float(step())  # compiles here when compiled; allocates the optimizer state
    first_s = time.time() - t0
    ms = bench(step, dev, warmup=a.warmup, iters=a.iters)
    start = torch.cuda.memory_allocated() if dev == "cuda" else None
    peak, _ = peak_of(step, dev)
    tokens = batch.shape[0] * (batch.shape[1] - 1)
    return dict(variant=name, step_ms=ms, tokens_per_s=tokens / (ms * 1e-3), first_step_s=first_s,
                first_loss=first, peak_gib=gib(None if peak is None else peak + start),
                resident_gib=gib(start))


def ours_loss(model, ids):
    return model.loss(ids[:, :-1], ids[:, 1:])[1]


def hf_loss(model, ids):
    x = ids[:, :-1]  # the same T inputs; HF shifts the labels itself (T-1 targets)
    return model(input_ids=x, labels=x).loss


def run_shape_regime(shape: str, regime: str, a, dev: str, dense: float, rows: list) -> None:
    cfg = model_config(shape, a)
    dtype = torch.float32 if regime == "fp32-autocast" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), generator=gen).to(dev)
    total, active = param_counts(cfg)
    active_ne = active - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    tokens = a.batch * a.seq
    base = dict(shape=shape, regime=regime, layers=cfg.num_hidden_layers, vocab=cfg.vocab_size,
                batch=a.batch, seq=a.seq, params_total=total, params_active=active)

    def add(r: dict) -> None:
        r.update(base)
        if "step_ms" in r:
            r["model_tflops"] = 6 * active_ne * tokens / (r["step_ms"] * 1e-3) / 1e12
            r["model_frac_of_dense"] = r["model_tflops"] / dense
        rows.append(r)
        print(f"[{shape} {regime}] {r['variant']}: " + (
            r.get("error") or f"{r['step_ms']:.1f} ms, {r['tokens_per_s']:.0f} tok/s, "
                              f"peak {fmt(r['peak_gib'])} GiB, first step {r['first_step_s']:.0f}s"),
              flush=True)

    torch.manual_seed(0)
    with torch.device(dev):
        ours = MoEForCausalLM(cfg).to(dtype)
    state = {k: v.detach().to("cpu", copy=True) for k, v in ours.state_dict().items()}  # for HF
    with torch.no_grad():
        ref_logits = ours(batch[:1, :-1]).float()
    def mine(name: str) -> dict:
        return guarded(name, lambda: run_variant(name, ours, ours_loss, batch, dtype, a, dev))
    add(mine("ours eager"))
    if a.loss_chunk:  # the head and loss N tokens at a time (``lrmoe train --loss-chunk N``)
        ours.set_loss_chunk(a.loss_chunk)
        add(mine(f"ours eager, --loss-chunk {a.loss_chunk}"))
        ours.set_loss_chunk(0)
    if a.router_grad_experts:  # the lever: no combined expert outputs kept (exact plans)
        ours.set_runtime(MoERuntime(backward=BackwardOptions(router_grad="experts")))
        add(mine("ours eager, router grad at experts"))
        ours.set_runtime(MoERuntime())
    if a.compile:
        torch._dynamo.reset()
        compile_model(ours, backend=a.compile_backend)
        add({**mine("ours compiled"), "compile_counts": compile_counts()})
        if a.loss_chunk:
            ours.set_loss_chunk(a.loss_chunk)
            add(mine(f"ours compiled, --loss-chunk {a.loss_chunk}"))
            ours.set_loss_chunk(0)
    ours = None  # HF starts from the weights ours started from (``state``)
    free(dev)
    impls = a.hf_impls.split(",") if a.hf_impls else []
    if a.compile and a.hf_compile_impl:
        impls = impls + [a.hf_compile_impl + " compiled"]
    for v in impls:
        impl, compiled = v.removesuffix(" compiled"), v.endswith(" compiled")
        name = f"HF {v}"

        def one(impl=impl, compiled=compiled, name=name):
            m = hf_model(cfg, impl, state, dtype, dev)
            with torch.no_grad():
                lg = m(input_ids=batch[:1, :-1]).logits.float()
            err = float((lg - ref_logits).norm() / ref_logits.norm())
            del lg
            if compiled:
                torch._dynamo.reset()
                m.compile(backend=a.compile_backend)
            r = run_variant(name, m, hf_loss, batch, dtype, a, dev)
            r["logits_rel_err_vs_ours"] = err
            if compiled:
                r["compile_counts"] = compile_counts()
            return r
        add(guarded(name, one))
        free(dev)


def guarded(name: str, fn) -> dict:
    if DEADLINE is not None and time.time() > DEADLINE:
        return dict(variant=name, error="skipped: --budget-s spent")
    try:
        return fn()
    except Exception as e:  # an implementation this transformers build lacks, or OOM
        return dict(variant=name, error=f"{type(e).__name__}: {str(e)[:240]}")


def free(dev: str) -> None:
    collect()
    torch._dynamo.reset()
    if dev == "cuda":
        torch.cuda.empty_cache()


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Whole training step ({meta['device']})", "",
             f"`{meta['command']}` — torch {meta['torch']}, transformers {meta['transformers']}, "
             f"{meta['date']}. Dense bf16 ceiling {meta['dense_bf16_tflops']:.0f} TFLOP/s, measured "
             "in this run. Model TFLOP/s = 6 × active non-embedding parameters × tokens / step "
             "time (attention's T² term excluded).", "",
             *gc.md_head("shape", "regime", "model", "step ms", "tokens/s", "peak GiB",
                         "model TFLOP/s", "% of dense", "first step s", "logits rel. err vs ours")]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['regime']} | {r['variant']} | error: {r['error']} "
                         "| | | | | | |")
            continue
        lines.append(
            f"| {r['shape']} | {r['regime']} | {r['variant']} | {r['step_ms']:.1f} "
            f"| {r['tokens_per_s']:,.0f} | {fmt(r['peak_gib'])} | {r['model_tflops']:.0f} "
            f"| {100 * r['model_frac_of_dense']:.0f}% | {r['first_step_s']:.0f} "
            f"| {fmt(r.get('logits_rel_err_vs_ours'), '.1e')} |")
    return "\n".join(lines) + "\n"


@gc.cli
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for train_step.json and train_step.md")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU (logic only)")
    ap.add_argument("--shapes", default="qwen3,glm")
    ap.add_argument("--regimes", default=",".join(REGIMES))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default qwen3 4, glm 3)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 32000; smoke 256)")
    ap.add_argument("--batch", type=int, default=None, help="sequences (default 4; smoke 2)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; smoke 32)")
    ap.add_argument("--hf-impls", default="grouped_mm",
                    help="HF experts implementations run eager (batched_mm materialises a weight "
                         "copy per pair: out of memory at these shapes)")
    ap.add_argument("--hf-compile-impl", default="grouped_mm",
                    help="HF experts implementation run compiled ('' = none)")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--no-router-grad-experts", dest="router_grad_experts", action="store_false",
                    help="skip ours eager with BackwardOptions(router_grad='experts')")
    ap.add_argument("--compile-backend", default=None, help="default inductor (smoke: aot_eager)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip the variants that would start after this many seconds (recorded "
                         "as skipped); order: shapes, then regimes, as given")
    ap.add_argument("--loss-chunk", type=int, default=0, metavar="TOKENS",
                    help="also time ours with the head and loss TOKENS tokens at a time")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=6)
    a = ap.parse_args(argv)
    dev = "cpu" if a.smoke else "cuda"
    shapes, regimes = gc.csv(a.shapes), gc.csv(a.regimes)
    for name, given, valid in (("--shapes", shapes, SHAPES), ("--regimes", regimes, REGIMES)):
        if bad := [s for s in given if s not in valid]:
            raise gc.LrmoeError(f"{name}: unknown {bad}; valid: {sorted(valid)}")
    gc.check_device(dev, "--smoke")
    a.vocab = a.vocab or (256 if a.smoke else 32000)
    a.batch = a.batch or (2 if a.smoke else 4)
    a.seq = a.seq or (32 if a.smoke else 2048)
    a.compile_backend = a.compile_backend or ("aot_eager" if a.smoke else "inductor")
    d = gc.out_dir(a.out)
    global DEADLINE
    DEADLINE = None if a.budget_s is None else time.time() + a.budget_s
    dense = gc.dense_tflops(dev)
    rows: list[dict] = []
    for shape in shapes:
        for regime in regimes:
            run_shape_regime(shape, regime, a, dev, dense, rows)
    meta = gc.run_meta(dev, dense)
    md = markdown(meta, rows)
    gc.write_outputs(d, "train_step", meta, rows, md)
    print(md)


if __name__ == "__main__":
    sys.exit(main())
