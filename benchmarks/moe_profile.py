"""Where the time and the memory of one MoE layer go: ours against HF transformers'
``grouped_mm`` block under ``torch.compile``, category by category (issue 16).

For each shape, token count and routing skew, three variants run one forward+backward
with the same weights and the same routing (built by ``moe_layer.py``): ``ours`` (eager
``MoELayer``, everything kept), ``ours_rg_experts`` (``BackwardOptions(router_grad=
"experts")``) and ``hf_compiled`` (HF's block, ``grouped_mm`` experts, inductor).

- Time: ``torch.profiler`` over ``--iters`` forward+backward iterations after warm-up;
  device kernel time per iteration by category (:data:`profile_parse.CATEGORIES`, a
  documented table of name regexes; the unclassified kernels are listed), split into
  forward and backward, plus ``stage:*`` ranges where the code has them, the device's
  busy time and span, and the wall time (median of CUDA events, profiler off).
- Memory: one forward+backward under ``torch.cuda.memory._record_memory_history``; the
  allocator trace gives the peak (cross-checked against ``max_memory_allocated``) and
  who holds the bytes then, by allocating frame (:func:`profile_parse.attribute`).
- Host syncs (CUDA): one forward+backward under ``torch.cuda.set_sync_debug_mode("warn")``;
  every synchronizing call is recorded with the innermost frames of this repository,
  lrmoe or transformers (:func:`sync_sites`), so the device's idle time inside the call
  can be traced to the lines that make it wait.
- Gap: per category, ours minus HF compiled.

Writes ``moe_profile.json`` (every number, every kernel) and ``moe_profile.md`` into --out.

Usage (GPU):  python3 benchmarks/moe_profile.py --out DIR [--shapes qwen3,glm] [--tokens 16384]
Smoke (CPU):  python3 benchmarks/moe_profile.py --out DIR --smoke   (toy shapes; CPU operator
              events stand in for kernels; no memory history)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_layer as ml  # noqa: E402  (also puts src/ on the path)
import profile_parse as pp  # noqa: E402
from gpu_common import GiB, fmt, out_dir, run_meta, write_outputs  # noqa: E402

from lrmoe.model.moe import MoERuntime  # noqa: E402
from lrmoe.parallel.exchange import BackwardOptions  # noqa: E402

VARIANTS = ("ours", "ours_rg_experts", "hf_compiled")
LABEL = {"ours": "ours", "ours_rg_experts": "ours rg@e", "hf_compiled": "HF compiled"}


def _sync() -> None:
    if ml.DEV == "cuda":
        torch.cuda.synchronize()


# the memory markers: allocations whose frames name these functions delimit the call
def _mark_start():
    return torch.empty(1, device=ml.DEV)


def _mark_forward_end():
    return torch.empty(1, device=ml.DEV)


def _mark_end():
    return torch.empty(1, device=ml.DEV)


def site_prefixes() -> tuple[str, ...]:
    """Where an allocating frame counts as ours, HF's or the compiler's."""
    import lrmoe
    out = [os.path.dirname(lrmoe.__file__) + "/", str(Path(__file__).resolve().parent) + "/",
           "torchinductor", os.path.dirname(torch.__file__) + "/_inductor/"]
    try:
        import transformers
        out.append(os.path.dirname(transformers.__file__) + "/")
    except ImportError:
        pass
    return tuple(out)


def profile_time(mod, x, dy, a, clear, trace_path: Path | None) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ml.DEV == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(a.iters):
            with record_function(pp.ITER):
                with record_function(pp.FWD):
                    y = mod(x)
                    _sync()
                with record_function(pp.BWD):
                    y.backward(dy)
                    _sync()
                del y
                clear()
    with tempfile.TemporaryDirectory() as td:
        p = Path(td, "trace.json")
        prof.export_chrome_trace(str(p))
        raw = p.read_bytes()
    if trace_path is not None:
        trace_path.write_bytes(gzip.compress(raw))
    events = json.loads(raw)
    return pp.summarize(events["traceEvents"] if isinstance(events, dict) else events, a.iters)


def sync_sites(records: list[list[str]], top: int = 12) -> dict:
    """``records``: per synchronizing call, its frames (innermost last) as ``file:line fn``.
    Returns the total and the ``top`` sites (the innermost frame under ``site_prefixes``,
    else the innermost frame) with their counts, most frequent first."""
    keys = site_prefixes()
    counts: dict[str, int] = {}
    for frames in records:
        ours = [f for f in frames if any(k in f for k in keys)]
        site = (ours or frames or ["<no python frame>"])[-1]
        counts[site] = counts.get(site, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return {"count": len(records), "sites": ranked[:top]}


def profile_syncs(mod, x, dy, clear) -> dict:
    """The synchronizing calls of one forward+backward (CUDA's sync debug mode)."""
    import traceback as tb
    import warnings
    if ml.DEV != "cuda":
        return {"error": "not measured: the sync debug mode needs CUDA"}
    records: list[list[str]] = []
    old_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message).lower():
            records.append([f"{f.filename}:{f.lineno} {f.name}" for f in tb.extract_stack()[:-1]])
        else:
            old_show(message, category, filename, lineno, file, line)

    _sync()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            mod(x).backward(dy)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old_show
    _sync()
    clear()
    return sync_sites(records)


