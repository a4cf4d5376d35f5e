"""One MoE layer on one GPU: ours vs HF transformers' MoE block, vs the dense GEMM ceiling.

Times forward and forward+backward (router through combine) at the full layer shapes of
Qwen3-30B-A3B and GLM-4.5-Air for N tokens, with routing drawn uniform or Zipf-skewed
(s = 1), using CUDA events (median of many runs after warm-up). Also times LRMoE's
backward at keep ratios 1.0 / 0.75 / 0.5 (everything retained, topk selection), and the
expert grouped GEMMs alone. Prints a table last; writes JSON with every number.

Usage (on the GPU machine):
    python3 benchmarks/moe_layer.py --out results.json [--tokens 16384] [--shapes qwen3,glm]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lrmoe.config import ModelConfig  # noqa: E402
from lrmoe.ops.experts import offsets, swiglu_backward, swiglu_forward  # noqa: E402
from lrmoe.model.moe import MoELayer, MoERuntime  # noqa: E402
from lrmoe.model.router import Routing  # noqa: E402
from lrmoe.policy.plan import Plan, full_plan  # noqa: E402

SHAPES = {
    "qwen3": dict(model_type="qwen3_moe", hidden_size=2048, moe_intermediate_size=768,
                  num_experts=128, num_experts_per_tok=8, n_shared_experts=0),
    "glm": dict(model_type="glm4_moe", hidden_size=4096, moe_intermediate_size=1408,
                num_experts=128, num_experts_per_tok=8, n_shared_experts=1),
}


DEV = "cuda"
PROFILE_DIR = None
PROFILE_KEEP = 1.0
PROFILE_ONLY = False


def bench(fn, warmup: int = 3, iters: int = 15) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs, timed with CUDA events."""
    if DEV == "cpu":  # dry runs of the script itself; not for reported numbers
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def dense_ceiling() -> float:
    n = 8192 if DEV == "cuda" else 512
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    ms = bench(lambda: a @ b, 3, 10)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


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


class KeepPolicy:
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


def hf_block(shape: str, cfg: ModelConfig, impl: str):
    """HF's MoE block at the same shapes, with the given experts implementation."""
    if shape == "qwen3":
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        hc = Qwen3MoeConfig(hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
                            num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                            norm_topk_prob=True)
        hc._experts_implementation = impl
        return Qwen3MoeSparseMoeBlock(hc)
    from transformers.models.glm4_moe.configuration_glm4_moe import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
    hc = Glm4MoeConfig(hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
                       n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                       n_shared_experts=cfg.n_shared_experts, n_group=1, topk_group=1, norm_topk_prob=True)
    hc._experts_implementation = impl
    return Glm4MoeMoE(hc)


