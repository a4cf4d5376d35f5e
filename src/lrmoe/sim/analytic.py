"""Modelled per-rank stats of one MoE layer's step, from a plan alone (no kernel runs):
the emulator's :class:`VirtualStats` with the expert kernels at a fixed GEMM rate, and
``lrmoe plan --compare``'s scale projection (docs/design.md §9, "Scale projection").

Legend: G ranks, S slots per rank, E experts, H hidden, F expert (moe) intermediate
size; ``_GG`` is ``[src rank, dst rank]``, ``_GGS`` ``[home rank, rank, slot]``.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from lrmoe.config import ModelConfig
from lrmoe.errors import LrmoeError
from lrmoe.ledger import Ledger
from lrmoe.policy.base import PlanInputs
from lrmoe.policy.link_cost import BWD_FLOPS_PER_HF, FWD_FLOPS_PER_HF, RECOMPUTE_FLOPS_PER_HF
from lrmoe.policy.lrmoe import LrmoeConfig
from lrmoe.policy.plan import Plan
from lrmoe.policy.registry import PolicyConfig, make_policy
from lrmoe.policy.static import StaticPolicy
from lrmoe.policy.symi import best_slots, plan_symi, slot_costs
from lrmoe.sim.cost import STAGES, StepTimes, step_times
from lrmoe.sim.links import Link
from lrmoe.sim.offload import offload_for
from lrmoe.sim.vstats import VirtualStats, pair_ratios
from lrmoe.traffic import RowBytes, plan_rows_GG
from lrmoe.units import fmt_bytes

PROJECTED = ("static", "symi", "lrmoe")


def modelled_stats(plan: Plan, cfg: ModelConfig, rate_flops: float, bytes_act: int = 2,
                   bytes_w: int = 2, recompute_rows: list[int] | None = None,
                   recompute_mode: str = "pairs",
                   plan_ms: float = 0.0, router_grad_at_experts: bool = False) -> VirtualStats:
    """MODELLED stats of one layer's step under ``plan``: nothing runs, nothing is timed.

    The expert GEMMs run at ``rate_flops``; ``recompute_rows`` per rank re-run forward in
    backward (``recompute_mode`` as :meth:`lrmoe.ledger.Ledger.exact_fit`'s: ``pairs`` charge
    their gate_up in the expert backward, a ``layer`` checkpoint :mod:`lrmoe.sim.cost`
    charges); ``plan_ms`` is charged to every rank as the emulator does."""
    H, F, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    G = plan.G
    stats = VirtualStats(plan, recompute_rows=None if recompute_rows is None
                         else [int(n) for n in recompute_rows], recompute_mode=recompute_mode)

    prices = RowBytes(H * bytes_act, 3 * H * F * bytes_w,
                      dot=router_grad_at_experts and plan.exact)
    for name, rows_GG in plan_rows_GG(plan, E).items():
        stats.rows_GG[name] = rows_GG
        stats.bytes_GG[name] = rows_GG * prices.of(name)

    # the count all-gather: E int64 to every peer (comm.all_gather_counts)
    stats.rows_GG["count_allgather"] = torch.ones(G, G, dtype=torch.long)
    stats.bytes_GG["count_allgather"] = torch.full((G, G), E * 8, dtype=torch.long)
    stats.stage_ms["plan"] = [float(plan_ms)] * G
    fwd = plan.rank_load().tolist()
    selected = plan.rank_backward_load().tolist()
    retained = plan.retain_GGS.sum(dim=(0, 2)).tolist()
    stats.rows = {"fwd": fwd, "retained": retained, "bwd": list(selected),
                  "selected": selected}
    ms_per_flop = 1e3 / rate_flops
    # rows recomputed per row (mode "pairs") run their gate_up again inside the expert
    # backward, as the runtime and the emulator run them
    rec = (stats.recompute_rows if recompute_mode == "pairs" and stats.recompute_rows
           else [0] * G)
    stats.expert_ms = {
        "fwd": [n * FWD_FLOPS_PER_HF * H * F * ms_per_flop for n in fwd],
        "bwd": [(n * BWD_FLOPS_PER_HF + r * RECOMPUTE_FLOPS_PER_HF) * H * F * ms_per_flop
                for n, r in zip(selected, rec)],
    }
    stats.saved_act_bytes = [n * (H + 2 * F) * bytes_act for n in retained]
    return stats


def mean_step_times(stats: list[VirtualStats], link: Link, offload=None) -> StepTimes:
    """Stage by stage, the mean over ``stats`` (one layer's step each) of
    :func:`lrmoe.sim.cost.step_times`, labelled ``modelled``."""
    runs = [step_times(s, link, offload=offload) for s in stats]
    out = StepTimes(link=link.name, label="modelled")
    for k in STAGES:
        setattr(out, k, sum(getattr(r, k) for r in runs) / len(runs))
    return out


def symi_slot_choice(cfg: ModelConfig, ledger: Ledger, samples: list[Tensor],
                     pops: list[Tensor], link: Link, rate_flops: float,
                     probe: int = 4) -> tuple[int, int | None]:
    """symi's ``s`` for a projection and the rule that chose it: ``(s, None)``, the least
    modelled MoE time (exchanges and offload included) among the ``s`` that fit every
    sample, on up to ``probe`` of them, ties to the larger; else ``(s, n)`` from
    :func:`lrmoe.policy.symi.best_slots` (it fits ``n`` samples)."""
    per = [slot_costs(ledger, c, p) for c, p in zip(samples, pops)]
    common = sorted(set.intersection(*(set(d) for d in per))) if per else []
    if not common:
        return best_slots(ledger, samples, pops, per=per)
    idx = sorted({round(i * (len(samples) - 1) / max(probe - 1, 1)) for i in range(probe)})

    def modelled(s: int) -> float:
        st = []
        for i in idx:
            plan = plan_symi(samples[i], s, pops[i])
            mode, rec, _ = ledger.exact_fit(plan)
            st.append(modelled_stats(plan, cfg, rate_flops, ledger.bytes_act, ledger.bytes_w, rec,
                                     mode, router_grad_at_experts=ledger.router_grad_at_experts))
        return mean_step_times(st, link, offload_for(ledger, "symi")).moe
    return min(common, key=lambda s: (modelled(s), -s)), None


def project_policy(name: str, cfg: ModelConfig, ledger: Ledger, samples: list[Tensor],
                   link: Link, rate_flops: float, lrmoe: LrmoeConfig | None = None,
                   slots_per_rank: int | None = None) -> dict:
    """``name`` (one of :data:`PROJECTED`) under ``ledger``'s budget over ``samples`` (``[G, E]``
    count matrices, each its own popularity): a JSON-ready row with whether it fits (and
    why not), the ledger peak, keep/retain/recompute ratios, mean replicas, symi's ``s``, the
    measured planning time and, when it fits, the modelled ms per MoE layer by stage and × L."""
    row = {"ep": ledger.G, "budget_bytes": ledger.budget_bytes, "policy": name, "fits": False,
           **dict.fromkeys(("reason", "peak_bytes", "keep_ratio", "retain_ratio", "recompute_ratio",
                            "layer_checkpoint_share", "replicas", "planning_ms", "slots_per_rank",
                            "modelled_layer_ms", "modelled_all_layers_ms", "modelled_stages_ms",
                            "lrmoe_over_symi"))}
    floor = max(t["total"] for t in ledger.feasible_minimum())
    if floor > ledger.budget_bytes:
        row["reason"] = (f"owned state and native instances alone need {fmt_bytes(floor)} "
                         f"> budget {fmt_bytes(ledger.budget_bytes)}")
        return row
    pops = [c.sum(0) for c in samples]
    try:
        plans, ms = _plan_samples(name, cfg, ledger, samples, pops, link, rate_flops, lrmoe,
                                  slots_per_rank, row)
    except LrmoeError as e:
        row["reason"] = str(e)
        return row
    recs, modes = _fit_samples(name, ledger, plans, ms, row)
    over = modes.count("over")
    if over:
        row["reason"] = "over budget even with a whole-layer checkpoint" + (
            f" ({over} of {len(recs)} sampled layers)" if len(recs) > 1 else "")
        return row
    row["layer_checkpoint_share"] = modes.count("layer") / len(modes)
    if all(rec is not None for rec in recs):
        row["recompute_ratio"] = pair_ratios(plans, recs)["recompute_ratio"]
    row["planning_ms"] = sum(ms) / len(ms)
    stats = [modelled_stats(p, cfg, rate_flops, ledger.bytes_act, ledger.bytes_w, rec, mode,
                            plan_ms=t, router_grad_at_experts=ledger.router_grad_at_experts)
             for p, rec, mode, t in zip(plans, recs, modes, ms)]
    st = mean_step_times(stats, link, offload_for(ledger, name))
    row["fits"] = True
    row["modelled_stages_ms"] = {k: v * 1e3 for k, v in st.stages().items()}
    row["modelled_layer_ms"] = st.moe * 1e3
    row["modelled_all_layers_ms"] = st.moe * 1e3 * ledger.L
    return row


def _plan_samples(name: str, cfg: ModelConfig, ledger: Ledger, samples: list[Tensor],
                  pops: list[Tensor], link: Link, rate_flops: float,
                  lrmoe: LrmoeConfig | None, slots_per_rank: int | None, row: dict
                  ) -> tuple[list[Plan], list[float]]:
    """Policy ``name``'s plan of every sample and its planning time (ms per layer), one
    untimed call first (lazy inits), as a run's steady state; symi's ``s`` into ``row``."""
    if name == "static":
        plan, args = StaticPolicy().plan, [(c, PlanInputs()) for c in samples]
    elif name == "symi":
        s = slots_per_rank
        if s is None:
            s = symi_slot_choice(cfg, ledger, samples, pops, link, rate_flops)[0]
        row["slots_per_rank"] = s
        plan, args = plan_symi, [(c, s, p) for c, p in zip(samples, pops)]
    else:
        plan = make_policy(PolicyConfig("lrmoe", slots_per_rank=slots_per_rank,
                                        lrmoe=lrmoe or LrmoeConfig()), cfg, ledger.G).plan
        args = [(c, PlanInputs(prev_counts_E=p, ledger=ledger)) for c, p in zip(samples, pops)]
    plan(*args[0])
    plans, ms = [], []
    for a in args:  # measured on this machine
        t0 = time.perf_counter()
        plans.append(plan(*a))
        ms.append((time.perf_counter() - t0) * 1e3)
    return plans, ms


def _fit_samples(name: str, ledger: Ledger, plans: list[Plan], ms: list[float], row: dict
                 ) -> tuple[list[list[int] | None], list[str]]:
    """Each plan's fit to the budget (mode and recomputed rows; timed into ``ms`` for the exact
    policies, whose planning it is part of), and the plans' peak, replicas and ratios into
    ``row``."""
    recs: list[list[int] | None] = []
    modes: list[str] = []
    peak = 0
    for i, plan in enumerate(plans):
        if name == "lrmoe" and plan.rung == "layer":  # its ladder's
            mode, rec, terms = ledger.exact_fit(plan)  # whole-layer rung: mode "layer"
        elif name == "lrmoe":  # its own recompute rows, if it plans any
            rec = None if plan.recompute_G is None else plan.recompute_G.tolist()
            mode, terms = "pairs", ledger.rank_terms(plan)
        else:  # the exact policy's fit to the budget is part of its planning (fit_exact)
            t0 = time.perf_counter()
            mode, rec, terms = ledger.exact_fit(plan)
            ms[i] += (time.perf_counter() - t0) * 1e3
        peak = max(peak, max(t["total"] for t in terms))
        recs.append(rec)
        modes.append(mode)
    row["peak_bytes"] = peak
    row["replicas"] = sum(p.num_replicas() for p in plans) / len(plans)
    if name == "lrmoe":
        ratios = pair_ratios(plans)
        row["keep_ratio"], row["retain_ratio"] = ratios["keep_ratio"], ratios["retain_ratio"]
    return recs, modes
