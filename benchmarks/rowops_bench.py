"""The control plane's row kernels (lrmoe.ops.rowops, lrmoe.ops.selection) against the
torch code they replace and against their bandwidth floor.

For each tokens-per-rank T (top-k K, hidden H, bf16; Qwen3-30B-A3B's layer by default)
one rank's pair rows are timed through each operation three ways: the Triton kernel (the
public function, on CUDA), the runtime's torch form of the same operation today (named
in the table), and the floor: the bytes the operation must move over HBM at
``--hbm-tbs`` TB/s (H200: 4.8). Times: median ms of one call, synchronised
(:func:`gpu_common.bench`), and the host's view: ms per call over a loop of calls
without syncs (what a host-bound stage costs); kernels: CUDA kernels per call counted by
torch.profiler (memcpys and memsets apart).

The selection runs at ``--ranks`` x ``--slots`` blocks (8 x 18: the headline's lrmoe
layout), every pair a candidate, half of each block kept; today's form is the runtime's
``select_and_compact`` plus its gather of the kept rows' output gradients.

    python3 benchmarks/rowops_bench.py --out DIR                  # H200, ~1-2 min
    python3 benchmarks/rowops_bench.py --out DIR --device cpu --tokens 64 --hidden 64
                                                                  # logic check only

Writes ``rowops.json`` and ``rowops.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # the select stage before
from gpu_common import bench, check_device, cli, csv, fmt, md_head, out_dir, run_meta, write_outputs  # noqa: E402

from lrmoe.ops import rowops, selection  # noqa: E402
from lrmoe.ops.fused import fused, gathered_dot, weighted_gather_sum  # noqa: E402
from lrmoe.parallel.options import BackwardOptions  # noqa: E402
from references.select_runtime import select_and_compact  # noqa: E402


def host_ms(fn, dev: str, n: int = 30) -> float:
    """Milliseconds per call over ``n`` calls issued back to back, one sync at the end."""
    fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / n


def kernels(fn, dev: str) -> int | None:
    """CUDA kernels one call launches (torch.profiler; copies and fills not counted)."""
    if dev != "cuda":
        return None
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(1 for n in names if not n.startswith(("Memcpy", "Memset", "cudaMemcpy", "cudaMemset")))


def block_sizes(P: int, B: int, g: torch.Generator) -> torch.Tensor:
    """``B`` block sizes summing to ``P``, skewed (popularity ∝ 1/rank^0.65), some empty."""
    w = 1.0 / torch.arange(1, B + 1, dtype=torch.float64) ** 0.65
    w[torch.randperm(B, generator=g)[: B // 9]] = 0  # empty slots
    return torch.bincount(torch.multinomial(w, P, replacement=True, generator=g), minlength=B)


def cases(T: int, K: int, H: int, G: int, S: int, dev: str, dt: torch.dtype, hbm: float):
    """``(name, kernel, today's form, its name, bytes moved)`` for one shape."""
    g = torch.Generator().manual_seed(0)
    P, B = T * K, G * S
    d = torch.randn(T, H, generator=g).to(dev, dt)
    y = torch.randn(P, H, generator=g).to(dev, dt)
    gate = torch.rand(T, K, generator=g).to(dev, dt)
    pair = torch.randperm(P, generator=g).to(dev)
    row_TK = torch.argsort(pair).view(T, K)
    size = block_sizes(P, B, g)
    starts = (torch.cumsum(size, 0) - size).reshape(G, S).t().reshape(-1)  # arrival (g, s) -> (s, g)
    lengths = size.reshape(G, S).t().reshape(-1)
    table = rowops.runs(starts.numpy(), lengths.numpy(), dev)
    dst, src, n = table.dst_first, table.src_first, table.n
    es, row = torch.tensor([], dtype=dt).element_size(), H * torch.tensor([], dtype=dt).element_size()
    combine_today = fused("combine", weighted_gather_sum, y)
    dot_today = fused("combine_bwd", gathered_dot, y)

    def invert_today():
        inv = torch.full((P,), -1, dtype=torch.long, device=dev)
        inv[pair] = torch.arange(P, device=dev)
        return inv

    yield ("arrival -> instance reorder", lambda: rowops.gather_runs(y, dst, src, n),
           lambda: y[rowops.run_positions(dst, src, n)], "positions + index", 2 * P * row)
    yield ("invert permutation", lambda: rowops.invert_permutation(pair, P, -1), invert_today,
           "full + index_put", 3 * 8 * P)
    yield ("combine (forward)", lambda: rowops.combine(y, row_TK, gate),
           lambda: combine_today(y, row_TK, gate), "compiled weighted_gather_sum", (P + T) * row + 10 * P)
    yield ("combine grad gate", lambda: rowops.combine_grad_gate(y, row_TK, d),
           lambda: dot_today(y, row_TK, d), "compiled gathered_dot", (P + T) * row + 12 * P)
    # selection: every pair a candidate, grouped by block, half of each block kept
    tok = (torch.randperm(P, generator=g) // K).to(dev)
    g_N = torch.rand(P, generator=g).to(dev)
    gate_N = torch.rand(P, generator=g).to(dev, dt)
    quota = size // 2
    home = SimpleNamespace(retain_I=size, select_I=quota, splits_shape=(G, S))
    S_rows = int(quota.sum())
    sel_bytes = P * (8 + 4 + es + 4) + S_rows * (20 + 2 * row)
    for est in ("topk", "sampled"):
        opts = BackwardOptions(estimator=est)
        gen = torch.Generator(device=dev).manual_seed(1)

        def new(est=est, gen=gen):
            args = ("grad_norm", rowops.token_norm(d), tok, g_N, gate_N, size, quota)
            if est == "topk":
                return selection.select_topk(*args, d)
            return selection.select_sampled(*args, gen, dout_TH=d)

        def today(opts=opts, gen=gen):
            tok_s = select_and_compact(d, tok, g_N, gate_N, home, opts, gen, False)[0]
            return d[tok_s]

        yield (f"select {est} + dy gather", new, today, "select_and_compact + index", sel_bytes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", default="4096,16384", help="tokens per rank, comma list")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--slots", type=int, default=18)
    ap.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth for the floor (TB/s)")
    a = ap.parse_args(argv)
    check_device(a.device)
    tokens = csv(a.tokens, int, "--tokens")
    d = out_dir(a.out)
    dt = torch.bfloat16
    rows = []
    for T in tokens:
        for name, new, today, today_name, nbytes in cases(T, a.top_k, a.hidden, a.ranks, a.slots,
                                                          a.device, dt, a.hbm_tbs):
            floor = nbytes / (a.hbm_tbs * 1e12) * 1e3
            r = dict(tokens=T, op=name, today=today_name, bytes=nbytes, floor_ms=floor,
                     kernel_ms=bench(new, a.device), today_ms=bench(today, a.device),
                     kernel_host_ms=host_ms(new, a.device), today_host_ms=host_ms(today, a.device),
                     kernel_launches=kernels(new, a.device), today_launches=kernels(today, a.device))
            rows.append(r)
            print(f"T={T} {name}: kernel {r['kernel_ms']:.4f} ms, today {r['today_ms']:.4f} ms, "
                  f"floor {floor:.4f} ms", flush=True)
    meta = run_meta(a.device, argv=argv, top_k=a.top_k, hidden=a.hidden, dtype="bf16",
                    ranks=a.ranks, slots=a.slots, hbm_tbs=a.hbm_tbs, triton=rowops.on_kernels(
                        torch.empty(0, device=a.device)))
    md = [f"# Row kernels ({meta['device']}, {meta['date']})", "",
          f"`{meta['command']}`; K={a.top_k}, H={a.hidden}, bf16; floor = bytes / {a.hbm_tbs} TB/s; "
          "ms: median of one synchronised call; host ms: per call over 30 calls, one sync; "
          "launches: CUDA kernels per call.", "",
          *md_head("T", "operation", "kernel ms", "today ms", "floor ms", "kernel / floor",
                   "kernel host ms", "today host ms", "launches (kernel / today)", "today's form")]
    for r in rows:
        md.append(f"| {r['tokens']} | {r['op']} | {r['kernel_ms']:.4f} | {r['today_ms']:.4f} | "
                  f"{r['floor_ms']:.4f} | {r['kernel_ms'] / r['floor_ms']:.1f} | {r['kernel_host_ms']:.4f} | "
                  f"{r['today_host_ms']:.4f} | {fmt(r['kernel_launches'], 'd')} / "
                  f"{fmt(r['today_launches'], 'd')} | {r['today']} |")
    write_outputs(d, "rowops", meta, rows, "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(cli(main)())
