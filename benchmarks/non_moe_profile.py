"""What the ``non_moe`` time of ``lrmoe bench ttl`` is made of, from a profile.

``bench ttl`` charges each step ``non_moe_s = (step wall − the emulator's MoE wall − the
offloaded optimizer's host part) / G`` (:mod:`lrmoe.sim.ttl`). This runs a few steps of a
workload through :func:`lrmoe.sim.ttl.bench_ttl` itself (static, registered settings)
under ``torch.profiler`` and splits each step's non-MoE wall into categories.

:func:`analyse` (pure, over the Chrome trace): a step is its ``ttl:step`` range; the MoE
wall is the ``ttl:moe_forward`` ranges less their ``stage:route`` parts (router and
shared experts, non-MoE for ``bench ttl``) plus each ``ExpertExchangeBackward`` node;
the host optimizer step is its ``offload:host_step`` range (``HostOffloadAdamW`` marks
it). Every device kernel (on the CPU: every leaf operator) is placed by the operator
that launched it: its ranges (``ttl:*`` phase, ``mod:<class>`` from global module hooks, ``stage:*``),
and for a backward operator those of the forward operator with the same autograd
sequence number. Device busy time goes to the categories of the kernels running then
(the first where they overlap), idle time to "host gap" of the host's phase; the
categories add up to the trace's non-MoE time, shown beside the run's recorded one.
Beside them, the part's FLOP floor (:func:`flop_floor`: its matmuls at the bf16 matmul
rate measured in the run) and the trace's non-MoE time as a multiple of it.

    python3 benchmarks/non_moe_profile.py --out DIR               # GPU, ~2-3 min
    python3 benchmarks/non_moe_profile.py --out DIR --device cpu --preset tiny-qwen3 \\
        --config '' --batch-size 8 --seq-len 32 --ep 4 --mem-budget '' --steps 3

Writes ``non_moe_profile.json`` and ``non_moe_profile.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpu_common import (  # noqa: E402
    check_device,
    cli,
    csv,
    dense_tflops,
    md_head,
    out_dir,
    run_meta,
    write_outputs,
)

from lrmoe.errors import LrmoeError  # noqa: E402
from lrmoe.train.offload import HOST_STEP_RANGE  # noqa: E402

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
SYNC_CALLS = re.compile(r"Synchronize|^cudaMemcpy$|^cuMemcpyDtoH")
SDPA = re.compile(r"scaled_dot_product|flash|efficient_attention|cudnn_attention|fmha", re.I)
CAST = re.compile(r"^aten::(_to_copy|to|copy_)$")
HOST_STEP = HOST_STEP_RANGE  # the host part of HostOffloadAdamW.step
HOST_CAT = "optimizer: experts' host step (excluded: host_s)"


# ------------------------------------------------------------------ trace reading
class Ev:
    """One complete ("X") event of a Chrome trace, with its parent on its thread."""

    __slots__ = ("name", "cat", "tid", "ts", "end", "args", "parent", "leaf")

    def __init__(self, e: dict):
        self.name, self.cat, self.tid = e["name"], e.get("cat", ""), e.get("tid")
        self.ts = float(e["ts"])
        self.end = self.ts + float(e.get("dur", 0.0))
        self.args = e.get("args") or {}
        self.parent: Ev | None = None
        self.leaf = True

    def ancestors(self):
        p = self.parent
        while p is not None:
            yield p
            p = p.parent


def nest(events: list[Ev]) -> None:
    """Set each host event's parent: the innermost event of its thread that contains it."""
    by_tid: dict = defaultdict(list)
    for e in events:
        by_tid[e.tid].append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e.ts, -e.end))
        stack: list[Ev] = []
        for e in evs:
            while stack and stack[-1].end < e.end - 1e-3:
                stack.pop()
            if stack:
                e.parent = stack[-1]
                if e.cat == "cpu_op":
                    stack[-1].leaf = False
            stack.append(e)


