"""A vectorised view of the memory ledger for the fast planners.

Legend: G ranks; per rank ``n`` occupied slots, ``R`` received pairs, ``h`` home
pairs, ``k`` retained pairs, ``rec`` recomputed pairs (ints, or int64 arrays ``[G]``).

The planners ask the ledger for bytes on every candidate move, and
:meth:`lrmoe.memory.Ledger.terms` builds a dict per call: too slow on the critical
path. This view re-derives no formula. A rank's home pairs ``h`` are fixed for a
whole plan (they are the counts' row sums), and for a fixed ``h`` the ledger's total is
affine in ``(n, R, k, rec)``: instances, received-row buffers and retained rows each
cost a fixed number of bytes. So for each distinct ``h`` the view asks
:meth:`terms` at ``R = 0`` and ``R = 1`` and along each other count, and keeps that
model only if the ledger then reproduces it far from those points (large and mixed
counts up to every pair of the layer, and :meth:`retain_capacity` where the room is a
few pairs, none, or negative). If any check fails (a ledger that is no longer affine in
those counts) every query falls back to the ledger's own methods one rank at a time:
the same answers, only slower. ``tests/test_planner_fast.py`` checks the view against
:meth:`Ledger.rank_terms` on whole plans.
"""

from __future__ import annotations

import numpy as np


class LedgerView:
    """``ledger`` (or ``None``: no budget) for ranks whose home pairs are ``home_G``.

    Args:
        ledger: a :class:`lrmoe.memory.Ledger` or ``None``.
        home_G: home pairs per rank (the count matrix's row sums).
        max_pairs: the most pairs one rank can receive (all of the layer's); the affine
            model is checked up to there.
    """

    def __init__(self, ledger, home_G: np.ndarray, max_pairs: int) -> None:
        self.ledger = ledger
        self.home = np.asarray(home_G, dtype=np.int64)
        self.budget = None if ledger is None else ledger.budget_bytes
        self.affine = False
        if self.budget is None:
            return
        h_list = self.home.tolist()

        def total(n, R, h, k=0, rec=0):
            return ledger.terms(n, R, h, k, rec)["total"]
        h0 = h_list[0]
        base = total(0, 0, h0)
        self.cn = total(1, 0, h0) - base
        self.ck = total(0, 0, h0, 1) - base
        self.crec = total(0, 0, h0, 1, 1) - total(0, 0, h0, 1)
        c0, cR = {}, {}
        ok = self.ck > 0
        top = max(int(max_pairs), 2)
        for h in sorted(set(h_list)):
            if not ok:
                break
            c0[h] = total(0, 0, h)
            cR[h] = total(0, 1, h) - c0[h]
            for n, R, k, rec in ((0, 2, 0, 0), (3, 1009, 500, 101), (7, top, top, top // 3)):
                ok &= total(n, R, h, k, rec) == self._total(c0[h], cR[h], n, R, k, rec)
            if ok and cR[h] > 0:
                # retain_capacity where the room is a few pairs, none, or negative
                R0 = (self.budget - c0[h] - self.cn) // cR[h]
                for R in (R0 - 1, R0, R0 + 1):
                    if R >= 0:
                        ok &= ledger.retain_capacity(1, R, h) == self._cap(c0[h], cR[h], 1, R)
        self.affine = bool(ok)
        if self.affine:
            self.c0_G = np.array([c0[h] for h in h_list], dtype=np.int64)
            self.cR_G = np.array([cR[h] for h in h_list], dtype=np.int64)
            self._c0, self._cR = self.c0_G.tolist(), self.cR_G.tolist()

    # ------------------------------------------------------------ affine model
    def _total(self, c0, cR, n, R, k=0, rec=0):
        return c0 + cR * R + self.cn * n + self.ck * k + self.crec * rec

    def _cap(self, c0, cR, n, R):
        room = self.budget - self._total(c0, cR, n, R)
        if isinstance(room, np.ndarray):
            return np.where(room < 0, -1, room // self.ck)
        return -1 if room < 0 else room // self.ck

    # ------------------------------------------------------------ queries
    def capacity_fn(self):
        """A fast ``(rank, n, R) -> retain_capacity`` on Python ints."""
        if self.budget is None:
            return lambda r, n, R: R
        h = self.home.tolist()
        if not self.affine:
            return lambda r, n, R: self.ledger.retain_capacity(n, R, h[r])
        B, c0, cR, cn, ck = self.budget, self._c0, self._cR, self.cn, self.ck

        def cap(r, n, R):
            room = B - c0[r] - cR[r] * R - cn * n
            return -1 if room < 0 else room // ck
        return cap

    def capacity(self, n_G, R_G) -> np.ndarray:
        """:meth:`Ledger.retain_capacity` of every rank, int64 ``[G]``."""
        if self.budget is None:
            return np.asarray(R_G, dtype=np.int64).copy()
        if self.affine:
            return self._cap(self.c0_G, self.cR_G, n_G, R_G)
        return np.array([self.ledger.retain_capacity(int(a), int(b), int(c))
                         for a, b, c in zip(n_G, R_G, self.home)], dtype=np.int64)

    def over(self, n_G, R_G, k_G, rec_G=None) -> bool:
        """True if some rank's total exceeds the budget."""
        if self.budget is None:
            return False
        rec_G = np.zeros_like(k_G) if rec_G is None else rec_G
        if self.affine:
            tot = self._total(self.c0_G, self.cR_G, n_G, R_G, k_G, rec_G)
            return bool((tot > self.budget).any())
        return max(t["total"] for t in self.terms(n_G, R_G, k_G, rec_G)) > self.budget

    def terms(self, n_G, R_G, k_G, rec_G) -> list[dict[str, int]]:
        """The ledger's own terms of every rank (slow: for messages and fallbacks)."""
        return [self.ledger.terms(int(a), int(b), int(c), int(d), int(e))
                for a, b, c, d, e in zip(n_G, R_G, self.home, k_G, rec_G)]

    def raise_if_over(self, n_G, R_G, k_G, rec_G, what: str) -> None:
        """The ledger's own :meth:`raise_if_over` message, built only when over."""
        if self.over(n_G, R_G, k_G, rec_G):
            rec_G = np.zeros_like(k_G) if rec_G is None else rec_G
            self.ledger.raise_if_over(self.terms(n_G, R_G, k_G, rec_G), what)
