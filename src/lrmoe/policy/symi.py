"""symi (arXiv 2504.19925, NSDI '26; docs/design.md §4): fixed slots per rank, replica
counts from the previous step's popularity, contiguous placement, even split, exact
backward.

Legend: G ranks, S = s slots per rank, E experts. All tensors int64 on the CPU.

The rounding: ``goal = pop/sum(pop)·G·s``, ``cnt = floor(max(goal, 1))``, ``diff = cnt -
goal``; while ``sum(cnt) > G·s`` decrement the largest ``diff`` among ``cnt > 1``, while
below increment the smallest (ties: lowest id).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from lrmoe.errors import LrmoeError, require
from lrmoe.policy.base import PlanInputs, Policy, Prepared
from lrmoe.policy.ledger_view import LedgerView
from lrmoe.policy.plan import Plan, fit_exact, fitted
from lrmoe.policy.plan_numpy import Slots, full_plan, host_counts

DEFAULT_EXTRA_SLOTS = 2


def _floor_counts(pop_E: Tensor | None, E: int, total_slots: int
                  ) -> tuple[list[int], list[float]]:
    """``cnt = floor(max(goal, 1))`` and ``diff = cnt - goal`` before SYMI's rounding."""
    require(total_slots >= E, f"{total_slots} slots cannot hold one instance of each of "
                              f"{E} experts")
    if pop_E is None:
        pop = [1.0] * E
    else:
        require(pop_E.numel() == E, f"popularity has {pop_E.numel()} entries, want {E}")
        require(bool((pop_E >= 0).all()), "popularity counts must be >= 0")
        pop = pop_E.double().tolist()
        if sum(pop) <= 0:
            pop = [1.0] * E
    tot = sum(pop)
    goal = [p / tot * total_slots for p in pop]
    cnt = [math.floor(max(g, 1.0)) for g in goal]
    return cnt, [c - g for c, g in zip(cnt, goal)]


def _round(cnt: list[int], diff: list[float], n: int, up: bool = False) -> list[int]:
    """Take ``n`` instances off ``cnt`` in place, the largest ``diff`` among ``cnt > 1``
    first, or (``up``) add ``n``, the smallest ``diff`` first (ties: lowest id); returns
    the experts in that order."""
    s = 1 if up else -1
    heap = [(s * diff[e], e) for e in range(len(cnt)) if up or cnt[e] > 1]
    heapq.heapify(heap)
    order = []
    while len(order) < n:
        _, e = heapq.heappop(heap)
        cnt[e] += s
        diff[e] += s
        order.append(e)
        if up or cnt[e] > 1:
            heapq.heappush(heap, (s * diff[e], e))
    return order


def replica_counts_heap(pop_E: Tensor | None, E: int, total_slots: int
                        ) -> tuple[list[int], list[float]]:
    """SYMI's rounding, with heaps: ``(cnt, diff)`` after it, ``cnt`` integers >= 1 summing
    to ``total_slots``."""
    cnt, diff = _floor_counts(pop_E, E, total_slots)
    n = sum(cnt)
    _round(cnt, diff, abs(n - total_slots), up=n < total_slots)
    return cnt, diff


def given_up_order(pop_E: Tensor | None, E: int, total_slots: int) -> tuple[list[int], list[int]]:
    """``(cnt, order)``: SYMI's replica counts and the experts whose replicas its
    decrement loop, run on, gives up first."""
    cnt, diff = replica_counts_heap(pop_E, E, total_slots)
    return cnt, _round(list(cnt), diff, sum(cnt) - E)


def contiguous(cnt_E: np.ndarray, G: int, s: int) -> np.ndarray:
    """``[G, s]``: expert 0's instances first, then expert 1's, rank by rank; with fewer than
    ``G·s`` instances ranks hold ``n // G`` (the first ``n % G`` one more), empty slots last."""
    cnt_E = np.asarray(cnt_E, dtype=np.int64)
    n = int(cnt_E.sum())
    per_G = n // G + (np.arange(G) < n % G)
    rank = np.repeat(np.arange(G), per_G)
    col = np.arange(n) - np.repeat(np.cumsum(per_G) - per_G, per_G)
    out = np.full((G, s), -1, dtype=np.int64)
    out[rank, col] = np.repeat(np.arange(cnt_E.size), cnt_E)
    return out


