"""A vectorised view of the memory ledger for the fast planners: the ledger's affine
pieces (:meth:`lrmoe.ledger.Ledger.total_pieces`) once per distinct home-pair count,
padded to ``[G, P, 4]`` per branch (``rec = 0``, ``rec >= 1``), answered in numpy.

Legend: G ranks, P pieces; per rank ``n`` occupied slots, ``R`` received pairs, ``h``
home pairs, ``k`` retained pairs, ``rec`` recomputed pairs.
"""

from __future__ import annotations

import numpy as np

from lrmoe.ledger import plan_counts, recompute_bounds

_NEVER = -(1 << 60)  # a padding piece's constant: it never binds
_BIG = 1 << 62       # "no limit" for a capacity


class LedgerView:
    """``ledger`` (``None``: no budget) for ranks whose home pairs are ``home_G``; ``exact``:
    price exact plans; ``priced``: build the arrays without a budget too."""

    def __init__(self, ledger, home_G: np.ndarray, exact: bool = False,
                 priced: bool = False) -> None:
        self.ledger = ledger
        self.exact = bool(exact)
        self.home = np.asarray(home_G, dtype=np.int64)
        self.budget = None if ledger is None else ledger.budget_bytes
        if ledger is None or (self.budget is None and not priced):
            return
        # the arrays depend on the home pairs alone, which are the same every step of a
        # run (tokens x top-k): the ledger keeps the last ones (its memo holds every
        # field they derive from)
        key = ledger._memo_key("view", self.exact)
        hit = ledger._pieces_memo.get(key)
        home_bytes = self.home.tobytes()
        if hit is None or hit[0] != home_bytes:
            hit = (home_bytes, self._arrays(ledger), {})
            ledger._pieces_memo[key] = hit
        (self.cn, self.pieces, self._by_h, self._inv, self._c0, self._cR, self._ck,
         self._ckdiv, self._ckbig) = hit[1]
        self._extra = hit[2]  # derived arrays built on first use (:meth:`_bounds`)

    def _arrays(self, ledger) -> tuple:
        uniq, inv = np.unique(self.home, return_inverse=True)
        by_h = [[ledger.total_pieces(int(h), self.exact, b) for b in (False, True)]
                for h in uniq.tolist()]
        # [branch][G, P, 4]: rec = 0 and rec >= 1, padded with pieces that never bind
        pieces = []
        for b in (0, 1):
            width = max(v[b][1].shape[0] for v in by_h)
            per_h = np.zeros((len(uniq), width, 4), dtype=np.int64)
            per_h[:, :, 0] = _NEVER
            for i, v in enumerate(by_h):
                per_h[i, :v[b][1].shape[0]] = v[b][1]
            pieces.append(per_h[inv.reshape(-1)])
        P0 = pieces[0]
        ck = P0[:, :, 2]
        # pieces flat in k bound nothing: a huge quotient
        return (by_h[0][0][0], pieces, by_h, inv.reshape(-1), P0[:, :, 0], P0[:, :, 1], ck,
                np.maximum(ck, 1), np.where(ck > 0, 0, _BIG))

    def capacity_fn(self):
        """A fast ``(rank, n, R) -> retain_capacity`` on Python ints."""
        if self.budget is None:
            return lambda r, n, R: R
        # per rank, the rec = 0 pieces as Python tuples (B - c0, cR, ck)
        B, cn = self.budget, self.cn
        rows_h = [[(B - int(c), int(a), int(k)) for c, a, k, _ in v[0][1].tolist()]
                  for v in self._by_h]
        rows = [rows_h[i] for i in self._inv.tolist()]

        def cap(r, n, R):
            used = cn * n
            best = _BIG
            for lim, cR, ck in rows[r]:
                room = lim - used - cR * R
                if room < 0:
                    return -1
                if ck > 0:
                    q = room // ck
                    if q < best:
                        best = q
            return R if best == _BIG else best
        return cap

    def monotone(self) -> bool:
        """Whether every rank's ``rec = 0`` pieces are non-decreasing in ``R`` and ``k``."""
        if self.budget is None:
            return True
        hit = self._extra.get("monotone")
        if hit is None:
            self._extra["monotone"] = hit = bool((self.pieces[0][:, :, 1:3] >= 0).all())
        return hit

    def capacity(self, n_G, R_G) -> np.ndarray:
        """:meth:`Ledger.retain_capacity` of every rank, int64 ``[G]`` (under a budget)."""
        R_G = np.asarray(R_G, dtype=np.int64)
        n_G = np.asarray(n_G, dtype=np.int64)
        room = (self.budget - self.cn * n_G)[:, None] - self._c0 - self._cR * R_G[:, None]
        q = (room // self._ckdiv + self._ckbig).min(1)
        return np.where(room.min(1) < 0, -1, np.where(q >= _BIG, R_G, q))

    def fits(self, n_G, R_G, k_G) -> np.ndarray:
        """Whether each rank can retain ``k_G`` pairs with nothing recomputed, bool ``[..., G]``."""
        R_G, k_G = np.asarray(R_G, dtype=np.int64), np.asarray(k_G, dtype=np.int64)
        if self.budget is None:
            return np.ones(R_G.shape, dtype=bool)
        top = (self._c0 + self._cR * R_G[..., None] + self._ck * k_G[..., None]).max(-1)
        return top + self.cn * np.asarray(n_G, dtype=np.int64) <= self.budget

    def received_bound(self, n_G, fn: int, fd: int) -> np.ndarray | None:
        """An upper bound, int64 ``[G]``, on the pairs each rank can receive with ``n_G`` instances
        while it retains at least ``fn/fd`` of them (``None``: the arithmetic could overflow);
        under a budget."""
        c0 = self._extra.get("c0")
        if c0 is None:  # padding pieces: a constant that keeps L small and positive
            self._extra["c0"] = c0 = np.where(self._c0 == _NEVER, -(1 << 40), self._c0)
        fn = min(fn, fd)
        L = (self.budget - self.cn * np.asarray(n_G, dtype=np.int64))[:, None] - c0
        if fd * int(np.abs(L).max()) >= 1 << 62:
            return None
        den = self._cR * fd + self._ck * fn  # (cR + ck·fn/fd)·R <= L, times fd
        return np.where(den > 0, L * fd // np.maximum(den, 1),
                        np.where(L >= 0, _BIG, -1)).min(1)

    def totals(self, n_G, R_G, k_G, rec_G=None) -> np.ndarray:
        """:meth:`Ledger.terms`' total of every rank, int64 ``[G]``."""
        n_G, R_G, k_G = (np.asarray(x, dtype=np.int64) for x in (n_G, R_G, k_G))
        # the rec = 0 branch alone (what every rank without recomputed rows takes)
        t = (self._c0 + self._cR * R_G[:, None] + self._ck * k_G[:, None]).max(1)
        if rec_G is not None and (rec := np.asarray(rec_G, dtype=np.int64)).any():
            x = np.stack([np.ones_like(R_G), R_G, k_G, rec], 1)[:, :, None]  # [G, 4, 1]
            t = np.where(rec > 0, (self.pieces[1] @ x)[:, :, 0].max(1), t)
        return self.cn * n_G + t

    def over(self, n_G, R_G, k_G, rec_G=None) -> bool:
        """True if some rank's total exceeds the budget."""
        if self.budget is None:
            return False
        return bool((self.totals(n_G, R_G, k_G, rec_G) > self.budget).any())

    def exact_fit(self, n_G, R_G, k_G) -> tuple[str, np.ndarray, np.ndarray]:
        """:meth:`Ledger.exact_fit` of an exact plan, every rank at once (under a budget)."""
        n_G, R_G, k_G = (np.asarray(x, dtype=np.int64) for x in (n_G, R_G, k_G))
        rec = np.zeros_like(k_G)
        short = self.totals(n_G, R_G, k_G) > self.budget
        if short.any():
            P = self.pieces[1][short]
            a = ((self.cn * n_G[short])[:, None] + P[:, :, 0] + P[:, :, 1] * R_G[short, None]
                 + P[:, :, 2] * k_G[short, None])
            ok, lo = recompute_bounds(self.budget, a, P[:, :, 3], k_G[short])
            rec[short] = np.where(ok, lo, -1)
        if rec.min() >= 0:
            return ("fits" if rec.max() == 0 else "pairs"), rec, self.totals(n_G, R_G, k_G, rec)
        totals = np.array([self.ledger.layer_terms(int(n), int(R), int(h))["total"]
                           for n, R, h in zip(n_G, R_G, self.home)], dtype=np.int64)
        return ("layer" if totals.max() <= self.budget else "over"), R_G.copy(), totals

    def _bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Necessary upper bounds on a rank's retained count with recompute, ``floor((room @ M + b)
        / den)`` where ``den > 0`` (``room``: the ``rec >= 1`` pieces' room at ``k = rec = 0``).
        Each piece ``A0 + c·k + d·rec <= B`` bounds ``k``: ``c·k <= room`` (``d = 0``), ``c·k <=
        room - d`` (``d > 0``, as ``rec >= 1``), ``(c + d)·k <= room`` (``d < 0``, as ``rec <=
        k``), and a falling ``p`` with a rising ``q`` leave an integer ``rec`` only if ``(d_q·c_p
        - d_p·c_q)·k <= -d_p·room_q + d_q·room_p``. Cached with the arrays."""
        hit = self._extra.get("bounds")
        if hit is not None:
            return hit
        P = self.pieces[1]
        c, d = P[:, :, 2], P[:, :, 3]
        G, n = c.shape
        eye = np.broadcast_to(np.eye(n, dtype=np.int64), (G, n, n))
        negd, posd = np.where(d < 0, -d, 0), np.where(d > 0, d, 0)
        pair = (d < 0)[:, :, None] & (d > 0)[:, None, :]  # [G, p, q]
        on_q = np.einsum("xq,gpq->gxpq", eye[0], negd[:, :, None] * pair)
        on_p = np.einsum("xp,gpq->gxpq", eye[0], posd[:, None, :] * pair)
        M = np.concatenate([eye, eye, eye, (on_q + on_p).reshape(G, n, n * n)], 2)
        zero = np.zeros_like(d)
        b = np.concatenate([zero, -d, zero, np.zeros((G, n * n), dtype=np.int64)], 1)
        den = np.concatenate([np.where(d == 0, c, 0), np.where(d > 0, c, 0),
                              np.where(d < 0, c + d, 0),
                              np.where(pair, posd[:, None, :] * c[:, :, None]
                                       + negd[:, :, None] * c[:, None, :], 0).reshape(G, -1)], 1)
        self._extra["bounds"] = hit = (M, b, den)
        return hit

    def capacity_recompute(self, n_G, R_G, ranks, window: int = 4, cap=None
                           ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`Ledger.retain_capacity_recompute` of ``ranks``: the ``window`` counts below
        the tightest of :meth:`_bounds` tested exactly, the ledger asked below them; ``cap``:
        ``ranks``' :meth:`capacity`, where the caller has it."""
        ranks = np.asarray(ranks, dtype=np.int64)
        n, R = (np.asarray(x, dtype=np.int64)[ranks] for x in (n_G, R_G))
        k0 = self.capacity(n_G, R_G)[ranks] if cap is None else cap
        out_k, out_rec = np.where(k0 < 0, -1, np.minimum(k0, R)), np.zeros_like(R)
        todo = (k0 >= 0) & (k0 < R)
        if not todo.any():
            return out_k, out_rec
        i = np.flatnonzero(todo)
        P = self.pieces[1][ranks[i]]
        A0 = (self.cn * n[i])[:, None] + P[:, :, 0] + P[:, :, 1] * R[i, None]  # [m, P]
        c, d = P[:, :, 2], P[:, :, 3]
        M, b, den = (x[ranks[i]] for x in self._bounds())
        num = np.einsum("mp,mpk->mk", self.budget - A0, M) + b
        up = np.where(den > 0, num // np.maximum(den, 1), _BIG).min(1)
        top = np.minimum(up, R[i])
        ks = top[:, None] - np.arange(window)[None, :]  # [m, w]
        a = A0[:, None, :] + c[:, None, :] * ks[:, :, None]
        ok, lo = recompute_bounds(self.budget, a, np.broadcast_to(d[:, None, :], a.shape), ks)
        ok &= ks > k0[i, None]
        has = ok.any(1)
        j = np.argmax(ok, 1)  # the first (largest k) feasible
        rows = np.arange(len(i))
        out_k[i] = np.where(has, ks[rows, j], k0[i])
        out_rec[i] = np.where(has, lo[rows, j], 0)
        for m in np.flatnonzero(~has & (ks[:, -1] > k0[i] + 1)).tolist():  # below the window
            r = int(ranks[i[m]])
            out_k[i[m]], out_rec[i[m]] = self.ledger.retain_capacity_recompute(
                int(n[i[m]]), int(R[i[m]]), int(self.home[r]), self.exact)
        return out_k, out_rec

    def raise_if_over(self, n_G, R_G, k_G, rec_G, what: str) -> None:
        """The ledger's own :meth:`raise_if_over` message, on its own terms (slow), built
        only when over."""
        if self.over(n_G, R_G, k_G, rec_G):
            rec_G = np.zeros_like(k_G) if rec_G is None else rec_G
            terms = [self.ledger.terms(int(a), int(b), int(c), int(d), int(e), exact=self.exact)
                     for a, b, c, d, e in zip(n_G, R_G, self.home, k_G, rec_G)]
            self.ledger.raise_if_over(terms, what)


def _plan_view(ledger, plan, priced=False) -> tuple[LedgerView, np.ndarray, np.ndarray, np.ndarray]:
    """The view for ``plan``'s home pairs and its per-rank ``(instances, received, retained)``."""
    n, R, home, k = plan_counts(plan)
    return LedgerView(ledger, home, exact=plan.exact, priced=priced), n, R, k


def plan_exact_fit(ledger, plan) -> tuple[str, np.ndarray, np.ndarray]:
    """:meth:`Ledger.exact_fit` of ``plan``, vectorised."""
    view, n, R, k = _plan_view(ledger, plan)
    return view.exact_fit(n, R, k)


def plan_raise_if_over(ledger, plan) -> None:
    """The ledger's own error where the exact ``plan`` (static's, capacity's) exceeds the budget."""
    if ledger is not None and ledger.budget_bytes is not None:
        view, n, R, k = _plan_view(ledger, plan)
        view.raise_if_over(n, R, k, None, "the plan")


def plan_totals(ledger, plan) -> np.ndarray:
    """Each rank's total of :meth:`Ledger.rank_terms` for ``plan``, vectorised."""
    if plan.layer_checkpoint:  # the whole-layer checkpoint's own terms (Ledger.layer_terms)
        return np.array([t["total"] for t in ledger.rank_terms(plan)], dtype=np.int64)
    view, n, R, k = _plan_view(ledger, plan, priced=True)  # the totals need no budget
    rec = None if plan.recompute_G is None else plan.recompute_G.numpy()
    return view.totals(n, R, k, rec)
