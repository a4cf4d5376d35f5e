"""lrmoe pass 1, fast: the greedy memory-aware replication on incremental state; the
moves of ``_place_replicas`` in ``tests/references/lrmoe_planner.py`` (docs/design.md §4).

Legend: G ranks, S slots per rank, E experts.

Two points of the bookkeeping: a host that retained everything still does after its
expert gains an instance (its share never grows), so its capacity is not asked again;
the smallest kept fraction is found by float comparison and used exactly, floats
ordering such fractions exactly while ranks hold < 2^26 pairs (beyond that the exact
:class:`fractions.Fraction` minimum is taken).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from lrmoe.policy.ledger_view import LedgerView
from lrmoe.policy.plan_numpy import Slots

_FLOAT_EXACT = 2 ** 26  # pair counts below this keep k/R float comparisons exact


@dataclass
class MoveLog:
    """The greedy's moves (each replica's expert, rank and slot) and each rank's load
    and retainable pairs before the first and after each, for :func:`worth_their_link`."""

    load_KG: list[list[int]] = field(default_factory=list)
    kept_KG: list[list[int]] = field(default_factory=list)
    expert_K: list[int] = field(default_factory=list)
    rank_K: list[int] = field(default_factory=list)
    slot_K: list[int] = field(default_factory=list)


def natives_GS(G: int, S: int, E: int) -> np.ndarray:
    """Static's placement in ``S`` slots per rank, the slots past ``E/G`` empty."""
    inst = np.full((G, S), -1, dtype=np.int64)
    inst[:, :E // G] = np.arange(E).reshape(G, E // G)
    return inst


FULL = 1 << 62  # the destination key of a rank without a free slot: sorts last


def place_replicas(total_E: np.ndarray, G: int, S: int, cfg, view: LedgerView,
                   log: MoveLog | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Pass 1 from each expert's total pairs: ``(inst_expert_GS, inst_load_GS)`` (loads:
    the even split); ``log`` gets the moves."""
    greedy = _Greedy(total_E, G, S, cfg.min_keep, view)
    limit = math.inf if cfg.max_replicas_per_step is None else cfg.max_replicas_per_step
    if log is not None:
        greedy.record(log)
    added = 0
    while added < limit:
        move = greedy.move()
        if move is None:
            break
        added += 1
        if log is not None:
            greedy.record(log)
            log.expert_K.append(move[0])
            log.rank_K.append(move[1])
            log.slot_K.append(move[2])
    inst_GS = np.array(greedy.slots, dtype=np.int64)
    # the loads kept move by move are the even split in global slot order: its closed form
    return inst_GS, Slots(inst_GS, len(total_E)).even_split(np.asarray(total_E, dtype=np.int64))


@dataclass
class _Move:
    """What one move's candidates share (the floor a destination must still retain: ``level``
    pairs and the fraction ``fn/fd``); ``dests`` and ``room`` are made on first need."""

    top: int
    n_top: int
    level: int
    fn: int
    fd: int
    first: int
    dests: list[int] | None = None
    room: list[float] | None = None


class _Greedy:
    """Pass 1's incremental state (module docstring)."""

    def __init__(self, total_E: np.ndarray, G: int, S: int, min_keep: float,
                 view: LedgerView):
        E = len(total_E)
        self.G, self.n_nat, self.min_keep, self.view = G, E // G, min_keep, view
        self.slots = natives_GS(G, S, E).tolist()
        self.total = np.asarray(total_E, dtype=np.int64).tolist()
        # an expert's instances ((rank, slot), slot order) and their loads, for the
        # experts that have replicas; the others have their native alone (instances)
        self.inst_of: dict[int, list[tuple[int, int]]] = {}
        self.inst_load: dict[int, list[int]] = {}
        self.n_of = [1] * E  # each expert's instances
        self.load = np.asarray(total_E, dtype=np.int64).reshape(G, self.n_nat).sum(1).tolist()
        self.n_inst = [self.n_nat] * G
        self.n_free = [S - self.n_nat] * G
        # a free rank's destination key orders by (load, id); full ranks sort last
        self.key = [self.load[r] * G + r if self.n_free[r] > 0 else FULL for r in range(G)]
        self.budget = view.budget is not None
        self.monotone = view.monotone()
        self.cap_fn = view.capacity_fn()
        # cap[r]: the rank's retention capacity, or (once it retains everything) a lower
        # bound of it that is >= its load: the rule reads only min(cap, load)
        self.cap, self.kept, self.ratio = [0] * G, [0] * G, [math.inf] * G
        self.sum_kept = 0
        if self.budget:
            self.cap = view.capacity(self.n_inst, self.load).tolist()  # cap_fn's answers
            for r in range(G):
                self._set_kept(r, self.load[r], self.cap[r])

    def instances(self, e: int) -> list[tuple[int, int]]:
        return self.inst_of.get(e) or [(e // self.n_nat, e % self.n_nat)]

    def record(self, log: MoveLog) -> None:
        log.load_KG.append(self.load.copy())
        log.kept_KG.append(self.kept.copy() if self.budget else self.load.copy())

    def move(self) -> tuple[int, int, int] | None:
        """Add the first candidate replica that lowers ``(max rank load, ranks at the
        max)``: ``(expert, rank, slot)``, or ``None`` when none does."""
        load = self.load
        top = max(load)
        n_top = load.count(top)
        hot = [load.index(top)] if n_top == 1 else [r for r in range(self.G) if load[r] == top]
        first = min(self.key)
        if first == FULL:  # no free slot: no destination for any candidate
            return None
        m = _Move(top, n_top, *self._floor(top, hot), first=first)
        least = first // self.G  # the least load of a rank with a free slot
        for e in self._candidates(hot):
            if least + self.total[e] // (self.n_of[e] + 1) > top:
                continue  # any destination would end above the top: no need to find one
            found = self._destination(e, m)
            if found is None:
                continue
            inst, q, extra, cap_d = found
            new_load = [q + (i < extra) for i in range(len(inst))]
            loads = load.copy()
            for (r, _), x in zip(self.instances(e), self.inst_load.get(e) or (self.total[e],)):
                loads[r] -= x
            for (r, _), x in zip(inst, new_load):
                loads[r] += x
            mx = max(loads)
            if (mx, loads.count(mx)) < (top, n_top):
                return (e, *self._apply(e, inst, new_load, loads, cap_d))
        return None

    def _candidates(self, hot: list[int]) -> list[int]:
        """The hot ranks' experts that can take one more instance, busiest per instance first."""
        total, n = self.total, self.n_of
        cands = {e for r in hot for e in self.slots[r] if e >= 0 and total[e] > n[e]}
        # (key, e) pairs sort as the key alone would: each e once
        return [e for _, e in sorted([(-total[e] / n[e], e) for e in cands])]

    def _floor(self, top: int, hot: list[int]) -> tuple[int, int, int]:
        """``(level, fn, fd)``: the ``min_keep`` level and the smallest kept fraction
        ``fn/fd`` a destination must still retain; none while a hot rank does not fit."""
        if not self.budget:
            return 0, 1, 1
        level, fn, fd = math.ceil(self.min_keep * self.sum_kept / self.G), 1, 1
        m = min(self.ratio)
        if m != math.inf:
            if top < _FLOAT_EXACT:
                r = self.ratio.index(m)
                fn, fd = self.kept[r], self.load[r]
            else:
                f = min(Fraction(self.kept[r], self.load[r]) for r in range(self.G)
                        if self.load[r])
                fn, fd = f.numerator, f.denominator
        if any(self.cap[r] < min(self.n_inst[r], self.load[r]) for r in hot):
            return 0, 0, 1
        return level, fn, fd

    def _destination(self, e: int, m: _Move):
        """:meth:`_try_dest`'s answer for the least-loaded free rank holding none of ``e``,
        else (with a budget) the next in key order with room that affords it; or ``None``."""
        G = self.G
        was = self.instances(e)
        held = {r for r, _ in was}
        d = m.first % G
        if d in held:
            m.dests = m.dests or sorted(self.key)
            d = next((k % G for k in m.dests if k != FULL and k % G not in held), None)
            if d is None:
                return None
        found = self._try_dest(e, d, m)
        if found is not None or not self.budget:
            return found
        if m.room is None:  # per rank, a bound on the pairs a replica may bring it and pass
            bound = (self.view.received_bound(np.array(self.n_inst, dtype=np.int64) + 1, m.fn, m.fd)
                     if self.monotone else None)
            m.room = ([math.inf] * G if bound is None
                      else (bound - np.array(self.load, dtype=np.int64)).tolist())
        m.dests = m.dests or sorted(self.key)
        q = self.total[e] // (len(was) + 1)  # the least the replica brings
        for k in m.dests:
            if k == FULL:
                break
            r = k % G
            if m.room[r] >= q and r not in held and r != d:
                found = self._try_dest(e, r, m)
                if found is not None:
                    return found
        return None

    def _try_dest(self, e: int, d: int, m: _Move):
        """``(instances, q, extra, capacity)`` (the even split: ``q``, +1 for the first ``extra``)
        if ``d`` can afford a replica of ``e``, still retaining ``min(R, max(n, level,
        ceil(fn/fd·R)))`` pairs."""
        slot = (d, self.slots[d].index(-1))
        inst = sorted(self.instances(e) + [slot])  # global slot order, as even_split
        q, extra = divmod(self.total[e], len(inst))
        c = None
        if self.budget:
            n, R = self.n_inst[d] + 1, self.load[d] + q + (inst.index(slot) < extra)
            need = max(n, m.level, -(-(m.fn * R) // m.fd))
            c = self.cap_fn(d, n, R)
            if c < min(R, need):
                return None
        return inst, q, extra, c

    def _apply(self, e: int, inst: list[tuple[int, int]], new_load: list[int],
               loads: list[int], cap_d: int | None) -> tuple[int, int]:
        """Place the replica and update ``e``'s hosts; returns its ``(rank, slot)``."""
        d, s = next(sl for sl in inst if sl not in self.instances(e))
        self.slots[d][s] = e
        self.n_inst[d] += 1
        self.n_free[d] -= 1
        self.inst_of[e], self.inst_load[e] = inst, new_load
        self.n_of[e] = len(inst)
        for r, _ in inst:
            R, before = loads[r], self.load[r]
            self.load[r] = R
            self.key[r] = R * self.G + r if self.n_free[r] > 0 else FULL
            if not self.budget:
                continue
            if r == d:
                c = cap_d  # _try_dest priced it at these (n, R)
            elif self.monotone and R <= before <= self.cap[r]:
                c = self.cap[r]  # retained everything, no more pairs: still does
            else:
                c = self.cap_fn(r, self.n_inst[r], R)
            self.cap[r] = c
            self._set_kept(r, R, c)
        return d, s

    def _set_kept(self, r: int, R: int, c: int) -> None:
        k = R if c >= R else max(c, 0)
        self.sum_kept += k - self.kept[r]
        self.kept[r] = k
        self.ratio[r] = k / R if R else math.inf
