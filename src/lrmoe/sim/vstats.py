"""What one emulated step records: per-rank timers and :class:`VirtualStats`.

Legend: G virtual ranks; ``_GG`` is ``[src rank, dst rank]``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lrmoe.policy.plan import Plan
from lrmoe.timing import timed

EXCHANGES = ("fwd_dispatch", "fwd_combine", "bwd_dispatch", "bwd_combine",
             "weight_scatter", "grad_reduce", "count_allgather", "bwd_count_exchange")
# a whole-layer checkpoint's re-run in backward re-sends these (Plan.layer_checkpoint):
# charged in ``bwd_recompute`` (:mod:`lrmoe.sim.cost`)
RECOMPUTE_EXCHANGES = ("recompute_dispatch", "recompute_combine")
# Measured per-rank work besides the expert GEMMs (ms in ``VirtualStats.stage_ms``; what
# each holds: docs/design.md §9, "The control plane is charged")
MEASURED_STAGES = ("plan", "select", "gather", "local")


class Timers:
    """Per-virtual-rank accumulated kernel time (ms), one named bucket at a time."""

    def __init__(self, G: int, device: torch.device):
        self.G, self.device = G, device
        self.ms: dict[str, list[float]] = {}
        self.events: list[tuple[str, int, object, object]] = []

    @contextlib.contextmanager
    def time(self, key: str, g: int):
        """Time rank g's region into bucket ``key``, inside a profiler range
        ``stage:<key>`` (the check that every op of a step is charged to a stage)."""
        with torch.profiler.record_function(f"stage:{key}"), timed(
                self.device, lambda ms: self.add(key, g, ms),
                lambda ev_a, ev_b: self.events.append((key, g, ev_a, ev_b))):
            yield

    def add(self, key: str, g: int, ms: float) -> None:
        self.ms.setdefault(key, [0.0] * self.G)[g] += ms

    def resolve(self) -> None:
        if self.events:
            torch.cuda.synchronize()
            for key, g, a, b in self.events:
                self.add(key, g, a.elapsed_time(b))
            self.events = []


@dataclass
class VirtualStats:
    """What one emulated step of one layer did, per virtual rank (all lists have G entries).

    Attributes:
        plan: the plan the policy returned.
        rows: per stage, rows each rank processed: ``fwd`` (assigned), ``retained``,
            ``bwd`` (rows entering experts^-1), ``selected``.
        rows_GG: per exchange (:data:`EXCHANGES`), ``[src, dst]`` rows sent (replica
            weight scatter / grad reduce: expert instances).
        bytes_GG: per exchange, ``[src, dst]`` bytes sent (exact, from the splits; the
            diagonal is a rank's copy to itself, which no link carries).
        expert_ms: ``fwd`` / ``bwd`` (and ``recompute``: a whole-layer checkpoint's re-run
            in backward): each rank's measured expert kernel time (ms).
        stage_ms: each rank's measured time (ms) of the :data:`MEASURED_STAGES`.
        bwd_end_s: ``perf_counter`` when the exchange's backward ended (after a device
            sync); the router's and shared experts' backward follow (non-MoE work).
        saved_act_bytes: activation bytes each rank kept for backward.
        ledger_total_bytes: the ledger's prediction per rank (when a ledger is given), for
            the plan as it runs (its recomputed rows or whole-layer checkpoint included).
        recompute_rows: the rows each rank re-runs forward in backward to fit, and
            ``recompute_mode`` how (:meth:`lrmoe.ledger.Ledger.exact_fit`'s ``fits``,
            ``pairs`` or ``layer``; per-row recompute is modelled by
            :mod:`lrmoe.sim.cost`, a whole-layer checkpoint runs and is measured).
        prepare_ms: wall ms of the policy's ``prepare`` (:func:`lrmoe.policy.base.prepare`),
            charged to no stage: it needs none of this step's counts, so it overlaps
            earlier work.
        rung: how the plan met the budget (:data:`lrmoe.policy.lrmoe_ladder.RUNGS`):
            lrmoe's ladder rung (``Plan.rung``), or an exact policy's fallback
            (``plan``: fits as it is, ``recompute``, ``layer``).
    """

    plan: Plan
    rows: dict[str, list[int]] = field(default_factory=dict)
    rows_GG: dict[str, Tensor] = field(default_factory=dict)
    bytes_GG: dict[str, Tensor] = field(default_factory=dict)
    expert_ms: dict[str, list[float]] = field(default_factory=dict)
    saved_act_bytes: list[int] = field(default_factory=list)
    stage_ms: dict[str, list[float]] = field(default_factory=dict)
    bwd_end_s: float | None = None
    ledger_total_bytes: list[int] | None = None
    recompute_rows: list[int] | None = None
    recompute_mode: str = "fits"
    rung: str = "plan"
    prepare_ms: float = 0.0
    counts_GE: Tensor | None = None


def pair_ratios(plans: list[Plan], recompute_rows=()) -> dict[str, float]:
    """Over the pairs ``plans`` assign: those selected (``keep_ratio``), retained
    (``retain_ratio``) and recomputed (``recompute_ratio``: per plan, rows per rank or None)."""
    n = max(sum(int(p.assign_GGS.sum()) for p in plans), 1)
    return {"keep_ratio": sum(int(p.select_GGS.sum()) for p in plans) / n,
            "retain_ratio": sum(int(p.retain_GGS.sum()) for p in plans) / n,
            "recompute_ratio": sum(sum(r or []) for r in recompute_rows) / n}
