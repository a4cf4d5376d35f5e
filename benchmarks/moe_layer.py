"""One MoE layer on one GPU: ours vs HF transformers' MoE block (eager and under
``torch.compile``), vs the dense GEMM ceiling.

Forward and forward+backward (router through combine) at Qwen3-30B-A3B's and
GLM-4.5-Air's layer shapes for N tokens, routing uniform or Zipf-skewed, same weights and
routing for every variant; median CUDA-event times after warm-up. Memory of one
forward+backward: ``peak`` above the weights and inputs, ``act`` = that minus the
gradients left behind. Also LRMoE's backward at keep ratios, the expert grouped GEMMs
alone, ``host`` = median host ms to enqueue one forward+backward (close to the CUDA-event
time: host-bound), and ``ours graphed``, a DIAGNOSTIC (our layer in CUDA graphs, no host
work between kernels; not a lrmoe feature, not compared for the goal, memory unmeasured).

Usage (GPU):  python3 benchmarks/moe_layer.py --out DIR [--tokens 16384,65536]
Smoke (CPU):  python3 benchmarks/moe_layer.py --out DIR --smoke   (tiny shapes; logic only)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_common as gc  # noqa: E402
from gpu_common import fmt, gib  # noqa: E402

from lrmoe.config import ModelConfig  # noqa: E402
from lrmoe.model.moe import MoELayer, MoERuntime  # noqa: E402
from lrmoe.model.router import Routing  # noqa: E402
from lrmoe.ops.experts import offsets, swiglu_backward, swiglu_forward  # noqa: E402
from lrmoe.parallel.exchange import BackwardOptions  # noqa: E402
from lrmoe.policy.base import Policy
from lrmoe.policy.plan import Plan  # noqa: E402
from lrmoe.policy.plan_numpy import full_plan  # noqa: E402

SHAPES = {
    "qwen3": dict(model_type="qwen3_moe", hidden_size=2048, moe_intermediate_size=768,
                  num_experts=128, num_experts_per_tok=8, n_shared_experts=0),
    "glm": dict(model_type="glm4_moe", hidden_size=4096, moe_intermediate_size=1408,
                num_experts=128, num_experts_per_tok=8, n_shared_experts=1),
}
SMOKE = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)

DEV = "cuda"
DTYPE = torch.bfloat16
PROFILE_DIR = None
PROFILE_KEEP = 1.0
PROFILE_ONLY = False


def bench(fn, warmup: int = 3, iters: int = 15) -> float:
    return gc.bench(fn, DEV, warmup, iters)


def draw_routing(T: int, E: int, K: int, skew: float, gen: torch.Generator) -> torch.Tensor:
    """Top-k experts per token without replacement; Zipf(s=skew) popularity over a random
    permutation of experts (skew 0 = uniform)."""
    w = 1.0 / torch.arange(1, E + 1, dtype=torch.float) ** skew
    w = w[torch.randperm(E, generator=gen)]
    return torch.multinomial(w.expand(T, E), K, replacement=False, generator=gen)


class FixedRouter(nn.Module):
    """Softmax router whose choice comes from a fixed table (same work as a real router)."""

    def __init__(self, weight: nn.Parameter, idx: torch.Tensor):
        super().__init__()
        self.weight, self.idx = weight, idx

    def forward(self, x):
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        g = probs.gather(1, self.idx)
        return Routing(self.idx, g / g.sum(-1, keepdim=True), None)


class KeepPolicy(Policy):
    """Static placement, everything retained, ``keep`` of each block selected (ceil)."""

    def __init__(self, keep: float):
        self.keep, self.name = keep, f"keep{keep}"

    def plan(self, counts, inputs):
        G, E = counts.shape
        p = full_plan(counts, torch.arange(E).reshape(G, E // G))
        if self.keep >= 1:
            return p
        sel = torch.ceil(p.retain_GGS.double() * self.keep).long()
        return Plan(p.inst_expert_GS, p.assign_GGS, p.retain_GGS, sel)


class SaveInputPolicy(Policy):
    """Static placement, exact, every row's gate_up output recomputed in backward (only the
    input rows kept, Megatron's MoE activation recompute); with ``router_grad="experts"``
    the combined rows are not kept either: the least an exact layer keeps."""

    name = "save_input"

    def plan(self, counts, inputs):
        G, E = counts.shape
        p = full_plan(counts, torch.arange(E).reshape(G, E // G))
        return dataclasses.replace(p, recompute_G=p.rank_load().clone())


def hf_block(shape: str, cfg: ModelConfig, impl: str):
    """HF's MoE block at the same shapes, with the given experts implementation."""
    kw = dict(hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
              num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=True)
    if shape == "qwen3":
        from transformers.models.qwen3_moe import modeling_qwen3_moe as m
        hc = m.Qwen3MoeConfig(num_experts=cfg.num_experts, **kw)
        block = m.Qwen3MoeSparseMoeBlock
    else:
        from transformers.models.glm4_moe import modeling_glm4_moe as m
        hc = m.Glm4MoeConfig(n_routed_experts=cfg.num_experts, n_shared_experts=cfg.n_shared_experts,
                             n_group=1, topk_group=1, **kw)
        block = m.Glm4MoeMoE
    hc._experts_implementation = impl
    return block(hc)


