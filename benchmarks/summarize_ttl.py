"""One ``lrmoe bench ttl`` run (``ttl.json``) as markdown, with the exchanges re-priced
for another link. Everything here is EMULATED.

    python benchmarks/summarize_ttl.py RUN_DIR [RUN_DIR ...] [--sensitivity]

Per policy: steps and emulated time to the target, final validation loss, mean emulated
step and MoE time, routing skew, keep / recompute ratios, budget status; the same
emulated times with every exchange re-priced for InfiniBand from the per-step critical
bytes the run recorded (``exchange_critical_bytes``). Steps and time to the target are
read as ``bench ttl`` reads them (:mod:`lrmoe.sim.target`: static's smoothed validation
curve at ``ceil(fraction · steps)``, a policy's own smoothed curve's first crossing,
linear between evaluations), so they equal the run's ``ttl.md`` and
``summarize_seeds.py``.

``--sensitivity``: each lrmoe variant's ratio over symi for other target fractions of
the same run (post hoc: the run's rule fixes one fraction).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from summarize_seeds import load_report  # noqa: E402

from lrmoe.commands.bench import fmt  # noqa: E402
from lrmoe.ledger import fmt_bytes  # noqa: E402
from lrmoe.sim.links import Link, get_link  # noqa: E402
from lrmoe.sim.target import crossing, target_at  # noqa: E402


def repriced(step: dict, old, new, G: int) -> float:
    """``step_emulated_s`` with every exchange re-priced from ``old`` to ``new`` link."""
    t = step["step_emulated_s"]
    for crit, n in step["exchange_critical_bytes"].values():
        if n:
            t += (crit / new.effective_Bps + n * new.latency_s * (G - 1)
                  - crit / old.effective_Bps - n * old.latency_s * (G - 1))
    return t


def window(rep: dict) -> int:
    return rep["target"].get("smooth_window", 3)


def target(rep: dict, fraction: float | None = None) -> float:
    """Static's smoothed validation loss at ``ceil(fraction · steps)`` (the run's own
    fraction by default)."""
    f = rep["target"].get("fraction", 0.8) if fraction is None else fraction
    steps = len(rep["policies"]["static"]["steps"])
    return target_at(rep["policies"]["static"]["evals"], math.ceil(f * steps), window(rep))


def reach(rep: dict, name: str, tgt: float, step_s: list[float] | None = None
          ) -> tuple[float | None, float | None]:
    """``(steps, emulated s)`` where policy ``name``'s smoothed curve first reaches
    ``tgt``; with ``step_s`` (one time per step, e.g. re-priced) the time is read on
    those times instead of the recorded ones."""
    evals = rep["policies"][name]["evals"]
    if step_s is not None:
        evals = [dict(e, cum_emulated_s=sum(step_s[:e["step"]])) for e in evals]
    return crossing(evals, tgt, window(rep))


def _lrmoe_names(rep: dict) -> list[str]:
    return [n for n in rep["policies"] if n.split(":")[0] == "lrmoe"]


def summarize(run: Path) -> str:
    rep = load_report(run)
    G, tg = rep["config"]["ep"], target(rep)
    budget = "none" if rep["budget_bytes"] is None else fmt_bytes(rep["budget_bytes"])
    # re-priced from the link the run was priced with (its recorded figures: a run made
    # before the presets carried their all-to-all efficiencies was priced at peak)
    lk = rep["link"]
    nv = (Link(**{k: v for k, v in lk.items() if k != "inter"}) if "bandwidth_Bps" in lk
          else get_link(lk["name"]))
    ib = get_link(rep["link"]["name"] == "ib" and "nvlink" or "ib")
    out = [f"### {run.name}", "",
           f"target val {tg:.4f} (static's smoothed curve at step "
           f"{rep['target']['static_step']}); budget {budget} per rank; "
           f"{rep['config']['steps']} steps; EP {G} virtual ranks", "",
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
        s_nv, tt_nv = reach(rep, name, tg)
        _, tt_ib = reach(rep, name, tg, t_ib)
        if r.get("out_of_memory"):  # its run stopped: no time to target
            s_nv = tt_nv = tt_ib = None
        tt[name] = (tt_nv, tt_ib)
        out.append("| " + " | ".join([
            name, r["budget_status"][:60], fmt(s_nv, ".1f"), fmt(tt_nv, ".3f"), fmt(tt_ib, ".3f"),
            f"{r['final_val_loss']:.4f}", f"{sum(t_nv) / n * 1e3:.2f}",
            f"{sum(s['moe_emulated_s'] for s in st) / n * 1e3:.2f}",
            f"{sum(t_ib) / n * 1e3:.2f}",
            f"{sum(s['expert_load_max_over_mean'] for s in st) / n:.2f}",
            f"{sum(s['fwd_load_max_over_mean'] for s in st) / n:.3f}",
            f"{sum(s['keep_ratio'] for s in st) / n:.3f}",
            f"{sum(s.get('recompute_ratio', 0) for s in st) / n:.3f}"]) + " |")
    if "symi" in tt:
        oom = {n for n, r in rep["policies"].items() if r.get("out_of_memory")}
        for lr in _lrmoe_names(rep):
            for i, link in enumerate(("NVLink", "IB")):
                a, b = tt[lr][i], tt["symi"][i]
                out.append(f"\n{lr} / symi time to target ({link}): "
                           + ("OOM (a policy ran out of memory)" if oom & {lr, "symi"}
                              else "n/a (a policy never reached it)" if None in (a, b)
                              else f"{a / b:.3f}"))
    return "\n".join(out)


def _cell(reached) -> str:
    return "never" if reached[0] is None else f"{reached[0]:.1f} / {reached[1]:.2f}"


def sensitivity(run: Path, fractions=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)) -> str:
    """Each lrmoe variant's time to target over symi's for other target fractions."""
    rep = load_report(run)
    out = []
    for lr in _lrmoe_names(rep):
        out += [f"{lr}:", "", "| target fraction | target val | symi steps / time (s) | "
                f"{lr} steps / time (s) | ratio |", "|---|---|---|---|---|"]
        for f in fractions:
            t = target(rep, f)
            sy, me = reach(rep, "symi", t), reach(rep, lr, t)
            both = None not in (sy[1], me[1])
            out.append(f"| {f} | {t:.4f} | {_cell(sy)} | {_cell(me)} | "
                       f"{fmt(me[1] / sy[1] if both else None, '.3f', 'n/a')} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    for p in [a for a in sys.argv[1:] if not a.startswith("--")]:
        print(summarize(Path(p)))
        if "--sensitivity" in sys.argv:
            print("\ntime to target over symi's at other target fractions (post hoc):\n")
            print(sensitivity(Path(p)))
        print()
