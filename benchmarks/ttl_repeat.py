"""Are two ``lrmoe bench ttl`` runs of the same command bitwise the same run?

    python benchmarks/ttl_repeat.py RUN_A/ttl.json RUN_B/ttl.json [--out FILE.md]

For every policy in both files: the first step whose training loss differs (bitwise),
the largest absolute difference of the training losses and of the validation losses,
and each run's mean measured wall time per step (what ``--deterministic`` costs, when
one pair of runs is deterministic and another is not). Prints a markdown table; exit 0
whatever it finds (it reports, it does not judge).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def compare(a: dict, b: dict) -> list[dict]:
    """One row per policy present in both runs."""
    rows = []
    for name, pa in a["policies"].items():
        pb = b["policies"].get(name)
        if pb is None or pa.get("failed") or pb.get("failed"):
            continue
        la = [s["train_loss"] for s in pa["steps"]]
        lb = [s["train_loss"] for s in pb["steps"]]
        n = min(len(la), len(lb))
        first = next((i + 1 for i in range(n) if la[i] != lb[i]), None)
        va = [e["val_loss"] for e in pa["evals"]]
        vb = [e["val_loss"] for e in pb["evals"]]
        m = min(len(va), len(vb))
        rows.append({
            "policy": name, "steps": n,
            "first_diff_step": first,
            "max_abs_train_diff": max((abs(x - y) for x, y in zip(la, lb)), default=math.nan),
            "max_abs_val_diff": max((abs(x - y) for x, y in zip(va[:m], vb[:m])), default=math.nan),
            "wall_s_per_step": [sum(s["wall_s"] for s in p["steps"][1:]) / max(1, len(p["steps"]) - 1)
                                for p in (pa, pb)],
        })
    return rows


def to_markdown(rows: list[dict], a: str, b: str) -> str:
    lines = [f"A = `{a}`, B = `{b}`", "",
             "| policy | steps | first step that differs | max abs train-loss diff "
             "| max abs val-loss diff | wall s/step A / B (measured, step 1 excluded) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        first = "none (bitwise equal)" if r["first_diff_step"] is None else str(r["first_diff_step"])
        wa, wb = r["wall_s_per_step"]
        lines.append(f"| {r['policy']} | {r['steps']} | {first} | {r['max_abs_train_diff']:.3g} "
                     f"| {r['max_abs_val_diff']:.3g} | {wa:.3f} / {wb:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = compare(json.loads(Path(args.a).read_text()), json.loads(Path(args.b).read_text()))
    md = to_markdown(rows, args.a, args.b)
    print(md)
    if args.out:
        Path(args.out).write_text(md)


if __name__ == "__main__":
    main()
