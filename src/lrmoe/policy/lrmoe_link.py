"""lrmoe's replicas weighed against their link cost, with ``LrmoeConfig.link`` set
(docs/design.md §4, "lrmoe and the link").

Legend: G ranks, S slots per rank, E experts, K prefixes of the placement's moves. All
arrays int64 numpy on the host.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lrmoe.policy.ledger_view import LedgerView
from lrmoe.policy.link_cost import plan_seconds, prefix_seconds, replica_rows_GG
from lrmoe.policy.lrmoe_place import MoveLog, natives_GS
from lrmoe.policy.plan import Plan
from lrmoe.policy.plan_numpy import Slots, host_counts


def worth_their_link(log: MoveLog, cfg, view: LedgerView, total_E: np.ndarray, S: int
                     ) -> tuple[np.ndarray, np.ndarray, int, Slots] | None:
    """Rule 1: ``(inst_expert_GS, inst_load_GS, replicas given up, its split index)`` for
    the best prefix of the logged moves, or ``None`` when that is all of them."""
    K = len(log.expert_K)
    if K == 0:
        return None
    G, E = len(view.home), len(total_E)
    step = np.arange(1, K + 1)
    owner = np.asarray(log.expert_K, dtype=np.int64) // (E // G)
    dst = np.asarray(log.rank_K, dtype=np.int64)
    sent = np.zeros((K + 1, G), dtype=np.int64)
    recv = np.zeros((K + 1, G), dtype=np.int64)
    sent[step, owner] = 1
    recv[step, dst] = 1
    sent, recv = sent.cumsum(0), recv.cumsum(0)
    load = np.asarray(log.load_KG, dtype=np.int64)
    n = E // G + recv
    t = prefix_seconds(cfg.link, load, np.asarray(log.kept_KG, dtype=np.int64), sent, recv,
                       view.home, cfg.balance, cfg.min_keep, cfg.selection)
    # the shortest prefix that fits the budget (the greedy may pass through placements
    # over it while its hot rank does not fit; its last one the caller checked); ties to
    # fewer replicas (a stable sort)
    for k in np.argsort(t, kind="stable").tolist():
        if k == K or view.fits(n[k], load[k], np.minimum(n[k], load[k])).all():
            break
    if k == K:
        return None
    inst = natives_GS(G, S, E)
    inst[dst[:k], np.asarray(log.slot_K[:k], dtype=np.int64)] = log.expert_K[:k]
    idx = Slots(inst, E)
    return inst, idx.even_split(total_E), K - k, idx


def no_slower_than_static(counts_GE, cfg, ledger, plan: Plan, trimmed_on) -> Plan:
    """Rule 2: ``plan``, or where its modelled step is not faster the plan on static's
    placement (``trimmed_on(placement)``, ``None`` where it does not fit); priced exactly
    unless :func:`estimated_seconds` puts it clearly ahead."""
    G, E = counts_GE.shape
    if plan.num_replicas() == 0:
        return plan
    gain = CLEAR_GAIN_NODES if cfg.link.spans_nodes(G) else CLEAR_GAIN
    static, placed = estimated_seconds(counts_GE, cfg, ledger, plan)
    if placed < (1.0 - gain) * static:
        return plan
    alt = trimmed_on(natives_GS(G, plan.S, E))
    if alt is None:  # the replicas are what makes it fit
        return plan
    if plan_seconds(cfg.link, alt, E) > plan_seconds(cfg.link, plan, E):
        return plan
    return dataclasses.replace(alt, rung=plan.rung, given_up_for="static",
                               replicas_given_up=plan.num_replicas() + plan.replicas_given_up)


# the modelled gain above which the estimate alone keeps the replicas: on a one-level link
# the estimate's ratio of a plan's step to static's stays within 0.08 of the exact ratio
# (random layers, EP 8-64, skew 0-2, NVLink/IB/PCIe, budgets loose to binding: tested), so
# a plan estimated this far ahead is ahead exactly; across the nodes of a two-level link,
# whose estimate spreads the rows evenly over both levels, within 0.25 (tested)
CLEAR_GAIN = 0.10
CLEAR_GAIN_NODES = 0.25


def estimated_seconds(counts_GE, cfg, ledger, plan: Plan) -> tuple[float, float]:
    """:func:`prefix_seconds`' estimate, from per-rank sums, of the modelled step on static's
    placement and on ``plan``'s: the plan is kept unpriced when more than
    :data:`CLEAR_GAIN` (across nodes :data:`CLEAR_GAIN_NODES`) ahead."""
    c = host_counts(counts_GE)
    G, E = c.shape
    view = LedgerView(ledger, c.sum(1))
    load0 = c.sum(0).reshape(G, E // G).sum(1)
    kept0 = load0 if view.budget is None else np.minimum(
        load0, np.maximum(view.capacity(np.full(G, E // G), load0), 0))
    a = plan.assign_GGS.numpy()
    rep = replica_rows_GG(plan.inst_expert_GS.numpy(), E)
    np.fill_diagonal(rep, 0)
    zero = np.zeros(G, dtype=np.int64)
    t = prefix_seconds(cfg.link, np.stack([load0, a.sum((0, 2))]),
                       np.stack([kept0, plan.retain_GGS.numpy().sum((0, 2))]),
                       np.stack([zero, rep.sum(1)]), np.stack([zero, rep.sum(0)]),
                       c.sum(1), cfg.balance, cfg.min_keep, cfg.selection)
    return float(t[0]), float(t[1])

