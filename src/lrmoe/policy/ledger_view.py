"""A vectorised view of the memory ledger for the fast planners.

Legend: G ranks, P pieces; per rank ``n`` occupied slots, ``R`` received pairs, ``h``
home pairs, ``k`` retained pairs, ``rec`` recomputed pairs (ints, or int64 arrays
``[G]``).

The planners ask the ledger for bytes on every candidate move, and
:meth:`lrmoe.memory.Ledger.terms` builds a dict per call: too slow on the critical
path. This view re-derives no formula. For a fixed ``h`` (a rank's home pairs, fixed
for a whole plan: the counts' row sums) the ledger's total is ``per_slot·n`` plus the
largest of a few affine pieces in ``(R, k, rec)`` (:meth:`Ledger.total_pieces`: the
code-derived transients are the largest of the row tensors alive at each point of the
layer's forward and backward). The view asks the ledger for those pieces once per
distinct ``h`` (the ledger memoises them), pads them to one ``[G, P]`` array per branch
(``rec = 0`` and ``rec >= 1``), and answers every query with numpy, or with a short
Python loop per rank in the placement's inner loop. ``tests/test_planner_fast.py``
checks the view against :meth:`Ledger.rank_terms` on whole plans and
``tests/test_ledger_planned.py`` against :meth:`Ledger.terms` and
:meth:`Ledger.retain_capacity`.
"""

from __future__ import annotations

import numpy as np

_NEVER = -(1 << 60)  # a padding piece's constant: it never binds
_BIG = 1 << 62       # "no limit" for a capacity


class LedgerView:
    """``ledger`` (or ``None``: no budget) for ranks whose home pairs are ``home_G``.

    Args:
        ledger: a :class:`lrmoe.memory.Ledger` or ``None``.
        home_G: home pairs per rank (the count matrix's row sums).
        exact: the plans priced are exact (static, SYMI): every received row in
            backward, none gathered; otherwise the ledger's bound for trimmed plans.
    """

    def __init__(self, ledger, home_G: np.ndarray, exact: bool = False) -> None:
        self.ledger = ledger
        self.exact = bool(exact)
        self.home = np.asarray(home_G, dtype=np.int64)
        self.budget = None if ledger is None else ledger.budget_bytes
        if self.budget is None:
            return
        uniq, inv = np.unique(self.home, return_inverse=True)
        by_h = [[ledger.total_pieces(int(h), self.exact, b) for b in (False, True)]
                for h in uniq.tolist()]
        self.cn = by_h[0][0][0]
        # [branch][G, P, 4]: rec = 0 and rec >= 1, padded with pieces that never bind
        self.pieces = []
        for b in (0, 1):
            width = max(v[b][1].shape[0] for v in by_h)
            per_h = np.zeros((len(uniq), width, 4), dtype=np.int64)
            per_h[:, :, 0] = _NEVER
            for i, v in enumerate(by_h):
                per_h[i, :v[b][1].shape[0]] = v[b][1]
            self.pieces.append(per_h[inv.reshape(-1)])
        # per rank, the rec = 0 pieces as Python tuples (c0, cR, ck) for capacity_fn
        rows_h = [[(int(c), int(a), int(k)) for c, a, k, _ in v[0][1].tolist()] for v in by_h]
        self._rows = [rows_h[i] for i in inv.reshape(-1).tolist()]
        P0 = self.pieces[0]
        self._c0, self._cR = P0[:, :, 0], P0[:, :, 1]
        self._ck = ck = P0[:, :, 2]
        self._ckdiv = np.maximum(ck, 1)  # pieces flat in k bound nothing: a huge quotient
        self._ckbig = np.where(ck > 0, 0, _BIG)

    # ------------------------------------------------------------ queries
    def capacity_fn(self):
        """A fast ``(rank, n, R) -> retain_capacity`` on Python ints."""
        if self.budget is None:
            return lambda r, n, R: R
        B, cn, rows = self.budget, self.cn, self._rows

        def cap(r, n, R):
            base = B - cn * n
            best = _BIG
            for c0, cR, ck in rows[r]:
                room = base - c0 - cR * R
                if room < 0:
                    return -1
                if ck > 0:
                    q = room // ck
                    if q < best:
                        best = q
            return R if best == _BIG else best
        return cap

    def capacity(self, n_G, R_G) -> np.ndarray:
        """:meth:`Ledger.retain_capacity` of every rank, int64 ``[G]``."""
        R_G = np.asarray(R_G, dtype=np.int64)
        if self.budget is None:
            return R_G.copy()
        n_G = np.asarray(n_G, dtype=np.int64)
        room = (self.budget - self.cn * n_G)[:, None] - self._c0 - self._cR * R_G[:, None]
        q = (room // self._ckdiv + self._ckbig).min(1)
        return np.where(room.min(1) < 0, -1, np.where(q >= _BIG, R_G, q))

    def fits(self, n_G, R_G, k_G) -> np.ndarray:
        """Whether each rank can retain ``k_G`` pairs with nothing recomputed, bool
        ``[G]``: ``capacity(n, R) >= k`` (every piece is non-decreasing in ``k``), without
        the divisions."""
        if self.budget is None:
            return np.ones(len(self.home), dtype=bool)
        R_G, k_G = np.asarray(R_G, dtype=np.int64), np.asarray(k_G, dtype=np.int64)
        top = (self._c0 + self._cR * R_G[:, None] + self._ck * k_G[:, None]).max(1)
        return top + self.cn * np.asarray(n_G, dtype=np.int64) <= self.budget

    def totals(self, n_G, R_G, k_G, rec_G=None) -> np.ndarray:
        """:meth:`Ledger.terms`' total of every rank, int64 ``[G]``."""
        n_G, R_G, k_G = (np.asarray(x, dtype=np.int64) for x in (n_G, R_G, k_G))
        rec_G = np.zeros_like(k_G) if rec_G is None else np.asarray(rec_G, dtype=np.int64)
        x = np.stack([np.ones_like(R_G), R_G, k_G, rec_G], 1)[:, :, None]  # [G, 4, 1]
        t0 = (self.pieces[0] @ x)[:, :, 0].max(1)
        t1 = (self.pieces[1] @ x)[:, :, 0].max(1)
        return self.cn * n_G + np.where(rec_G > 0, t1, t0)

    def over(self, n_G, R_G, k_G, rec_G=None) -> bool:
        """True if some rank's total exceeds the budget."""
        if self.budget is None:
            return False
        return bool((self.totals(n_G, R_G, k_G, rec_G) > self.budget).any())

    def terms(self, n_G, R_G, k_G, rec_G) -> list[dict[str, int]]:
        """The ledger's own terms of every rank (slow: for messages)."""
        return [self.ledger.terms(int(a), int(b), int(c), int(d), int(e), exact=self.exact)
                for a, b, c, d, e in zip(n_G, R_G, self.home, k_G, rec_G)]

    def raise_if_over(self, n_G, R_G, k_G, rec_G, what: str) -> None:
        """The ledger's own :meth:`raise_if_over` message, built only when over."""
        if self.over(n_G, R_G, k_G, rec_G):
            rec_G = np.zeros_like(k_G) if rec_G is None else rec_G
            self.ledger.raise_if_over(self.terms(n_G, R_G, k_G, rec_G), what)
