"""lrmoe pass 1 with every destination test in numpy: the reference of
:mod:`lrmoe.policy.lrmoe_place` (tests only).

The same incremental bookkeeping as the fast path, written the plainer way: each
retention capacity is asked of the ledger's view whenever a rank's load changes, and
when the least-loaded destination can not afford a replica, every rank is tested at once
in numpy (:class:`_Dests`, a mirror of the ranks' loads, instances and free slots).
:func:`place_replicas` must return exactly what the fast path returns
(tests/test_place_fast.py); both make the moves of the loop-by-loop reference
(``_place_replicas`` in ``tests/references/lrmoe_planner.py``).

Legend: G ranks, S slots per rank, E experts.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from lrmoe.policy.ledger_view import LedgerView

_FLOAT_EXACT = 2 ** 26  # pair counts below this keep k/R float comparisons exact


def place_replicas(total_E: np.ndarray, G: int, S: int, cfg, view: LedgerView
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Pass 1 from each expert's total pairs (the count matrix's column sums: all the
    placement looks at, besides the ledger's view of the home pairs); returns
    ``(inst_expert_GS, inst_load_GS)`` (loads: the even split)."""
    E = len(total_E)
    n_nat = E // G
    slots = [list(range(r * n_nat, (r + 1) * n_nat)) + [-1] * (S - n_nat) for r in range(G)]
    total = np.asarray(total_E, dtype=np.int64).tolist()
    inst_of = [[(e // n_nat, e % n_nat)] for e in range(E)]  # (rank, slot), slot order
    inst_load = [[t] for t in total]
    load = np.asarray(total_E, dtype=np.int64).reshape(G, n_nat).sum(1).tolist()
    n_inst = [n_nat] * G
    n_free = [S - n_nat] * G
    # a free rank's destination key orders by (load, id); full ranks sort last
    full = 1 << 62
    key = [load[r] * G + r if n_free[r] > 0 else full for r in range(G)]
    limit = math.inf if cfg.max_replicas_per_step is None else cfg.max_replicas_per_step
    budget = view.budget is not None
    cap_fn = view.capacity_fn()
    inf = math.inf
    cap, kept, ratio = [0] * G, [0] * G, [inf] * G
    sum_kept = 0
    if budget:
        for r in range(G):
            cap[r] = cap_fn(r, n_inst[r], load[r])
            kept[r] = min(load[r], max(cap[r], 0))
            ratio[r] = kept[r] / load[r] if load[r] else inf
        sum_kept = sum(kept)
    vec = _Dests(view, load, n_inst, n_free, total, inst_of) if budget else None

    def try_dest(e: int, d: int, level: int, fn: int, fd: int):
        """The new instance list and even split if rank ``d`` can afford a replica of
        ``e``: it must still retain ``min(R, max(n, level, ceil(fn/fd·R)))`` pairs."""
        slot = (d, slots[d].index(-1))
        inst = sorted(inst_of[e] + [slot])  # global slot order, as even_split
        q, m = divmod(total[e], len(inst))
        if budget:
            n, R = n_inst[d] + 1, load[d] + q + (inst.index(slot) < m)
            need = max(n, level, -(-(fn * R) // fd))
            if cap_fn(d, n, R) < min(R, need):
                return None
        return inst, q, m

    added = 0
    while added < limit:
        top = max(load)
        n_top = load.count(top)
        hot = [load.index(top)] if n_top == 1 else [r for r in range(G) if load[r] == top]
        cands = {e for r in hot for e in slots[r] if e >= 0 and total[e] > len(inst_of[e])}
        cands = sorted(cands, key=lambda e: (-total[e] / len(inst_of[e]), e))
        level, fn, fd = 0, 1, 1  # min_keep level and the smallest kept fraction fn/fd
        if budget:
            level = math.ceil(cfg.min_keep * sum_kept / G)
            m = min(ratio)
            if m != inf:
                if top < _FLOAT_EXACT:
                    r = ratio.index(m)
                    fn, fd = kept[r], load[r]
                else:
                    f = min(Fraction(kept[r], load[r]) for r in range(G) if load[r])
                    fn, fd = f.numerator, f.denominator
            if any(cap[r] < min(n_inst[r], load[r]) for r in hot):
                level, fn, fd = 0, 0, 1  # a hot rank does not fit yet: any feasible dest
        dests = sorted(key)  # least-loaded first, as the reference's sorted dests

        done = False
        for e in cands:
            held = {r for r, _ in inst_of[e]}
            found = None
            for k in dests:
                if k == full:
                    break
                d = k % G
                if d in held:
                    continue
                found = try_dest(e, d, level, fn, fd)
                if found is None and vec is not None:  # the rest at once
                    d = vec.first_affordable(e, held, level, fn, fd)
                    found = None if d is None else try_dest(e, d, level, fn, fd)
                if found is not None or vec is not None or not budget:
                    break
            if found is None:
                continue
            inst, q, m = found
            new_load = [q + (i < m) for i in range(len(inst))]
            loads = load.copy()
            for (r, _), x in zip(inst_of[e], inst_load[e]):
                loads[r] -= x
            for (r, _), x in zip(inst, new_load):
                loads[r] += x
            mx = max(loads)
            if (mx, loads.count(mx)) < (top, n_top):
                d, s = next(sl for sl in inst if sl not in inst_of[e])
                slots[d][s] = e
                n_inst[d] += 1
                n_free[d] -= 1
                inst_of[e], inst_load[e] = inst, new_load
                for r, _ in inst:  # the touched ranks: e's hosts (one instance each)
                    R = loads[r]
                    load[r] = R
                    key[r] = R * G + r if n_free[r] > 0 else full
                    if budget:
                        cap[r] = c = cap_fn(r, n_inst[r], R)
                        k = R if c >= R else max(c, 0)
                        sum_kept += k - kept[r]
                        kept[r] = k
                        ratio[r] = k / R if R else inf
                if vec is not None:
                    vec.update(inst, d)
                added += 1
                done = True
                break
        if not done:
            break
    load_GS = [[0] * S for _ in range(G)]
    for e in range(E):
        for (r, s), x in zip(inst_of[e], inst_load[e]):
            load_GS[r][s] = x
    return np.array(slots, dtype=np.int64), np.array(load_GS, dtype=np.int64)


class _Dests:
    """Numpy mirror of the ranks' loads, instances and free slots: which destinations
    can afford a replica, all ranks at once (with a budget only)."""

    def __init__(self, view: LedgerView, rank_load, n_inst, n_free, total, inst_of) -> None:
        self.view, self.total, self.inst_of = view, total, inst_of
        self.rank_load = rank_load  # the caller's list, kept current by it
        self.load = np.array(rank_load, dtype=np.int64)
        self.n = np.array(n_inst, dtype=np.int64)
        self.n_free = n_free  # the caller's list, kept current by it
        self.free = np.array(n_free) > 0
        self.G = len(rank_load)
        self.ranks = np.arange(self.G)

    def update(self, inst: list[tuple[int, int]], d: int) -> None:
        """After a replica of an expert now on ``inst`` went to rank ``d``."""
        self.load[[r for r, _ in inst]] = [self.rank_load[r] for r, _ in inst]
        self.n[d] += 1
        self.free[d] = self.n_free[d] > 0

    def first_affordable(self, e: int, held: set[int], level: int, fn: int, fd: int
                         ) -> int | None:
        """The least-loaded rank (ties: lower id) with a free slot, no instance of ``e``,
        that can afford one: as ``try_dest``'s test, vectorised."""
        v = self.view
        q, m = divmod(self.total[e], len(self.inst_of[e]) + 1)
        # the new instance's position in global slot order: held ranks before it
        pos = np.searchsorted(np.array(sorted(held)), self.ranks)
        R = self.load + q + (pos < m)
        n = self.n + 1
        need = np.maximum(np.maximum(n, level), -(-(fn * R) // fd))
        ok = self.free & v.fits(n, R, np.minimum(R, need))
        ok[list(held)] = False
        if not ok.any():
            return None
        return int(np.where(ok, self.load * self.G + self.ranks, np.iinfo(np.int64).max).argmin())
