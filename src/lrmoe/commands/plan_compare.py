"""``lrmoe plan --compare``: static, symi and lrmoe projected to EP sizes and budgets.

For each (EP size, per-rank budget, policy): whether it fits, its ledger peak, keep and
recompute ratios, replicas, symi's ``s``, and a **modelled** MoE step time
(:mod:`lrmoe.sim.analytic`: a fixed GEMM rate and the link model; nothing runs). Loads
come from a Zipf skew, a loads file or a routing trace (:mod:`lrmoe.routing_loads`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from lrmoe.cli_flags import check_num
from lrmoe.commands.columns import aligned, fmt
from lrmoe.config import ModelConfig
from lrmoe.errors import LrmoeError, require
from lrmoe.ledger import Ledger
from lrmoe.policy.registry import PolicyConfig
from lrmoe.routing_loads import is_trace, load_counts, read_json, read_trace, synthetic_counts
from lrmoe.sim.analytic import PROJECTED, project_policy
from lrmoe.sim.cost import STAGES
from lrmoe.sim.links import get_link
from lrmoe.sim.offload import assumptions as offload_assumptions
from lrmoe.units import fmt_bytes, parse_bytes

GEMM_TFLOPS = 440.0  # ~60% of the 742 TFLOP/s dense bf16 rate measured on one H200
GEMM_SOURCE = ("expert grouped GEMMs at ~60% of the 742 TFLOP/s dense bf16 rate measured on "
               "one H200 (benchmarks/RESULTS.md)")
NOT_MODELLED = ("non-MoE time (attention, dense layers, optimizer)", "overlap between stages",
                "GEMM efficiency at other shapes",
                "selection, saved-row gathers, local permute/combine kernels (stages select, "
                "gather, local: measured by bench ttl, zero here)")


def _int_list(text: str, name: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    require(len(out) > 0 and all(x >= 1 for x in out),
            f"{name}={text!r} must be positive integers separated by commas, e.g. 16,32,64")
    return out


def _budget_list(text: str) -> list[tuple[str, int]]:
    out = []
    for part in [x.strip() for x in text.split(",") if x.strip()]:
        try:
            out.append((part, parse_bytes(part)))
        except LrmoeError as e:
            raise LrmoeError(f"--budgets: {e}") from None
    require(len(out) > 0, f"--budgets={text!r} names no budget; write e.g. 24GiB,40GiB")
    return out


def compare_tables(rows: list[dict]) -> str:
    """The summary table and the per-stage table (ms per MoE layer), times modelled."""
    m = "modelled"
    heads = [["", "", "", "", "ledger", "", "", "", "", "measured", m, m, m],
             ["ep", "budget", "policy", "fits", "peak/rank", "keep", "recompute", "replicas",
              "s", "plan ms/layer", "ms/layer", "ms/all layers", "lrmoe/symi"]]
    body = []
    for r in rows:
        rep = r["replicas"]
        peak = None if r["peak_bytes"] is None else fmt_bytes(r["peak_bytes"])
        body.append([str(r["ep"]), r["budget"], r["policy"],
                     "yes" if r["fits"] else "does not fit", fmt(peak, "s", "-"),
                     fmt(r["keep_ratio"], ".3f", "-"), fmt(r["recompute_ratio"], ".3f", "-"),
                     "-" if rep is None else (f"{rep:.0f}" if rep == int(rep) else f"{rep:.1f}"),
                     fmt(r["slots_per_rank"], "d", "-"), fmt(r["planning_ms"], ".3f", "-"),
                     fmt(r["modelled_layer_ms"], ".3f", "-"),
                     fmt(r["modelled_all_layers_ms"], ".2f", "-"),
                     fmt(r["lrmoe_over_symi"], ".3f", "-")])
    main = aligned(heads, body, {1, 2, 3})
    short = {"plan": "plan", "count_exchange": "counts", "local": "local", "select": "select",
             "gather": "gather", "fwd_dispatch": "f_disp", "fwd_experts": "f_exp",
             "fwd_combine": "f_comb", "bwd_dispatch": "b_disp", "bwd_experts": "b_exp",
             "bwd_recompute": "b_recomp", "bwd_combine": "b_comb", "weight_scatter": "w_scatter",
             "grad_reduce": "g_reduce", "opt_d2h": "o_d2h", "opt_host_update": "o_host",
             "opt_h2d": "o_h2d"}
    heads = [["", "", ""] + [m] * len(STAGES), ["ep", "budget", "policy"] + [short[s] for s in STAGES]]
    body = [[str(r["ep"]), r["budget"], r["policy"]]
            + [f"{r['modelled_stages_ms'][s]:.3f}" for s in STAGES]
            for r in rows if r["fits"]]
    stages = aligned(heads, body, {1, 2}) if body else "(no row fits)"
    return main + "\n\nstages, ms per MoE layer (slowest rank per stage):\n" + stages


@dataclass
class Loads:
    """Where the compared loads come from: a routing trace, a loads file or a synthetic
    skew. ``samples(G)``: the ``[G, E]`` counts at EP size ``G`` (one per sampled (step,
    layer) of a trace); ``record``: as the JSON output names them; ``what``: one line for
    the header."""

    samples: Callable[[int], list]
    record: dict
    what: str


def read_loads(args: argparse.Namespace, E: int, k: int) -> Loads:
    T = args.tokens_per_rank
    if not args.loads:
        return Loads(lambda G: [synthetic_counts(G, E, T, k, args.skew, args.seed)],
                     {"source": "synthetic", "skew": args.skew, "seed": args.seed},
                     f"synthetic Zipf skew {args.skew:g} (seed {args.seed}), {T} tokens/rank")
    data = read_json(args.loads)
    if not is_trace(data):
        return Loads(lambda G: [load_counts(args.loads, G, E, data)],
                     {"source": "file", "file": args.loads}, f"loads {args.loads}")
    trace = read_trace(args.loads, data, E, k, args.trace_steps)
    return Loads(lambda G: trace.counts(G, T, k),
                 {"source": "trace", "file": args.loads, "steps_in_trace": trace.n_steps,
                  "steps_sampled": trace.steps, "samples": len(trace.loads_E),
                  "observed_skew_max_over_mean": trace.skew},
                 f"routing trace {args.loads}: steps {trace.steps} of {trace.n_steps} "
                 f"(0-based), {len(trace.loads_E)} (step, layer) samples, rescaled to {T} "
                 f"tokens/rank; observed skew (mean max/mean expert load) {trace.skew:.2f}")


def check_compare_args(args: argparse.Namespace, E: int) -> tuple[list[int], list[tuple[str, int]]]:
    """The EP sizes and budgets of the flags (every flag checked before any work)."""
    require(args.ep is None, f"--ep={args.ep} is not used with --compare; give the EP sizes "
                             "with --ep-list")
    require(args.mem_budget is None, "--mem-budget is not used with --compare; give the "
                                     "budgets with --budgets")
    eps = _int_list(args.ep_list, "--ep-list")
    bad = [G for G in eps if E % G]
    require(not bad, f"--ep-list={args.ep_list!r}: {bad} do not divide the number of experts {E}")
    budgets = _budget_list(args.budgets)
    check_num("gemm_tflops", args.gemm_tflops, 0.0, open_low=True)
    if args.json:  # fail before the work, not after
        parent = Path(args.json).resolve().parent
        require(parent.is_dir(), f"--json {args.json}: folder {parent} does not exist")
    return eps, budgets


def project_rows(args: argparse.Namespace, cfg: ModelConfig, policy: PolicyConfig, loads: Loads,
                 eps: list[int], budgets: list[tuple[str, int]], link) -> list[dict]:
    """One row per (EP size, budget, policy), with lrmoe's time over symi's."""
    rows = []
    for G in eps:
        samples = loads.samples(G)
        for text, budget in budgets:
            ledger = Ledger.for_dtype(cfg, G, budget, args.dtype,
                                      optimizer_offload=args.optimizer_offload)
            # --router-grad experts: static and symi (exact) keep no combined rows; lrmoe
            # stays home (its trimmed plans keep them), as in `bench ttl`
            lean = replace(ledger, router_grad_at_experts=args.router_grad == "experts")
            group = {name: {"budget": text,
                            **project_policy(name, cfg, ledger if name == "lrmoe" else lean,
                                             samples, link, args.gemm_tflops * 1e12,
                                             policy.lrmoe, args.slots_per_rank)}
                     for name in PROJECTED}
            rows += group.values()
            lr, sy = group["lrmoe"], group["symi"]
            if lr["fits"] and sy["fits"]:
                lr["lrmoe_over_symi"] = lr["modelled_layer_ms"] / sy["modelled_layer_ms"]
    return rows


def model_line(args: argparse.Namespace, cfg: ModelConfig) -> str:
    """The model a plan is for: ``{preset}: E= top_k= H= F= MoE layers=``."""
    return (f"{args.preset or args.config}: E={cfg.num_experts} top_k={cfg.num_experts_per_tok} "
            f"H={cfg.hidden_size} F={cfg.moe_intermediate_size} MoE layers={len(cfg.moe_layers)}")


def print_header(args: argparse.Namespace, cfg: ModelConfig, loads: Loads, link) -> None:
    """What was compared and what the times model."""
    print(f"{model_line(args, cfg)}  dtype={args.dtype}  tokens/rank={args.tokens_per_rank}")
    print(f"loads: {loads.what}")
    print(f"times are MODELLED, not measured: expert GEMMs at {args.gemm_tflops:g} TFLOP/s per "
          f"rank{' (' + GEMM_SOURCE + ')' if args.gemm_tflops == GEMM_TFLOPS else ''};")
    print(f"  link {link.name}: {link.bandwidth_Bps / 1e9:g} GB/s per direction, "
          f"{link.latency_s * 1e6:g} us per peer message; each stage its slowest rank, "
          "stages in sequence")
    if args.optimizer_offload == "host":
        print("  optimizer offload to host, modelled: " + offload_assumptions())
    if args.router_grad == "experts":
        print("  --router-grad experts: static and symi keep no combined expert outputs "
              "(router gradient from the expert backward, 4 more bytes per row home); "
              "lrmoe keeps them")
    print("  planning (column plan ms/layer, stage plan) is MEASURED on this machine: each "
          "policy's plan call per layer (with the exact policies' fit to the budget), charged "
          "to every rank and included in ms/layer")
    print("  not modelled: " + "; ".join(NOT_MODELLED))


def print_misfits(rows: list[dict]) -> None:
    """One line per (ep, budget, reason) a policy does not fit."""
    notes: dict[tuple, list[str]] = {}
    for r in rows:
        if r["reason"]:
            notes.setdefault((r["ep"], r["budget"], r["reason"]), []).append(r["policy"])
    if notes:
        print("\ndoes not fit:")
        for (G, text, reason), who in notes.items():
            print(f"  ep {G} budget {text} {', '.join(who)}: {reason}")


def write_json(args: argparse.Namespace, cfg: ModelConfig, loads: Loads, link,
               rows: list[dict]) -> None:
    out = {"label": "modelled", "model": args.preset or args.config, "E": cfg.num_experts,
           "top_k": cfg.num_experts_per_tok, "H": cfg.hidden_size,
           "F": cfg.moe_intermediate_size, "moe_layers": len(cfg.moe_layers),
           "dtype": args.dtype, "tokens_per_rank": args.tokens_per_rank,
           "optimizer_offload": args.optimizer_offload, "router_grad": args.router_grad,
           "loads": loads.record, "gemm_tflops": args.gemm_tflops,
           "gemm_source": GEMM_SOURCE, "not_modelled": list(NOT_MODELLED),
           "link": {"name": link.name, "bandwidth_Bps": link.bandwidth_Bps,
                    "latency_s": link.latency_s, "source": link.source},
           "rows": rows}
    try:
        Path(args.json).write_text(json.dumps(out, indent=1))
    except OSError as e:
        raise LrmoeError(f"cannot write --json {args.json}: {e.strerror or e}") from None


def run_compare(args: argparse.Namespace, cfg: ModelConfig, policy: PolicyConfig) -> int:
    eps, budgets = check_compare_args(args, cfg.num_experts)
    link = get_link(args.link)
    loads = read_loads(args, cfg.num_experts, cfg.num_experts_per_tok)
    rows = project_rows(args, cfg, policy, loads, eps, budgets, link)
    print_header(args, cfg, loads, link)
    print(compare_tables(rows))
    print_misfits(rows)
    if args.json:
        write_json(args, cfg, loads, link, rows)
    return 0
