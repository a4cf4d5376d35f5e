"""What lrmoe's backward **select** stage costs on one home rank, and where (issue 14).

In the issue-14 Qwen3 runs (`--deterministic`, sampled estimator) the select stage took
8.4–11.3 emulated ms a step against 0.2 ms for SYMI; the earlier top-k runs without
`--deterministic` took 2.6–2.7 ms. This benchmark times
:func:`lrmoe.parallel.exchange.select_and_compact` alone, as `bench ttl` times it (CUDA
events around the call, so a host sync inside counts the device's idle time), on one
synthetic home rank of the workload's shape, for each estimator without torch's
deterministic algorithms, with them as `bench ttl --deterministic` sets them, and with
torch's default fill of uninitialized memory on top, and profiles the sampled estimator
to name its kernels.

The rank's pairs: ``T`` tokens x top-``k`` experts drawn Zipf(``--skew``) over ``E``
experts, ``S`` slots per rank on ``G`` ranks (each expert's pairs in its home slot, the
instance layout of a plan without replicas), every pair retained, each block's backward
quota ``--keep`` of its rows (the balanced quotas' mean in the runs was 0.94–0.96).

    python3 benchmarks/select_cost.py --out DIR            (GPU; writes select_cost.{json,md})
    python3 benchmarks/select_cost.py --out DIR --smoke    (CPU, tiny, logic only)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lrmoe.parallel.exchange import BackwardOptions, select_and_compact  # noqa: E402
from lrmoe.sim.ttl import deterministic_mode  # noqa: E402


def home_case(T: int, K: int, H: int, E: int, G: int, S: int, skew: float, keep: float,
              dev: torch.device, seed: int = 0) -> dict:
    """One home rank's candidates in send order (grouped by block), with the plan and
    layout fields select_and_compact reads."""
    gen = torch.Generator().manual_seed(seed)
    w = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** skew
    idx = torch.stack([torch.multinomial(w, K, replacement=False, generator=gen)
                       for _ in range(T)])  # [T, K] distinct experts per token
    pair_expert = idx.reshape(-1)
    order = torch.argsort(pair_expert, stable=True)  # send order: by block (expert's slot)
    E_per = E // G
    block_of_expert = (pair_expert // E_per) * S + pair_expert % E_per  # global block g*S+s
    assign_I = torch.bincount(block_of_expert, minlength=G * S)
    quota_I = torch.floor(assign_I.double() * keep).long()
    plan = SimpleNamespace(assign_GGS=torch.zeros(G, G, S, dtype=torch.long))
    plan.assign_GGS[0] = assign_I.reshape(G, S)
    home = SimpleNamespace(retain_I=assign_I, select_I=quota_I, splits_shape=(G, S))
    gates = torch.rand(T * K, generator=gen)
    return dict(dout=torch.randn(T, H, generator=gen).to(dev, torch.bfloat16),
                tok=(order // K).to(dev), g=gates[order].to(dev), gate=gates[order].to(dev),
                home=home, plan=plan, n_blocks=G * S)


def run_select(case: dict, estimator: str, gen: torch.Generator | None):
    opts = BackwardOptions(estimator=estimator)
    return select_and_compact(case["dout"], case["tok"], case["g"], case["gate"], case["home"],
                              opts, gen, False)


# ops that only make a view or wrap a host scalar: no kernel of their own on the device
_NO_KERNEL = {"select", "detach", "lift_fresh", "scalar_tensor", "view", "unbind",
              "_local_scalar_dense", "alias", "slice", "expand", "t"}


def count_ops(case: dict, estimator: str, dev: torch.device) -> dict:
    """ATen ops one call dispatches (``TorchDispatchMode``), and those of them that launch
    work on the device: the select stage is host-bound, so each costs host time."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    gen = torch.Generator(device=dev).manual_seed(1) if estimator == "sampled" else None
    with _Count() as c:
        run_select(case, estimator, gen)
    return dict(ops=len(c.names), kernel_ops=sum(n not in _NO_KERNEL for n in c.names))


def time_select(case: dict, estimator: str, dev: torch.device, reps: int) -> dict:
    """Median and spread of the call's time: CUDA events around it on the GPU (as the
    harness), wall time on the CPU."""
    gen = torch.Generator(device=dev).manual_seed(1) if estimator == "sampled" else None
    for _ in range(3):
        run_select(case, estimator, gen)
    ms = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run_select(case, estimator, gen)
            b.record()
            torch.cuda.synchronize()
            ms.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            run_select(case, estimator, gen)
            ms.append((time.perf_counter() - t) * 1e3)
    return dict(median_ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms), reps=reps)


def profile_select(case: dict, estimator: str, dev: torch.device) -> str:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    gen = torch.Generator(device=dev).manual_seed(1) if estimator == "sampled" else None
    run_select(case, estimator, gen)
    with profile(activities=acts) as prof:
        for _ in range(5):
            run_select(case, estimator, gen)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (logic only)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per home rank")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--slots", type=int, default=18)
    ap.add_argument("--skew", type=float, default=1.0)
    ap.add_argument("--keep", type=float, default=0.95)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    if a.slots < a.experts // a.ranks:
        print(f"select_cost: --slots {a.slots} < experts per rank {a.experts // a.ranks}",
              file=sys.stderr)
        return 2
    if a.smoke:
        a.tokens, a.hidden, a.experts, a.top_k, a.ranks, a.slots, a.reps = 64, 32, 16, 2, 4, 5, 3
        dev = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("select_cost: no CUDA device (use --smoke on the CPU)", file=sys.stderr)
        return 2
    else:
        dev = torch.device("cuda")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    case = home_case(a.tokens, a.top_k, a.hidden, a.experts, a.ranks, a.slots, a.skew, a.keep,
                     dev)
    rows, profiles = [], {}
    # "no": torch's default kernels; "yes+fill": bench ttl --deterministic (torch's
    # deterministic mode as it comes, filling every new tensor); "yes": with
    # --no-deterministic-fill
    for det in ("no", "yes", "yes+fill"):
        with deterministic_mode(det != "no", fill=det == "yes+fill"):
            for est in ("topk", "sampled"):
                r = time_select(case, est, dev, a.reps)
                r.update(estimator=est, deterministic=det, **count_ops(case, est, dev))
                rows.append(r)
                if est == "sampled":
                    profiles[f"sampled, deterministic={det}"] = profile_select(case, est, dev)
    meta = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)",
                torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                command="select_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
                shape=dict(tokens=a.tokens, hidden=a.hidden, experts=a.experts, top_k=a.top_k,
                           ranks=a.ranks, slots=a.slots, skew=a.skew, keep=a.keep))
    (out / "select_cost.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# select_and_compact on one home rank ({meta['device']})", "",
             f"`{meta['command']}` — torch {meta['torch']}, {meta['date']}; shape {meta['shape']}.",
             "", "| estimator | deterministic | median ms | min–max ms | ops a call (with a "
             "device kernel) |", "|---|---|---|---|---|"]
    lines += [f"| {r['estimator']} | {r['deterministic']} | {r['median_ms']:.3f} "
              f"| {r['min_ms']:.3f}–{r['max_ms']:.3f} | {r['ops']} ({r['kernel_ops']}) |"
              for r in rows]
    for k, t in profiles.items():
        lines += ["", f"## profile, {k} (5 calls)", "", "```", t, "```"]
    (out / "select_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:8 + len(rows)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