def patch_hf_routing(block, idx):
    """Make HF's gate return the same fixed routing (softmax gates gathered at idx)."""
    gate = block.gate

    def fwd(hidden):
        logits = F.linear(hidden.reshape(-1, gate.weight.shape[1]), gate.weight)
        g = torch.softmax(logits.float(), dim=-1).gather(1, idx)
        return logits, (g / g.sum(-1, keepdim=True)).to(hidden.dtype), idx
    gate.forward = fwd


def hf_twin(shape: str, cfg: ModelConfig, impl: str, layer: MoELayer, idx: torch.Tensor):
    """HF's block with ``layer``'s weights and the same fixed routing."""
    blk = hf_block(shape, cfg, impl).to(DEV).to(DTYPE)
    with torch.no_grad():
        blk.gate.weight.copy_(layer.router.weight)
        blk.experts.gate_up_proj.copy_(layer.experts.gate_up_proj)
        blk.experts.down_proj.copy_(layer.experts.down_proj)
        if cfg.n_shared_experts:
            for n in ("gate_proj", "up_proj", "down_proj"):
                getattr(blk.shared_experts, n).weight.copy_(getattr(layer.shared_experts, n).weight)
    patch_hf_routing(blk, idx)
    return blk


def host_ms(fn, iters: int = 15) -> float | None:
    """Median host milliseconds of ``fn()`` started on an idle device, without a sync
    inside (what the host spends enqueueing it); ``None`` off CUDA."""
    if DEV != "cuda":
        return None
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def graphed_copy(layer: MoELayer, idx: torch.Tensor, x: torch.Tensor) -> nn.Module:
    """A copy of ``layer`` (reading the same routing table ``idx``) captured into CUDA
    graphs, forward and backward: the diagnostic ``ours graphed`` (module doc)."""
    rt, layer.runtime = layer.runtime, MoERuntime()  # its stats hold CUDA events: no copy
    try:
        g = copy.deepcopy(layer)
    finally:
        layer.runtime = rt
    g.router = FixedRouter(g.router.weight, idx)
    return torch.cuda.make_graphed_callables(g, (x,), allow_unused_input=True)


def measure(mod: nn.Module, x: torch.Tensor, dy: torch.Tensor, ref: torch.Tensor | None,
            fwd_only_too: bool = True, memory: bool = True) -> dict:
    """Forward and forward+backward times, host enqueue time, memory of one
    forward+backward, and the output's relative error against ``ref`` (our eager layer's
    output)."""

    def fwd():
        with torch.no_grad():
            return mod(x)

    def fwdbwd():
        mod(x).backward(dy)

    def clear():
        x.grad = None
        for p in mod.parameters():
            p.grad = None

    def step():
        fwdbwd()
        clear()

    out = {}
    # compiled modules: the output with grad on (a no_grad call would compile a second,
    # inference graph that the timed forward+backward never uses)
    y = (fwd() if fwd_only_too else mod(x).detach()).float()
    if ref is not None:
        out["rel_err_vs_ours"] = float((y - ref).norm() / ref.norm())
    del y
    if fwd_only_too:
        out["fwd_ms"] = bench(fwd)
    out["fwdbwd_ms"] = bench(step)
    out["host_ms"] = host_ms(step)
    clear()
    if not memory:
        return out
    peak, kept = gc.peak_of(fwdbwd, DEV)  # the gradients stay allocated: ``kept``
    clear()
    out["peak_gib"], out["act_gib"] = gib(peak), gib(None if peak is None else peak - kept)
    return out


