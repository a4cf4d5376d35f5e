"""``lrmoe plan``: print one layer's plan and memory ledger per rank, without a GPU.

Loads come from ``--loads FILE`` or a synthetic Zipf skew (``--skew``); the plan is the
one a training step would make for those counts (SYMI's popularity = the same loads,
i.e. a steady state). The command exits 0 when every rank fits ``--mem-budget`` (or no
budget is given) and 1 when the plan shown exceeds it; bad input is exit code 2.

``--compare`` projects static, symi and lrmoe to several EP sizes and per-rank budgets:
whether each fits, its ledger peak, and a **modelled** step time of the MoE layers
(:mod:`lrmoe.sim.analytic`: a fixed GEMM rate and the link model; nothing runs). There
``--loads`` may also be a routing trace written by ``lrmoe bench ttl``.

Legend: G ranks (EP size), E experts, k experts per token, T tokens per home rank.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lrmoe.config import ModelConfig
from lrmoe.errors import LrmoeError, require
from lrmoe.memory import TERMS, Ledger, fmt_bytes, parse_bytes
from lrmoe.policy.base import PlanInputs
from lrmoe.policy.capacity import apportion
from lrmoe.policy.lrmoe import LrmoeConfig
from lrmoe.policy.plan import Plan
from lrmoe.policy.registry import POLICY_NAMES, PolicyConfig, make_policy
from lrmoe.policy.symi import largest_feasible_slots
from lrmoe.presets import get_preset
from lrmoe.sim.analytic import PROJECTED, project_policy
from lrmoe.sim.cost import STAGES
from lrmoe.sim.links import LINKS, get_link

_SHORT = {"owned_state": "owned", "instance_weights": "inst_w", "instance_grads": "inst_g",
          "buffers": "buffers", "retained_acts": "retained"}
GEMM_TFLOPS = 440.0  # ~60% of the 742 TFLOP/s dense bf16 rate measured on one H200
GEMM_SOURCE = ("expert grouped GEMMs at ~60% of the 742 TFLOP/s dense bf16 rate measured on "
               "one H200 (benchmarks/RESULTS.md)")
NOT_MODELLED = ("non-MoE time (attention, dense layers, optimizer)", "overlap between stages",
                "GEMM efficiency at other shapes", "local permute/combine kernels")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="print one layer's plan and per-rank memory ledger",
        description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="model preset name (see `lrmoe presets`)")
    src.add_argument("--config", help="HF config.json file or folder")
    p.add_argument("--ep", type=int, default=None, help="EP group size G (not with --compare)")
    p.add_argument("--policy", default="static", help=f"one of {', '.join(POLICY_NAMES)}")
    p.add_argument("--slots-per-rank", type=int, default=None,
                   help="symi: slots per rank (default: the largest that fits --mem-budget, "
                        "else E/G+2; with --compare the s of least busiest-rank GEMM work); "
                        "lrmoe: most slots per rank")
    p.add_argument("--mem-budget", default=None,
                   help="bytes per rank for all MoE layers' experts, e.g. 40GiB")
    p.add_argument("--loads", default=None,
                   help="JSON: per-expert counts [..], {\"counts\": [..]}, a G x E matrix, or "
                        "(with --compare) a routing trace of `lrmoe bench ttl`")
    p.add_argument("--skew", type=float, default=1.0,
                   help="Zipf exponent of synthetic loads (0 = uniform)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic expert order")
    p.add_argument("--tokens-per-rank", type=int, default=16384,
                   help="tokens per home rank (each routed to top_k experts)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"),
                   help="compute dtype of instance weights and activations")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="capacity policy")
    p.add_argument("--balance", type=float, default=1.0, help="lrmoe backward balance")
    p.add_argument("--min-keep", type=float, default=0.5, help="lrmoe min keep ratio")
    p.add_argument("--no-selection", action="store_true",
                   help="lrmoe: select every retained pair")
    c = p.add_argument_group("scale projection (--compare; times are modelled, not measured)")
    c.add_argument("--compare", action="store_true",
                   help="static, symi and lrmoe at each --ep-list size and --budgets budget")
    c.add_argument("--ep-list", default="16,32,64", help="EP sizes, comma-separated")
    c.add_argument("--budgets", default="24GiB,40GiB,80GiB",
                   help="per-rank budgets for all MoE layers' experts, comma-separated")
    c.add_argument("--trace-steps", type=int, default=20,
                   help="routing trace: steps sampled, evenly spaced, always the last")
    c.add_argument("--gemm-tflops", type=float, default=GEMM_TFLOPS,
                   help=f"modelled expert GEMM rate per rank (default {GEMM_TFLOPS:g}: "
                        + GEMM_SOURCE.replace("%", "%%") + ")")
    c.add_argument("--link", default="nvlink", choices=tuple(LINKS),
                   help="link preset of the modelled all-to-alls (lrmoe.sim.links)")
    c.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    p.set_defaults(func=run)


# ---------------------------------------------------------------------- loads
def _water_fill(w_E: Tensor, pairs: int, cap: int) -> Tensor:
    """``pairs`` integer units over experts in proportion to ``w_E >= 0``, none above ``cap``.

    Experts whose share would pass ``cap`` get ``cap`` and the excess goes to the others
    in proportion to their weights; then largest-remainder rounding (ties to the lower
    expert id), so the sum is exact. Needs ``cap · (experts with weight > 0) >= pairs``.
    """
    w = w_E.double()
    E = w.numel()
    share = torch.zeros(E, dtype=torch.float64)
    free = w > 0
    left = float(pairs)
    for _ in range(E):
        share[free] = w[free] / w[free].sum() * left
        over = free & (share > cap)
        if not over.any():
            break
        share[over] = cap
        free &= ~over
        left = pairs - float(share[~free].sum())
    row = share.floor().long()
    order = torch.argsort(-(share - row), stable=True)
    row[order[: pairs - int(row.sum())]] += 1
    return row


def synthetic_counts(G: int, E: int, tokens_per_rank: int, top_k: int, skew: float,
                     seed: int = 0) -> Tensor:
    """``[G, E]`` Zipf loads: expert ``perm[j]`` gets weight ``1/(j+1)^skew``.

    Every home rank spreads its ``tokens·top_k`` pairs by the same weights (largest
    remainder); no expert gets more pairs than the home has tokens (one pair per token),
    the excess going to the others in proportion to their weights.
    """
    require(tokens_per_rank >= 1, f"--tokens-per-rank={tokens_per_rank} must be >= 1")
    require(skew >= 0, f"--skew={skew} must be >= 0")
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(E, generator=gen)
    w = torch.empty(E, dtype=torch.float64)
    w[perm] = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** skew
    row = _water_fill(w, tokens_per_rank * top_k, tokens_per_rank)
    return row[None, :].repeat(G, 1)


def spread_over_homes(total_E: Tensor, G: int) -> Tensor:
    """``[G, E]``: each expert's pairs split evenly over the G home ranks."""
    return apportion(total_E, torch.ones(G, total_E.numel(), dtype=torch.long) * (total_E.max() + 1))


