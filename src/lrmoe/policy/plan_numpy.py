"""numpy twins of the plan primitives, for planners on the critical path: each returns
exactly what its torch reference returns, at a fraction of torch's per-call cost.

Legend: G ranks, S slots per rank, E experts, N/K generic row/column counts; int64 arrays.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from lrmoe.errors import LrmoeError
from lrmoe.policy.plan import Plan

_FLOAT_EXACT = 1 << 53  # integers below this are exact in a double
_BIG_SPLIT = 2048  # entries from which the float division and narrow sort pay off
# the largest sort key of each width (np.iinfo per call costs more than the sort it serves)
_KEY_MAX = {4: int(np.iinfo(np.int32).max), 8: int(np.iinfo(np.int64).max)}


def apportion_rows_np(total_K: np.ndarray, weight_KN: np.ndarray) -> np.ndarray:
    """Largest remainder along rows: ``total_K[k]`` units over row ``k``'s entries in proportion
    to them, ties to the lower entry; the unique key ``remainder·N + (N-1-n)`` makes one
    sort per row give the stable largest-remainder order."""
    w = np.asarray(weight_KN, dtype=np.int64)
    total = np.asarray(total_K, dtype=np.int64)
    W = w.sum(1)
    if (total > W).any() or (total < 0).any():
        raise LrmoeError("apportion: totals must lie between 0 and the column weight")
    part = (total > 0) & (total < W)
    n_part = np.count_nonzero(part)
    if n_part == len(part) or (w.size >= _BIG_SPLIT and 2 * n_part >= len(part)):
        # every row at once (a row taking all or nothing splits to exactly that, and an
        # empty one to zeros): no gather and scatter of the rows that split
        out, rows, wc, tc, Wc = None, None, w, total[:, None], np.maximum(W, 1)[:, None]
    else:
        out = w * (total == W)[:, None]
        if n_part == 0:
            return out
        rows = part.nonzero()[0]
        wc, tc, Wc = w[rows], total[rows, None], W[rows, None]
    N = w.shape[1]
    key = tc * wc
    big = wc.size >= _BIG_SPLIT
    top = int(Wc.max()) if big else 0  # read on large arrays only
    if big and top * int(tc.max()) < _FLOAT_EXACT:
        # floor(t·w / W) through one float division, exact: t·w < 2^53 is exact in a
        # double, and a quotient that is not an integer lies >= 1/W from the next one,
        # farther than the division's rounding (< t·w·2^-53 / W < 1/W)
        base = (key / Wc).astype(np.int64)
        key -= base * Wc  # the remainders
    else:
        base, key = np.divmod(key, Wc)
    left = tc[:, 0] - base.sum(1)
    if big and top * N < 1 << 31:
        key = key.astype(np.int32)  # every key < W·N fits: a narrower sort
    key *= N
    key += np.arange(N - 1, -1, -1, dtype=key.dtype)  # remainder, then the lower entry first
    kth = np.sort(key, axis=1)[np.arange(len(key)), N - np.maximum(left, 1)]
    kth[left <= 0] = _KEY_MAX[kth.dtype.itemsize]  # above every key: no entry gets +1
    base += key >= kth[:, None]
    if out is None:
        return base
    out[rows] = base
    return out


class Slots:
    """What the split arithmetic needs of a placement, computed once per placement."""

    def __init__(self, inst_expert_GS: np.ndarray, n_experts: int) -> None:
        self.shape = inst_expert_GS.shape
        ie = np.asarray(inst_expert_GS, dtype=np.int64).ravel()
        self.valid = valid = ie >= 0
        self.e_idx = e_idx = np.where(valid, ie, 0)
        key = np.where(valid, e_idx, n_experts)
        self.order = order = np.argsort(key, kind="stable")  # global slot order per expert
        key_sorted = key[order]
        self.starts = np.searchsorted(key_sorted, key_sorted)
        self.k = np.empty_like(order)
        self.k[order] = np.arange(ie.size) - self.starts
        self.n = np.maximum(np.bincount(e_idx[valid], minlength=n_experts)[e_idx], 1)
        # the slots whose expert has several instances (the only ones whose blocks need
        # the interval arithmetic: a lone instance takes every home's pairs)
        self.shared = (valid & (self.n > 1)).nonzero()[0]

    def even_split(self, total_E: np.ndarray) -> np.ndarray:
        """Each expert's ``total_E`` split evenly over its instances, the first ones in global
        slot order get +1: ``[G, S]``."""
        t = total_E[self.e_idx]
        return ((t // self.n + (self.k < t % self.n)) * self.valid).reshape(self.shape)

    def overlap_ig(self, counts_GE: np.ndarray, inst_load_GS: np.ndarray) -> np.ndarray:
        """The pairs each home sends to each instance, instance-major ``[G·S, G]``: contiguous
        intervals, homes in rank order, instances in global slot order per expert."""
        c_EG = np.ascontiguousarray(counts_GE.T)
        # a lone instance takes its expert's pairs from every home (its load is their
        # total); an empty slot takes none
        out = c_EG[self.e_idx]
        out *= (self.valid & (self.n == 1))[:, None]
        if self.shared.size == 0:
            return out
        load = inst_load_GS.ravel() * self.valid
        lo_sorted = load[self.order]
        cum = lo_sorted.cumsum()
        inst_hi = np.empty_like(cum)
        inst_hi[self.order] = cum - (cum - lo_sorted)[self.starts]
        i, e = self.shared, self.e_idx[self.shared]
        hh = c_EG[e].cumsum(1)  # [shared, G]: end of each home's interval in e's pairs
        ov = np.minimum(hh, inst_hi[i, None])
        ov -= np.maximum(hh - c_EG[e], (inst_hi[i] - load[i])[:, None])
        out[i] = np.maximum(ov, 0, out=ov)
        return out


def blocks_to_GGS(x_IG: np.ndarray, G: int, S: int) -> np.ndarray:
    """Instance-major blocks ``[G·S, G]`` as the plan's ``[home, rank, slot]``."""
    return np.ascontiguousarray(x_IG.T).reshape(G, G, S)


def to_plan(inst_GS: np.ndarray, assign_GGS: np.ndarray, retain_GGS: np.ndarray,
            select_GGS: np.ndarray, recompute_G: np.ndarray | None = None) -> Plan:
    """A :class:`Plan` of torch int64 tensors sharing the arrays' memory."""
    t = [None if a is None else torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
         for a in (inst_GS, assign_GGS, retain_GGS, select_GGS, recompute_G)]
    return Plan(*t[:4], recompute_G=t[4])


def host_counts(counts_GE) -> np.ndarray:
    """``counts_GE`` as an int64 numpy array (a torch tensor on the host is shared)."""
    if isinstance(counts_GE, torch.Tensor):
        return counts_GE.detach().cpu().long().numpy()
    return np.asarray(counts_GE, dtype=np.int64)


def full_plan(counts_GE: Tensor, inst_expert_GS: Tensor, inst_load_GS: Tensor | None = None,
              slots: Slots | None = None) -> Plan:
    """A plan that retains and selects every pair on ``inst_expert_GS`` (``slots``: its
    split index), instance ``i`` taking ``inst_load_GS[i]`` (default: an even split);
    torch tensors or numpy arrays."""
    c, inst = host_counts(counts_GE), host_counts(inst_expert_GS)
    idx = Slots(inst, c.shape[1]) if slots is None else slots
    load = idx.even_split(c.sum(0)) if inst_load_GS is None else host_counts(inst_load_GS)
    a = blocks_to_GGS(idx.overlap_ig(c, load), *inst.shape)
    return to_plan(inst, a, a.copy(), a.copy())
