"""``bench ttl --budget-floor-fraction X``: the budget ``X · F``, ``X >= 1``, where ``F`` is
static's whole-layer floor over the run's own routing, read off a calibration run of
static without a budget, so static fits every step (docs/design.md §9).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from lrmoe.errors import require
from lrmoe.policy.plan import layer_checkpoint_plan, native_plan

FLAG = "--budget-floor-fraction"


@dataclass
class FloorBudget:
    """The budget of ``--budget-floor-fraction``: ``budget_bytes = int(fraction · floor_bytes)``."""

    fraction: float
    floor_bytes: int  # F
    budget_bytes: int
    source: str  # where F was read: "calibration run" or the --reuse file

    def record(self) -> dict:
        return dataclasses.asdict(self) | {
            "rule": "fraction x F, F = the largest rank total of static's whole-layer-"
                    "checkpointed native plan over every step, micro-batch and MoE layer "
                    "of static's run (lrmoe.sim.ttl_budget)"}


def check_fraction(x: float | None) -> None:
    require(x is None or (isinstance(x, (int, float)) and math.isfinite(x) and x >= 1),
            f"{FLAG} {x!r} must be a finite number >= 1 (the budget as a multiple of "
            "static's whole-layer floor F: below 1 static would run out of memory)")


def counts_matrix(counts_E: list[int], G: int, home: int) -> torch.Tensor:
    """``[G, E]`` counts with column sums ``counts_E`` and row sums ``home`` (filled in
    order: home rank by home rank, expert by expert). The ledger prices a rank by its
    received and home pairs, so any such split prices alike."""
    c = torch.tensor(counts_E, dtype=torch.long)
    require(int(c.sum()) == G * home and bool((c >= 0).all()),
            f"a layer's counts sum to {int(c.sum())}, want ep·tokens_per_rank·top_k = {G * home}")
    hi = c.cumsum(0)
    lo = hi - c
    g_lo = torch.arange(G)[:, None] * home
    return ((torch.minimum(hi[None], g_lo + home) - torch.maximum(lo[None], g_lo)).clamp(min=0))


def floor_of_run(led, cfg, mcfg, counts_E: list[list]) -> int:
    """``F``: the largest rank total of static's whole-layer-checkpointed native plan over
    a run's per-micro-batch, per-layer counts (``counts_E[step]``: its micro-batches'
    layers in order), priced by ``led``, the ledger the emulator prices static with
    (:func:`lrmoe.sim.ttl.static_floor_ledger`)."""
    G = cfg.train.ep
    home = cfg.train.batch_size // G * cfg.train.seq_len * mcfg.num_experts_per_tok
    plans = (native_plan(counts_matrix([int(x) for x in c.tolist()], G, home))
             for step in counts_E for c in step)
    return max(t["total"] for plan in plans
               for t in led.rank_terms(layer_checkpoint_plan(plan)))


def calibrate(cfg, mcfg, batches, val_b, link, log, run, led) -> FloorBudget:
    """Run static without a budget (``run``: :func:`lrmoe.sim.ttl.run_policy`) and return
    ``--budget-floor-fraction``'s budget, its floor priced by ``led``."""
    log(f"[static, calibration] no budget: reading static's whole-layer floor F for {FLAG}")
    res = run("static", cfg, mcfg, batches, val_b, None, link,
              lambda m: log(m.replace("[static]", "[static, calibration]", 1)))
    require(not res["failed"], f"static's calibration run for {FLAG} stopped: {res['failed']}")
    counts_E = [[c.sum(0) for micro in step for c in micro] for step in res["_counts_GE"]]
    F = floor_of_run(led, cfg, mcfg, counts_E)
    x = cfg.budget_floor_fraction
    return FloorBudget(x, F, int(x * F), "calibration run")


def reused(cfg, static: dict) -> FloorBudget:
    """The budget of the ``--reuse`` file whose static run is taken (same settings)."""
    rule = static.get("budget_rule") or {}
    require(rule.get("floor_bytes") is not None and rule.get("budget_bytes") is not None,
            f"--reuse {cfg.reuse}: its static run records no {FLAG} budget; run static again")
    return FloorBudget(cfg.budget_floor_fraction, int(rule["floor_bytes"]),
                       int(rule["budget_bytes"]), f"--reuse {cfg.reuse}")