def profile_memory(mod, x, dy, a, clear) -> dict:
    """One forward+backward under the allocator's history; the peak and who holds it."""
    if ml.DEV != "cuda":
        return dict(error="not measured: the allocator history needs CUDA (CPU smoke run)")
    hist = getattr(torch.cuda.memory, "_record_memory_history", None)
    snap_fn = getattr(torch.cuda.memory, "_snapshot", None)
    if hist is None or snap_fn is None:
        msg = (f"not measured: torch {torch.__version__} lacks "
               "torch.cuda.memory._record_memory_history/_snapshot")
        print(msg, flush=True)
        return dict(error=msg)
    clear()
    _sync()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    kw = dict(enabled="all", context="all", stacks=a.stacks, max_entries=a.max_entries)
    try:
        try:
            hist(**kw, clear_history=True)  # the previous variant's entries go
        except TypeError:
            hist(**kw)  # older signature: the last markers still delimit this call
    except (TypeError, RuntimeError) as e:
        msg = f"not measured: _record_memory_history(...) failed on torch {torch.__version__}: {e}"
        print(msg, flush=True)
        return dict(error=msg)
    try:
        m0 = _mark_start()
        y = mod(x)
        m1 = _mark_forward_end()
        y.backward(dy)
        del y
        m2 = _mark_end()
        _sync()
        stat_peak = torch.cuda.max_memory_allocated() - start
        stat_left = torch.cuda.memory_allocated() - start
        snap = snap_fn()
    finally:
        hist(enabled=None)
    del m0, m1, m2
    clear()
    try:
        rep = pp.replay(snap["device_traces"][torch.cuda.current_device()])
    except (ValueError, KeyError, IndexError) as e:  # e.g. history shorter than the call
        msg = f"not measured: the allocator trace could not be read ({type(e).__name__}: {e})"
        print(msg, flush=True)
        return dict(error=msg, allocator_peak_bytes=stat_peak)
    out = pp.attribute(rep, site_prefixes())
    out.update(allocator_peak_bytes=stat_peak, allocator_left_bytes=stat_left,
               trace_entries=rep["entries"], free_action=rep["free_action"])
    return out


