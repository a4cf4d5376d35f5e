"""Planning time per MoE layer on its critical path: every policy at EP 8..64.

For each EP size × Zipf skew × budget (loose: everything retained; binding: room to
retain ~40% of the busiest rank's pairs) and policy, the median time of the part of
planning that waits on the step's counts: ``policy.plan(counts_GE, inputs)`` on one CPU
thread, after :func:`lrmoe.policy.base.prepare` ran on the previous step's counts (a
fresh draw from the same weights). Wall and thread-CPU time (robust to a loaded machine),
and off the critical path: ``prepare`` (SYMI's placement, lrmoe's with
``placement=previous``: none of this step's counts), ``check`` / ``pricing``
(``Plan.check`` and the ledger's pricing, which the runtime skips). ``replaced``: a
prepared placement that did not fit this step's counts and was made again.

Policies: static and symi (recompute to fit, as ``bench ttl`` runs them), capacity, and
lrmoe with and without ``recompute``, placement ``current``, ``previous``, or held for
the optimizer step (``step``, ``step-previous``: the critical part is a later
micro-batch's plan on the held placement, ``micro-batch 0 ms`` beside it the step's
first, which places), and with ``link`` its link-cost rules (``--link``, GEMMs at
``--gemm-tflops``: a modelled rate; it only steers which replicas pay). With CUDA, also
"from device counts" (copy to the host, the runtime's one sync, then plan) and the host
syncs inside ``plan`` (0 expected). ``--reference`` also times the loop-by-loop lrmoe
planner (``tests/references/lrmoe_planner.py``).

    python3 benchmarks/plan_speed.py --out DIR [--preset qwen3-30b-a3b] [--reference]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # the reference planner

import gpu_common as gc  # noqa: E402

from lrmoe.errors import LrmoeError  # noqa: E402
from lrmoe.ledger import Ledger  # noqa: E402
from lrmoe.policy import (  # noqa: E402
    CapacityPolicy,
    LrmoeConfig,
    LrmoePolicy,
    PlanInputs,
    StaticPolicy,
    SymiPolicy,
)
from lrmoe.policy.base import prepare  # noqa: E402
from lrmoe.presets import get_preset  # noqa: E402
from lrmoe.sim.links import get_link, link_cost  # noqa: E402
from references import lrmoe_planner  # noqa: E402

POLICIES = ("static", "symi", "capacity", "lrmoe", "lrmoe:recompute", "lrmoe:previous",
            "lrmoe:recompute+previous", "lrmoe:link", "lrmoe:link+previous", "lrmoe:step",
            "lrmoe:step-previous", "lrmoe:link+step", "lrmoe:link+step-previous")
HELD_MICRO_BATCHES = 4  # a held placement's link cost is shared by this many
CRITICAL_MS = 0.5  # the target for the critical part, ms per layer


def zipf_counts(G: int, E: int, pairs_per_rank: int, skew: float, seed: int,
                draw: int = 0) -> torch.Tensor:
    """``[G, E]``: each home rank's pairs drawn from Zipf(skew) over permuted experts;
    ``draw`` > 0: another draw from the same weights."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, E + 1, dtype=np.float64) ** skew
    w = w[rng.permutation(E)]
    if draw:
        rng = np.random.default_rng([seed, draw])
    return torch.from_numpy(rng.multinomial(pairs_per_rank, w / w.sum(), size=G)).long()


def budgets(cfg, G: int, counts: torch.Tensor, dtype: str) -> dict[str, int]:
    """Loose: 1.5× the peak of the unbounded lrmoe plan (all retained). Binding: its
    fixed bytes plus the smallest of 40/55/70/85% of its largest retained bytes that
    lrmoe can plan in (at high skew the hot rank keeps more pairs under a budget)."""
    free = Ledger.for_dtype(cfg, G, None, dtype)
    terms = free.rank_terms(LrmoePolicy().plan(counts, PlanInputs(ledger=free)))
    fixed = max(t["total"] - t["retained_acts"] for t in terms)
    kept = max(t["retained_acts"] for t in terms)
    for frac in (0.4, 0.55, 0.7, 0.85):
        binding = int(fixed + frac * kept)
        try:
            LrmoePolicy().plan(counts, PlanInputs(ledger=Ledger.for_dtype(cfg, G, binding, dtype)))
            break
        except LrmoeError:
            continue
    return {"loose": int(1.5 * max(t["total"] for t in terms)), "binding": binding}


def make(name: str, cfg=None, link: str = "ib", tflops: float = 400.0):
    """The policy of a row; the exact ones recompute to fit a budget (as ``bench ttl``)."""
    if name.startswith("lrmoe"):
        opts = name.partition(":")[2].split("+")
        where = next((o for o in opts if o in ("previous", "step", "step-previous")), "current")
        cost = None
        if "link" in opts:
            share = HELD_MICRO_BATCHES if where.startswith("step") else 1
            cost = link_cost(get_link(link), tflops * 1e12, cfg.hidden_size,
                             cfg.moe_intermediate_size, 2, 2, share)
        return LrmoePolicy(LrmoeConfig(recompute="recompute" in opts, placement=where,
                                       link=cost))
    if name == "symi":
        return SymiPolicy(None, recompute=True)  # E/G + 2 slots
    if name == "static":
        return StaticPolicy(recompute=True)
    return CapacityPolicy(1.25)