def patch_hf_routing(block, idx):
    """Make HF's gate return the same fixed routing (softmax gates gathered at idx)."""
    gate = block.gate

    def fwd(hidden):
        h = hidden.reshape(-1, gate.weight.shape[1])
        logits = F.linear(h, gate.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        g = probs.gather(1, idx)
        g = (g / g.sum(-1, keepdim=True)).to(h.dtype)
        return logits, g, idx
    gate.forward = fwd


def run_shape(shape: str, T: int, skew: float, impls: list[str], results: list, dense: float):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    base = dict(vocab_size=256, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                num_hidden_layers=1, intermediate_size=1024)
    cfg = ModelConfig(**base, **SHAPES[shape])
    E, K, H, Fd = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    idx = draw_routing(T, E, K, skew, gen).to(DEV)
    counts = torch.bincount(idx.flatten(), minlength=E)
    lmo = float(counts.max() / counts.float().mean())
    layer = MoELayer(cfg, 0).to(DEV).to(torch.bfloat16)
    layer.router = FixedRouter(layer.router.weight, idx)
    x = (torch.randn(1, T, H, device=DEV, dtype=torch.bfloat16)).requires_grad_()
    dy = torch.randn(1, T, H, device=DEV, dtype=torch.bfloat16)
    P = T * K
    fl_fwd, fl_bwd = 6 * P * H * Fd, 12 * P * H * Fd
    if cfg.n_shared_experts:
        fl_fwd += 6 * T * H * Fd * cfg.n_shared_experts
        fl_bwd += 12 * T * H * Fd * cfg.n_shared_experts
    row = dict(shape=shape, tokens=T, skew=skew, load_max_over_mean=lmo)

    def fwd():
        with torch.no_grad():
            layer(x)

    def fwdbwd():
        layer(x).backward(dy)
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    if PROFILE_DIR and DEV == "cuda":
        from torch.profiler import ProfilerActivity, profile
        layer.runtime = MoERuntime(policy=KeepPolicy(PROFILE_KEEP))
        fwdbwd()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fwdbwd()
            torch.cuda.synchronize()
        Path(PROFILE_DIR, f"profile_{shape}_{skew}_keep{PROFILE_KEEP}.txt").write_text(
            prof.key_averages().table(sort_by="cuda_time_total", row_limit=50))
        layer.runtime = MoERuntime()
        if PROFILE_ONLY:
            return
    row["ours_fwd_ms"] = bench(fwd)
    row["ours_fwdbwd_ms"] = bench(fwdbwd)
    row["ours_fwdbwd_tflops"] = (fl_fwd + fl_bwd) / (row["ours_fwdbwd_ms"] * 1e-3) / 1e12

    # expert GEMMs alone, on rows already grouped by expert
    counts_l = counts.tolist()
    xs = torch.randn(P, H, device=DEV, dtype=torch.bfloat16)
    dys = torch.randn(P, H, device=DEV, dtype=torch.bfloat16)
    w13, w2 = layer.experts.gate_up_proj.detach(), layer.experts.down_proj.detach()
    offs = offsets(counts_l, xs.device)
    y0, gu0 = swiglu_forward(xs, w13, w2, counts_l, offs)
    gf = bench(lambda: swiglu_forward(xs, w13, w2, counts_l, offs))
    gb = bench(lambda: swiglu_backward(xs, gu0, dys, w13, w2, counts_l, offs))
    row["gemm_fwd_tflops"] = 6 * P * H * Fd / (gf * 1e-3) / 1e12
    row["gemm_bwd_tflops"] = 12 * P * H * Fd / (gb * 1e-3) / 1e12
    row["gemm_fwdbwd_frac_of_dense"] = 18 * P * H * Fd / ((gf + gb) * 1e-3) / 1e12 / dense

    # keep ratios: backward time = fwd+bwd - fwd
    for keep in (1.0, 0.75, 0.5):
        layer.runtime = MoERuntime(policy=KeepPolicy(keep))
        fb = bench(fwdbwd)
        row[f"keep{keep}_fwdbwd_ms"] = fb
        row[f"keep{keep}_bwd_ms"] = fb - row["ours_fwd_ms"]
    from lrmoe.parallel.exchange import BackwardOptions
    layer.runtime = MoERuntime(policy=KeepPolicy(0.5), backward=BackwardOptions(compaction=False))
    row["keep0.5_nocompact_bwd_ms"] = bench(fwdbwd) - row["ours_fwd_ms"]
    layer.runtime = MoERuntime()

    # correctness against HF and the peer's time
    row["peer"] = {}
    for impl in impls:
        try:
            blk = hf_block(shape, cfg, impl).to(DEV).to(torch.bfloat16)
            with torch.no_grad():
                blk.gate.weight.copy_(layer.router.weight)
                blk.experts.gate_up_proj.copy_(layer.experts.gate_up_proj)
                blk.experts.down_proj.copy_(layer.experts.down_proj)
                if cfg.n_shared_experts:
                    for n in ("gate_proj", "up_proj", "down_proj"):
                        getattr(blk.shared_experts, n).weight.copy_(
                            getattr(layer.shared_experts, n).weight)
            patch_hf_routing(blk, idx)
            with torch.no_grad():
                ya, yb = layer(x).float(), blk(x).float()
            err = float((ya - yb).norm() / yb.norm())

            def pf(blk=blk):
                with torch.no_grad():
                    blk(x)

            def pfb(blk=blk):
                blk(x).backward(dy)
                x.grad = None
                for p in blk.parameters():
                    p.grad = None
            row["peer"][impl] = dict(fwd_ms=bench(pf), fwdbwd_ms=bench(pfb), rel_err_vs_ours=err)
        except Exception as e:  # an implementation this transformers build lacks, or OOM
            row["peer"][impl] = dict(error=f"{type(e).__name__}: {str(e)[:160]}")
        if DEV == "cuda":
            torch.cuda.empty_cache()
    ok = {k: v for k, v in row["peer"].items() if "fwdbwd_ms" in v}
    if ok:
        best = min(ok, key=lambda k: ok[k]["fwdbwd_ms"])
        row["peer_best"] = best
        row["speedup_fwdbwd_vs_peer"] = ok[best]["fwdbwd_ms"] / row["ours_fwdbwd_ms"]
        row["speedup_fwd_vs_peer"] = ok[best]["fwd_ms"] / row["ours_fwd_ms"]
    results.append(row)
    if DEV == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--shapes", default="qwen3,glm")
    ap.add_argument("--skews", default="0,1")
    ap.add_argument("--impls", default="grouped_mm,batched_mm,eager")
    ap.add_argument("--out", default="moe_layer_results.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile-dir", default=None)
    ap.add_argument("--profile-keep", type=float, default=1.0)
    ap.add_argument("--profile-only", action="store_true")
    a = ap.parse_args()
    global DEV, PROFILE_DIR, PROFILE_KEEP, PROFILE_ONLY
    DEV, PROFILE_DIR, PROFILE_KEEP, PROFILE_ONLY = a.device, a.profile_dir, a.profile_keep, a.profile_only
    dense = dense_ceiling()
    results: list = []
    for shape in a.shapes.split(","):
        for skew in (float(s) for s in a.skews.split(",")):
            t0 = time.time()
            run_shape(shape, a.tokens, skew, a.impls.split(","), results, dense)
            if PROFILE_ONLY:
                continue
            print(f"[{shape} skew={skew}] done in {time.time() - t0:.0f}s", flush=True)
    import transformers
    meta = dict(device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)",
                torch=torch.__version__,
                transformers=transformers.__version__, python=platform.python_version(),
                dense_bf16_tflops=dense, date=time.strftime("%Y-%m-%d"), argv=sys.argv)
    Path(a.out).write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    print(json.dumps(meta))
    hdr = (f"{'shape':6} {'skew':>4} {'lmax/mean':>9} {'fwd ms':>7} {'f+b ms':>7} {'peer f+b':>8} "
           f"{'x peer':>6} {'gemm%dense':>10} {'bwd k1':>7} {'bwd k.75':>8} {'bwd k.5':>7} {'k.5/k1':>6} "
           f"{'k.5 nocomp':>10}")
    print(hdr)
    for r in results if not PROFILE_ONLY else []:
        pb = r["peer"].get(r.get("peer_best", ""), {}).get("fwdbwd_ms", float("nan"))
        print(f"{r['shape']:6} {r['skew']:>4} {r['load_max_over_mean']:>9.2f} {r['ours_fwd_ms']:>7.2f} "
              f"{r['ours_fwdbwd_ms']:>7.2f} {pb:>8.2f} {r.get('speedup_fwdbwd_vs_peer', 0):>6.2f} "
              f"{100 * r['gemm_fwdbwd_frac_of_dense']:>9.1f}% {r['keep1.0_bwd_ms']:>7.2f} "
              f"{r['keep0.75_bwd_ms']:>8.2f} {r['keep0.5_bwd_ms']:>7.2f} "
              f"{r['keep0.5_bwd_ms'] / r['keep1.0_bwd_ms']:>6.2f} {r['keep0.5_nocompact_bwd_ms']:>10.2f}")
        for k, v in r["peer"].items():
            print(f"    peer {k}: {v}")


if __name__ == "__main__":
    main()
