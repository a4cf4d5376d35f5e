"""lrmoe passes 2 and 3, vectorised: retention quotas and backward quotas (the
arithmetic of ``tests/references/lrmoe_planner.py`` in closed form).

Legend: G ranks, S slots per rank; ``_IG`` is ``[rank·S + slot, home rank]`` (one row per
instance: the plan's blocks, transposed so that every split runs along contiguous
memory). All arrays int64 numpy on the host.
"""

from __future__ import annotations

import numpy as np

from lrmoe.policy.ledger_view import LedgerView
from lrmoe.policy.plan_numpy import apportion_rows_np


def retention(assign_IG: np.ndarray, inst_GS: np.ndarray, view: LedgerView,
              recompute: bool, load_GS: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Pass 2: ``(retained per block [G·S, G], rows recomputed per rank (None without
    ``recompute``), pairs retained per rank)``; ``load_GS``: the instances' loads."""
    G, S = inst_GS.shape
    recv_G = load_GS.sum(1)
    n_occ = (inst_GS >= 0).sum(1)
    keep = recv_G.copy()
    rec = np.zeros(G, dtype=np.int64) if recompute else None
    if view.budget is not None:
        keep = np.minimum(recv_G, view.capacity(n_occ, recv_G))
        short = (keep < recv_G).nonzero()[0]
        if recompute and short.size:
            # the ranks short of room: the ledger's recompute arithmetic, all at once (their
            # capacity is their keep: it is below what they received)
            more, need = view.capacity_recompute(n_occ, recv_G, short, cap=keep[short])
            up = more > keep[short]
            keep[short[up]] = more[up]
            rec[short[up]] = need[up]
    short = (keep < recv_G).nonzero()[0]
    if short.size == 0:
        return assign_IG, rec, keep  # all retained: the same array (the caller copies)
    # a rank that retains everything keeps every block whole; the others split
    base_GS = (load_GS[short] > 0).astype(np.int64)
    # rest_G >= 0: the placement pass leaves every rank room for one pair per instance
    rest_G = keep[short] - base_GS.sum(1)
    quota_GS = base_GS + apportion_rows_np(rest_G, load_GS[short] - base_GS)
    rows = (short[:, None] * S + np.arange(S)).ravel()
    retain = assign_IG.copy()
    retain[rows] = apportion_rows_np(quota_GS.ravel(), assign_IG[rows])
    return retain, rec, keep


def backward_quotas(assign_IG: np.ndarray, retain_IG: np.ndarray, G: int, balance: float,
                    min_keep: float) -> np.ndarray:
    """Pass 3: trim ranks above the mean retained load toward it, above the floors
    (blocks ``[G·S, G]``, one row per instance)."""
    ret_G = retain_IG.sum(1).reshape(G, -1).sum(1)
    mean = float(ret_G.sum()) / G
    # the reference's Python float expression, elementwise in the same order (IEEE
    # doubles either way, so the rounding is the same)
    above = ret_G > mean
    if not above.any():
        return retain_IG  # nothing to trim: the same array (the caller copies)
    target = np.where(above, np.ceil(mean + (1.0 - balance) * (ret_G - mean) - 1e-9), ret_G)
    want_G = np.maximum(ret_G - target.astype(np.int64), 0)
    ranks = want_G.nonzero()[0]
    if ranks.size == 0:
        return retain_IG
    # only the ranks above the mean are trimmed: the rest keep every retained pair
    S = retain_IG.shape[0] // G
    rows = (ranks[:, None] * S + np.arange(S)).ravel()
    ret = retain_IG[rows]
    # ceil(a·min_keep) <= a for min_keep <= 1 (a rounded product never exceeds a)
    room = ret - np.minimum(np.ceil(assign_IG[rows] * min_keep).astype(np.int64), ret)
    room_GS = room.sum(1).reshape(-1, S)
    cut_GS = apportion_rows_np(np.minimum(want_G[ranks], room_GS.sum(1)), room_GS)
    out = retain_IG.copy()
    out[rows] = ret - apportion_rows_np(cut_GS.ravel(), room)
    return out
