"""lrmoe pass 1, fast: the greedy memory-aware replication on incremental state.

Legend: G ranks, S slots per rank, E experts.

Same rule, same moves as the reference (``_place_replicas`` in
``tests/references/lrmoe_planner.py``; see :mod:`lrmoe.policy.lrmoe` for the rule); only the bookkeeping
differs, so that one move costs a few microseconds instead of a pass over every rank
and expert with a ledger call each:

* candidates come from the hot ranks' slots, not a scan of all experts;
* only the ranks a move touches (its expert's hosts, whose even split changes) are
  updated: load, destination key, and (with a budget) retention capacity, kept pairs
  and kept fraction from the ledger's vectorised view
  (:class:`lrmoe.policy.ledger_view.LedgerView`), with a running sum; max, count and
  sort of the per-rank lists run in C (``max``, ``list.count``, ``sorted``);
* a host that retained everything still does after its expert gains an instance (its
  share never grows, and capacity only grows as the load falls): its capacity is not
  asked again, nor the new host's, which the destination test priced;
* the smallest kept fraction is found by float comparison and used exactly (an integer
  fraction): floats order such fractions exactly while ranks hold < 2^26 pairs (beyond
  that the exact :class:`fractions.Fraction` minimum is taken);
* destinations: ranks sorted once per move by a ``load·G + id`` key; if the first can
  not afford the replica, one numpy pass per move bounds the pairs each rank could
  still take (:func:`_room`, a bound for every candidate of the move), and only the
  ranks with room for the candidate's share are tested, one by one in key order.

The plainer bookkeeping (every capacity asked again, every rank tested in numpy per
candidate) is ``tests/references/lrmoe_place_numpy.py``; tests/test_place_fast.py
compares the two.
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
    """The greedy's moves, for a rule that keeps only a prefix of them
    (:func:`lrmoe.policy.lrmoe.worth_their_link`).

    Attributes:
        load_KG: each rank's received pairs before the first move and after each.
        kept_KG: ... and the pairs it can retain (its load, without a budget).
        expert_K, rank_K, slot_K: each move's replica: its expert and where it went.
    """

    load_KG: list[list[int]] = field(default_factory=list)
    kept_KG: list[list[int]] = field(default_factory=list)
    expert_K: list[int] = field(default_factory=list)
    rank_K: list[int] = field(default_factory=list)
    slot_K: list[int] = field(default_factory=list)


def place_replicas(total_E: np.ndarray, G: int, S: int, cfg, view: LedgerView,
                   log: MoveLog | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Pass 1 from each expert's total pairs (the count matrix's column sums: all the
    placement looks at, besides the ledger's view of the home pairs); returns
    ``(inst_expert_GS, inst_load_GS)`` (loads: the even split). ``log``: filled with
    the moves and the ranks' loads after each."""
    E = len(total_E)
    n_nat = E // G
    inst0 = np.full((G, S), -1, dtype=np.int64)
    inst0[:, :n_nat] = np.arange(E).reshape(G, n_nat)
    slots = inst0.tolist()
    total = np.asarray(total_E, dtype=np.int64).tolist()
    # an expert's instances ((rank, slot), slot order) and their loads, for the experts
    # that have replicas; the others have their native alone (native_of)
    inst_of: dict[int, list[tuple[int, int]]] = {}
    inst_load: dict[int, list[int]] = {}

    def native_of(e: int) -> list[tuple[int, int]]:
        return [(e // n_nat, e % n_nat)]
    load = np.asarray(total_E, dtype=np.int64).reshape(G, n_nat).sum(1).tolist()
    n_inst = [n_nat] * G
    n_free = [S - n_nat] * G
    # a free rank's destination key orders by (load, id); full ranks sort last
    full = 1 << 62
    key = [load[r] * G + r if n_free[r] > 0 else full for r in range(G)]
    limit = math.inf if cfg.max_replicas_per_step is None else cfg.max_replicas_per_step
    budget = view.budget is not None
    monotone = view.monotone()
    cap_fn = view.capacity_fn()
    inf = math.inf
    # cap[r]: the rank's retention capacity, or (once it retains everything) a lower
    # bound of it that is >= its load: the rule reads only min(cap, load)
    cap, kept, ratio = [0] * G, [0] * G, [inf] * G
    sum_kept = 0
    if budget:
        cap = view.capacity(n_inst, load).tolist()  # all ranks at once: cap_fn's answers
        for r in range(G):
            kept[r] = min(load[r], max(cap[r], 0))
            ratio[r] = kept[r] / load[r] if load[r] else inf
        sum_kept = sum(kept)

    def try_dest(e: int, d: int, level: int, fn: int, fd: int):
        """``(instances, q, m, capacity)``: the new instance list, its even split ``q``
        (+1 for the first ``m``) and rank ``d``'s capacity with the replica (``None``
        without a budget), if ``d`` can afford a replica of ``e``: it must still retain
        ``min(R, max(n, level, ceil(fn/fd·R)))`` pairs."""
        slot = (d, slots[d].index(-1))
        inst = sorted(inst_of.get(e, native_of(e)) + [slot])  # global slot order, as even_split
        q, m = divmod(total[e], len(inst))
        c = None
        if budget:
            n, R = n_inst[d] + 1, load[d] + q + (inst.index(slot) < m)
            need = max(n, level, -(-(fn * R) // fd))
            c = cap_fn(d, n, R)
            if c < min(R, need):
                return None
        return inst, q, m, c

    if log is not None:
        log.load_KG.append(load.copy())
        log.kept_KG.append(kept.copy() if budget else load.copy())
    added = 0
    while added < limit:
        top = max(load)
        n_top = load.count(top)
        hot = [load.index(top)] if n_top == 1 else [r for r in range(G) if load[r] == top]
        cands = {e for r in hot for e in slots[r]
                 if e >= 0 and total[e] > len(inst_of.get(e, ()) or (1,))}
        cands = sorted(cands, key=lambda e: (-total[e] / len(inst_of.get(e, ()) or (1,)), e))
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
        first = min(key)  # the least-loaded free rank (full ranks sort last)
        dests = None  # every rank in (load, id) order, sorted when a move needs it
        room = None  # per rank, at most the pairs a replica may bring it (lazily)

        done = False
        for e in cands:
            was = inst_of.get(e) or native_of(e)
            held = {r for r, _ in was}
            d = first % G
            if first == full:
                d = None
            elif d in held:  # the least-loaded free rank that holds none of e
                dests = dests or sorted(key)
                d = next((k % G for k in dests if k != full and k % G not in held), None)
            if d is None:
                continue
            found = try_dest(e, d, level, fn, fd)
            if found is None and budget:  # the next least-loaded that affords it
                if room is None:
                    room = _room(view, load, n_inst, fn, fd, monotone)
                dests = dests or sorted(key)
                q = total[e] // (len(was) + 1)  # the least the replica brings
                for r in dests:
                    if r == full:
                        break
                    r %= G
                    if room[r] >= q and r not in held and r != d:
                        found = try_dest(e, r, level, fn, fd)
                        if found is not None:
                            break
            if found is None:
                continue
            inst, q, m, cap_d = found
            new_load = [q + (i < m) for i in range(len(inst))]
            loads = load.copy()
            for (r, _), x in zip(was, inst_load.get(e) or (total[e],)):
                loads[r] -= x
            for (r, _), x in zip(inst, new_load):
                loads[r] += x
            mx = max(loads)
            if (mx, loads.count(mx)) < (top, n_top):
                d, s = next(sl for sl in inst if sl not in was)
                slots[d][s] = e
                n_inst[d] += 1
                n_free[d] -= 1
                inst_of[e], inst_load[e] = inst, new_load
                for r, _ in inst:  # the touched ranks: e's hosts (one instance each)
                    R, was = loads[r], load[r]
                    load[r] = R
                    key[r] = R * G + r if n_free[r] > 0 else full
                    if budget:
                        if r == d:
                            c = cap_d  # try_dest priced it at these (n, R)
                        elif monotone and R <= was <= cap[r]:
                            c = cap[r]  # retained everything, no more pairs: still does
                        else:
                            c = cap_fn(r, n_inst[r], R)
                        cap[r] = c
                        k = R if c >= R else max(c, 0)
                        sum_kept += k - kept[r]
                        kept[r] = k
                        ratio[r] = k / R if R else inf
                added += 1
                done = True
                if log is not None:
                    log.load_KG.append(load.copy())
                    log.kept_KG.append(kept.copy() if budget else load.copy())
                    log.expert_K.append(e)
                    log.rank_K.append(d)
                    log.slot_K.append(s)
                break
        if not done:
            break
    inst_GS = np.array(slots, dtype=np.int64)
    # the loads kept move by move are the even split in global slot order: its closed form
    return inst_GS, Slots(inst_GS, E).even_split(np.asarray(total_E, dtype=np.int64))


def _room(view: LedgerView, load: list[int], n_inst: list[int], fn: int, fd: int,
          monotone: bool) -> list[float]:
    """Per rank, an upper bound on the pairs a replica may bring it and still pass
    ``try_dest``'s test, which keeps at least ``fn/fd`` of them: one numpy pass over the
    ranks (:meth:`~lrmoe.policy.ledger_view.LedgerView.received_bound`); no bound (inf)
    where the ledger's pieces are not monotone or the arithmetic could overflow."""
    R = view.received_bound(np.array(n_inst, dtype=np.int64) + 1, fn, fd) if monotone else None
    if R is None:
        return [math.inf] * len(load)
    return (R - np.array(load, dtype=np.int64)).tolist()