def build_layer(shape: str, T: int, smoke: bool):
    """Our layer at ``shape`` (seeded) with a :class:`FixedRouter` reading the routing
    table ``idx_TK`` (zeros: fill it with :func:`draw_routing`), an input ``x`` that
    wants its gradient, and an output gradient ``dy``: ``(cfg, layer, idx_TK, x, dy)``."""
    torch.manual_seed(0)
    base = dict(vocab_size=256, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                num_hidden_layers=1, intermediate_size=1024)
    cfg = ModelConfig(**base, **{**SHAPES[shape], **(SMOKE if smoke else {})})
    K, H = cfg.num_experts_per_tok, cfg.hidden_size
    idx = torch.zeros(T, K, dtype=torch.long, device=DEV)
    layer = MoELayer(cfg, 0).to(DEV).to(DTYPE)
    layer.router = FixedRouter(layer.router.weight, idx)
    x = torch.randn(1, T, H, device=DEV, dtype=DTYPE).requires_grad_()
    dy = torch.randn(1, T, H, device=DEV, dtype=DTYPE)
    return cfg, layer, idx, x, dy


def run_tokens(shape: str, T: int, skews: list[float], a, results: list, dense: float) -> None:
    """Every variant at one shape and token count; the routing table is rewritten in place
    for each skew, so the compiled variants compile once per (shape, T)."""
    cfg, layer, idx, x, dy = build_layer(shape, T, a.smoke)
    E, K, H, Fd = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    compile_kw = dict(backend=a.compile_backend, dynamic=False)
    ours_c = torch.compile(layer, **compile_kw)
    peers = {impl: hf_twin(shape, cfg, impl, layer, idx) for impl in a.impls.split(",")}
    peer_c = None
    if a.compile_impl:
        blk = peers.get(a.compile_impl) or hf_twin(shape, cfg, a.compile_impl, layer, idx)
        peer_c = torch.compile(blk, **compile_kw)
    P = T * K
    fl = 18 * P * H * Fd + (18 * T * H * Fd * cfg.n_shared_experts)
    gen = torch.Generator().manual_seed(1)
    graphed = None
    for skew in skews:
        t0 = time.time()
        idx.copy_(draw_routing(T, E, K, skew, gen))
        counts = torch.bincount(idx.flatten(), minlength=E)
        row = dict(shape=shape, tokens=T, skew=skew,
                   load_max_over_mean=float(counts.max() / counts.float().mean()))
        if PROFILE_DIR and DEV == "cuda":
            profile_layer(layer, x, dy, shape, skew)
            if PROFILE_ONLY:
                continue
        layer.runtime = MoERuntime()
        with torch.no_grad():
            ref = layer(x).float()
        row["ours"] = measure(layer, x, dy, None)
        row["ours"]["fwdbwd_tflops"] = fl / (row["ours"]["fwdbwd_ms"] * 1e-3) / 1e12
        row["ours_compiled"] = _guarded(lambda r=ref: measure(ours_c, x, dy, r, False))
        if DEV == "cuda":  # captured once per (shape, T), at the first skew's routing
            if graphed is None:
                graphed = _guarded(lambda: graphed_copy(layer, idx, x))
            row["ours_graphed"] = (graphed if isinstance(graphed, dict) else _guarded(
                lambda r=ref, g=graphed: measure(g, x, dy, r, False, memory=False)))
        # the router-gradient lever: no combined rows kept (exact plan)
        layer.runtime = MoERuntime(backward=BackwardOptions(router_grad="experts"))
        row["ours_router_grad_experts"] = _guarded(lambda r=ref: measure(layer, x, dy, r))
        # and gate_up recomputed in backward: only the input rows kept
        layer.runtime = MoERuntime(policy=SaveInputPolicy(),
                                   backward=BackwardOptions(router_grad="experts"))
        row["ours_save_input"] = _guarded(lambda r=ref: measure(layer, x, dy, r))
        layer.runtime = MoERuntime()
        row["peer"] = {impl: _guarded(lambda b=b, r=ref: measure(b, x, dy, r)) for impl, b in peers.items()}
        if peer_c is not None:
            row["peer_compiled"] = _guarded(lambda r=ref: measure(peer_c, x, dy, r, False))
            row["peer_compiled"]["impl"] = a.compile_impl
        del ref
        row.update(gemm_rates(layer, counts.tolist(), P, H, Fd, dense))
        row.update(keep_sweep(layer, x, dy, [float(k) for k in a.keeps.split(",") if k],
                              row["ours"]["fwd_ms"]))
        results.append(_finish(row))
        print(f"[{shape} T={T} skew={skew}] {time.time() - t0:.0f}s", flush=True)
    if DEV == "cuda":
        torch.cuda.empty_cache()