def run_variant(name: str, mod, x, dy, a, ref, tag: str) -> dict:
    def clear():
        x.grad = None
        for p in mod.parameters():
            p.grad = None

    def step():
        mod(x).backward(dy)
        clear()

    t0 = time.time()
    try:
        y = mod(x)  # warm-up (compiles), and the output against ours
        out = dict(rel_err_vs_ours=None if ref is None else
                   float((y.detach().float() - ref).norm() / ref.norm()))
        y.backward(dy)
        del y
        clear()
        for _ in range(a.warmup):
            step()
        out["wall_ms"] = ml.bench(step)
        tp = Path(a.out, f"trace_{tag}_{name}.json.gz") if a.traces else None
        out["time"] = profile_time(mod, x, dy, a, clear, tp)
    except Exception as e:  # one variant failing must not lose the others
        traceback.print_exc()
        out = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        if ml.DEV == "cuda":
            torch.cuda.empty_cache()
    if "error" not in out:
        try:
            out["syncs"] = profile_syncs(mod, x, dy, clear)
        except Exception as e:
            out["syncs"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        try:  # e.g. out of memory with the history on: the times stay
            out["memory"] = profile_memory(mod, x, dy, a, clear)
        except Exception as e:
            traceback.print_exc()
            out["memory"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            if ml.DEV == "cuda":
                torch.cuda.empty_cache()
    clear()
    print(f"  [{tag} {name}] {time.time() - t0:.0f}s", flush=True)
    return out


def run_shape(shape: str, T: int, skews: list[float], a, rows: list) -> None:
    cfg, layer, idx, x, dy = ml.build_layer(shape, T, a.smoke)
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    hf = torch.compile(ml.hf_twin(shape, cfg, "grouped_mm", layer, idx),
                       backend=a.compile_backend, dynamic=False)
    gen = torch.Generator().manual_seed(1)
    runtimes = {"ours": MoERuntime(),
                "ours_rg_experts": MoERuntime(backward=BackwardOptions(router_grad="experts"))}
    for skew in skews:
        idx.copy_(ml.draw_routing(T, E, K, skew, gen))  # in place: compiled once per shape
        counts = torch.bincount(idx.flatten(), minlength=E)
        tag = f"{shape}_{T}_{skew:g}"
        layer.runtime = MoERuntime()
        with torch.no_grad():
            ref = layer(x).float()
        row = dict(shape=shape, tokens=T, skew=skew,
                   load_max_over_mean=float(counts.max() / counts.float().mean()))
        for v in VARIANTS:
            if v in runtimes:
                layer.runtime = runtimes[v]
            row[v] = run_variant(v, hf if v == "hf_compiled" else layer, x, dy, a,
                                 None if v == "ours" else ref, tag)
        layer.runtime = MoERuntime()
        rows.append(row)
    if ml.DEV == "cuda":
        torch.cuda.empty_cache()


def _ms(v: dict, cat: str, key: str = "ms"):
    t = v.get("time")
    return None if t is None else t["categories"][cat][key]


def _gib(v: dict, key: str):
    m = v.get("memory") or {}
    val = m.get(key) if key in m else (m.get("split") or {}).get(key)
    return None if val is None else val / GiB


def time_table(row: dict) -> list[str]:
    """Per category: each variant's ms (forward / backward) and ours minus HF compiled."""
    o, h = row["ours"], row["hf_compiled"]
    lines = ["| category | ours ms (fwd / bwd) | ours rg@e ms | HF compiled ms (fwd / bwd) "
             "| ours − HF ms |", "|---|---|---|---|---|"]

    def line(label, vals, shown=None):
        d = None if vals[0] is None or vals[2] is None else vals[0] - vals[2]
        shown = shown or [fmt(v) for v in vals]
        lines.append(f"| {label} | " + " | ".join(shown) + f" | {fmt(d, '+.2f')} |")

    def split(v, cat):
        return f"{fmt(_ms(v, cat))} ({fmt(_ms(v, cat, 'fwd_ms'))} / {fmt(_ms(v, cat, 'bwd_ms'))})"

    for cat in [*pp.CATEGORIES, pp.OTHER]:
        vals = [_ms(row[v], cat) for v in VARIANTS]
        line(cat, vals, [split(o, cat), fmt(vals[1]), split(h, cat)])
    for label, key in (("**kernel time, total**", "total_ms"), ("device busy (union)", "busy_ms"),
                       ("device span (first kernel start to last end)", "span_ms")):
        line(label, [(row[v].get("time") or {}).get(key) for v in VARIANTS])
    line("device idle within the span",
         [None if (row[v].get("time") or {}).get("span_ms") is None
          else row[v]["time"]["span_ms"] - row[v]["time"]["busy_ms"] for v in VARIANTS])
    line("**wall, profiler off (median)**", [row[v].get("wall_ms") for v in VARIANTS])
    return lines


def gap_summary(row: dict) -> list[str]:
    """One line: where ours spends more than HF compiled, largest first (ms per iteration)."""
    o, h = row["ours"].get("time"), row["hf_compiled"].get("time")
    if not o or not h:
        return []
    d = {c: o["categories"][c]["ms"] - h["categories"][c]["ms"] for c in [*pp.CATEGORIES, pp.OTHER]}
    if o.get("span_ms") is not None and h.get("span_ms") is not None:
        d["device idle"] = (o["span_ms"] - o["busy_ms"]) - (h["span_ms"] - h["busy_ms"])
    top = sorted(d.items(), key=lambda kv: -kv[1])
    return ["Ours minus HF compiled, largest first: "
            + ", ".join(f"{k} {v:+.2f} ms" for k, v in top) + ".", ""]


def memory_lines(row: dict) -> list[str]:
    lines = ["| memory, GiB above the call's start | " + " | ".join(LABEL[v] for v in VARIANTS)
             + " | ours − HF |", "|---|---|---|---|---|"]
    for label, key in (("peak (allocator trace)", "peak_bytes"), ("peak (max_memory_allocated)",
                                                                 "allocator_peak_bytes"),
                       ("alive at the peak, allocated in forward (kept for backward)", "forward_kept"),
                       ("alive at the peak, allocated in backward", "backward"),
                       ("  of which left after the call (gradients)", "left_after")):
        g = [_gib(row[v], key) for v in VARIANTS]
        d = None if g[0] is None or g[2] is None else g[0] - g[2]
        lines.append(f"| {label} | " + " | ".join(fmt(x) for x in g) + f" | {fmt(d, '+.2f')} |")
    for v in VARIANTS:
        m = row[v].get("memory") or {}
        if "error" in m or "error" in row[v]:
            lines += ["", f"{LABEL[v]}: memory {m.get('error') or row[v].get('error')}"]
            continue
        lines += ["", f"{LABEL[v]}: bytes alive at the peak by allocating frame (innermost frame "
                      "in lrmoe, transformers, inductor or this benchmark, with up to two callers):",
                  "", "| GiB | fwd / bwd GiB | blocks | site |", "|---|---|---|---|"]
        for site, s in list(m["sites"].items())[:10]:
            lines.append(f"| {s['bytes'] / GiB:.3f} | {s['forward'] / GiB:.3f} / {s['backward'] / GiB:.3f} "
                         f"| {s['blocks']} | `{site.replace('|', '¦')}` |")
    return lines


def markdown(meta: dict, rows: list[dict], a) -> str:
    out = [f"# One MoE layer, forward+backward, profiled by category ({meta['device']})", "",
           f"`{meta['command']}` — torch {meta['torch']}, transformers {meta['transformers']}, "
           f"{meta['date']}.", "",
           f"Kernel ms per iteration, averaged over {a.iters} profiled iterations after warm-up "
           "(a synchronize closes the forward and the backward ranges). Categories: the first "
           "regex of `profile_parse.CATEGORIES` that matches the kernel name; `other` = none "
           "(listed below). `device idle` = span minus busy time: host work, syncs and launch "
           "gaps inside the iteration. `ours rg@e`: `BackwardOptions(router_grad=\"experts\")`."]
    if a.smoke:
        out += ["", "**Smoke run (CPU): times are CPU operator self times of toy shapes, not "
                    "results; the allocator history needs CUDA, so memory is not measured.**"]
    for r in rows:
        out += ["", f"## {r['shape']}, {r['tokens']:,} tokens, skew {r['skew']:g} "
                    f"(max/mean load {r['load_max_over_mean']:.2f})", ""]
        errs = [f"- {LABEL[v]}: {r[v]['error']}" for v in VARIANTS if "error" in r[v]]
        out += errs + ([""] if errs else [])
        out += time_table(r) + [""] + gap_summary(r)
        err = [f"{LABEL[v]} {r[v]['rel_err_vs_ours']:.1e}" for v in VARIANTS
               if r[v].get("rel_err_vs_ours") is not None]
        out.append("Output rel. error vs ours (same weights and routing): " + (", ".join(err) or "—"))
        st = (r["ours"].get("time") or {}).get("stages") or {}
        out += ["", "Stage ranges in ours: " + (", ".join(f"`{k}` {v:.2f} ms" for k, v in st.items())
                                                 if st else "none (MoELayer marks no `stage:*` "
                                                 "profiler ranges; the categories stand in)")]
        for v in VARIANTS:
            ks = [(k, d) for k, d in ((r[v].get("time") or {}).get("kernels") or {}).items()
                  if d["category"] == pp.OTHER][:5]
            if ks:
                out += ["", f"{LABEL[v]}: top unclassified (`other`):"]
                out += [f"- {d['ms']:.3f} ms, {d['calls']:g}×: `{k[:160]}`" for k, d in ks]
        out += [""] + memory_lines(r) + sync_lines(r)
    return "\n".join(out) + "\n"


def sync_lines(row: dict) -> list[str]:
    """Host syncs per forward+backward, and where ours makes them."""
    out = ["", "Host synchronizations in one forward+backward (`set_sync_debug_mode`): " + ", ".join(
        f"{LABEL[v]} " + (str(row[v]["syncs"]["count"]) if "count" in row[v].get("syncs", {})
                          else row[v].get("syncs", {}).get("error", "—"))
        for v in VARIANTS)]
    sites = (row["ours"].get("syncs") or {}).get("sites") or []
    if sites:
        out += ["", "| syncs | site in ours (innermost frame in this repository) |", "|---|---|"]
        out += [f"| {n} | `{site}` |" for site, n in sites]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for moe_profile.json and moe_profile.md")
    ap.add_argument("--smoke", action="store_true", help="toy shapes on the CPU (logic only)")
    ap.add_argument("--shapes", default="qwen3,glm")
    ap.add_argument("--tokens", default=None, help="comma list (default 16384; smoke 64)")
    ap.add_argument("--skews", default="0", help="comma list of Zipf exponents (0 = uniform)")
    ap.add_argument("--iters", type=int, default=3, help="profiled iterations (averaged)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile-backend", default=None, help="default inductor (smoke: aot_eager)")
    ap.add_argument("--stacks", default="python", choices=("python", "all"),
                    help="allocation frames: python (fast) or all (adds C++, slow to symbolize)")
    ap.add_argument("--max-entries", type=int, default=2_000_000, help="allocator history length")
    ap.add_argument("--traces", action="store_true", help="also keep each Chrome trace (.json.gz)")
    a = ap.parse_args()
    ml.DEV = "cpu" if a.smoke else "cuda"
    if ml.DEV == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: run on the GPU, or pass --smoke for the CPU logic check")
    bad = [s for s in a.shapes.split(",") if s not in ml.SHAPES]
    if bad:
        ap.error(f"--shapes: unknown {bad}; valid: {sorted(ml.SHAPES)}")
    try:
        tokens = [int(t) for t in (a.tokens or ("64" if a.smoke else "16384")).split(",")]
        skews = [float(s) for s in a.skews.split(",")]
    except ValueError as e:
        ap.error(f"--tokens/--skews: {e}")
    if min(tokens) < 1 or min(skews) < 0 or a.iters < 1 or a.warmup < 0:
        ap.error("--tokens must be >= 1, --skews >= 0, --iters >= 1, --warmup >= 0")
    a.compile_backend = a.compile_backend or ("aot_eager" if a.smoke else "inductor")
    d = out_dir(a.out)
    rows: list = []
    t0 = time.time()
    for shape in a.shapes.split(","):
        for T in tokens:
            run_shape(shape, T, skews, a, rows)
            print(f"[{shape} T={T}] done at {time.time() - t0:.0f}s", flush=True)
    meta = run_meta(ml.DEV, None)  # no dense ceiling here (moe_layer.py measures it)
    meta.update(categories=pp.CATEGORIES, iters=a.iters, warmup=a.warmup, wall_s=time.time() - t0)
    md = markdown(meta, rows, a)
    write_outputs(d, "moe_profile", meta, rows, md)
    print(md)


if __name__ == "__main__":
    main()