def require_slots(s, n_nat: int) -> None:
    """Refuse ``s`` slots per rank unless they hold the ``n_nat = E/G`` native experts."""
    require(isinstance(s, int) and s >= n_nat,
            f"slots_per_rank={s!r} must be an integer >= E/G = {n_nat} (each rank holds its "
            "native experts)")


def place_symi(prev_counts_E: Tensor | None, G: int, E: int, s: int) -> np.ndarray:
    """SYMI's placement ``[G, s]`` from the previous step's popularity (needs no current count)."""
    require(E % G == 0, f"number of experts {E} is not divisible by the EP size {G}")
    require_slots(s, E // G)
    return contiguous(replica_counts_heap(prev_counts_E, E, G * s)[0], G, s)


def plan_symi(counts_GE: Tensor, slots_per_rank: int, prev_counts_E: Tensor | None = None,
              ledger=None, recompute: bool = False, placement: np.ndarray | None = None,
              slots: Slots | None = None) -> Plan:
    """SYMI's plan for one layer; over the ledger it raises, or with ``recompute`` fits by
    :func:`fit_exact`'s fallbacks, then :func:`fewer_replicas`."""
    G, E = counts_GE.shape
    s = slots_per_rank
    inst = placement if placement is not None else place_symi(prev_counts_E, G, E, s)
    require(tuple(inst.shape) == (G, s), f"symi: a prepared placement of shape "
                                         f"{tuple(inst.shape)} does not match {(G, s)}")
    c = host_counts(counts_GE)
    plan = full_plan(c, inst, slots=slots)  # exact backward
    if ledger is None or ledger.budget_bytes is None:
        return plan
    view = LedgerView(ledger, c.sum(1), exact=True)
    recv = plan.assign_GGS.numpy().sum((0, 2))
    n_inst = np.full(G, s)
    if not view.over(n_inst, recv, recv):
        return plan
    if recompute:
        mode, rec, _ = view.exact_fit(n_inst, recv, recv)
        if mode != "over":
            return fitted(plan, mode, rec)
        if G * s == E:  # no replica to give up: static's verdict
            return fit_exact(plan, ledger, f"symi with slots_per_rank={s}")
        return fewer_replicas(c, s, prev_counts_E, ledger, view)
    view.raise_if_over(n_inst, recv, recv, None, f"symi with slots_per_rank={s}")
    return plan


# a plan's rung when SYMI gave replicas up, by Ledger.exact_fit's mode
FEWER_RUNGS = {"fits": "fewer-replicas", "pairs": "recompute-fewer-replicas",
               "layer": "layer-fewer-replicas"}


def fewer_replicas(c_GE: np.ndarray, s: int, prev_counts_E: Tensor | None, ledger,
                   view: LedgerView) -> Plan:
    """SYMI's plan where its ``s`` slots do not fit at all: its most replicas that fit,
    given up in :func:`given_up_order` (none left: static's placement and verdict)."""
    G, E = c_GE.shape
    total_E = c_GE.sum(0)
    cnt, order = given_up_order(prev_counts_E, E, G * s)
    cnt = np.asarray(cnt, dtype=np.int64)
    for k, e in enumerate(order, start=1):
        cnt[e] -= 1
        inst = contiguous(cnt, G, s)
        idx = Slots(inst, E)
        load = idx.even_split(total_E)
        n_inst, recv = (inst >= 0).sum(1), load.sum(1)
        mode, rec, _ = view.exact_fit(n_inst, recv, recv)
        if mode == "over" and k < len(order):
            continue
        plan = full_plan(c_GE, inst, load, idx)
        if mode == "over":  # the natives alone: static's verdict, static's message
            return fit_exact(plan, ledger, f"symi with slots_per_rank={s}, every replica "
                                           "given up (static's placement),")
        return fitted(plan, mode, rec, rung=FEWER_RUNGS[mode], replicas_given_up=k,
                       given_up_for="memory")
    raise LrmoeError("symi: no replica to give up (internal error: please report)")


def _slot_range(ledger, counts_GE: Tensor, max_slots: int | None):
    """The ``s`` from E/G to ``max_slots`` (None: E) until one's instances alone exceed the budget."""
    G, E = counts_GE.shape
    hi = E if max_slots is None else max_slots
    home_max = int(counts_GE.long().sum(1).max())
    for s in range(E // G, hi + 1):  # symi's plans are exact (Ledger.terms)
        if (ledger is not None and ledger.budget_bytes is not None
                and ledger.terms(s, 0, home_max, 0, exact=True)["total"] > ledger.budget_bytes):
            return
        yield s


def largest_feasible_slots(ledger, counts_GE: Tensor, prev_counts_E: Tensor | None = None,
                           max_slots: int | None = None) -> int:
    """The largest ``s`` in ``[E/G, max_slots]`` whose SYMI plan fits (memory is not
    monotone in ``s``: every one tried); raises if none fits."""
    G, E = counts_GE.shape
    lo = E // G
    hi = E if max_slots is None else max_slots
    require(hi >= lo, f"max_slots={hi} must be >= E/G = {lo}")
    if ledger is None or ledger.budget_bytes is None:
        return hi
    best, first_err = None, None
    for s in _slot_range(ledger, counts_GE, hi):
        try:
            plan_symi(counts_GE, s, prev_counts_E, ledger)
            best = s
        except LrmoeError as e:
            first_err = first_err or e
    if best is None:
        raise LrmoeError(f"no slots_per_rank >= {lo} fits: "
                         f"{first_err or 'the native experts alone exceed the budget'}")
    return best


# forward = 3 GEMM units per pair, backward 6, recomputing gate_up 2 (SwiGLU: gate_up is
# 2 of the expert's 3 HF-sized matrices), a whole-layer checkpoint re-runs the forward: 3
_FWD, _BWD, _RECOMPUTE = 3, 6, {"fits": 0, "pairs": 2, "layer": 3}


def slot_costs(ledger, counts_GE: Tensor, prev_counts_E: Tensor | None = None,
               max_slots: int | None = None) -> dict[int, int]:
    """``{s: busiest rank's GEMM work in H·F units}`` for every ``s`` that fits with recompute."""
    G = counts_GE.shape[0]
    out = {}
    for s in _slot_range(ledger, counts_GE, max_slots):
        plan = plan_symi(counts_GE, s, prev_counts_E)
        mode, rec = ("fits", [0] * G) if ledger is None else ledger.exact_fit(plan)[:2]
        if mode == "over":
            continue
        load = plan.rank_load().tolist()
        out[s] = max((_FWD + _BWD) * n + _RECOMPUTE[mode] * r for n, r in zip(load, rec))
    return out


def best_slots(ledger, counts: list[Tensor], prevs: list[Tensor | None],
               max_slots: int | None = None, per: list[dict[int, int]] | None = None
               ) -> tuple[int, int]:
    """``(s, matrices it fits)``: the ``s`` that fits the most count matrices, then the
    least mean busiest-rank work, then the larger (``per``: their :func:`slot_costs`)."""
    if per is None:
        per = [slot_costs(ledger, c, p, max_slots) for c, p in zip(counts, prevs)]
    cands = set().union(*per)
    require(bool(cands), "no slots_per_rank fits the budget even with activation recompute")

    def key(s):
        fit = [d[s] for d in per if s in d]
        return (-len(fit), sum(fit) / len(fit), -s)
    s = min(cands, key=key)
    return s, -key(s)[0]


@dataclass
class SymiPolicy(Policy):
    """SYMI with ``slots_per_rank`` slots (None: ``E/G + 2``); ``recompute``: fit a
    budget by recomputing rows instead of failing."""

    slots_per_rank: int | None = None
    recompute: bool = False
    name: str = "symi"

    def _slots(self, G: int, E: int) -> int:
        return self.slots_per_rank if self.slots_per_rank is not None \
            else E // G + DEFAULT_EXTRA_SLOTS

    def prepare(self, prev_counts, G: int, inputs: PlanInputs,
                home_pairs: int | None = None) -> Prepared | None:
        """The placement, from the previous step's popularity alone (``None`` on the first step)."""
        if prev_counts is None:
            return None
        pop = prev_counts if prev_counts.dim() == 1 else prev_counts.sum(0)
        E = pop.numel()
        inst = place_symi(pop, G, E, self._slots(G, E))
        return Prepared(inst, Slots(inst, E))

    def plan(self, counts_GE: Tensor, inputs: PlanInputs) -> Plan:
        G, E = counts_GE.shape
        prep = inputs.prepared
        return plan_symi(counts_GE, self._slots(G, E), inputs.prev_counts_E, inputs.ledger,
                         self.recompute, prep.inst_expert_GS if prep is not None else None,
                         prep.slots if prep is not None else None)