def union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def subtract(base: tuple[float, float], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``base`` less the (disjoint, sorted) intervals ``cut``."""
    out, a = [], base[0]
    for c0, c1 in cut:
        if c1 <= a or c0 >= base[1]:
            continue
        if c0 > a:
            out.append((a, c0))
        a = max(a, c1)
    if a < base[1]:
        out.append((a, base[1]))
    return out


def overlap(iv: tuple[float, float], segs: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(max(iv[0], a), min(iv[1], b)) for a, b in segs if min(iv[1], b) > max(iv[0], a)]


def ms(segs) -> float:
    """Total length of ``segs`` (trace µs) in ms."""
    return sum(b - a for a, b in segs) / 1e3


class Trace:
    """A profile's events, with forward/backward links (see module doc)."""

    def __init__(self, trace: dict):
        xs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
        self.host = [Ev(e) for e in xs if e.get("cat") in ("cpu_op", "user_annotation",
                                                           "cuda_runtime", "cuda_driver")]
        nest(self.host)
        dev = [Ev(e) for e in xs if e.get("cat") in DEVICE_CATS]
        launch = {e.args.get("correlation"): e for e in self.host
                  if e.cat in ("cuda_runtime", "cuda_driver") and "correlation" in e.args}
        if dev:  # each kernel with the host event that launched it
            self.device = [(d, launch.get(d.args.get("correlation"))) for d in dev]
            self.cpu_only = False
        else:  # the CPU: leaf operators stand in for kernels
            self.device = [(e, e) for e in self.host if e.cat == "cpu_op" and e.leaf]
            self.cpu_only = True
        self.fwd_of: dict[int, Ev] = {}
        for e in self.host:
            seq = e.args.get("Sequence number")
            if e.cat == "cpu_op" and seq is not None and not _in_backward(e):
                self.fwd_of.setdefault(seq, e)
        self.ranges = [e for e in self.host if e.cat == "user_annotation"]

    def named(self, name: str) -> list[Ev]:
        return sorted((e for e in self.host if e.name == name), key=lambda e: e.ts)


def _in_backward(e: Ev) -> bool:
    return any(a.name.startswith("autograd::engine::evaluate_function") for a in
               [e, *e.ancestors()])


def labels(tr: Trace, op: Ev | None) -> tuple[list[str], str, str]:
    """``(ranges outer→inner, direction, op names)`` of a launching host event: its own
    ranges, or for a backward operator its forward operator's."""
    if op is None:
        return [], "?", ""
    chain = [op, *op.ancestors()]
    names = " ".join(a.name for a in chain if a.cat == "cpu_op")
    node = next((a for a in chain if a.name.startswith("autograd::engine::evaluate_function")),
                None)
    if node is None:
        return [a.name for a in reversed(chain) if a.cat == "user_annotation"], "fwd", names
    if "AccumulateGrad" in node.name:
        return ["grad accumulation"], "bwd", names
    fwd = tr.fwd_of.get(node.args.get("Sequence number"))
    if fwd is None:
        return [], "bwd", names
    return ([a.name for a in reversed([fwd, *fwd.ancestors()]) if a.cat == "user_annotation"],
            "bwd", names + " " + fwd.name)


def category(rs: list[str], direction: str, names: str, kernel: str) -> str:
    """The category of a kernel from its launching operator's ranges and names."""
    if not rs and direction == "?":
        return "kernels with no launch found"
    if HOST_STEP in rs:
        return HOST_CAT
    if "grad accumulation" in rs:
        return "gradient accumulation (AccumulateGrad)"
    if re.search(r"aten::empty|aten::new_empty", names) and re.search(r"fill", kernel + names,
                                                                        re.I):
        return "deterministic fill of new tensors"
    if "step:clip" in rs:
        return "gradient clipping"
    if "step:optimizer" in rs:
        return "optimizer: AdamW on the device"
    d = f" ({direction})"
    if "ttl:moe_forward" in rs:
        if any(r == "stage:route" for r in rs):
            return "routers, aux loss, shared experts" + d
        if "stage:weight_scatter" in rs:
            return "expert weight casts and instance gather" + d
        return "MoE layer glue around the emulator (casts, reshapes)" + d
    mods = [r[4:] for r in rs if r.startswith("mod:")]
    inner = mods[-1] if mods else ""
    if "Attention" in mods:
        if inner == "RMSNorm":
            return "norms" + d
        if inner == "Linear":
            return ("autocast casts of dense weights" if CAST.search(names.split(" ")[0])
                    else "attention projections" + d)
        if SDPA.search(kernel) or SDPA.search(names):
            return "attention SDPA" + d
        return "attention other (q/k norms, rotary, layout copies)" + d
    if inner == "RMSNorm":
        return "norms" + d
    if "MLP" in mods:
        return "dense MLP" + d
    if "step:forward" in rs or "step:backward" in rs or mods or direction == "bwd":
        return "embedding, head, loss, residual adds" + d
    return "step glue (batch, zero_grad, scheduler, end_step)"


def analyse(trace: dict, skip: int = 0) -> dict:
    """Per step (from the ``skip``-th ``ttl:step`` on): the non-MoE time of the trace by
    category (ms), the device's busy and idle time in it, and the host syncs there."""
    tr = Trace(trace)
    steps = tr.named("ttl:step")[skip:]
    # a route range ends when its kernels are launched; bench ttl's clock stops after
    # they ran (a sync): extend it to its last kernel's end
    ext: dict[int, float] = {}
    for d, op in tr.device:
        for a in ([] if op is None else [op, *op.ancestors()]):
            if a.name == "stage:route":
                ext[id(a)] = max(ext.get(id(a), a.end), d.end)
    route = union([(e.ts, ext.get(id(e), e.end)) for e in tr.named("stage:route")])
    moe = []
    for e in tr.named("ttl:moe_forward"):
        moe += subtract((e.ts, e.end), route)
    moe += [(e.ts, e.end) for e in tr.host
            if e.name == "autograd::engine::evaluate_function: ExpertExchangeBackward"]
    moe = union(moe)
    host_step = union([(e.ts, e.end) for e in tr.named(HOST_STEP)])
    phases = [(e.ts, e.end, e.name) for e in tr.ranges
              if e.name in ("step:forward", "step:backward", "step:clip", "step:optimizer")]
    dev_sorted = sorted(tr.device, key=lambda d: d[0].ts)
    syncs = [e for e in tr.host if e.cat in ("cuda_runtime", "cuda_driver")
             and SYNC_CALLS.search(e.name)]
    out = []
    for st in steps:
        window = (st.ts, st.end)
        moe_in = [iv for iv in moe if iv[1] > window[0] and iv[0] < window[1]]
        segs = subtract(window, moe_in)
        cats: dict[str, float] = defaultdict(float)

        def add(cat: str, iv, cats=cats) -> None:
            if iv:
                cats[cat] += ms(iv)
        busy, cover = [], window[0]
        for d, op in dev_sorted:
            if d.end <= window[0] or d.ts >= window[1]:
                continue
            iv = overlap((max(d.ts, cover), d.end), segs)
            add(category(*labels(tr, op), d.name), iv)
            busy += iv
            cover = max(cover, d.end)
        busy = union(busy)
        idle = [iv for seg in segs for iv in subtract(seg, busy)]
        phase_iv = union([(p0, p1) for p0, p1, _ in phases])
        for gap in idle:
            add(HOST_CAT, overlap(gap, host_step))
            for r in subtract(gap, host_step):
                for p0, p1, name in phases:
                    add(f"host gap (device idle): {name.split(':', 1)[1]}", overlap(r, [(p0, p1)]))
                add("host gap (device idle): step glue", subtract(r, phase_iv))
        n_ms, host_ms = ms(segs), ms(iv for h in host_step for iv in overlap(h, segs))
        in_segs = [s for s in syncs if overlap((s.ts, s.end), segs)]
        out.append({
            "step_ms": ms([window]), "moe_wall_ms": ms(iv for m in moe_in for iv in overlap(m, [window])),
            "non_moe_ms": n_ms, "host_step_ms": host_ms, "non_moe_less_host_ms": n_ms - host_ms,
            "busy_ms": ms(busy), "idle_ms": ms(idle), "syncs": len(in_segs),
            "sync_host_ms": ms((s.ts, s.end) for s in in_segs), "categories": dict(cats)})
    return {"steps": out, "cpu_only": tr.cpu_only}


def mean_table(steps: list[dict]) -> dict[str, float]:
    """Mean ms per step of each category over the analysed steps."""
    acc: dict[str, float] = defaultdict(float)
    for s in steps:
        for k, v in s["categories"].items():
            acc[k] += v / len(steps)
    return dict(sorted(acc.items(), key=lambda kv: -kv[1]))


def real_rank_share(cat: str, G: int, dense_share: float, offload: str) -> tuple[float, str]:
    """What fraction of a category's time (all G ranks' tokens, one process) one real EP
    rank spends, reading the code: per-token and per-expert work splits over the ranks
    (1/G); the dense parameters' optimizer step and clipping are done in full by every
    rank (the dense parameters are replicated); host gaps are the host's own time, which
    a real rank making the same calls spends in full (an upper bound: its kernels are
    1/G as long, so it hides less of it); the experts' host step is charged apart."""
    if cat.startswith("optimizer: experts' host step"):
        return 0.0, "charged apart (host_s)"
    if cat.startswith("host gap") or cat.startswith("step glue"):
        return 1.0, "every rank, in full (upper bound)"
    mixed = dense_share + (1 - dense_share) / G
    if cat == "gradient clipping":
        return mixed, "dense params in full, experts' 1/G"
    if cat == "optimizer: AdamW on the device":
        return ((1.0, "dense params only, every rank in full") if offload == "host"
                else (mixed, "dense params in full, experts' 1/G"))
    return 1.0 / G, "1/G (per token or per expert)"


def markdown_table(cats: dict[str, float], G: int, dense_share: float = 0.0,
                   offload: str = "host") -> list[str]:
    lines = md_head("category", "ms per step (all G ranks' tokens)", "ms per rank (/G, as charged)",
                    "a real rank (reading the code)", "rule")
    real = charged = 0.0
    for k, v in cats.items():
        f, rule = real_rank_share(k, G, dense_share, offload)
        c = 0.0 if k.startswith("optimizer: experts' host step") else v / G
        real, charged = real + f * v, charged + c
        lines.append(f"| {k} | {v:.2f} | {c:.3f} | {f * v:.3f} | {rule} |")
    tot = sum(cats.values())
    lines.append(f"| **total (non-MoE time of the trace)** | **{tot:.2f}** | **{charged:.3f}** "
                 f"| **{real:.3f}** | |")
    return lines


# ----------------------------------------------------------------------- running
@contextlib.contextmanager
def instrumented():
    """Module ranges (``mod:<class>``) for every module call; removed after. (The
    offloaded optimizer marks its host part as ``offload:host_step`` itself.)"""
    from torch.nn.modules import module as mm

    stack: list = []

    def pre(m, _args):
        r = torch.profiler.record_function(f"mod:{type(m).__name__}")
        r.__enter__()
        stack.append(r)

    def post(m, _args, _out):
        if stack:
            stack.pop().__exit__(None, None, None)
    h1 = mm.register_module_forward_pre_hook(pre)
    h2 = mm.register_module_forward_hook(post)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


def run(cfg, profile: bool, log) -> tuple[dict, dict | None]:
    """``bench_ttl(cfg)``; with ``profile`` under the profiler: ``(report, trace)``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_

    from lrmoe.sim.ttl import bench_ttl
    if not profile:
        return bench_ttl(cfg, log=log), None
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cfg.train.device == "cuda" else [])
    with instrumented(), prof_(activities=acts) as p:
        rep = bench_ttl(cfg, log=log)
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "t.json"
        p.export_chrome_trace(str(f))
        trace = json.loads(f.read_text())
    return rep, trace


def recorded(rep: dict, skip: int) -> dict:
    """Mean recorded ms per step (the run's own rows) over the analysed steps."""
    rows = rep["policies"]["static"]["steps"][skip:]
    keys = ("wall_s", "moe_wall_s", "non_moe_measured_s", "non_moe_s")
    out = {k.replace("_s", "_ms"): 1e3 * sum(r[k] for r in rows) / len(rows) for k in keys}
    out["host_s_ms"] = out["wall_ms"] - out["moe_wall_ms"] - out["non_moe_measured_ms"]
    return out


def _recorded_line(r: dict, skip: int, steps: int, G: int) -> str:
    """What bench ttl recorded for the analysed steps of the profiled run."""
    return (f"Recorded by bench ttl, mean of steps {skip + 1}–{steps} (ms a step, all G = {G} "
            f"ranks' tokens): profiled: wall {r['wall_ms']:.1f}, MoE wall {r['moe_wall_ms']:.1f}, "
            f"host step {r['host_s_ms']:.1f}, **non_moe_measured {r['non_moe_measured_ms']:.1f} → "
            f"non_moe_s {r['non_moe_ms']:.2f} per rank**.")


def flop_floor(mcfg, batch: int, seq: int, tflops: float) -> dict:
    """The non-MoE part's FLOP floor of one step (one micro-batch of ``batch x seq``
    tokens: all G ranks' tokens, as the trace): its matmul FLOPs, forward + backward
    (3x the forward: the backward computes two products per forward one), at the dense
    bf16 rate ``tflops`` measured in this run. Forward FLOPs per token: the attention
    projections ``2H(Dq + 2Dkv) + 2DqH``, causal SDPA ``2 T Dq`` (its two products over
    the T/2 earlier tokens on average), the router ``2HE``, dense MLPs and shared experts
    ``6HI``, the head ``2HV``. Norms, rotary, casts and the rest move bytes and count no
    FLOPs: the floor is what the part's matmuls cost at the ceiling, and what it takes
    above that is its overhead."""
    H, D = mcfg.hidden_size, mcfg.head_dim
    dq, dkv = mcfg.num_attention_heads * D, mcfg.num_key_value_heads * D
    moe = set(mcfg.moe_layers)
    per_tok = {"attention projections": 0, "attention SDPA": 0, "routers": 0,
               "dense MLPs and shared experts": 0, "head": 2 * H * mcfg.vocab_size}
    for layer in range(mcfg.num_hidden_layers):
        per_tok["attention projections"] += 2 * H * (dq + 2 * dkv) + 2 * dq * H
        per_tok["attention SDPA"] += 2 * seq * dq
        if layer in moe:
            per_tok["routers"] += 2 * H * mcfg.num_experts
            per_tok["dense MLPs and shared experts"] += (
                6 * H * mcfg.moe_intermediate_size * mcfg.n_shared_experts)
        else:
            per_tok["dense MLPs and shared experts"] += 6 * H * mcfg.intermediate_size
    flops = {k: 3 * v * batch * seq for k, v in per_tok.items()}
    total = sum(flops.values())
    return {"flops": flops, "total_flops": total, "dense_bf16_tflops": tflops,
            "floor_ms": total / (tflops * 1e12) * 1e3}


def _floor_line(fl: dict, measured_ms: float, G: int) -> str:
    """The floor against the trace's non-MoE time (less the host step)."""
    return (f"**FLOP floor** of the non-MoE part (module doc of `flop_floor`): "
            f"{fl['total_flops'] / 1e9:,.1f} GFLOP a step at {fl['dense_bf16_tflops']:.3g} "
            f"TFLOP/s (bf16 matmul, measured here) = **{fl['floor_ms']:.3g} ms a step** "
            f"({fl['floor_ms'] / G:.3f} per rank); the trace's non-MoE time less the host "
            f"step is **{measured_ms / fl['floor_ms']:.1f}x the floor** (goal: at most 2x).")


def _model_config(cfg):
    from lrmoe.train.config import resolve_model_config

    return resolve_model_config(cfg.train, vocab_size=None)


def param_split(cfg) -> dict[str, int]:
    """Parameters of the workload's model: the experts' (a real rank holds E/G of them)
    and the rest (every rank holds, clips and steps all of them)."""
    from lrmoe.model import MoEForCausalLM
    from lrmoe.parallel.groups import is_expert_param

    with torch.device("meta"):
        model = MoEForCausalLM(_model_config(cfg))
    out = {"expert": 0, "dense": 0}
    for n, p in model.named_parameters():
        out["expert" if is_expert_param(n) else "dense"] += p.numel()
    return out


@cli
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="benchmarks/configs/qwen3-30b-a3b-layer-2L.json")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--mem-budget", default="2GiB")
    ap.add_argument("--offload", default="host,device",
                    help="optimizer offload settings to profile (host: as registered)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip", type=int, default=2, help="steps left out of the analysis")
    ap.add_argument("--no-deterministic", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from dataclasses import replace

    from lrmoe.sim.ttl import TTLConfig
    offloads = csv(a.offload)
    if not offloads or not set(offloads) <= {"host", "device"}:
        raise LrmoeError(f"--offload {a.offload!r}: use host, device or both")
    if a.steps <= a.skip or a.skip < 0:
        raise LrmoeError(f"--steps {a.steps} must exceed --skip {a.skip} (>= 0)")
    check_device(a.device)
    out = out_dir(a.out)
    base = TTLConfig.from_flat(
        preset=a.preset or None, config=a.config or None, ep=a.ep, policies=("static",),
        mem_budget=a.mem_budget or None, steps=a.steps, batch_size=a.batch_size,
        seq_len=a.seq_len, lr=1e-3, device=a.device, eval_every=0, eval_batches=8,
        seed=a.seed, link="nvlink", deterministic=not a.no_deterministic)
    G, t0 = a.ep, time.perf_counter()
    params = param_split(base)
    floor = flop_floor(_model_config(base), a.batch_size, a.seq_len, dense_tflops(a.device))
    dense = params["dense"] / max(params["dense"] + params["expert"], 1)
    results, md = [], []

    def log(msg):
        print(f"[{time.perf_counter() - t0:.0f}s] {msg}", flush=True)
    for off in offloads:
        log(f"offload {off}: profiled run")
        rep, trace = run(replace(base, train=replace(base.train, optimizer_offload=off)), True, log)
        an = analyse(trace, a.skip)
        s = an["steps"]
        mean = {k: sum(x[k] for x in s) / len(s) for k in
                ("step_ms", "moe_wall_ms", "non_moe_ms", "host_step_ms",
                 "non_moe_less_host_ms", "busy_ms", "idle_ms", "syncs", "sync_host_ms")}
        res = {"optimizer_offload": off, "recorded_profiled": recorded(rep, a.skip),
               "analysis": an, "categories_ms": mean_table(s), "cpu_only": an["cpu_only"],
               "trace_means": mean, "flop_floor": floor,
               "non_moe_over_floor": mean["non_moe_less_host_ms"] / floor["floor_ms"]}
        results.append(res)
        md += [f"## optimizer offload: {off}", "",
               _recorded_line(res["recorded_profiled"], a.skip, a.steps, G),
               f"Trace (profiled run): step {mean['step_ms']:.1f}, MoE wall "
               f"{mean['moe_wall_ms']:.1f}, non-MoE {mean['non_moe_ms']:.1f} of which host step "
               f"{mean['host_step_ms']:.1f} → **non-MoE less host step "
               f"{mean['non_moe_less_host_ms']:.1f}** (device busy {mean['busy_ms']:.1f}, idle "
               f"{mean['idle_ms']:.1f}; {mean['syncs']:.0f} host syncs taking "
               f"{mean['sync_host_ms']:.1f} ms of host time)."
               + (" CPU run: leaf operators stand in for kernels (logic check only)."
                  if an["cpu_only"] else ""), "",
               _floor_line(floor, mean["non_moe_less_host_ms"], G), "",
               *markdown_table(res["categories_ms"], G, dense, off), ""]
        log(f"offload {off}: non-MoE {mean['non_moe_less_host_ms']:.1f} ms a step (trace), "
            f"{res['recorded_profiled']['non_moe_measured_ms']:.1f} recorded")
    meta = run_meta(a.device, argv=argv, config=vars(a), params=params,
                    wall_s=time.perf_counter() - t0)
    text = "\n".join([
        f"# non-MoE time of bench ttl, by category ({meta['device']})", "",
        f"Command: `{meta['command']}`; {meta['date']}; torch {meta['torch']}. Static "
        "policy, registered settings otherwise. Categories add up to the trace's non-MoE "
        "time (module doc of benchmarks/non_moe_profile.py). Parameters: "
        f"{params['expert'] / 1e6:.1f} M in experts (a real rank holds 1/G of them), "
        f"{params['dense'] / 1e6:.1f} M dense (every rank clips and steps all of them).",
        "", *md]) + "\n"
    write_outputs(out, "non_moe_profile", meta, results, text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
