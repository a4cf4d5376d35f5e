"""The divergence guard: stop a run whose loss blew up but stayed finite (NaN and inf are
caught where the loss is computed). The rule, and why its state is checkpointed:
docs/design.md §7.
"""

from __future__ import annotations

from lrmoe.train.config import DIVERGENCE_WARMUP

BETA = 0.8


class DivergenceGuard:
    def __init__(self, factor: float, state: dict | None = None):
        self.factor = factor
        s = state or {}
        self.ema: float | None = s.get("ema")
        self.low: float | None = s.get("min")
        self.seen: int = int(s.get("seen", 0))

    def state(self) -> dict:
        return {"ema": self.ema, "min": self.low, "seen": self.seen}

    def check(self, loss: float) -> str | None:
        """Fold in one step's loss; a sentence describing the blow-up, or None."""
        self.ema = loss if self.ema is None else BETA * self.ema + (1 - BETA) * loss
        self.seen += 1
        checked = self.factor > 0 and self.seen > DIVERGENCE_WARMUP
        if checked and self.low is not None and self.low > 0 and self.ema > self.factor * self.low:
            return (f"the smoothed training loss {self.ema:.4g} is {self.ema / self.low:.3g}x "
                    f"its running minimum {self.low:.4g} (--divergence-factor "
                    f"{self.factor:g})")
        self.low = self.ema if self.low is None else min(self.low, self.ema)
        return None