def _read_json(path: str):
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise LrmoeError(f"cannot read --loads {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f": {e.msg} at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
        raise LrmoeError(f"--loads {path} is not valid JSON{where}") from None


def _is_trace(data) -> bool:
    return isinstance(data, dict) and "steps" in data


def load_counts(path: str, G: int, E: int, data=None) -> Tensor:
    """Read ``--loads``: per-expert counts (spread evenly over homes) or a G x E matrix."""
    data = _read_json(path) if data is None else data
    require(not _is_trace(data), f"--loads {path} is a routing trace (many steps and layers); "
                                 "use it with --compare")
    if isinstance(data, dict):
        require("counts" in data, f"--loads {path} is an object without a \"counts\" field")
        data = data["counts"]
    try:
        t = torch.tensor(data, dtype=torch.float64)
    except (TypeError, ValueError):
        raise LrmoeError(f"--loads {path} must hold a list of numbers or a list of "
                         "equal-length lists") from None
    require(bool((t >= 0).all()) and bool((t == t.round()).all()),
            f"--loads {path} must hold non-negative integers")
    t = t.long()
    if t.dim() == 1:
        require(t.numel() == E, f"--loads {path} has {t.numel()} counts; the model has {E} "
                                "experts")
        return spread_over_homes(t, G)
    require(t.dim() == 2 and tuple(t.shape) == (G, E),
            f"--loads {path} matrix has shape {tuple(t.shape)}; want (--ep, experts) = "
            f"{(G, E)}")
    return t


@dataclass
class RoutingTrace:
    """Sampled ``(step, layer)`` global expert loads of a ``lrmoe bench ttl`` trace.

    Attributes:
        path: the file.
        n_steps: steps in the trace.
        steps: the sampled steps (0-based), evenly spaced, the last one included.
        loads_E: global pairs per expert, one per sampled (step, layer).
        skew: mean over the samples of max/mean expert load (as observed).
    """

    path: str
    n_steps: int
    steps: list[int]
    loads_E: list[Tensor]
    skew: float

    def counts(self, G: int, tokens_per_rank: int, top_k: int) -> list[Tensor]:
        """Per sample, ``[G, E]`` loads rescaled to ``G·T·k`` pairs (at most ``G·T`` per
        expert: one pair per token), each expert's pairs spread evenly over the homes."""
        pairs, cap = G * tokens_per_rank * top_k, G * tokens_per_rank
        return [spread_over_homes(_water_fill(c.double(), pairs, cap), G) for c in self.loads_E]


def read_trace(path: str, data: dict, E: int, top_k: int, n_samples: int) -> RoutingTrace:
    """Validate a routing trace (``steps[step][moe_layer][expert]`` = global pairs) and
    sample ``n_samples`` of its steps."""
    require(n_samples >= 1, f"--trace-steps={n_samples} must be >= 1")
    try:
        t = torch.tensor(data["steps"], dtype=torch.float64)
    except (TypeError, ValueError):
        raise LrmoeError(f"--loads {path}: routing trace \"steps\" must be a list (steps) of "
                         "lists (MoE layers) of equal-length lists of numbers (experts)") from None
    require(t.dim() == 3 and t.shape[0] >= 1 and t.shape[1] >= 1,
            f"--loads {path}: routing trace \"steps\" has shape {tuple(t.shape)}; want "
            "(steps, MoE layers, experts) with at least one step and layer")
    require(t.shape[2] == E, f"--loads {path}: routing trace has {t.shape[2]} experts per layer; "
                             f"the model has {E}")
    require(bool((t >= 0).all()) and bool((t == t.round()).all()),
            f"--loads {path}: routing trace must hold non-negative integers")
    t = t.long()
    n = t.shape[0]
    m = min(n_samples, n)
    steps = sorted({(i + 1) * n // m - 1 for i in range(m)})
    loads, ratios = [], []
    for s in steps:
        for layer in range(t.shape[1]):
            c = t[s, layer]
            used = int((c > 0).sum())
            require(used >= top_k, f"--loads {path}: step {s} layer {layer} routes to {used} "
                                   f"experts; top_k={top_k} needs at least {top_k}")
            loads.append(c)
            ratios.append(float(c.max()) / float(c.double().mean()))
    return RoutingTrace(path, n, steps, loads, sum(ratios) / len(ratios))


# ---------------------------------------------------------------------- output
def _instances(row: Tensor) -> str:
    return ",".join(str(int(e)) for e in row if e >= 0)


def _aligned(heads: list[list[str]], rows: list[list[str]], left: set[int]) -> str:
    """Plain aligned columns: ``left`` columns left-justified, the others right."""
    width = [max(len(x) for x in col) for col in zip(*heads, *rows)]
    lines = []
    for row in heads + rows:
        cells = [c.ljust(w) if i in left else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, width))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def format_table(plan: Plan, terms: list[dict[str, int]], budget: int | None) -> str:
    """A plain aligned table: one row per rank, loads and ledger terms in GiB."""
    fwd, bwd = plan.rank_load(), plan.rank_backward_load()
    head = ["rank", "instances", "fwd", "bwd"] + [_SHORT[k] for k in TERMS] + ["total", "fits"]
    rows = []
    for r, t in enumerate(terms):
        fits = "-" if budget is None else ("yes" if t["total"] <= budget else "NO")
        rows.append([str(r), _instances(plan.inst_expert_GS[r]), str(int(fwd[r])),
                     str(int(bwd[r]))] + [fmt_bytes(t[k]) for k in TERMS]
                    + [fmt_bytes(t["total"]), fits])
    return _aligned([head], rows, {0, 1})


def summary(plan: Plan, terms: list[dict[str, int]], budget: int | None) -> str:
    fwd, bwd = plan.rank_load().double(), plan.rank_backward_load().double()
    assigned = int(plan.assign_GGS.sum())
    lines = [
        f"forward load  max {int(fwd.max())}  mean {fwd.mean():.1f}  "
        f"max/mean {fwd.max() / fwd.mean().clamp(min=1e-9):.3f}",
        f"backward load max {int(bwd.max())}  mean {bwd.mean():.1f}  "
        f"max/mean {bwd.max() / bwd.mean().clamp(min=1e-9):.3f}",
        f"replicas {plan.num_replicas()}  retained {int(plan.retain_GGS.sum())}/{assigned}  "
        f"selected {int(plan.select_GGS.sum())}/{assigned}",
    ]
    if plan.dropped_GE is not None:
        lines.append(f"dropped {int(plan.dropped_GE.sum())} pairs (capacity)")
    peak = max(t["total"] for t in terms)
    if budget is None:
        lines.append(f"peak rank {fmt_bytes(peak)} (no budget)")
    else:
        lines.append(f"peak rank {fmt_bytes(peak)} of budget {fmt_bytes(budget)}: "
                     + ("fits" if peak <= budget else "DOES NOT FIT"))
    return "\n".join(lines)


# ---------------------------------------------------------------------- run
def _model(args: argparse.Namespace) -> ModelConfig:
    return get_preset(args.preset) if args.preset else ModelConfig.from_file(args.config)


def _lrmoe_config(args: argparse.Namespace) -> LrmoeConfig:
    return LrmoeConfig(balance=args.balance, min_keep=args.min_keep,
                       selection=not args.no_selection)


def run(args: argparse.Namespace) -> int:
    if args.compare:
        return run_compare(args)
    require(args.ep is not None, "--ep is required without --compare")
    cfg = _model(args)
    G, E, k = args.ep, cfg.num_experts, cfg.num_experts_per_tok
    require(G >= 1 and E % G == 0, f"--ep={G} must divide the number of experts {E}")
    budget = None if args.mem_budget is None else parse_bytes(args.mem_budget)
    ledger = Ledger.for_dtype(cfg, G, budget, args.dtype)
    if args.loads:
        counts = load_counts(args.loads, G, E)
    else:
        counts = synthetic_counts(G, E, args.tokens_per_rank, k, args.skew, args.seed)
    pop = counts.sum(0)

    slots, note = args.slots_per_rank, ""
    if args.policy == "symi" and slots is None and budget is not None:
        try:
            slots = largest_feasible_slots(ledger, counts, pop)
            note = f"slots per rank {slots}: the largest that fits the budget"
        except LrmoeError as e:
            slots, note = E // G, f"no slots_per_rank fits ({e}); showing s = E/G"
    policy = make_policy(PolicyConfig(args.policy, args.capacity_factor, slots,
                                      _lrmoe_config(args)), cfg, G)

    try:
        plan = policy.plan(counts, PlanInputs(prev_counts_E=pop, ledger=ledger))
    except LrmoeError as e:
        if budget is None or args.policy == "lrmoe":
            raise
        # An exact policy over budget: show what it would need.
        print(f"note: {e}")
        unbounded = Ledger.for_dtype(cfg, G, None, args.dtype)
        plan = policy.plan(counts, PlanInputs(prev_counts_E=pop, ledger=unbounded))
    terms = ledger.rank_terms(plan)

    print(f"{args.preset or args.config}: E={E} top_k={k} H={cfg.hidden_size} "
          f"F={cfg.moe_intermediate_size} MoE layers={ledger.L}  EP={G}  policy={args.policy}"
          f"  dtype={args.dtype}  pairs/rank={int(counts.sum(1).max())}")
    print(f"per slot (all layers) {fmt_bytes(ledger.L * ledger.P)}, per retained pair "
          f"(all layers) {fmt_bytes(ledger.L * ledger.A)}")
    if note:
        print(note)
    print(format_table(plan, terms, budget))
    print(summary(plan, terms, budget))
    return 0 if budget is None or max(t["total"] for t in terms) <= budget else 1


# ---------------------------------------------------------------------- compare
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
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        try:
            out.append((part, parse_bytes(part)))
        except LrmoeError as e:
            raise LrmoeError(f"--budgets: {e}") from None
    require(len(out) > 0, f"--budgets={text!r} names no budget; write e.g. 24GiB,40GiB")
    return out


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def compare_tables(rows: list[dict]) -> str:
    """The summary table and the per-stage table (ms per MoE layer), times modelled."""
    m = "modelled"
    heads = [["", "", "", "", "ledger", "", "", "", "", m, m, m],
             ["ep", "budget", "policy", "fits", "peak/rank", "keep", "recompute", "replicas",
              "s", "ms/layer", "ms/all layers", "lrmoe/symi"]]
    body = []
    for r in rows:
        rep = r["replicas"]
        body.append([str(r["ep"]), r["budget"], r["policy"],
                     "yes" if r["fits"] else "does not fit",
                     _fmt(None if r["peak_bytes"] is None else fmt_bytes(r["peak_bytes"]), "s"),
                     _fmt(r["keep_ratio"], ".3f"), _fmt(r["recompute_ratio"], ".3f"),
                     "-" if rep is None else (f"{rep:.0f}" if rep == int(rep) else f"{rep:.1f}"),
                     _fmt(r["slots_per_rank"], "d"), _fmt(r["modelled_layer_ms"], ".3f"),
                     _fmt(r["modelled_all_layers_ms"], ".2f"), _fmt(r["lrmoe_over_symi"], ".3f")])
    main = _aligned(heads, body, {1, 2, 3})
    short = {"fwd_dispatch": "f_disp", "fwd_experts": "f_exp", "fwd_combine": "f_comb",
             "bwd_dispatch": "b_disp", "bwd_experts": "b_exp", "bwd_recompute": "b_recomp",
             "bwd_combine": "b_comb", "weight_scatter": "w_scatter", "grad_reduce": "g_reduce"}
    heads = [["", "", ""] + [m] * len(STAGES), ["ep", "budget", "policy"] + [short[s] for s in STAGES]]
    body = [[str(r["ep"]), r["budget"], r["policy"]]
            + [f"{r['modelled_stages_ms'][s]:.3f}" for s in STAGES]
            for r in rows if r["fits"]]
    stages = _aligned(heads, body, {1, 2}) if body else "(no row fits)"
    return main + "\n\nstages, ms per MoE layer (slowest rank per stage):\n" + stages


def run_compare(args: argparse.Namespace) -> int:
    require(args.ep is None, f"--ep={args.ep} is not used with --compare; give the EP sizes "
                             "with --ep-list")
    require(args.mem_budget is None, "--mem-budget is not used with --compare; give the "
                                     "budgets with --budgets")
    cfg = _model(args)
    E, k, T = cfg.num_experts, cfg.num_experts_per_tok, args.tokens_per_rank
    eps = _int_list(args.ep_list, "--ep-list")
    bad = [G for G in eps if E % G]
    require(not bad, f"--ep-list={args.ep_list!r}: {bad} do not divide the number of experts {E}")
    budgets = _budget_list(args.budgets)
    require(math.isfinite(args.gemm_tflops) and args.gemm_tflops > 0,
            f"--gemm-tflops={args.gemm_tflops} must be a positive number")
    require(T >= 1, f"--tokens-per-rank={T} must be >= 1")
    link, rate = get_link(args.link), args.gemm_tflops * 1e12
    if args.json:  # fail before the work, not after
        parent = Path(args.json).resolve().parent
        require(parent.is_dir(), f"--json {args.json}: folder {parent} does not exist")

    trace, data = None, None
    if args.loads:
        data = _read_json(args.loads)
        if _is_trace(data):
            trace = read_trace(args.loads, data, E, k, args.trace_steps)
    if trace is not None:
        loads = {"source": "trace", "file": args.loads, "steps_in_trace": trace.n_steps,
                 "steps_sampled": trace.steps, "samples": len(trace.loads_E),
                 "observed_skew_max_over_mean": trace.skew}
        what = (f"routing trace {args.loads}: steps {trace.steps} of {trace.n_steps} (0-based), "
                f"{len(trace.loads_E)} (step, layer) samples, rescaled to {T} tokens/rank; "
                f"observed skew (mean max/mean expert load) {trace.skew:.2f}")
    elif data is not None:
        loads = {"source": "file", "file": args.loads}
        what = f"loads {args.loads}"
    else:
        loads = {"source": "synthetic", "skew": args.skew, "seed": args.seed}
        what = f"synthetic Zipf skew {args.skew:g} (seed {args.seed}), {T} tokens/rank"

    rows = []
    for G in eps:
        if trace is not None:
            samples = trace.counts(G, T, k)
        elif data is not None:
            samples = [load_counts(args.loads, G, E, data)]
        else:
            samples = [synthetic_counts(G, E, T, k, args.skew, args.seed)]
        for text, budget in budgets:
            ledger = Ledger.for_dtype(cfg, G, budget, args.dtype)
            group = {name: {"budget": text,
                            **project_policy(name, cfg, ledger, samples, link, rate,
                                             _lrmoe_config(args), args.slots_per_rank)}
                     for name in PROJECTED}
            rows += group.values()
            lr, sy = group["lrmoe"], group["symi"]
            if lr["fits"] and sy["fits"]:
                lr["lrmoe_over_symi"] = lr["modelled_layer_ms"] / sy["modelled_layer_ms"]

    name, L = args.preset or args.config, len(cfg.moe_layers)
    print(f"{name}: E={E} top_k={k} H={cfg.hidden_size} F={cfg.moe_intermediate_size} "
          f"MoE layers={L}  dtype={args.dtype}  tokens/rank={T}")
    print(f"loads: {what}")
    print(f"times are MODELLED, not measured: expert GEMMs at {args.gemm_tflops:g} TFLOP/s per "
          f"rank{' (' + GEMM_SOURCE + ')' if args.gemm_tflops == GEMM_TFLOPS else ''};")
    print(f"  link {link.name}: {link.bandwidth_Bps / 1e9:g} GB/s per direction, "
          f"{link.latency_s * 1e6:g} us per peer message; each stage its slowest rank, "
          "stages in sequence")
    print("  not modelled: " + "; ".join(NOT_MODELLED))
    print(compare_tables(rows))
    notes: dict[tuple, list[str]] = {}  # one line per (ep, budget, reason)
    for r in rows:
        if r["reason"]:
            notes.setdefault((r["ep"], r["budget"], r["reason"]), []).append(r["policy"])
    if notes:
        print("\ndoes not fit:")
        for (G, text, reason), who in notes.items():
            print(f"  ep {G} budget {text} {', '.join(who)}: {reason}")
    if args.json:
        out = {"label": "modelled", "model": name, "E": E, "top_k": k, "H": cfg.hidden_size,
               "F": cfg.moe_intermediate_size, "moe_layers": L, "dtype": args.dtype,
               "tokens_per_rank": T, "loads": loads, "gemm_tflops": args.gemm_tflops,
               "gemm_source": GEMM_SOURCE, "not_modelled": list(NOT_MODELLED),
               "link": {"name": link.name, "bandwidth_Bps": link.bandwidth_Bps,
                        "latency_s": link.latency_s, "source": link.source},
               "rows": rows}
        try:
            Path(args.json).write_text(json.dumps(out, indent=1))
        except OSError as e:
            raise LrmoeError(f"cannot write --json {args.json}: {e.strerror or e}") from None
    return 0
