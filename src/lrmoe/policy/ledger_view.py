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
few pairs, none, or negative). The probes are remembered per ledger object (while its
fields are unchanged; objects among them by identity) and per ``h``, so a run pays
them once, not per layer and step. If any check fails (a ledger that is no longer affine in
those counts) every query falls back to the ledger's own methods one rank at a time:
the same answers, only slower. ``tests/test_planner_fast.py`` checks the view against
:meth:`Ledger.rank_terms` on whole plans.
"""

from __future__ import annotations

import numpy as np

_MEMO: dict[int, dict] = {}  # id(ledger) -> its probed coefficients (see LedgerView)


def _fingerprint(ledger) -> tuple:
    """The ledger's fields (objects by identity): a changed field means probe again."""
    return (type(ledger),) + tuple(
        (k, v if isinstance(v, (int, float, str, type(None))) else id(v))
        for k, v in vars(ledger).items())


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
        # The probes cost a dozen ledger calls: remember them per ledger (the same
        # object with the same fields) and per home-pair count; a layer with more pairs
        # than were probed probes again.
        key = _fingerprint(ledger)
        memo = _MEMO.get(id(ledger))
        if memo is None or memo["key"] != key or memo["ledger"] is not ledger:
            if len(_MEMO) >= 32:
                _MEMO.clear()
            memo = _MEMO[id(ledger)] = {"key": key, "ledger": ledger, "h": {}, "slopes": None}
        if memo["slopes"] is None:
            memo["slopes"] = self._slopes(h_list[0])
        self.cn, self.ck, self.crec = memo["slopes"]
        top = max(int(max_pairs), 2)
        ok = self.ck > 0
        per_h = memo["h"]
        for h in set(h_list):
            if not ok:
                break
            if h not in per_h or per_h[h][2] < top:
                per_h[h] = self._probe(h, 2 * top)
            ok &= per_h[h][3]
        self.affine = bool(ok)
        if self.affine:
            self.c0_G = np.array([per_h[h][0] for h in h_list], dtype=np.int64)
            self.cR_G = np.array([per_h[h][1] for h in h_list], dtype=np.int64)
            self._c0, self._cR = self.c0_G.tolist(), self.cR_G.tolist()

    def _terms_total(self, n, R, h, k=0, rec=0) -> int:
        return self.ledger.terms(n, R, h, k, rec)["total"]

    def _slopes(self, h: int) -> tuple[int, int, int]:
        """Bytes per occupied slot, per retained pair, per recomputed pair (at ``h``)."""
        t = self._terms_total
        base = t(0, 0, h)
        return t(1, 0, h) - base, t(0, 0, h, 1) - base, t(0, 0, h, 1, 1) - t(0, 0, h, 1)

    def _probe(self, h: int, top: int) -> tuple[int, int, int, bool]:
        """``(c0, cR, top, ok)`` for home pairs ``h``: the ledger at ``R = 0, 1`` and
        whether the affine model holds at mixed probes up to ``top`` pairs and at
        :meth:`retain_capacity` where the room is a few pairs, none, or negative."""
        t = self._terms_total
        c0 = t(0, 0, h)
        cR = t(0, 1, h) - c0
        ok = True
        for n, R, k, rec in ((0, 2, 0, 0), (3, 1009, 500, 101), (7, top, top, top // 3)):
            ok &= t(n, R, h, k, rec) == self._total(c0, cR, n, R, k, rec)
        if ok and cR > 0:
            R0 = (self.budget - c0 - self.cn) // cR
            for R in (R0 - 1, R0, R0 + 1):
                if R >= 0:
                    ok &= self.ledger.retain_capacity(1, R, h) == self._cap(c0, cR, 1, R)
        return c0, cR, top, bool(ok)

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
