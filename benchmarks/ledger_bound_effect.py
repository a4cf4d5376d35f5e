"""How much the planners' conservative transient bound decides who fits (issue 14) — MODELLED.

Until 2026-12-02 the planners priced one layer's transients with ``Ledger.buffer_bytes``
(every received row charged the backward's largest per-row set; ``Ledger(transients=
"bound")`` here, since they now price the code-derived account); on an H200 the peak measured for static
and SYMI ranks was 0.97–1.00 of the transients derived from the code for the executed
plan (``Ledger.rank_terms(plan, plan_buffers=True)``) and only 0.57–0.68 of the planners'
bound (``benchmarks/RESULTS.md``, issue 16, fourth session). This script replays the
routing of a recorded ``bench ttl`` run (static's routing trace: global pairs per expert,
spread evenly over the homes, as ``plan --compare`` does) and prices, at every step and
MoE layer, static's plan and SYMI's plan for each ``s`` under both accounts, **without
recompute**:

- static: at how many (step, layer) samples its plan fits the budget, and its largest
  per-rank peak;
- SYMI: the largest ``s`` whose plan fits at every sample (SYMI's rule in ``bench ttl``
  also lets it recompute; this shows only where memory alone would leave room).

Nothing runs on a device; the peaks are ledger arithmetic, labelled modelled.

    python3 benchmarks/ledger_bound_effect.py --config CFG --trace TRACE --budget BYTES \\
        [--router-grad-experts] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lrmoe.config import ModelConfig  # noqa: E402
from lrmoe.loads import read_json, read_trace  # noqa: E402
from lrmoe.memory import Ledger, fmt_bytes, parse_bytes  # noqa: E402
from lrmoe.policy.base import PlanInputs  # noqa: E402
from lrmoe.policy.static import StaticPolicy  # noqa: E402
from lrmoe.policy.symi import plan_symi  # noqa: E402
from lrmoe.sim.ttl import balanced_budget  # noqa: E402


def peaks(ledger: Ledger, plan, tokens: int) -> tuple[int, int]:
    """Largest per-rank total under the planners' bound and under the code-derived one."""
    planners = max(t["total"] for t in ledger.rank_terms(plan, tokens))
    code = max(t["total"] for t in ledger.rank_terms(plan, tokens, plan_buffers=True))
    return planners, code


def analyse(cfg: ModelConfig, trace_path: str, budget: int, experts_grad: bool,
            max_s: int | None = None) -> dict:
    data = read_json(trace_path)
    G, T = int(data["ep"]), int(data["tokens_per_rank"])
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    n_steps = len(data["steps"])
    tr = read_trace(trace_path, data, E, k, n_steps)  # every step
    counts = tr.counts(G, T, k)
    L = len(data["steps"][0])
    # popularity: the previous step's loads of the same layer (SYMI's input; the first
    # step's own, as bench ttl's profile takes it)
    pops = [counts[i - L if i >= L else i].sum(0) for i in range(len(counts))]
    led = Ledger.for_dtype(cfg, G, budget, "bf16", optimizer_offload="host",
                           router_grad_at_experts=experts_grad, transients="bound")
    st = [peaks(led, StaticPolicy().plan(c, PlanInputs()), T) for c in counts]
    # bench ttl's --budget-retain-fraction 0.8 rule (a balanced static rank keeping 80% of
    # its pairs' activations, priced by a ledger with the combined rows, as bench ttl
    # does): the planners' account is balanced_budget itself; the code-derived one applies
    # the same rule to the balanced rank's code-derived total
    bal = StaticPolicy().plan(torch.full((G, E), T * k // E, dtype=torch.long), PlanInputs())
    t_c = Ledger.for_dtype(cfg, G, None, "bf16", optimizer_offload="host").rank_terms(
        bal, T, plan_buffers=True)[0]
    out = {"G": G, "tokens_per_rank": T, "samples": len(counts), "budget": budget,
           "balanced_0.8_budget": {"planners": balanced_budget(cfg, G, T, 0.8, "bf16", "host",
                                                               "bound"),
                                   "code": int(t_c["total"] - 0.2 * t_c["retained_acts"])},
           "static": {"fits_planners": sum(p <= budget for p, _ in st),
                      "fits_code": sum(c <= budget for _, c in st),
                      "max_planners": max(p for p, _ in st), "max_code": max(c for _, c in st)},
           "symi": {}}
    best = {"planners": None, "code": None}
    for s in range(E // G, (max_s or 2 * E // G) + 1):
        sp = [peaks(led, plan_symi(c, s, p), T) for c, p in zip(counts, pops)]
        fit_p, fit_c = all(p <= budget for p, _ in sp), all(c <= budget for _, c in sp)
        out["symi"][s] = {"fits_all_planners": fit_p, "fits_all_code": fit_c,
                          "max_planners": max(p for p, _ in sp), "max_code": max(c for _, c in sp)}
        best["planners"] = s if fit_p else best["planners"]
        best["code"] = s if fit_c else best["code"]
    out["symi_largest_s"] = best
    return out


def markdown(name: str, r: dict) -> str:
    n, b = r["samples"], r["budget"]
    st = r["static"]
    lines = [f"### {name} (budget {fmt_bytes(b)} per rank, EP {r['G']}, "
             f"{r['tokens_per_rank']} tokens per rank, {n} step×layer samples) — MODELLED", "",
             "| | planners' bound | transients derived from the code |", "|---|---|---|",
             f"| static fits without recompute | {st['fits_planners']} of {n} | "
             f"{st['fits_code']} of {n} |",
             f"| static's largest per-rank peak | {fmt_bytes(st['max_planners'])} | "
             f"{fmt_bytes(st['max_code'])} |",
             f"| SYMI's largest s that fits every sample without recompute | "
             f"{r['symi_largest_s']['planners'] or 'none'} | {r['symi_largest_s']['code'] or 'none'} |",
             f"| the `--budget-retain-fraction 0.8` rule would give | "
             f"{fmt_bytes(r['balanced_0.8_budget']['planners'])} | "
             f"{fmt_bytes(r['balanced_0.8_budget']['code'])} |",
             "", "| s | SYMI peak, planners' bound | SYMI peak, code-derived |", "|---|---|---|"]
    for s, v in r["symi"].items():
        lines.append(f"| {s} | {fmt_bytes(v['max_planners'])}{' (fits)' if v['fits_all_planners'] else ''}"
                     f" | {fmt_bytes(v['max_code'])}{' (fits)' if v['fits_all_code'] else ''} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="HF-style model config (.json)")
    ap.add_argument("--trace", required=True, help="a bench ttl routing_trace_*.json")
    ap.add_argument("--budget", required=True, help="per-rank budget, bytes or e.g. 8GiB")
    ap.add_argument("--router-grad-experts", action="store_true",
                    help="static and SYMI take the router gradient at the experts")
    ap.add_argument("--max-s", type=int, default=None, help="largest s to try (default 2E/G)")
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", default=None, help="append the markdown to this file")
    a = ap.parse_args()
    cfg = ModelConfig.from_file(a.config)
    r = analyse(cfg, a.trace, parse_bytes(a.budget), a.router_grad_experts, a.max_s)
    md = markdown(a.name or a.trace, r)
    print(md)
    if a.out:
        with open(a.out, "a") as f:
            f.write(md + "\n")


if __name__ == "__main__":
    main()
