"""A memory budget that binds without a run's routing, for the tests of the fallbacks
(tests only)."""

from __future__ import annotations

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
