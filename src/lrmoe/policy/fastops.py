"""numpy twins of the plan primitives, for planners on the critical path.

Legend: G ranks, S slots per rank, E experts, N/K generic row/column counts. All
arrays int64 on the host. Each function returns exactly what its torch reference
returns (:func:`lrmoe.policy.capacity.apportion`, :func:`lrmoe.policy.plan.even_split`,
:func:`lrmoe.policy.plan.interval_overlap`; tests/test_planner_fast.py compares them on
random inputs); at these sizes (a few thousand entries) numpy's per-call cost is a
fraction of torch's on one CPU thread.
"""

from __future__ import annotations

import numpy as np
import torch

from lrmoe.errors import require
from lrmoe.policy.plan import Plan


def apportion_np(total_K: np.ndarray, weight_NK: np.ndarray) -> np.ndarray:
    """:func:`lrmoe.policy.capacity.apportion` (largest remainder, ties to the lower row)."""
    w = np.asarray(weight_NK, dtype=np.int64)
    total = np.asarray(total_K, dtype=np.int64)
    W = w.sum(0)
    require(bool((total <= W).all()) and bool((total >= 0).all()),
            "apportion: totals must lie between 0 and the column weight")
    num = total[None, :] * w
    base = num // np.maximum(W, 1)
    left = total - base.sum(0)
    cols = np.flatnonzero(left > 0)  # only these columns hand out remainders
    if cols.size:
        rem = num[:, cols] - base[:, cols] * np.maximum(W[cols], 1)
        lc = left[cols]
        # the left-th largest remainder t per column: rows above it get +1, and of the
        # rows equal to it the lowest ones, as many as are left (a stable sort's order)
        t = -np.sort(-rem, axis=0)[lc - 1, np.arange(cols.size)]
        above = rem > t
        eq = rem == t
        give = above | (eq & (eq.cumsum(0) <= (lc - above.sum(0))[None, :]))
        base[:, cols] += give
    return base


def _slot_rank(e_idx: np.ndarray, valid: np.ndarray, n_experts: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """Sort order of the slots by (expert, global slot) and each slot's first sorted
    position of its expert; empty slots sort after every expert."""
    key = np.where(valid, e_idx, n_experts)
    order = np.argsort(key, kind="stable")  # stable: global slot order within an expert
    key_sorted = key[order]
    return order, np.searchsorted(key_sorted, key_sorted)


def even_split_np(counts_GE: np.ndarray, inst_expert_GS: np.ndarray) -> np.ndarray:
    """:func:`lrmoe.policy.plan.even_split`: each expert's total split evenly over its
    instances, the first ones in global slot order get +1."""
    total_E = counts_GE.sum(0)
    E = total_E.size
    ie = inst_expert_GS.ravel()
    valid = ie >= 0
    e_idx = np.where(valid, ie, 0)
    n_E = np.bincount(e_idx[valid], minlength=E)
    order, starts = _slot_rank(e_idx, valid, E)
    k = np.empty_like(order)
    k[order] = np.arange(ie.size) - starts
    n = np.maximum(n_E[e_idx], 1)
    t = total_E[e_idx]
    return ((t // n + (k < t % n)) * valid).reshape(inst_expert_GS.shape)


def interval_overlap_np(counts_GE: np.ndarray, inst_expert_GS: np.ndarray,
                        inst_load_GS: np.ndarray) -> np.ndarray:
    """:func:`lrmoe.policy.plan.interval_overlap`: ``assign_GGS`` from contiguous
    intervals, homes in rank order and instances in global slot order per expert."""
    G, E = counts_GE.shape
    S = inst_expert_GS.shape[1]
    home_hi = counts_GE.cumsum(0)
    home_lo = home_hi - counts_GE
    ie = inst_expert_GS.ravel()
    valid = ie >= 0
    e_idx = np.where(valid, ie, 0)
    load = inst_load_GS.ravel() * valid
    order, starts = _slot_rank(e_idx, valid, E)
    cum = load[order].cumsum()
    hi_sorted = cum - (cum - load[order])[starts]
    inst_hi = np.empty_like(hi_sorted)
    inst_hi[order] = hi_sorted
    inst_lo = inst_hi - load
    lo = np.maximum(home_lo[:, e_idx], inst_lo[None, :])
    hi = np.minimum(home_hi[:, e_idx], inst_hi[None, :])
    return (np.clip(hi - lo, 0, None) * valid[None, :]).reshape(G, G, S)


def to_plan(inst_GS: np.ndarray, assign_GGS: np.ndarray, retain_GGS: np.ndarray,
            select_GGS: np.ndarray, **extra) -> Plan:
    """A :class:`Plan` of torch int64 tensors sharing the arrays' memory."""
    t = [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
         for a in (inst_GS, assign_GGS, retain_GGS, select_GGS)]
    extra = {k: None if v is None else torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64))
             for k, v in extra.items()}
    return Plan(*t, **extra)


def host_counts(counts_GE) -> np.ndarray:
    """``counts_GE`` as an int64 numpy array (a torch tensor on the host is shared)."""
    if isinstance(counts_GE, torch.Tensor):
        return counts_GE.detach().cpu().long().numpy()
    return np.asarray(counts_GE, dtype=np.int64)
