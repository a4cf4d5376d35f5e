"""``lrmoe plan``: print one layer's plan and memory ledger per rank, without a GPU.

Loads come from ``--loads FILE`` or a synthetic Zipf skew (``--skew``); the plan is the
one a training step would make for those counts (SYMI's popularity = the same loads,
i.e. a steady state). The command exits 0 when every rank fits ``--mem-budget`` (or no
budget is given) and 1 when the plan shown exceeds it; bad input is exit code 2.
"""

from __future__ import annotations

import argparse
import json
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

_SHORT = {"owned_state": "owned", "instance_weights": "inst_w", "instance_grads": "inst_g",
          "buffers": "buffers", "retained_acts": "retained"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="print one layer's plan and per-rank memory ledger",
        description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="model preset name (see `lrmoe presets`)")
    src.add_argument("--config", help="HF config.json file or folder")
    p.add_argument("--ep", type=int, required=True, help="EP group size G")
    p.add_argument("--policy", default="static", help=f"one of {', '.join(POLICY_NAMES)}")
    p.add_argument("--slots-per-rank", type=int, default=None,
                   help="symi: slots per rank (default: the largest that fits --mem-budget, "
                        "else E/G+2); lrmoe: most slots per rank")
    p.add_argument("--mem-budget", default=None,
                   help="bytes per rank for all MoE layers' experts, e.g. 40GiB")
    p.add_argument("--loads", default=None,
                   help="JSON: per-expert counts [..], {\"counts\": [..]} or a G x E matrix")
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
    p.set_defaults(func=run)


# ---------------------------------------------------------------------- loads
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
    pairs, cap = tokens_per_rank * top_k, tokens_per_rank
    share = torch.zeros(E, dtype=torch.float64)
    free = torch.ones(E, dtype=torch.bool)
    left = float(pairs)
    for _ in range(E):  # water-fill: cap experts at one pair per token
        share[free] = w[free] / w[free].sum() * left
        over = free & (share > cap)
        if not over.any():
            break
        share[over] = cap
        free &= ~over
        left = pairs - float(share[~free].sum())
    # integer counts with exact sum: largest remainder, ties to the lower expert id
    row = share.floor().long()
    order = torch.argsort(-(share - row), stable=True)
    row[order[: pairs - int(row.sum())]] += 1
    return row[None, :].repeat(G, 1)


def load_counts(path: str, G: int, E: int) -> Tensor:
    """Read ``--loads``: per-expert counts (spread evenly over homes) or a G x E matrix."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise LrmoeError(f"cannot read --loads {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise LrmoeError(f"--loads {path} is not valid JSON: {e.msg} at line {e.lineno}") from None
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
        return apportion(t, torch.ones(G, E, dtype=torch.long) * (t.max() + 1))
    require(t.dim() == 2 and tuple(t.shape) == (G, E),
            f"--loads {path} matrix has shape {tuple(t.shape)}; want (--ep, experts) = "
            f"{(G, E)}")
    return t


# ---------------------------------------------------------------------- output
def _instances(row: Tensor) -> str:
    return ",".join(str(int(e)) for e in row if e >= 0)


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
    width = [max(len(x) for x in col) for col in zip(head, *rows)]
    left = {0, 1}
    lines = []
    for row in [head] + rows:
        cells = [c.ljust(w) if i in left else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, width))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


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
def run(args: argparse.Namespace) -> int:
    cfg = get_preset(args.preset) if args.preset else ModelConfig.from_file(args.config)
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
    lcfg = LrmoeConfig(balance=args.balance, min_keep=args.min_keep,
                       selection=not args.no_selection)
    policy = make_policy(PolicyConfig(args.policy, args.capacity_factor, slots, lcfg), cfg, G)

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
