"""Summarize `lrmoe bench ttl` runs (ttl.json) as markdown, re-applying the link model.

    python benchmarks/summarize_ttl.py benchmarks/results/ttl_gpu_qwen3_v1 [...]

Per policy: steps and emulated time to the target, final validation loss, mean emulated
step and MoE time, routing skew, keep / recompute ratios, budget status; then the same
emulated times with the exchanges re-priced for InfiniBand from the per-step critical
bytes the run recorded (``exchange_critical_bytes``). Everything here is EMULATED.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lrmoe.commands.bench import fmt
from lrmoe.memory import fmt_bytes
from lrmoe.sim.links import get_link
from lrmoe.sim.ttl import time_to_target


def repriced(step: dict, old, new, G: int) -> float:
    """``step_emulated_s`` with every exchange re-priced from ``old`` to ``new`` link."""
    t = step["step_emulated_s"]
    for crit, n in step["exchange_critical_bytes"].values():
        if n:
            t += (crit / new.effective_Bps + n * new.latency_s * (G - 1)
                  - crit / old.effective_Bps - n * old.latency_s * (G - 1))
    return t


def summarize(run: Path) -> str:
    rep = json.loads((run / "ttl.json").read_text())
    G, tg = rep["config"]["ep"], rep["target"]
    nv, ib = get_link("nvlink"), get_link(rep["link"]["name"] == "ib" and "nvlink" or "ib")
    out = [f"### {run.name}", "",
           f"target val {tg['val_loss']:.4f} (static at step {tg['static_step']}); budget "
           f"{fmt_bytes(rep['budget_bytes'])} per rank; {rep['config']['steps']} steps; "
           f"EP {G} virtual ranks", "",
           "| policy | status | steps→target | time→target NVLink (s) | time→target IB (s) | "
           "final val | mean step NVLink (ms) | mean MoE NVLink (ms) | mean step IB (ms) | "
           "expert max/mean | rank max/mean (fwd) | keep | recompute |",
           "|" + "---|" * 13]
    tt = {}
    for name, r in rep["policies"].items():
        st = r["steps"]
        n = max(len(st), 1)
        t_nv = [s["step_emulated_s"] for s in st]
        t_ib = [repriced(s, nv, ib, G) for s in st]
        s_nv, _ = time_to_target(r, tg["val_loss"], tg["rtol"])
        tt_nv, tt_ib = (None, None) if s_nv is None else (sum(t_nv[:s_nv]), sum(t_ib[:s_nv]))
        tt[name] = (tt_nv, tt_ib)
        out.append("| " + " | ".join([
            name, r["budget_status"][:60], fmt(s_nv, "d"), fmt(tt_nv, ".3f"), fmt(tt_ib, ".3f"),
            f"{r['final_val_loss']:.4f}", f"{sum(t_nv) / n * 1e3:.2f}",
            f"{sum(s['moe_emulated_s'] for s in st) / n * 1e3:.2f}",
            f"{sum(t_ib) / n * 1e3:.2f}",
            f"{sum(s['expert_load_max_over_mean'] for s in st) / n:.2f}",
            f"{sum(s['fwd_load_max_over_mean'] for s in st) / n:.3f}",
            f"{sum(s['keep_ratio'] for s in st) / n:.3f}",
            f"{sum(s.get('recompute_ratio', 0) for s in st) / n:.3f}"]) + " |")
    if "lrmoe" in tt and "symi" in tt:
        for i, link in enumerate(("NVLink", "IB")):
            a, b = tt["lrmoe"][i], tt["symi"][i]
            out.append(f"\nlrmoe/symi time to target ({link}): "
                       + ("n/a (a policy never reached it)" if None in (a, b) else f"{a / b:.3f}"))
        lr, sy = rep["policies"]["lrmoe"], rep["policies"]["symi"]
        common = {e["step"]: e["val_loss"] for e in sy["evals"]}
        gaps = [(e["step"], e["val_loss"] / common[e["step"]] - 1) for e in lr["evals"]
                if e["step"] in common and e["step"] > 0]
        if gaps:
            s_, g_ = gaps[-1]
            out.append(f"lrmoe val vs symi at step {s_}: {g_ * 100:+.2f}%")
    return "\n".join(out)


if __name__ == "__main__":
    print("\n\n".join(summarize(Path(p)) for p in sys.argv[1:]))
