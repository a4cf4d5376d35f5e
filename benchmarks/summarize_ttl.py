"""``lrmoe bench ttl`` runs as markdown, one run at a time or over seeds. EMULATED times.

    python3 benchmarks/summarize_ttl.py RUN [RUN ...]               # a table per run
    python3 benchmarks/summarize_ttl.py --seeds OUT/ttl/qwen3/s{0,1,2}  # over seeds
    python3 benchmarks/summarize_ttl.py --seeds OUT/ttl/qwen3/s{0,1,2} --plot ratios.png

A RUN folder holds ``ttl.json``, ``ttl.json.gz`` (as kept under ``benchmarks/results``)
or, for a run cut short, ``ttl_partial.json`` or its ``.gz`` (the policies that finished).
Targets and crossings are read as ``bench ttl`` reads them (:mod:`lrmoe.sim.target`:
static's validation curve smoothed over the run's window, read at ``ceil(fraction ·
steps)``; a policy's own smoothed curve's first crossing, linear between evaluations),
so both views equal the run's ``ttl.md``.

Per run: each policy's steps and emulated time to the target, final validation loss,
mean emulated step and MoE time, the non-MoE share of a micro-batch (its non-MoE time
over its non-MoE plus MoE time, the optimizer step left out, the first two steps too),
routing skew, keep / recompute ratios and budget status (another link's times:
``reprice_links.py``). ``--seeds``: each policy's ratio over symi per seed with their
mean, min–max and 95% confidence interval (Student t, n − 1 degrees of freedom), one
evaluation's noise at the target,
and the mean emulated ms per stage and policy over the seeds; ``--plot PNG`` draws the
per-seed ratios with their mean and interval. ``--one-off R``: a sensitivity view, each
policy's steps slower than R × its own median step charged at that median (one-off
costs such as a first compile of a new shape fall on whichever policy meets them first;
beside them the steps that compiled, where the run recorded it); MODELLED from the
recorded steps, and said so in the output.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpu_common import cli, read_json, reading  # noqa: E402

from lrmoe.commands.columns import fmt  # noqa: E402
from lrmoe.errors import LrmoeError  # noqa: E402
from lrmoe.sim.target import crossing, eval_noise, target_at  # noqa: E402
from lrmoe.units import fmt_bytes  # noqa: E402

RUN = "a bench ttl run's record (ttl.json, ttl.json.gz or ttl_partial.json[.gz])"


# Student t's 0.975 quantile by degrees of freedom (the two-sided 95% interval)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228}


def ci95(xs: list[float]) -> tuple[float, float] | None:
    """The mean's two-sided 95% interval, Student t with ``n − 1`` degrees of freedom
    (``None`` below 2 values or above the table)."""
    n = len(xs)
    if n < 2 or n - 1 not in T975:
        return None
    m, h = statistics.mean(xs), T975[n - 1] * statistics.stdev(xs) / math.sqrt(n)
    return m - h, m + h


def load_report(run: Path) -> dict:
    """The run folder's whole ``bench ttl`` record, from the first of ``ttl.json``,
    ``ttl.json.gz``, ``ttl_partial.json`` (or ``.gz``) there; none, or unreadable:
    :class:`LrmoeError`."""
    names = ("ttl.json", "ttl.json.gz", "ttl_partial.json", "ttl_partial.json.gz")
    for name in names:
        f = run / name
        if f.exists():
            return read_json(f)
    raise LrmoeError(f"{run}: holds none of {', '.join(names)}")


def one_offs_at_median(rep: dict, ratio: float) -> dict:
    """``rep`` with each policy's steps slower than ``ratio`` × its median step charged at
    that median: its evaluations' cumulative emulated times lowered by the excess of such
    steps up to them (``--one-off``). Returns a new report; ``rep`` is left as it was."""
    if not ratio > 1:
        raise LrmoeError(f"--one-off must be above 1 (a multiple of the median step), got {ratio}")
    out = {**rep, "policies": {}}
    for name, r in rep["policies"].items():
        times = [s["step_emulated_s"] for s in r["steps"]]
        med = statistics.median(times) if times else 0.0
        excess = {s["step"]: s["step_emulated_s"] - med for s in r["steps"]
                  if s["step_emulated_s"] > ratio * med}
        evals = [{**e, "cum_emulated_s": e["cum_emulated_s"]
                  - sum(x for k, x in excess.items() if k <= e["step"])} for e in r["evals"]]
        out["policies"][name] = {**r, "evals": evals, "one_off_steps": sorted(excess)}
    return out


def _compiled_steps(steps: list[dict]) -> str:
    """The steps that compiled something (the run's per-step ``compiles``), as text."""
    if any("compiles" not in st for st in steps):
        return "(not recorded)"
    return str([st["step"] for st in steps if st["compiles"]] or "none")


def window(rep: dict) -> int:
    return rep.get("target", {}).get("smooth_window", 3)


def target(rep: dict) -> float:
    """Static's smoothed validation loss at ``ceil(fraction · steps)``."""
    f = rep.get("target", {}).get("fraction", 0.8)
    steps = len(rep["policies"]["static"]["steps"])
    return target_at(rep["policies"]["static"]["evals"], math.ceil(f * steps), window(rep))


def reach(rep: dict, name: str, tgt: float) -> tuple[float | None, float | None]:
    """``(steps, emulated s)`` where policy ``name``'s smoothed curve first reaches ``tgt``."""
    return crossing(rep["policies"][name]["evals"], tgt, window(rep))


def non_moe_share(steps: list[dict], skip: int = 2) -> float | None:
    """Mean over micro-batches (after the first ``skip`` steps) of non-MoE / (non-MoE +
    MoE) emulated time: how much of a layer's work the MoE part is, optimizer aside."""
    mbs = [m for s in steps[skip:] for m in s.get("micro_batch_emulated_s", [])]
    shares = [m["non_moe_s"] / (m["non_moe_s"] + m["moe_emulated_s"]) for m in mbs]
    return statistics.mean(shares) if shares else None


def summarize(run: Path) -> str:
    rep = load_report(run)
    G, tg, pols = rep["config"]["ep"], target(rep), rep["policies"]
    budget = "none" if rep["budget_bytes"] is None else fmt_bytes(rep["budget_bytes"])
    link = rep["link"]["name"] if isinstance(rep.get("link"), dict) else rep.get("link")
    out = [f"### {run.name}", "",
           f"target val {tg:.4f} (static's smoothed curve at step "
           f"{rep['target']['static_step']}); budget {budget} per rank; "
           f"{rep['config']['steps']} steps; EP {G} virtual ranks; link {link}", "",
           "| policy | status | steps→target | time→target (s) | final val | mean step (ms) | "
           "mean MoE (ms) | non-MoE share | expert max/mean | rank max/mean (fwd) | keep | "
           "recompute |", "|" + "---|" * 12]
    tt = {}
    for name, r in pols.items():
        st = r["steps"]
        n = max(len(st), 1)
        s_nv, tt_nv = reach(rep, name, tg)
        if r.get("out_of_memory"):  # its run stopped: no time to target
            s_nv = tt_nv = None
        tt[name] = tt_nv
        means = [sum(s.get(k, 0) for s in st) / n for k in
                 ("moe_emulated_s", "expert_load_max_over_mean", "fwd_load_max_over_mean",
                  "keep_ratio", "recompute_ratio")]
        out.append("| " + " | ".join([
            name, r["budget_status"][:60], fmt(s_nv, ".1f"), fmt(tt_nv, ".3f"),
            f"{r['final_val_loss']:.4f}", f"{sum(s['step_emulated_s'] for s in st) / n * 1e3:.2f}",
            f"{means[0] * 1e3:.2f}", fmt(non_moe_share(st), ".3f", "n/a"), f"{means[1]:.2f}",
            f"{means[2]:.3f}", f"{means[3]:.3f}", f"{means[4]:.3f}"]) + " |")
    if "symi" in tt:
        oom = {n for n, r in pols.items() if r.get("out_of_memory")}
        for lr in [n for n in pols if n.split(":")[0] == "lrmoe"]:
            a, b = tt[lr], tt["symi"]
            out.append(f"\n{lr} / symi time to target: "
                       + ("OOM (a policy ran out of memory)" if oom & {lr, "symi"}
                          else "n/a (a policy never reached it)" if None in (a, b)
                          else f"{a / b:.3f}"))
    return "\n".join(out)


def seed_row(rep: dict) -> dict:
    """One seed: the target, the evaluation noise there, and each policy's crossing and
    ratio over symi's time (``"OOM"`` where it or symi ran out of memory)."""
    base, tg = rep["policies"]["static"], target(rep)
    at = math.ceil(rep.get("target", {}).get("fraction", 0.8) * len(base["steps"]))
    out = {"target": tg, "noise": eval_noise(base["evals"], at, window(rep)), "policies": {}}
    for name, r in rep["policies"].items():
        step, t = reach(rep, name, tg)
        out["policies"][name] = {"step": step, "time": t, "final": r["final_val_loss"],
                                 "steps": len(r["steps"]), "failed": r.get("failed"),
                                 "oom": r.get("out_of_memory")}
    symi = out["policies"].get("symi", {})
    for name, p in out["policies"].items():
        p["ratio"] = (p["time"] / symi["time"] if p["time"] and symi.get("time")
                      and not p["failed"] else None)
        if p["oom"] or (symi.get("oom") and name != "symi"):
            p["ratio"] = "OOM"
    return out


def _seed_cell(p: dict | None) -> str:
    if p is None:
        return "not run"
    if p["oom"]:
        return f"OOM at step {p['oom']['step']}"
    if p["ratio"] == "OOM":
        return f"OOM (symi ran out of memory; final {p['final']:.4f})"
    if p["failed"]:
        return f"stopped at step {p['steps'] + 1}"
    return f"{fmt(p['ratio'], '.3f', 'never')} ({p['final']:.4f})"


def seed_ratios(ps: list[dict | None]) -> list[float]:
    """The ratios over symi of the seeds where the policy reached the target (no
    out-of-memory verdict, not stopped)."""
    return [p["ratio"] for p in ps if p and not p["oom"] and not p["failed"]
            and p["ratio"] not in (None, "OOM")]


def loaded(runs: list[Path] | list[dict]) -> list[dict]:
    """The runs' reports: folders are read, reports already read are kept."""
    return [r if isinstance(r, dict) else load_report(r) for r in runs]


def plot_seeds(runs: list[Path] | list[dict], path: Path) -> dict:
    """Each policy's per-seed time-to-target ratio over symi (points), their mean and 95%
    interval (bar), to ``path`` (PNG); ``runs`` as folders or their loaded reports.
    Returns what it drew: ``{policy: (ratios, mean, (lo, hi) or None)}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reps = loaded(runs)
    rows = [seed_row(rep) for rep in reps]
    names = [n for n in dict.fromkeys(n for rep in reps for n in rep["policies"]) if n != "symi"]
    drawn = {}
    fig, ax = plt.subplots(figsize=(6.4, 1.2 + 0.7 * len(names)))
    for y, n in enumerate(names):
        rs = seed_ratios([row["policies"].get(n) for row in rows])
        ci = ci95(rs)
        mean = statistics.mean(rs) if rs else None
        drawn[n] = (rs, mean, ci)
        ax.scatter(rs, [y] * len(rs), color="0.6", zorder=2,
                   label="one seed" if y == 0 else None)
        if mean is not None:
            err = None if ci is None else [[mean - ci[0]], [ci[1] - mean]]
            ax.errorbar([mean], [y], xerr=err, fmt="o", color="C0", capsize=4, zorder=3,
                        label="mean, 95% interval (t)" if y == 0 else None)
    ax.axvline(1.0, color="k", lw=0.8, ls="--")
    ax.set_yticks(range(len(names)), [n.replace(":", ":\n") for n in names])
    ax.set_ylim(-0.7, len(names) - 0.3)
    ax.set_xlabel("emulated time to target / symi's (per seed, paired)")
    link = reps[0].get("link", {}).get("name", "?")
    rated = sum(1 for row in rows if seed_ratios(list(row["policies"].values())))
    some = "" if rated == len(reps) else f" ({rated} with a ratio over symi)"
    ax.set_title(f"{len(reps)} seeds{some}, link {link} (EMULATED)", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return drawn


def seeds(runs: list[Path], reps: list[dict] | None = None) -> str:
    """The table over seeds (``--seeds``); ``reps``: the runs' reports, if already read."""
    reps = loaded(reps if reps is not None else runs)
    pols = [rep["policies"] for rep in reps]
    rows = [seed_row(rep) for rep in reps]
    names = list(dict.fromkeys(n for p in pols for n in p))
    out = ["| policy | " + " | ".join(f"{r.name} ratio (final val)" for r in runs)
           + " | mean ratio | min–max | 95% CI (t) | seeds with a ratio |",
           "|" + "---|" * (len(runs) + 5)]
    for n in names:
        ps = [row["policies"].get(n) for row in rows]
        rs = seed_ratios(ps)
        ci = ci95(rs)
        out.append(f"| {n} | " + " | ".join(map(_seed_cell, ps))
                   + (f" | {statistics.mean(rs):.3f} | {min(rs):.3f}–{max(rs):.3f}" if rs
                      else " | n/a | n/a")
                   + (f" | {ci[0]:.3f}–{ci[1]:.3f}" if ci else " | n/a")
                   + f" | {len(rs)} of {len(rows)} |")
    out.append("")
    for r, row in zip(runs, rows):
        nz = row["noise"]
        out.append(f"- {r.name}: target {row['target']:.4f}; one evaluation's std error "
                   f"{nz['std_error']:.3f} vs smoothed change between neighbouring evaluations "
                   f"{nz['neighbour_change']:.4f} ({'below' if nz['ok'] else 'NOT below'} a "
                   "quarter); paired std error of the change from the previous evaluation "
                   f"(same batches) {nz['paired_std_error']:.4f} "
                   f"({'below' if nz['paired_ok'] else 'NOT below'} a quarter)")
    stages = list(next(iter(pols[0].values()))["steps"][0]["stages_emulated_s"])
    out += ["", "Mean emulated ms per step by stage over the seeds (all steps each policy ran):",
            "", "| policy | " + " | ".join(stages + ["non_moe", "total"]) + " |",
            "|" + "---|" * (len(stages) + 3)]
    for n in names:
        st = [s for p in pols if n in p for s in p[n]["steps"]]
        if st:  # none: out of memory at its first step
            vals = [statistics.mean(s["stages_emulated_s"][k] for s in st) for k in stages]
            vals += [statistics.mean(s[k] for s in st) for k in ("non_moe_s", "step_emulated_s")]
            out.append(f"| {n} | " + " | ".join(f"{v * 1e3:.2f}" for v in vals) + " |")
    return "\n".join(out)


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--seeds", action="store_true", help="one table over the runs (seeds)")
    ap.add_argument("--plot", type=Path, metavar="PNG",
                    help="with --seeds: also plot each policy's per-seed ratios over symi")
    ap.add_argument("--one-off", type=float, metavar="R",
                    help="with --seeds: charge each policy's steps slower than R x its median "
                         "step at that median (a MODELLED sensitivity view)")
    a = ap.parse_args(argv)
    if a.plot and not a.seeds:
        raise LrmoeError("--plot draws the seeds: give --seeds too")
    if a.one_off is not None and not a.seeds:
        raise LrmoeError("--one-off re-reads the seeds: give --seeds too")
    if not a.seeds:
        tables = []
        for r in a.runs:
            with reading(RUN, r):
                tables.append(summarize(r))
        print("\n\n".join(tables))
        return 0
    reps = loaded(a.runs)  # read once for the table and the plot
    with reading(RUN, *a.runs):
        if a.one_off is not None:
            reps = [one_offs_at_median(rep, a.one_off) for rep in reps]
            print(f"MODELLED: each policy's steps slower than {a.one_off:g} x its median step "
                  "charged at that median (steps so charged, per seed and policy, below)\n")
        print(seeds(a.runs, reps))
        if a.one_off is not None:
            print("\n" + "\n".join(f"- {r.name} {n}: steps {p['one_off_steps'] or 'none'}; "
                                    f"compiled at {_compiled_steps(p['steps'])}"
                                    for r, rep in zip(a.runs, reps)
                                    for n, p in rep["policies"].items()))
        if a.plot:
            plot_seeds(reps, a.plot)
    return 0


main = cli(run)  # exit 2 after one line on bad input

if __name__ == "__main__":
    raise SystemExit(main())
