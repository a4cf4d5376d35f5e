"""``lrmoe plan``: print one layer's plan and memory ledger per rank, without a GPU.

Loads come from ``--loads FILE`` or a synthetic Zipf skew (``--skew``); the plan is the
one a training step would make for those counts (SYMI's popularity = the same loads,
i.e. a steady state). The command exits 0 when every rank fits ``--mem-budget`` (or no
budget is given) and 1 when the plan shown exceeds it; bad input is exit code 2.
``--compare``: :mod:`lrmoe.commands.plan_compare`.

Legend: G ranks (EP size), E experts, k experts per token, T tokens per home rank.
"""

from __future__ import annotations

import argparse
import dataclasses

from lrmoe.cli_flags import PLAN, add_policy_flags, check_int, check_policy_flags, policy_config
from lrmoe.commands.columns import aligned
from lrmoe.commands.plan_compare import GEMM_SOURCE, GEMM_TFLOPS, model_line, run_compare
from lrmoe.config import ModelConfig
from lrmoe.errors import LrmoeError, require
from lrmoe.ledger import TERMS, Ledger
from lrmoe.policy.base import PlanInputs
from lrmoe.policy.lrmoe_ladder import RUNG_NOTES
from lrmoe.policy.plan import Plan
from lrmoe.policy.registry import PolicyConfig, make_policy
from lrmoe.policy.symi import largest_feasible_slots
from lrmoe.presets import get_preset
from lrmoe.routing_loads import load_counts, synthetic_counts
from lrmoe.sim.links import LINKS
from lrmoe.units import fmt_bytes, parse_bytes

_SHORT = {"owned_state": "owned", "instance_weights": "inst_w", "instance_grads": "inst_g",
          "buffers": "buffers", "retained_acts": "retained", "combine_rows": "combined",
          "pair_index": "index"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="print one layer's plan and per-rank memory ledger",
        description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="model preset name (see `lrmoe presets`)")
    src.add_argument("--config", help="HF config.json file or folder")
    p.add_argument("--ep", type=int, default=None, help="EP group size G (not with --compare)")
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
    g = p.add_argument_group("policy and memory (lrmoe.cli_flags: the same flags as train "
                             "and bench)")
    add_policy_flags(g, PLAN)
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


def format_table(plan: Plan, terms: list[dict[str, int]], budget: int | None) -> str:
    """A plain aligned table: one row per rank, loads and ledger terms in GiB."""
    fwd, bwd = plan.rank_load(), plan.rank_backward_load()
    head = ["rank", "instances", "fwd", "bwd"] + [_SHORT[k] for k in TERMS] + ["total", "fits"]
    rows = []
    for r, t in enumerate(terms):
        fits = "-" if budget is None else ("yes" if t["total"] <= budget else "NO")
        instances = ",".join(str(int(e)) for e in plan.inst_expert_GS[r] if e >= 0)
        rows.append([str(r), instances, str(int(fwd[r])),
                     str(int(bwd[r]))] + [fmt_bytes(t[k]) for k in TERMS]
                    + [fmt_bytes(t["total"]), fits])
    return aligned([head], rows, {0, 1})


def summary(plan: Plan, terms: list[dict[str, int]], budget: int | None) -> str:
    fwd, bwd = plan.rank_load().double(), plan.rank_backward_load().double()
    assigned = int(plan.assign_GGS.sum())
    lines = [f"{name} max {int(x.max())}  mean {x.mean():.1f}  "
             f"max/mean {x.max() / x.mean().clamp(min=1e-9):.3f}"
             for name, x in (("forward load ", fwd), ("backward load", bwd))]
    lines.append(f"replicas {plan.num_replicas()}  retained {int(plan.retain_GGS.sum())}/"
                 f"{assigned}  selected {int(plan.select_GGS.sum())}/{assigned}")
    if plan.dropped_GE is not None:
        lines.append(f"dropped {int(plan.dropped_GE.sum())} pairs (capacity)")
    peak = max(t["total"] for t in terms)
    if budget is None:
        lines.append(f"peak rank {fmt_bytes(peak)} (no budget)")
    else:
        lines.append(f"peak rank {fmt_bytes(peak)} of budget {fmt_bytes(budget)}: "
                     + ("fits" if peak <= budget else "DOES NOT FIT"))
    return "\n".join(lines)


def plan_policy(args: argparse.Namespace, slots: int | None = None) -> PolicyConfig:
    """The policy config of the flags given (``slots``: in place of --slots-per-rank)."""
    given = {k: getattr(args, k) for k in PLAN if hasattr(args, k)}
    if slots is not None:
        given["slots_per_rank"] = slots
    return policy_config(given)


def run(args: argparse.Namespace) -> int:
    # every integer flag in range: no count beyond int64 reaches the planners' int64 arrays
    check_int("ep", args.ep, 1, allow_none=True)
    # beyond 2**31 - 1 tokens a home rank routes, pairs times bytes per pair leave int64
    check_int("tokens_per_rank", args.tokens_per_rank, 1, high=2**31 - 1)
    check_int("seed", args.seed, 0, high=2**64 - 1)
    check_int("trace_steps", args.trace_steps, 1)
    check_policy_flags({k: getattr(args, k) for k in PLAN})
    require(args.compare or args.ep is not None, "--ep is required without --compare")
    cfg = get_preset(args.preset) if args.preset else ModelConfig.from_file(args.config)
    if args.compare:
        return run_compare(args, cfg, plan_policy(args))
    G, E, k = args.ep, cfg.num_experts, cfg.num_experts_per_tok
    require(E % G == 0, f"--ep={G} must divide the number of experts {E}")
    budget = None if args.mem_budget is None else parse_bytes(args.mem_budget)
    ledger = Ledger.for_dtype(cfg, G, budget, args.dtype,
                              optimizer_offload=args.optimizer_offload,
                              router_grad_at_experts=args.router_grad == "experts")
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
    policy = make_policy(plan_policy(args, slots), cfg, G)

    try:
        plan = policy.plan(counts, PlanInputs(prev_counts_E=pop, ledger=ledger))
    except LrmoeError as e:
        if budget is None or args.policy == "lrmoe":
            raise
        # An exact policy over budget: show what it would need.
        print(f"note: {e}")
        unbounded = dataclasses.replace(ledger, budget_bytes=None)
        plan = policy.plan(counts, PlanInputs(prev_counts_E=pop, ledger=unbounded))
    terms = ledger.rank_terms(plan)  # a layer-checkpointed plan in the ledger's layer mode

    print(f"{model_line(args, cfg)}  EP={G}  policy={args.policy}  dtype={args.dtype}  "
          f"pairs/rank={int(counts.sum(1).max())}")
    print(f"per slot (all layers) {fmt_bytes(ledger.L * ledger.P)}, per retained pair "
          f"(all layers) {fmt_bytes(ledger.L * ledger.A)}")
    if note:
        print(note)
    if plan.rung is not None:
        print(f"rung: {plan.rung} ({RUNG_NOTES[plan.rung]})")
    print(format_table(plan, terms, budget))
    print(summary(plan, terms, budget))
    return 0 if budget is None or max(t["total"] for t in terms) <= budget else 1