def timed(repeats: int, fn, *args) -> tuple[float, float, str | None, float]:
    """Median wall and thread-CPU ms of ``fn(*args)``, the error if it raises, and the
    least thread-CPU ms (what a quiet machine gives; medians move with the load)."""
    wall, cpu, err = [], [], None
    for i in range(repeats + 2):
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            fn(*args)
        except LrmoeError as e:
            err = str(e)[:120]
        w1, c1 = time.perf_counter(), time.thread_time()
        if i >= 2:  # two warm-up calls
            wall.append((w1 - w0) * 1e3)
            cpu.append((c1 - c0) * 1e3)
    return statistics.median(wall), statistics.median(cpu), err, min(cpu)


def _plan(policy, counts, inputs) -> None:
    try:
        policy.plan(counts, inputs)
    except LrmoeError:
        pass


def gpu_timed(policy, counts_dev: torch.Tensor, inputs: PlanInputs, repeats: int
              ) -> tuple[float, int]:
    """Median ms of copy-to-host + plan from device counts, and host syncs inside plan."""
    out = []
    for i in range(repeats + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _plan(policy, counts_dev.cpu(), inputs)  # .cpu(): the runtime's own sync
        if i >= 2:
            out.append((time.perf_counter() - t0) * 1e3)
    host = counts_dev.cpu()
    return statistics.median(out), gc.count_syncs(lambda: _plan(policy, host, inputs))[1]


def off_path(name: str, pol, counts, inputs, ledger, repeats: int) -> dict:
    """What no longer sits on the critical path: prepare, the plan check and the
    ledger pricing the emulator used to charge as planning (thread ms)."""
    prev = inputs.prev_counts_E
    pairs = int(counts.sum()) // counts.shape[0]
    row = {"prepare_ms": timed(repeats, prepare, pol, prev, counts.shape[0], inputs, pairs)[1]}
    try:
        plan = pol.plan(counts, inputs)
    except LrmoeError:
        return {**row, "check_ms": None, "pricing_ms": None, "replaced": None}
    price = ledger.exact_fit if name in ("static", "symi") else ledger.rank_terms
    row["check_ms"] = timed(repeats, plan.check, counts)[1]
    row["pricing_ms"] = timed(repeats, price, plan)[1]
    replaced = getattr(pol, "replaced_placements", 0)
    pol.plan(counts, inputs)
    row["replaced"] = getattr(pol, "replaced_placements", 0) - replaced > 0
    return row


@gc.cli
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for plan_speed.json and plan_speed.md")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--eps", default="8,16,32,64")
    ap.add_argument("--skews", default="0,1,2")
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated, of {', '.join(POLICIES)}")
    ap.add_argument("--reference", action="store_true",
                    help="also time the reference lrmoe planner (slow: 3 repeats)")
    ap.add_argument("--no-gpu", action="store_true", help="skip the device-counts timing")
    ap.add_argument("--link", default="ib", help="the link the link-cost rules price (lrmoe:link)")
    ap.add_argument("--gemm-tflops", type=float, default=400.0,
                    help="the expert GEMM rate the link-cost rules assume (modelled)")
    args = ap.parse_args(argv)
    cfg = get_preset(args.preset)
    eps, skews = gc.csv(args.eps, int, "--eps"), gc.csv(args.skews, float, "--skews")
    policies = gc.csv(args.policies)
    bad = [G for G in eps if G < 1 or cfg.num_experts % G]
    if bad or args.repeats < 1 or args.tokens_per_rank < 1:
        raise LrmoeError(f"--eps {bad} must divide E={cfg.num_experts}; --repeats and "
                         "--tokens-per-rank must be >= 1")
    if unknown := [p for p in policies if p not in POLICIES]:
        raise LrmoeError(f"--policies {unknown}: use some of {', '.join(POLICIES)}")
    out = gc.out_dir(args.out)
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available() and not args.no_gpu
    pairs = args.tokens_per_rank * cfg.num_experts_per_tok
    rows = []
    for G in eps:
        for skew in skews:
            seed = G * 100 + int(skew * 10)
            first = zipf_counts(G, cfg.num_experts, pairs, skew, seed)
            prev = zipf_counts(G, cfg.num_experts, pairs, skew, seed, draw=1).sum(0)
            # a held step's later micro-batch: another draw from the same weights
            later = zipf_counts(G, cfg.num_experts, pairs, skew, seed, draw=2)
            for bname, budget in budgets(cfg, G, first, args.dtype).items():
                ledger = Ledger.for_dtype(cfg, G, budget, args.dtype)
                for name in policies:
                    counts = first
                    pol = make(name, cfg, args.link, args.gemm_tflops)
                    exact = name in ("static", "symi", "capacity")
                    # static and symi price the budget by recompute; capacity by a check
                    inputs = prepare(pol, prev, G, PlanInputs(step=1, prev_counts_E=prev,
                                                              ledger=ledger), pairs)
                    micro0 = None
                    if "step" in name:  # held: micro-batch 0 places, a later one reuses
                        micro0 = timed(args.repeats, pol.plan, counts, inputs)[1]
                        _plan(pol, counts, inputs)
                        inputs = prepare(pol, prev, G, replace(inputs, micro=1), pairs)
                        counts = later
                    wall, cpu, err, best = timed(args.repeats, pol.plan, counts, inputs)
                    row = {"ep": G, "skew": skew, "budget": bname, "budget_bytes": budget,
                           "policy": name, "exact": exact, "cpu_wall_ms": wall,
                           "cpu_thread_ms": cpu, "cpu_thread_min_ms": best, "error": err,
                           "gpu_ms": None, "host_syncs_in_plan": None, "reference_ms": None,
                           "micro0_thread_ms": micro0,
                           **off_path(name, pol, counts, inputs, ledger, args.repeats)}
                    if cuda:
                        row["gpu_ms"], row["host_syncs_in_plan"] = gpu_timed(
                            pol, counts.cuda(), inputs, args.repeats)
                    if name in ("lrmoe", "lrmoe:recompute") and args.reference:
                        rc = LrmoeConfig(recompute=name.endswith("recompute"))
                        row["reference_ms"] = timed(3, lrmoe_planner.plan_lrmoe, counts,
                                                    rc, ledger)[1]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    meta = gc.run_meta("cpu", argv=argv, device="cpu", preset=args.preset, numpy=np.__version__,
                       tokens_per_rank=args.tokens_per_rank, repeats=args.repeats, threads=1,
                       link=args.link, gemm_tflops=args.gemm_tflops,
                       cpu=platform.processor() or platform.machine(),
                       gpu=torch.cuda.get_device_name() if cuda else None)
    md = markdown(meta, rows)
    gc.write_outputs(out, "plan_speed", meta, rows, md)
    print(md)


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def summary(rows: list[dict], key: str = "cpu_thread_ms") -> list[str]:
    """Per policy and EP: the largest critical-path thread ms (``key``: medians, or
    the least of the repeats) over skews and budgets (rows that plan), against the
    target."""
    eps = sorted({r["ep"] for r in rows})
    lines = ["| policy | " + " | ".join(f"EP {G}" for G in eps) + f" | all ≤ {CRITICAL_MS} ms |",
             "|---|" + "---|" * (len(eps) + 1)]
    for name in dict.fromkeys(r["policy"] for r in rows):
        worst = [max((r[key] for r in rows if r["policy"] == name
                      and r["ep"] == G and not r["error"]), default=None) for G in eps]
        ok = all(w is None or w <= CRITICAL_MS for w in worst)
        lines.append(f"| {name} | " + " | ".join(_f(w) for w in worst)
                     + f" | {'yes' if ok else 'no'} |")
    return lines


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"Critical-path planning time per layer, {meta['preset']}, "
             f"{meta['tokens_per_rank']} tokens/rank, one CPU thread (medians of "
             f"{meta['repeats']}; torch {meta['torch']}, CPU {meta['cpu']}, GPU: "
             f"{meta['gpu'] or 'none'}). `plan` = `policy.plan` after `prepare` (thread "
             "CPU ms; wall beside it); `prepare`, `check` and `pricing` are off the critical "
             "path; `gpu ms` = copy device counts to the host (the runtime's one sync) + "
             "plan; `syncs` = host syncs inside plan.", "",
             f"command: `{meta['command']}`", "",
             f"Held placements (`step`, `step-previous`): `plan` is a later micro-batch's "
             "plan on the held placement; `micro-batch 0 ms` the step's first (which places). "
             f"`link`: lrmoe's link-cost rules on {meta['link']} at {meta['gemm_tflops']:g} "
             f"TFLOP/s (modelled), a held placement's cost shared by {HELD_MICRO_BATCHES} "
             "micro-batches.", "",
             f"Largest critical-path ms over skews and budgets (target {CRITICAL_MS} ms), "
             "medians:", "", *summary(rows), "",
             "... and the least of the repeats (a quiet machine's):", "",
             *summary(rows, "cpu_thread_min_ms"), "",
             *gc.md_head("EP", "skew", "budget", "policy", "plan ms", "wall ms", "prepare ms",
                         "check ms", "pricing ms", "gpu ms", "syncs", "reference ms",
                         "micro-batch 0 ms", "note")]
    for r in rows:
        note = "does not fit" if r["error"] else ("placement replaced" if r["replaced"] else "")
        lines.append(f"| {r['ep']} | {r['skew']:g} | {r['budget']} | {r['policy']} | "
                     f"{_f(r['cpu_thread_ms'])} | {_f(r['cpu_wall_ms'])} | "
                     f"{_f(r['prepare_ms'])} | {_f(r['check_ms'])} | {_f(r['pricing_ms'])} | "
                     f"{_f(r['gpu_ms'])} | "
                     f"{'-' if r['host_syncs_in_plan'] is None else r['host_syncs_in_plan']} | "
                     f"{_f(r['reference_ms'])} | {_f(r.get('micro0_thread_ms'))} | {note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
