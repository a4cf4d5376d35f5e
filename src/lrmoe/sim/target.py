"""Targets and crossing times read from smoothed validation curves (docs/design.md §9).

A curve is a list of evaluations ``{"step", "val_loss", "cum_emulated_s"}`` (plus
``"val_batch_losses"`` when recorded).
"""

from __future__ import annotations

import math
import statistics


def smooth(vals: list[float], window: int = 3) -> list[float]:
    """Centred moving average of width ``window`` (odd), shrinking at the ends."""
    if window < 1 or window % 2 == 0:
        raise ValueError(f"smoothing window must be an odd number >= 1, got {window}")
    h = window // 2
    out = []
    for i in range(len(vals)):
        w = min(h, i, len(vals) - 1 - i)
        seg = vals[i - w:i + w + 1]
        out.append(sum(seg) / len(seg))
    return out


def _evals(evals: list[dict]) -> list[dict]:
    return [e for e in evals if e["step"] > 0]


def target_at(evals: list[dict], step: float, window: int = 3) -> float:
    """The smoothed loss of ``evals`` at ``step`` (linear between evaluations)."""
    ev = _evals(evals)
    if not ev:
        raise ValueError("no evaluations after step 0")
    s = smooth([e["val_loss"] for e in ev], window)
    xs = [e["step"] for e in ev]
    if step <= xs[0]:
        return s[0]
    for i in range(1, len(xs)):
        if step <= xs[i]:
            f = (step - xs[i - 1]) / (xs[i] - xs[i - 1])
            return s[i - 1] + f * (s[i] - s[i - 1])
    return s[-1]


def crossing(evals: list[dict], target: float, window: int = 3
             ) -> tuple[float | None, float | None]:
    """``(step, emulated seconds)`` where the smoothed curve first reaches ``target``."""
    ev = _evals(evals)
    s = smooth([e["val_loss"] for e in ev], window)
    for i, v in enumerate(s):
        if v <= target:
            if i == 0:
                return float(ev[0]["step"]), ev[0]["cum_emulated_s"]
            f = (s[i - 1] - target) / (s[i - 1] - v)
            a, b = ev[i - 1], ev[i]
            return (a["step"] + f * (b["step"] - a["step"]),
                    a["cum_emulated_s"] + f * (b["cum_emulated_s"] - a["cum_emulated_s"]))
    return None, None


def eval_noise(evals: list[dict], step: float, window: int = 3) -> dict:
    """One evaluation's standard error against the smoothed change between
    neighbouring evaluations around ``step``; ``ok`` when SE < change / 4. Beside it the
    paired SE of the change (neighbours share their batches, so most SE moves no crossing)."""
    ev = _evals(evals)
    i = min(range(len(ev)), key=lambda j: abs(ev[j]["step"] - step))
    b = ev[i].get("val_batch_losses") or []
    se = statistics.stdev(b) / math.sqrt(len(b)) if len(b) >= 2 else float("nan")
    s = smooth([e["val_loss"] for e in ev], window)
    lo, hi = max(i - 1, 0), min(i + 1, len(ev) - 1)
    change = abs(s[lo] - s[hi]) / max(hi - lo, 1)
    prev = ev[max(i - 1, 0)].get("val_batch_losses") or []
    if i > 0 and len(prev) == len(b) >= 2:
        d = [x - y for x, y in zip(b, prev)]
        paired = statistics.stdev(d) / math.sqrt(len(d))
    else:
        paired = float("nan")
    return {"step": ev[i]["step"], "batches": len(b), "std_error": se,
            "neighbour_change": change, "ok": bool(se < change / 4),
            "paired_std_error": paired, "paired_ok": bool(paired < change / 4)}

