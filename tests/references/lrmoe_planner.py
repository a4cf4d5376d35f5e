"""lrmoe, the reference planner: the loop-by-loop reading of the fast path.

Legend: G ranks, S slots per rank, E experts; a *block* ``[g, r, s]`` is the pairs home
``g`` sends to instance ``(r, s)``. All tensors int64 on the CPU.

The rule is :mod:`lrmoe.policy.lrmoe`'s docstring (placement, retention quotas,
backward quotas), written here as directly as it reads: Python loops over ranks and
experts with a ledger call per candidate. :func:`lrmoe.policy.lrmoe.plan_lrmoe` must
return the same plans and raise the same errors (tests/test_planner_fast.py); this
module is slow (tens of ms per layer at EP 64), and only tests and
``benchmarks/plan_speed.py --reference`` call it.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
from torch import Tensor

from lrmoe.errors import LrmoeError, require
from lrmoe.policy.lrmoe import LrmoeConfig
from lrmoe.policy.plan import Plan
from references.plans import apportion, even_split, interval_overlap


def _even(total: int, n: int) -> list[int]:
    return [total // n + (1 if k < total % n else 0) for k in range(n)]


def _place_replicas(c: Tensor, S: int, cfg: LrmoeConfig, ledger) -> Tensor:
    """Pass 1: greedy memory-aware replication; returns ``inst_expert_GS``."""
    G, E = c.shape
    n_nat = E // G
    slots = [list(range(r * n_nat, (r + 1) * n_nat)) + [-1] * (S - n_nat) for r in range(G)]
    total = c.sum(0).tolist()
    home = c.sum(1).tolist()
    inst_of = [[(e // n_nat, e % n_nat)] for e in range(E)]  # (rank, slot), slot order
    inst_load = [[total[e]] for e in range(E)]
    rank_load = [sum(total[r * n_nat:(r + 1) * n_nat]) for r in range(G)]
    n_inst = [n_nat] * G
    budget = None if ledger is None else ledger.budget_bytes
    limit = math.inf if cfg.max_replicas_per_step is None else cfg.max_replicas_per_step

    def kept(r: int) -> int:
        return min(rank_load[r], max(ledger.retain_capacity(n_inst[r], rank_load[r], home[r]), 0))

    def affordable(d: int, gained: int, level: int, frac: Fraction) -> bool:
        # After the addition rank d must still afford retaining min_keep of a balanced
        # rank's backward work (level) and the worst rank's retained fraction (frac) of
        # its pairs, all its pairs if fewer, and at least one pair per instance.
        if budget is None:
            return True
        n, R = n_inst[d] + 1, rank_load[d] + gained
        need = max(n, level, math.ceil(frac * R))
        return ledger.retain_capacity(n, R, home[d]) >= min(R, need)

    added = 0
    while added < limit:
        top = max(rank_load)
        objective = (top, rank_load.count(top))
        hot = {r for r in range(G) if rank_load[r] == top}
        cands = [e for e in range(E)
                 if total[e] > len(inst_of[e]) and any(r in hot for r, _ in inst_of[e])]
        cands.sort(key=lambda e: (-total[e] / len(inst_of[e]), e))
        level, frac = 0, Fraction(1)
        if budget is not None:
            k = [kept(r) for r in range(G)]
            level = math.ceil(cfg.min_keep * sum(k) / G)
            frac = min((Fraction(k[r], rank_load[r]) for r in range(G) if rank_load[r]),
                       default=Fraction(1))
            if any(ledger.retain_capacity(n_inst[r], rank_load[r], home[r])
                   < min(n_inst[r], rank_load[r]) for r in hot):
                # a hot rank does not fit at all yet: any destination that still fits
                # (one pair per instance) is better than no plan
                level, frac = 0, Fraction(0)
        done = False
        for e in cands:
            held = {r for r, _ in inst_of[e]}
            dests = sorted((rank_load[r], r) for r in range(G)
                           if r not in held and -1 in slots[r])
            new_inst = new_load = new_slot = None
            for _, d in dests:
                slot = (d, slots[d].index(-1))
                inst = sorted(inst_of[e] + [slot])  # global slot order, as even_split
                load = _even(total[e], len(inst))
                if affordable(d, load[inst.index(slot)], level, frac):
                    new_inst, new_load, new_slot = inst, load, slot
                    break
            if new_slot is None:
                continue
            loads = list(rank_load)
            for (r, _), x in zip(inst_of[e], inst_load[e]):
                loads[r] -= x
            for (r, _), x in zip(new_inst, new_load):
                loads[r] += x
            if (max(loads), loads.count(max(loads))) < objective:
                d, s = new_slot
                slots[d][s] = e
                n_inst[d] += 1
                inst_of[e], inst_load[e], rank_load = new_inst, new_load, loads
                added += 1
                done = True
                break
        if not done:
            break
    return torch.tensor(slots, dtype=torch.long)


def _retention(assign_GGS: Tensor, inst_GS: Tensor, home_G: Tensor, ledger,
               recompute: bool = False) -> tuple[Tensor, Tensor | None]:
    """Pass 2: retention quotas per instance, then per block; with ``recompute`` also
    the rows per rank that keep only their input row (``None`` without)."""
    G, _, S = assign_GGS.shape
    load_GS = assign_GGS.sum(0)
    recv_G = load_GS.sum(1)
    n_occ = (inst_GS >= 0).sum(1)
    keep = recv_G.clone()
    rec = torch.zeros(G, dtype=torch.long) if recompute else None
    if ledger is not None and ledger.budget_bytes is not None:
        for r in range(G):
            n, R, h = int(n_occ[r]), int(recv_G[r]), int(home_G[r])
            keep[r] = min(R, ledger.retain_capacity(n, R, h))
            if recompute and keep[r] < R:
                # retain more, some as input rows only: the most pairs that fit, then
                # the fewest of them recomputed
                more, need = ledger.retain_capacity_recompute(n, R, h)
                if more > keep[r]:
                    keep[r] = more
                    rec[r] = need
    base_GS = (load_GS > 0).long()
    rest_G = keep - base_GS.sum(1)
    if (rest_G < 0).any():  # the placement pass guarantees this never happens
        r = int(torch.nonzero(rest_G < 0)[0])
        raise LrmoeError(f"lrmoe planner: rank {r} cannot retain one pair per instance "
                         "(internal error: please report)")
    quota_GS = base_GS + apportion(rest_G, (load_GS - base_GS).T).T
    retain = apportion(quota_GS.flatten(), assign_GGS.reshape(G, G * S)).reshape(G, G, S)
    return retain, rec


def _backward_quotas(assign_GGS: Tensor, retain_GGS: Tensor, cfg: LrmoeConfig) -> Tensor:
    """Pass 3: trim ranks above the mean retained load toward it, above the floors."""
    G, _, S = assign_GGS.shape
    floor = torch.ceil(assign_GGS.double() * cfg.min_keep).long().clamp(max=assign_GGS)
    floor = torch.minimum(floor, retain_GGS)
    room_GGS = retain_GGS - floor
    room_GS = room_GGS.sum(0)
    ret_G = retain_GGS.sum(dim=(0, 2))
    mean = float(ret_G.sum()) / G
    target = [r if r <= mean else math.ceil(mean + (1.0 - cfg.balance) * (r - mean) - 1e-9)
              for r in ret_G.tolist()]
    cut_G = (ret_G - torch.tensor(target, dtype=torch.long)).clamp(min=0)
    cut_G = torch.minimum(cut_G, room_GS.sum(1))
    cut_GS = apportion(cut_G, room_GS.T).T
    cut = apportion(cut_GS.flatten(), room_GGS.reshape(G, G * S)).reshape(G, G, S)
    return retain_GGS - cut


def plan_lrmoe(counts_GE: Tensor, config: LrmoeConfig | None = None, ledger=None) -> Plan:
    """The LRMoE plan of one layer (see the module docstring)."""
    cfg = config or LrmoeConfig()
    G, E = counts_GE.shape
    require(E % G == 0, f"number of experts {E} is not divisible by the EP size {G}")
    c = counts_GE.long()
    require(bool((c >= 0).all()), "counts must be >= 0")
    n_nat = E // G
    S = cfg.max_slots_per_rank if cfg.max_slots_per_rank is not None else n_nat + 2
    require(S >= n_nat, f"lrmoe.max_slots_per_rank={S} must be >= E/G = {n_nat} "
                        "(each rank holds its native experts)")
    inst = _place_replicas(c, S, cfg, ledger)
    assign = interval_overlap(c, inst, even_split(c, inst))
    if ledger is not None and ledger.budget_bytes is not None:
        # Feasibility after placement: replicas may have taken pairs (and so buffer bytes)
        # off a hot rank that the native placement alone could not fit.
        n_inst = (inst >= 0).sum(1)
        recv = assign.sum(dim=(0, 2))
        home = c.sum(1)
        ledger.raise_if_over(
            [ledger.terms(int(n_inst[r]), int(recv[r]), int(home[r]), min(int(n_inst[r]), int(recv[r])))
             for r in range(G)],
            "the smallest lrmoe plan (its placement, one retained pair per instance)")
    retain, rec = _retention(assign, inst, c.sum(1), ledger, cfg.recompute)
    select = _backward_quotas(assign, retain, cfg) if cfg.selection else retain.clone()
    plan = Plan(inst, assign, retain, select, recompute_G=rec)
    plan.check(c)
    if ledger is not None:
        ledger.check(plan)
    return plan
