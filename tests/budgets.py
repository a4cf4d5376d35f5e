"""Memory budgets for the tests: one that binds without a run's routing (the tests of the
fallbacks) and the floor of any memory-aware plan on given counts."""

from __future__ import annotations

import numpy as np

from lrmoe.ledger import Ledger


def balanced_budget(mcfg, G: int, tokens_per_rank: int, fraction: float, dtype: str,
                    optimizer_offload: str = "device") -> int:
    """Bytes per rank of a perfectly balanced static rank (its E/G natives, ``T·k`` home
    and received pairs) that retains only ``fraction`` of its pairs (not a budget rule of
    ``bench ttl``)."""
    led = Ledger.for_dtype(mcfg, G, None, dtype, optimizer_offload=optimizer_offload)
    pairs = tokens_per_rank * mcfg.num_experts_per_tok
    t = led.terms(mcfg.num_experts // G, pairs, pairs, pairs, exact=True)
    return int(t["total"] - (1 - fraction) * t["retained_acts"])


def one_pair_each(led: Ledger, n_G, recv_G, home_G) -> np.ndarray:
    """Each rank's total, by the ledger's terms, with ``n`` instances retaining one pair
    each (all its received pairs when fewer)."""
    return np.array([led.terms(int(n), int(R), int(h), int(min(n, R)))["total"]
                     for n, R, h in zip(n_G, recv_G, home_G)])


def natives_floor(led: Ledger, counts_GE) -> int:
    """The busiest rank's total of the smallest memory-aware plan on ``counts_GE``: the
    natives, one retained pair each."""
    G, E = counts_GE.shape
    n = E // G
    c = counts_GE.long()
    recv, home = c.sum(0).reshape(G, n).sum(1).tolist(), c.sum(1).tolist()
    return int(one_pair_each(led, [n] * G, recv, home).max())
