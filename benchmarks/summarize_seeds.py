"""Time-to-target statistics over seeds from ``lrmoe bench ttl`` outputs (EMULATED times).

Each argument is one seed's run folder holding ``ttl.json`` (or ``ttl.json.gz``) or, for
a run cut short, ``ttl_partial.json`` (the policies that finished). The target and the
crossings are recomputed with the registered rule (:mod:`lrmoe.sim.target`: static's val curve
smoothed over ``--window`` evaluations, read at ``ceil(fraction · steps)``; a policy
reaches it where its own smoothed curve does), so a partial run is read the same way as
a finished one. Prints markdown: per-seed ratios over symi, their mean and min–max per
policy, and the mean emulated ms per stage and policy over the seeds; writes a plot of
the per-seed ratios and each seed's validation curves with ``--plot``.

    python3 benchmarks/summarize_seeds.py benchmarks/results/ttl_qwen3_2gib/s{0,1,2}
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lrmoe.sim.target import crossing, eval_noise, target_at  # noqa: E402


def load_report(run: Path) -> dict:
    """The run folder's whole ``bench ttl`` record: ``ttl.json``, ``ttl.json.gz`` (as
    kept under ``benchmarks/results``) or ``ttl_partial.json``."""
    for name in ("ttl.json", "ttl.json.gz", "ttl_partial.json"):
        f = run / name
        if f.exists():
            raw = gzip.decompress(f.read_bytes()) if name.endswith(".gz") else f.read_bytes()
            return json.loads(raw)
    raise SystemExit(f"summarize_seeds: {run} holds none of ttl.json, ttl.json.gz, "
                     "ttl_partial.json")


def load(run: Path) -> dict:
    return load_report(run)["policies"]


def seed_row(pol: dict, fraction: float, window: int) -> dict:
    base = pol["static"]
    at = math.ceil(fraction * len(base["steps"]))
    target = target_at(base["evals"], at, window)
    out = {"target": target, "noise": eval_noise(base["evals"], at, window), "policies": {}}
    for name, r in pol.items():
        step, t = crossing(r["evals"], target, window)
        out["policies"][name] = {"step": step, "time": t, "final": r["final_val_loss"],
                                 "steps": len(r["steps"]), "failed": r.get("failed"),
                                 "oom": r.get("out_of_memory")}
    symi = out["policies"].get("symi", {})
    t_symi = symi.get("time")
    for name, p in out["policies"].items():
        p["ratio"] = p["time"] / t_symi if p["time"] and t_symi and not p["failed"] else None
        if p["oom"] or (symi.get("oom") and name != "symi"):  # no time to target: "OOM"
            p["ratio"] = "OOM"
    return out


def _plot(path: Path, runs: list[Path], pols: list[dict], rows: list[dict], names: list[str]):
    """Left: each lrmoe variant's per-seed ratio (an x on the top edge where it never
    reached the target). Then one panel per seed: every policy's validation loss by
    step, with the target."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 1 + len(rows), figsize=(4 + 3.2 * len(rows), 3.6))
    ax = axes[0]
    variants = [x for x in names if x not in ("static", "symi")]
    top = max([1.1] + [row["policies"][n]["ratio"] for row in rows for n in variants
                       if row["policies"].get(n, {}).get("ratio") is not None]) + 0.05
    for i, n in enumerate(variants):
        color = f"C{names.index(n)}"  # as in the curve panels
        for j, row in enumerate(rows):
            p = row["policies"].get(n)
            if p is None or p["failed"] or p["ratio"] == "OOM":
                continue
            y, marker = (p["ratio"], "o") if p["ratio"] is not None else (top, "x")
            ax.plot(j + 0.08 * i, y, marker, color=color, label=n if j == 0 else None)
    ax.axhline(1.0, color="k", lw=1, label="symi")
    ax.axhline(0.55, color="r", ls="--", lw=1, label="goal 0.55")
    ax.set_ylim(0.5, top + 0.05)
    ax.set_xticks(range(len(rows)), [r.name for r in runs])
    ax.set_ylabel("time to target / symi's (emulated); x = never")
    ax.legend(fontsize=6)
    for ax, r, pol, row in zip(axes[1:], runs, pols, rows):
        for n in names:
            ev = pol[n]["evals"] if n in pol else []
            ax.plot([e["step"] for e in ev], [e["val_loss"] for e in ev], lw=1, label=n)
        ax.axhline(row["target"], color="k", ls=":", lw=1, label="target")
        lo = min(e["val_loss"] for p in pol.values() for e in p["evals"])
        ax.set_ylim(lo - 0.1, lo + 1.5)
        ax.set_title(f"{r.name}: validation loss", fontsize=8)
        ax.set_xlabel("step")
    axes[-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--fraction", type=float, default=0.8)
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--plot", type=Path, default=None)
    a = ap.parse_args(argv)
    pols = [load(r) for r in a.runs]
    rows = [seed_row(p, a.fraction, a.window) for p in pols]
    names = list(dict.fromkeys(n for p in pols for n in p))
    print("| policy | " + " | ".join(f"{r.name} ratio (final val)" for r in a.runs)
          + " | mean ratio | min–max | seeds with a ratio |")
    print("|" + "---|" * (len(a.runs) + 4))
    for n in names:
        cells, rs = [], []
        for row in rows:
            p = row["policies"].get(n)
            if p is None:
                cells.append("not run")
            elif p["oom"]:
                cells.append(f"OOM at step {p['oom']['step']}")
            elif p["ratio"] == "OOM":
                cells.append(f"OOM (symi ran out of memory; final {p['final']:.4f})")
            elif p["failed"]:
                cells.append(f"stopped at step {p['steps'] + 1}")
            else:
                cells.append(f"{p['ratio']:.3f} ({p['final']:.4f})" if p["ratio"] is not None
                             else f"never ({p['final']:.4f})")
                if p["ratio"] is not None:
                    rs.append(p["ratio"])
        mean = f"{statistics.mean(rs):.3f}" if rs else "n/a"
        spread = f"{min(rs):.3f}–{max(rs):.3f}" if rs else "n/a"
        print(f"| {n} | " + " | ".join(cells) + f" | {mean} | {spread} | {len(rs)} of {len(rows)} |")
    print()
    for r, row in zip(a.runs, rows):
        nz = row["noise"]
        print(f"- {r.name}: target {row['target']:.4f}; one evaluation's std error "
              f"{nz['std_error']:.3f} vs smoothed change between neighbouring evaluations "
              f"{nz['neighbour_change']:.4f} ({'below' if nz['ok'] else 'NOT below'} a quarter); "
              f"paired std error of the change from the previous evaluation (same batches) "
              f"{nz['paired_std_error']:.4f} ({'below' if nz['paired_ok'] else 'NOT below'} a "
              f"quarter)")
    stages = list(next(iter(pols[0].values()))["steps"][0]["stages_emulated_s"])
    print("\nMean emulated ms per step by stage over the seeds (all steps each policy ran):\n")
    print("| policy | " + " | ".join(stages + ["non_moe", "total"]) + " |")
    print("|" + "---|" * (len(stages) + 3))
    for n in names:
        st = [s for p in pols if n in p for s in p[n]["steps"]]
        if not st:  # out of memory at its first step
            continue
        vals = [statistics.mean(s["stages_emulated_s"][k] for s in st) for k in stages]
        vals += [statistics.mean(s["non_moe_s"] for s in st),
                 statistics.mean(s["step_emulated_s"] for s in st)]
        print(f"| {n} | " + " | ".join(f"{v * 1e3:.2f}" for v in vals) + " |")
    if a.plot:
        _plot(a.plot, a.runs, pols, rows, names)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