def _guarded(fn) -> dict:
    try:
        return fn()
    except Exception as e:  # an implementation this transformers build lacks, or OOM
        if DEV == "cuda":
            torch.cuda.empty_cache()
        return dict(error=f"{type(e).__name__}: {str(e)[:200]}")


def _finish(row: dict) -> dict:
    """Ratios against the compiled peer (the goal's 1.25x bar) and against the fastest peer."""
    ours = row["ours"]
    peers = {f"HF {k}": v for k, v in row["peer"].items()}
    pc = row.get("peer_compiled", {})
    if pc:
        peers[f"HF {pc.get('impl')} compiled"] = pc
    timed = {k: v["fwdbwd_ms"] for k, v in peers.items() if "fwdbwd_ms" in v}
    if timed:
        row["peer_best"] = min(timed, key=timed.get)
        row["speedup_fwdbwd_vs_best_peer"] = timed[row["peer_best"]] / ours["fwdbwd_ms"]
    if "fwdbwd_ms" in pc:
        row["speedup_fwdbwd_vs_peer_compiled"] = pc["fwdbwd_ms"] / ours["fwdbwd_ms"]
        if pc.get("act_gib") and ours.get("act_gib") is not None:
            row["act_ratio_vs_peer_compiled"] = ours["act_gib"] / pc["act_gib"]
    return row


def gemm_rates(layer: MoELayer, counts: list[int], P: int, H: int, Fd: int, dense: float) -> dict:
    """The expert grouped GEMMs alone, on rows already grouped by expert."""
    xs = torch.randn(P, H, device=DEV, dtype=DTYPE)
    dys = torch.randn(P, H, device=DEV, dtype=DTYPE)
    w13, w2 = layer.experts.gate_up_proj.detach(), layer.experts.down_proj.detach()
    offs = offsets(counts, xs.device)
    _, gu0 = swiglu_forward(xs, w13, w2, counts, offs)
    gf = bench(lambda: swiglu_forward(xs, w13, w2, counts, offs))
    gb = bench(lambda: swiglu_backward({"x": xs, "gu": gu0, "dy": dys}, w13, w2, counts, offs))
    return dict(gemm_fwd_tflops=6 * P * H * Fd / (gf * 1e-3) / 1e12,
                gemm_bwd_tflops=12 * P * H * Fd / (gb * 1e-3) / 1e12,
                gemm_fwdbwd_frac_of_dense=18 * P * H * Fd / ((gf + gb) * 1e-3) / 1e12 / dense)


def _fwdbwd(layer, x, dy):
    def step():
        layer(x).backward(dy)
        x.grad = None
        for p in layer.parameters():
            p.grad = None
    return step


