"""lrmoe: memory-aware replication, retention quotas and backward quotas (our reading).

Legend: G ranks, S slots per rank, E experts; a *block* ``[g, r, s]`` is the pairs home
``g`` sends to instance ``(r, s)``. All tensors int64 on the CPU.

The plan is built in three passes (SYSTEM.md §4 lrmoe), each deterministic:

1. **Placement.** Start from the natives (rank ``r`` holds experts ``r·E/G ..``) with
   ``max_slots_per_rank - E/G`` empty slots per rank. Repeatedly take the experts that
   have an instance on a rank at the maximum load, in descending per-instance load
   (ties: lower id); for each, find the least-loaded rank (ties: lower id) that has a
   free slot, holds no instance of it yet, and can afford the new instance plus the
   activations its pairs need: after the addition the ledger must leave room on that
   rank to retain ``min(received, max(instances, ceil(min_keep · M), ceil(ρ ·
   received)))`` pairs, where ``M`` is the mean retained pairs per rank (the balanced
   backward load pass 3 aims at) and ``ρ`` the smallest retained fraction of any rank
   (1 when everything is retained). Add the replica if that strictly lowers ``(max
   rank load, number of ranks at the max)``. So when the budget lets every rank
   retain everything, replicas go only where they keep that true (the plan stays
   exact); under a tight budget a replica trades some of its host's retention (one
   instance's bytes plus its buffers) for forward balance, never leaving the host
   worse off than the worst rank already is, nor below ``min_keep`` of a balanced
   rank's backward work (while a rank at the maximum load does not fit at all, a
   destination need only stay feasible: any plan beats none). Stop when no expert
   improves the objective, the slots run out or ``max_replicas_per_step`` is reached.
   Each expert's pairs are split evenly over its instances (re-split after every
   addition; first instances in slot order get +1).
2. **Retention quotas.** Each rank retains ``min(received, affordable)`` pairs, where
   ``affordable`` is what its budget has left after owned state, instances and buffers
   (everything, without a budget). With ``recompute`` a rank short of room retains as
   many pairs as fit when each keeps only its input row, and recomputes the gate_up
   output of the fewest of them (``Plan.recompute_G``). The rank's quota goes first one pair to each
   non-empty instance, then the rest in proportion to the instances' remaining loads;
   an instance's quota goes to its blocks in proportion to their pairs.
3. **Backward quotas.** ``M`` = mean retained pairs per rank. A rank above ``M`` trims its
   selected pairs to ``ceil(M + (1 - balance)·(retained - M))``, never below the floor
   ``min(retain, ceil(min_keep·assign))`` of any block: the cut is shared over its
   instances, and then their blocks, in proportion to how far each is above its floor
   (with every pair retained this scales every instance by the same factor).
   ``selection=False`` selects every retained pair.

All rounding is largest-remainder (:func:`lrmoe.policy.capacity.apportion`), so sums are
exact. The plan never exceeds the ledger's budget; if even the natives with one
retained pair per instance do not fit, :class:`LrmoeError` names the rank and shortfall.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from fractions import Fraction

import torch
from torch import Tensor

from lrmoe.errors import LrmoeError, require
from lrmoe.policy.base import PlanInputs
from lrmoe.policy.capacity import apportion
from lrmoe.policy.plan import Plan, even_split, interval_overlap

ESTIMATORS = ("topk", "sampled")
RETENTION_ORDERS = ("gate",)


@dataclass
class LrmoeConfig:
    """Knobs of the LRMoE planner and runtime.

    Attributes:
        balance: how far backward quotas trim a rank above the mean backward load
            toward the mean (1 = fully to the mean, 0 = no trimming).
        min_keep: floor on each block's fraction of selected pairs (of its assigned).
        max_replicas_per_step: cap on replicas added per layer and step (None: no cap).
        max_slots_per_rank: slots per rank incl. natives; None means ``E/G + 2``.
        estimator: backward selection of pairs inside a quota (runtime): ``topk`` keeps
            the highest-metric pairs, ``sampled`` samples ``p ∝ metric`` and reweights.
        compaction: runtime ablation: False zeroes unselected rows instead of removing.
        selection: False selects every retained pair (memory-aware placement only).
        retention_order: which pairs fill a retention quota (runtime): ``gate`` keeps
            the highest gate weights.
        keep: ``fixed`` uses ``min_keep`` as given; ``auto`` adapts each layer's floor to
            hold the fidelity monitor's cosine at ``target_cosine``.
        target_cosine: the gradient fidelity ``auto`` aims for.
        fidelity_every: how often the runtime measures fidelity (``auto`` needs > 0).
        recompute: retention may also keep pairs whose gate_up output is recomputed in
            backward (only the input row saved): a rank retains as many pairs as fit
            that way, recomputing the fewest (more pairs in backward, more backward work).
    """

    balance: float = 1.0
    min_keep: float = 0.5
    max_replicas_per_step: int | None = None
    max_slots_per_rank: int | None = None
    estimator: str = "topk"
    compaction: bool = True
    selection: bool = True
    retention_order: str = "gate"
    keep: str = "fixed"
    target_cosine: float = 0.99
    fidelity_every: int = 0
    recompute: bool = False

    def __post_init__(self) -> None:
        require(0.0 <= self.balance <= 1.0, f"lrmoe.balance={self.balance} must be in [0, 1]")
        require(0.0 <= self.min_keep <= 1.0,
                f"lrmoe.min_keep={self.min_keep} must be in [0, 1]")
        require(self.max_replicas_per_step is None or self.max_replicas_per_step >= 0,
                f"lrmoe.max_replicas_per_step={self.max_replicas_per_step} must be >= 0 "
                "or None")
        require(self.max_slots_per_rank is None or self.max_slots_per_rank >= 1,
                f"lrmoe.max_slots_per_rank={self.max_slots_per_rank} must be >= 1 or None")
        require(self.estimator in ESTIMATORS,
                f"lrmoe.estimator={self.estimator!r} is not one of {ESTIMATORS}")
        require(self.retention_order in RETENTION_ORDERS,
                f"lrmoe.retention_order={self.retention_order!r} is not one of "
                f"{RETENTION_ORDERS}")


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
                room = ledger.budget_bytes - ledger.terms(n, R, h, 0)["total"]
                more = min(R, room // (ledger.L * ledger.A_recompute))
                if more > keep[r]:
                    keep[r] = more
                    rec[r] = max(0, ledger.recompute_needed(n, R, h, more))
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


@dataclass
class LrmoePolicy:
    config: LrmoeConfig = field(default_factory=LrmoeConfig)
    name: str = "lrmoe"

    min_keep_by_layer: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        c = self.config
        if c.keep not in ("fixed", "auto"):
            raise LrmoeError(f"lrmoe keep={c.keep!r} is not valid; use 'fixed' or 'auto'")
        if c.keep == "auto" and c.fidelity_every <= 0:
            raise LrmoeError("--lrmoe-keep auto needs the fidelity monitor: give "
                             "--lrmoe-fidelity-every N with N > 0")

    def plan(self, counts_GE: Tensor, inputs: PlanInputs) -> Plan:
        cfg = self.config
        if cfg.keep == "auto":
            mk = self.min_keep_by_layer.get(inputs.layer, cfg.min_keep)
            cfg = dataclasses.replace(cfg, min_keep=mk)
        return plan_lrmoe(counts_GE, cfg, inputs.ledger)

    def observe_fidelity(self, layer: int, cosine: float) -> None:
        """Keep-ratio controller (``keep='auto'``): raise the layer's floor when the
        selected gradient drifts below the target cosine, lower it slowly when well above.
        Deterministic, so every rank (which sees the same gathered cosine) agrees."""
        if self.config.keep != "auto":
            return
        mk = self.min_keep_by_layer.get(layer, self.config.min_keep)
        t = self.config.target_cosine
        if cosine < t:
            mk = min(1.0, mk + 0.1)
        elif cosine > t + 0.5 * (1 - t):
            mk = max(0.05, mk - 0.02)
        self.min_keep_by_layer[layer] = round(mk, 6)

    def state_dict(self) -> dict:
        return {"min_keep_by_layer": {str(k): v for k, v in self.min_keep_by_layer.items()}}

    def load_state_dict(self, d: dict) -> None:
        self.min_keep_by_layer = {int(k): float(v) for k, v in d.get("min_keep_by_layer", {}).items()}
