"""Reading a profile of one MoE layer: kernel time by category, and who holds the bytes at
the memory peak. Pure functions over plain data (a ``torch.profiler`` Chrome trace and a
``torch.cuda.memory._snapshot()`` dict), so they are tested on the CPU with synthetic input;
``moe_profile.py`` feeds them the real thing.

Time. Each kernel (``cat`` ``kernel``, ``gpu_memset``, ``gpu_memcpy``) is placed in the
profiled iteration and in its forward or backward by the CPU time of its launch (the
``cuda_runtime``/``cuda_driver`` event with the same ``correlation``), else by its own
start (the runner synchronizes before each range closes, so both land in the range).
Without device events (the CPU smoke run) the ``cpu_op`` events stand in, each counted
by its self time (its span minus its direct children's). Every name gets the first
category of :data:`CATEGORIES` whose regex it matches (case-insensitive), else "other".

Memory. The allocator trace between the start and end markers is replayed: ``alloc``
adds a block, ``free_completed`` removes it (``free_requested`` when a trace has no
completions). The peak is the first moment the bytes allocated since the start marker
(minus blocks freed that were allocated before it) reach their maximum; the blocks alive
then are grouped by allocation site (:func:`site_of`), and split by when they were
allocated (forward: kept for backward; backward: transient or gradient) and whether they
outlive the call (left after: gradients).
"""

from __future__ import annotations

import bisect
import linecache
import re
from collections import defaultdict

# First match wins. Kernel names from eager ATen (often mangled C++), cuBLAS/CUTLASS,
# Triton kernels that inductor names after the ops it fused (``triton_{poi,red,per,tem}_
# fused_<ops>_<n>``), and, for the CPU smoke run, ``aten::`` operator names.
CATEGORIES: dict[str, str] = {
    # dense and grouped GEMMs (grouped_mm is CUTLASS; cuBLAS on Hopper is nvjet/xmma;
    # inductor's mm templates are triton_tem_; cuBLAS split-K ends in splitKreduce)
    "gemm": r"cutlass|gemm|gemv|cublas|nvjet|xmma|wgmma|splitkreduce|^triton_tem_"
            r"|^aten::(mm|bmm|addmm|baddbmm|_grouped_mm|grouped_mm|_scaled_grouped_mm)$",
    # SwiGLU and its gradient (silu = x*sigmoid(x); its backward shows sigmoid)
    "activation": r"silu|swiglu|sigmoid|gelu|act_and_mul",
    # routing bookkeeping: sorts, top-k, counts, softmax, prefix sums, index building
    # (arange is elementwise_kernel_with_index; repeat_interleave is compute_cuda_kernel)
    "routing": r"sort|topk|top_k|histogram|histc|bincount|softmax|cumsum|scan|unique"
               r"|searchsorted|multinomial|argmax|nonzero|kernel_with_index|arange"
               r"|repeat_interleave|compute_cuda_kernel",
    # moving rows: gathers/scatters/index ops (permute to experts, the combine), copies,
    # casts done as copies, and inductor kernels that only cast or move data
    "gather_scatter_copy": r"index|gather|scatter|embedding|take|memcpy|copy_kernel|catarray"
                           r"|^aten::(copy_|_to_copy|cat|clone|contiguous|stack|permute)$"
                           r"|^triton_poi_fused(_+(to_copy|clone|cat|copy|view|unsqueeze|squeeze"
                           r"|slice|permute|transpose|t|expand|select|reshape|constant_pad_nd))+_\d+$",
    "reduction": r"reduce_kernel|^triton_(red|per)_|^aten::(sum|mean|amax|amin|max|min|norm"
                 r"|linalg_vector_norm)$",
    "memset_fill": r"memset|fill|zero",
    # the remaining pointwise work: scaling by gates, adds, casts fused with arithmetic
    "elementwise": r"elementwise|^triton_poi_|^aten::(mul|add|sub|rsub|div|neg|exp|log|pow|rsqrt"
                   r"|sqrt|reciprocal|where|clamp|maximum|minimum|abs|lt|le|gt|ge|eq|ne)_?$",
}
OTHER = "other"
_RX = {k: re.compile(v, re.I) for k, v in CATEGORIES.items()}

DEVICE_CATS = ("kernel", "gpu_memset", "gpu_memcpy")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
ITER, FWD, BWD = "lrmoe_profile:iter", "lrmoe_profile:forward", "lrmoe_profile:backward"
STAGE_PREFIX = "stage:"