def keep_sweep(layer: MoELayer, x, dy, keeps: list[float], fwd_ms: float) -> dict:
    """LRMoE backward time (forward+backward minus forward) at each keep ratio, and at
    the smallest keep with compaction off."""
    fwdbwd, out = _fwdbwd(layer, x, dy), {}
    for keep in keeps:
        layer.runtime = MoERuntime(policy=KeepPolicy(keep))
        out[f"keep{keep}_bwd_ms"] = bench(fwdbwd) - fwd_ms
    if keeps and min(keeps) < 1:
        layer.runtime = MoERuntime(policy=KeepPolicy(min(keeps)),
                                   backward=BackwardOptions(compaction=False))
        out[f"keep{min(keeps)}_nocompact_bwd_ms"] = bench(fwdbwd) - fwd_ms
    layer.runtime = MoERuntime()
    return out


def profile_layer(layer: MoELayer, x, dy, shape: str, skew: float) -> None:
    from torch.profiler import ProfilerActivity, profile

    fwdbwd = _fwdbwd(layer, x, dy)
    layer.runtime = MoERuntime(policy=KeepPolicy(PROFILE_KEEP))
    fwdbwd()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fwdbwd()
        torch.cuda.synchronize()
    Path(PROFILE_DIR, f"profile_{shape}_{x.shape[1]}_{skew}_keep{PROFILE_KEEP}.txt").write_text(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=50))
    layer.runtime = MoERuntime()


def markdown(meta: dict, results: list[dict]) -> str:
    pc_impl = next((r["peer_compiled"].get("impl") for r in results if "peer_compiled" in r), "—")
    lines = [f"# One MoE layer, forward+backward ({meta['device']})", "",
             f"`{meta['command']}` — torch {meta['torch']}, transformers {meta['transformers']}, "
             f"{meta['date']}; dense bf16 ceiling {meta['dense_bf16_tflops']:.0f} TFLOP/s "
             "(measured in this run).", "",
             "Times: median ms of forward+backward (CUDA events). Memory: GiB above the "
             "weights and inputs at the peak of one forward+backward (`peak`), and that minus "
             "the gradients (`act`).", "",
             "`ours rg@e`: `BackwardOptions(router_grad=\"experts\")` (the router gradient from "
             "the expert backward; no combined rows kept). `ours x-only`: that, and every "
             "row's gate_up output recomputed in backward (only the input rows kept). "
             "`host ours / HF compiled`: median host ms to enqueue one forward+backward. "
             "`ours graphed`: DIAGNOSTIC, ours captured in CUDA graphs (no host work between "
             "kernels; not a lrmoe feature, not the goal's comparison).", "",
             *gc.md_head("shape", "tokens", "skew", "max/mean load", "ours", "ours compiled",
                      "ours rg@e", "ours x-only", f"HF {pc_impl} compiled", "× HF compiled",
                      "host ours / HF compiled", "ours graphed (diag.)", "ours act / peak",
                      "ours rg@e act / peak", "ours x-only act / peak", "HF compiled act / peak",
                      "act ratio", "GEMM % dense", "bwd keep 0.5 / 1.0")]
    for r in results:
        o, oc, pc, ol, ox, og = (r.get(k, {}) for k in (
            "ours", "ours_compiled", "peer_compiled", "ours_router_grad_experts", "ours_save_input",
            "ours_graphed"))
        k1, k5 = r.get("keep1.0_bwd_ms"), r.get("keep0.5_bwd_ms")
        lines.append(
            f"| {r['shape']} | {r['tokens']:,} | {r['skew']:g} | {r['load_max_over_mean']:.2f} "
            f"| {fmt(o.get('fwdbwd_ms'))} | {fmt(oc.get('fwdbwd_ms'))} | {fmt(ol.get('fwdbwd_ms'))} "
            f"| {fmt(ox.get('fwdbwd_ms'))} | {fmt(pc.get('fwdbwd_ms'))} "
            f"| {fmt(r.get('speedup_fwdbwd_vs_peer_compiled'))} "
            f"| {fmt(o.get('host_ms'))} / {fmt(pc.get('host_ms'))} | {fmt(og.get('fwdbwd_ms'))} "
            + "".join(f"| {fmt(v.get('act_gib'))} / {fmt(v.get('peak_gib'))} " for v in (o, ol, ox, pc))
            + f"| {fmt(r.get('act_ratio_vs_peer_compiled'))} "
            f"| {fmt(100 * r['gemm_fwdbwd_frac_of_dense'], '.0f')} "
            f"| {fmt(k5 / k1 if k1 and k5 else None)} |")
    lines += ["", "Eager HF peers (forward+backward ms, act / peak GiB, rel. error vs ours):", ""]
    for r in results:
        for impl, v in r["peer"].items():
            desc = v.get("error") or (f"{fmt(v['fwdbwd_ms'])} ms, {fmt(v.get('act_gib'))} / "
                                      f"{fmt(v.get('peak_gib'))} GiB, err {v['rel_err_vs_ours']:.1e}")
            lines.append(f"- {r['shape']} T={r['tokens']:,} skew={r['skew']:g} {impl}: {desc}")
        og = r.get("ours_graphed", {})
        if "rel_err_vs_ours" in og:
            lines.append(f"- {r['shape']} T={r['tokens']:,} skew={r['skew']:g} ours graphed: "
                         f"rel. error vs ours {og['rel_err_vs_ours']:.1e}")
        for key in ("ours_compiled", "ours_graphed", "ours_router_grad_experts", "ours_save_input",
                    "peer_compiled"):
            if "error" in r.get(key, {}):
                lines.append(f"- {r['shape']} T={r['tokens']:,} skew={r['skew']:g} {key}: {r[key]['error']}")
    if meta.get("skipped_by_budget"):
        lines += ["", f"Skipped (--budget-s spent): {', '.join(meta['skipped_by_budget'])}"]
    return "\n".join(lines) + "\n"


