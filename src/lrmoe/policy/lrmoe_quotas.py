"""lrmoe passes 2 and 3, vectorised: retention quotas and backward quotas.

Legend: G ranks, S slots per rank; ``_GGS`` is ``[home rank, rank, slot]``. All arrays
int64 numpy on the host. The same arithmetic as the reference
(:mod:`lrmoe.policy.lrmoe_reference` ``_retention`` and ``_backward_quotas``), in closed
form: per-rank capacities from the ledger's vectorised view, largest-remainder
rounding by :func:`lrmoe.policy.fastops.apportion_np`.
"""

from __future__ import annotations

import math

import numpy as np

from lrmoe.errors import LrmoeError
from lrmoe.policy.fastops import apportion_np
from lrmoe.policy.ledger_view import LedgerView


def retention(assign_GGS: np.ndarray, inst_GS: np.ndarray, home_G: np.ndarray,
              view: LedgerView, recompute: bool = False
              ) -> tuple[np.ndarray, np.ndarray | None]:
    """Pass 2: retention quotas per instance, then per block; with ``recompute`` also the
    rows per rank that keep only their input row (``None`` without)."""
    G, _, S = assign_GGS.shape
    load_GS = assign_GGS.sum(0)
    recv_G = load_GS.sum(1)
    n_occ = (inst_GS >= 0).sum(1)
    keep = recv_G.copy()
    rec = np.zeros(G, dtype=np.int64) if recompute else None
    if view.budget is not None:
        keep = np.minimum(recv_G, view.capacity(n_occ, recv_G))
        if recompute:
            ledger = view.ledger
            for r in np.flatnonzero(keep < recv_G).tolist():
                # the few ranks short of room: the ledger's own recompute arithmetic
                n, R, h = int(n_occ[r]), int(recv_G[r]), int(home_G[r])
                more, need = ledger.retain_capacity_recompute(n, R, h)
                if more > keep[r]:
                    keep[r] = more
                    rec[r] = need
    base_GS = (load_GS > 0).astype(np.int64)
    rest_G = keep - base_GS.sum(1)
    if (rest_G < 0).any():  # the placement pass guarantees this never happens
        r = int(np.flatnonzero(rest_G < 0)[0])
        raise LrmoeError(f"lrmoe planner: rank {r} cannot retain one pair per instance "
                         "(internal error: please report)")
    quota_GS = base_GS + apportion_np(rest_G, (load_GS - base_GS).T).T
    retain = apportion_np(quota_GS.ravel(), assign_GGS.reshape(G, G * S)).reshape(G, G, S)
    return retain, rec


def backward_quotas(assign_GGS: np.ndarray, retain_GGS: np.ndarray, balance: float,
                    min_keep: float) -> np.ndarray:
    """Pass 3: trim ranks above the mean retained load toward it, above the floors."""
    G, _, S = assign_GGS.shape
    floor = np.minimum(np.ceil(assign_GGS.astype(np.float64) * min_keep).astype(np.int64),
                       assign_GGS)
    floor = np.minimum(floor, retain_GGS)
    room_GGS = retain_GGS - floor
    room_GS = room_GGS.sum(0)
    ret_G = retain_GGS.sum((0, 2))
    mean = float(ret_G.sum()) / G
    # the reference's Python float expression, rank by rank (G values: cheap, and the
    # rounding is the same by construction)
    target = np.array([r if r <= mean else math.ceil(mean + (1.0 - balance) * (r - mean) - 1e-9)
                       for r in ret_G.tolist()], dtype=np.int64)
    cut_G = np.minimum(np.maximum(ret_G - target, 0), room_GS.sum(1))
    cut_GS = apportion_np(cut_G, room_GS.T).T
    cut = apportion_np(cut_GS.ravel(), room_GGS.reshape(G, G * S)).reshape(G, G, S)
    return retain_GGS - cut