def classify(name: str, rules: dict[str, re.Pattern] | None = None) -> str:
    for cat, rx in (rules or _RX).items():
        if rx.search(name):
            return cat
    return OTHER


def gpu_ops(events: list[dict]) -> list[dict]:
    """Device events as ``{name, at, start, dur}`` (µs); ``at`` = launch time, else start."""
    launch = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    out = []
    for e in events:
        if e.get("cat") in DEVICE_CATS and e.get("ph", "X") == "X":
            at = launch.get(e.get("args", {}).get("correlation"), e["ts"])
            out.append(dict(name=e["name"], at=at, start=e["ts"], dur=float(e.get("dur", 0))))
    return out


def cpu_self_ops(events: list[dict]) -> list[dict]:
    """``cpu_op`` events with their self time: span minus direct children (same thread)."""
    by_thread = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op" and e.get("ph", "X") == "X":
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out = []

    def emit(e, child):
        out.append(dict(name=e["name"], at=e["ts"], start=e["ts"], dur=max(float(e["dur"]) - child, 0.0)))

    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, children's time]
        for e in evs:
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                emit(*stack.pop())
            if stack:
                stack[-1][1] += e["dur"]
            stack.append([e, 0.0])
        while stack:
            emit(*stack.pop())
    return out


def windows(events: list[dict], name: str) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e.get("cat") == "user_annotation" and e.get("name") == name)


def inside(t: float, wins: list[tuple[float, float]]) -> bool:
    i = bisect.bisect_right(wins, (t, float("inf"))) - 1
    return i >= 0 and wins[i][0] <= t <= wins[i][1]


def _union(iv: list[tuple[float, float]]) -> float:
    tot, end = 0.0, float("-inf")
    for a, b in sorted(iv):
        if b > end:
            tot += b - max(a, end)
            end = b
    return tot


def summarize(events: list[dict], iters: int, rules: dict[str, re.Pattern] | None = None) -> dict:
    """Per-iteration milliseconds by category (total, forward, backward), by kernel name,
    inside ``stage:*`` ranges, and the device's busy time and span per iteration."""
    ops, source = gpu_ops(events), "device kernels"
    if not ops:
        ops, source = cpu_self_ops(events), "CPU operators (self time)"
    its, fw, bw = windows(events, ITER), windows(events, FWD), windows(events, BWD)
    if len(its) != iters:
        raise ValueError(f"the trace holds {len(its)} '{ITER}' ranges, expected {iters}")
    ops = [o for o in ops if inside(o["at"], its)]
    cats = {c: dict(ms=0.0, fwd_ms=0.0, bwd_ms=0.0, calls=0.0) for c in [*CATEGORIES, OTHER]}
    kernels: dict[str, dict] = {}
    for o in ops:
        c = classify(o["name"], rules)
        ms = o["dur"] / 1e3 / iters
        row = cats[c]
        row["ms"] += ms
        row["calls"] += 1 / iters
        if inside(o["at"], fw):
            row["fwd_ms"] += ms
        elif inside(o["at"], bw):
            row["bwd_ms"] += ms
        k = kernels.setdefault(o["name"], dict(category=c, ms=0.0, calls=0.0))
        k["ms"] += ms
        k["calls"] += 1 / iters
    stages = defaultdict(float)
    names = {e["name"] for e in events if e.get("cat") == "user_annotation"
             and str(e.get("name", "")).startswith(STAGE_PREFIX)}
    for n in sorted(names):
        w = windows(events, n)
        stages[n] = sum(o["dur"] for o in ops if inside(o["at"], w)) / 1e3 / iters
    busy = span = 0.0
    for a, b in (its if source == "device kernels" else []):  # CPU self times have no span
        iv = [(o["start"], o["start"] + o["dur"]) for o in ops if a <= o["at"] <= b]
        if iv:
            busy += _union(iv)
            span += max(e for _, e in iv) - min(s for s, _ in iv)
    total = sum(r["ms"] for r in cats.values())
    return dict(source=source, total_ms=total, categories=cats, stages=dict(stages),
                kernels=dict(sorted(kernels.items(), key=lambda kv: -kv[1]["ms"])),
                busy_ms=busy / 1e3 / iters if busy else None, span_ms=span / 1e3 / iters if span else None,
                range_ms=sum(b - a for a, b in its) / 1e3 / iters)


# --- memory -------------------------------------------------------------------------

MARK_START, MARK_FWD, MARK_END = "_mark_start", "_mark_forward_end", "_mark_end"


