"""The host AdamW of ``--optimizer-offload host`` alone, without the device: how the same
update runs as one fused call over every tensor (the serial update), one call a tensor, or
chunk by chunk (the pipeline; ``--chunks``: the sizes), on the main thread or on a second
thread with the same thread count. Host arithmetic only: no copies to or from a device.

The tensors are one EP rank's offloaded experts of ``offload_step.py``'s workloads (the
model built on the meta device for its shapes), fp32 masters and moments, fp32 gradients
(or bf16 gradients widened chunk by chunk into a scratch and scaled, as the pipeline does).

    python3 benchmarks/host_adamw.py --out DIR            # the GPU machine's host, ~1 min
    python3 benchmarks/host_adamw.py --out DIR --workloads tiny --reps 2   # logic

Writes ``host_adamw.json`` and ``host_adamw.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_common as gc  # noqa: E402
from offload_step import model_config  # noqa: E402

from lrmoe.model.transformer import MoEForCausalLM  # noqa: E402
from lrmoe.train.host_pipe import HOST_CHUNK, host_adamw  # noqa: E402
from lrmoe.train.offload import offloaded_params  # noqa: E402

GROUP = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)


def state_for(name: str) -> dict:
    with torch.device("meta"):
        shapes = [p.shape for p in offloaded_params(MoEForCausalLM(model_config(name)))]
    g = torch.Generator().manual_seed(0)
    mk = [torch.randn(s, generator=g) for s in shapes]
    return dict(master=mk, grad=[torch.randn(s, generator=g) for s in shapes],
                bf16=[torch.randn(s, generator=g).bfloat16() for s in shapes],
                m1=[torch.zeros(s) for s in shapes], m2=[torch.zeros(s) for s in shapes],
                step=[torch.zeros(()) for _ in shapes])


def list_call(st: dict) -> None:
    host_adamw(st["master"], st["grad"], st["m1"], st["m2"], [s.clone() for s in st["step"]], GROUP)


def per_tensor(st: dict) -> None:
    for i in range(len(st["master"])):
        host_adamw([st["master"][i]], [st["grad"][i]], [st["m1"][i]], [st["m2"][i]],
                   [st["step"][i].clone()], GROUP)


def chunked(st: dict, chunk: int, widen: bool = False) -> None:
    scratch = torch.empty(chunk)
    for i in range(len(st["master"])):
        src = (st["bf16"] if widen else st["grad"])[i].view(-1)
        w, a1, a2 = (st[k][i].view(-1) for k in ("master", "m1", "m2"))
        for a in range(0, src.numel(), chunk):
            b = min(src.numel(), a + chunk)
            g = scratch[:b - a].copy_(src[a:b]).mul_(0.5) if widen else src[a:b]
            host_adamw([w[a:b]], [g], [a1[a:b]], [a2[a:b]], [st["step"][i].clone()], GROUP)


def variants(chunks: list[int]) -> dict:
    out = {"one call, all tensors": list_call, "one call a tensor": per_tensor}
    for c in chunks:
        out[f"chunks of {c}"] = lambda st, c=c: chunked(st, c)
        out[f"chunks of {c}, bf16 widened"] = lambda st, c=c: chunked(st, c, True)
    return out


def timed(fn, st: dict, reps: int, pool: ThreadPoolExecutor | None) -> float:
    run = (lambda: fn(st)) if pool is None else (lambda: pool.submit(fn, st).result())
    run()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


@gc.cli
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", default="qwen3,glm")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunks", default=str(HOST_CHUNK),
                    help=f"elements a chunk, a comma list (the trainer's: {HOST_CHUNK})")
    a = ap.parse_args(argv)
    todo = variants(gc.csv(a.chunks, int, "--chunks"))
    d = gc.out_dir(a.out)
    threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(1, "host-adamw", torch.set_num_threads, (threads,))
    worker_threads = pool.submit(torch.get_num_threads).result()
    rows = []
    for name in gc.csv(a.workloads):
        st = state_for(name)
        n = sum(t.numel() for t in st["master"])
        for label, fn in todo.items():
            for where, p in (("main", None), ("worker", pool)):
                ms = timed(fn, st, a.reps, p)
                rows.append(dict(workload=name, params=n, tensors=len(st["master"]),
                                 variant=label, thread=where, median_ms=ms))
                print(f"[{name}] {label} on {where}: {ms:.1f} ms", flush=True)
        del st
    meta = gc.run_meta("cpu", threads=threads, worker_threads=worker_threads,
                       parallel_info=torch.__config__.parallel_info())
    meta["device"] = "host CPU"
    md = [f"# Host AdamW alone ({meta['date']})", "",
          f"`{meta['command']}` — torch {meta['torch']}, {threads} threads (worker "
          f"{worker_threads}). Measured: median wall ms of {a.reps} updates after one.", "",
          *gc.md_head("workload", "params", "tensors", "variant", "thread", "ms")]
    md += [f"| {r['workload']} | {r['params'] / 1e6:.1f}M | {r['tensors']} | {r['variant']} | "
           f"{r['thread']} | {r['median_ms']:.1f} |" for r in rows]
    gc.write_outputs(d, "host_adamw", meta, rows, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