@gc.cli
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for moe_layer.json and moe_layer.md")
    ap.add_argument("--smoke", action="store_true", help="toy shapes on the CPU (logic only)")
    ap.add_argument("--tokens", default=None, help="comma list (default 16384,65536; smoke 64)")
    ap.add_argument("--shapes", default="qwen3,glm")
    ap.add_argument("--skews", default="0,1")
    ap.add_argument("--impls", default="grouped_mm", help="HF experts implementations run eager")
    ap.add_argument("--compile-impl", default="grouped_mm",
                    help="HF experts implementation run under torch.compile ('' = none)")
    ap.add_argument("--compile-backend", default=None, help="default inductor (smoke: aot_eager)")
    ap.add_argument("--keeps", default="1.0,0.5", help="LRMoE keep ratios for the backward sweep")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip the (shape, tokens) runs that would start after this many seconds "
                         "(listed in the markdown); order: shapes, then tokens, as given")
    ap.add_argument("--profile-dir", default=None)
    ap.add_argument("--profile-keep", type=float, default=1.0)
    ap.add_argument("--profile-only", action="store_true")
    a = ap.parse_args(argv)
    global DEV, PROFILE_DIR, PROFILE_KEEP, PROFILE_ONLY
    DEV = "cpu" if a.smoke else "cuda"
    shapes, skews = gc.csv(a.shapes), gc.csv(a.skews, float, "--skews")
    tokens = gc.csv(a.tokens or ("64" if a.smoke else "16384,65536"), int, "--tokens")
    if bad := [s for s in shapes if s not in SHAPES]:
        raise gc.LrmoeError(f"--shapes: unknown {bad}; valid: {sorted(SHAPES)}")
    gc.check_device(DEV, "--smoke")
    a.compile_backend = a.compile_backend or ("aot_eager" if a.smoke else "inductor")
    PROFILE_DIR, PROFILE_KEEP, PROFILE_ONLY = a.profile_dir, a.profile_keep, a.profile_only
    d = gc.out_dir(a.out)
    deadline = None if a.budget_s is None else time.time() + a.budget_s
    dense = gc.dense_tflops(DEV)
    results: list = []
    skipped = []
    for shape in shapes:
        for T in tokens:
            if deadline is not None and time.time() > deadline:
                skipped.append(f"{shape} T={T}")
                continue
            run_tokens(shape, T, skews, a, results, dense)
    meta = gc.run_meta(DEV, dense)
    meta["skipped_by_budget"] = skipped
    md = markdown(meta, results)
    gc.write_outputs(d, "moe_layer", meta, results, md)
    print(md)


if __name__ == "__main__":
    sys.exit(main())