def _marker(entry: dict) -> str | None:
    for f in entry.get("frames") or []:
        if f.get("name") in (MARK_START, MARK_FWD, MARK_END):
            return f["name"]
    return None


def replay(trace: list[dict]) -> dict:
    """Walk the allocator trace from the start marker to the end marker; the peak of the
    bytes allocated since the start (frees of older blocks count negative) and the blocks
    alive at that moment, each with its phase and whether it outlives the call."""
    acts = {e.get("action") for e in trace}
    free_act = "free_completed" if "free_completed" in acts else "free_requested"
    pos = {}
    for i, e in enumerate(trace):
        m = _marker(e) if e.get("action") == "alloc" else None
        if m:
            pos[m] = i  # the last of each: an earlier recording may still be in the history
    missing = [m for m in (MARK_START, MARK_FWD, MARK_END) if m not in pos]
    if missing:
        raise ValueError(f"allocator trace lacks the markers {missing} (history truncated?)")
    lo, fwd_end, hi = pos[MARK_START], pos[MARK_FWD], pos[MARK_END]
    if not lo < fwd_end < hi:
        raise ValueError("allocator trace markers out of order (start, forward end, end)")
    skip = set(pos.values())  # the markers themselves (kept alive past the end marker)

    def walk(stop: int):
        live: dict[int, int] = {}  # addr -> index of the alloc of the block there now
        total = peak = 0
        peak_i = lo
        for i in range(lo + 1, stop):
            e = trace[i]
            a = e.get("action")
            if i in skip:
                continue
            if a == "alloc":
                live[e["addr"]] = i
                total += e["size"]
            elif a == free_act:
                got = live.pop(e["addr"], None)
                total -= e["size"] if got is None else trace[got]["size"]
            if total > peak:
                peak, peak_i = total, i
        return live, peak, peak_i

    at_end, peak, peak_i = walk(hi)
    at_peak, _, _ = walk(peak_i + 1)  # replay again up to the peak: who is alive there
    blocks = [dict(size=trace[i]["size"], frames=trace[i].get("frames") or [],
                   phase="forward" if i < fwd_end else "backward", left_after=at_end.get(addr) == i)
              for addr, i in at_peak.items()]
    return dict(peak_bytes=peak, peak_index=peak_i - lo, forward_end_index=fwd_end - lo,
                entries=hi - lo, blocks=blocks, free_action=free_act)


def _frame_str(f: dict) -> str:
    fn = str(f.get("filename", "?"))
    src = linecache.getline(fn, int(f.get("line", 0) or 0)).strip()
    here = f"{'/'.join(fn.split('/')[-2:])}:{f.get('line')} {f.get('name')}"
    return here + (f" [{src[:80]}]" if src else "")


def site_of(frames: list[dict], prefixes: tuple[str, ...], callers: int = 2) -> str:
    """The allocating site: the innermost frame whose file is under one of ``prefixes``
    (our package, transformers, inductor and its generated code, this benchmark) and up to
    ``callers`` of its callers under them too; else the innermost Python frame, else the
    innermost frame. Each with its source line where the file is readable."""
    if not frames:
        return "<no Python frame: C++ autograd or allocator>"
    ours = [i for i, f in enumerate(frames) if any(p in str(f.get("filename", "")) for p in prefixes)]
    if ours:
        return " <- ".join(_frame_str(frames[i]) for i in ours[:1 + callers])
    py = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    return _frame_str(py[0] if py else frames[0])


def attribute(rep: dict, prefixes: tuple[str, ...]) -> dict:
    """Bytes alive at the peak, by allocation site (largest first) and by phase."""
    sites: dict[str, dict] = {}
    split = defaultdict(int)
    for b in rep["blocks"]:
        s = sites.setdefault(site_of(b["frames"], prefixes),
                             dict(bytes=0, blocks=0, forward=0, backward=0, left_after=0))
        s["bytes"] += b["size"]
        s["blocks"] += 1
        s[b["phase"]] += b["size"]
        split[b["phase"]] += b["size"]
        if b["left_after"]:
            s["left_after"] += b["size"]
            split["left_after"] += b["size"]
    return dict(peak_bytes=rep["peak_bytes"], alive_bytes=sum(b["size"] for b in rep["blocks"]),
                split=dict(forward_kept=split["forward"], backward=split["backward"],
                           left_after=split["left_after"]),
                sites=dict(sorted(sites.items(), key=lambda kv: -kv[1]["bytes"])))
