"""Summarise one-GPU training runs (metrics.jsonl per run dir) into JSON and a loss plot.

    python benchmarks/summarize_gpu_runs.py OUT_PREFIX RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def summarize(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tr = [r for r in rows if r.get("kind") == "train"]
    va = [r for r in rows if r.get("kind") == "val"]
    plain = [r for r in tr[5:] if not r.get("fidelity_step")]
    moe = tr[-1]["moe"]
    pairs = sum(m["pairs"] for m in moe)
    out = dict(
        run=run.name, steps=tr[-1]["step"],
        val=[(v["step"], round(v["val_loss"], 4)) for v in va],
        keep_ratio=round(sum(m["selected"] for m in moe) / pairs, 4),
        retained_ratio=round(sum(m["retained"] for m in moe) / pairs, 4),
        bwd_bytes_over_exact=round(sum(m["bwd_bytes"] for m in moe)
                                   / sum(m["bwd_exact_bytes"] for m in moe), 4),
        step_s_median=round(statistics.median(r["step_s"] for r in plain), 4) if plain else None,
        fidelity_cosine=[round(m["fidelity_cosine"], 4) for r in tr for m in r["moe"][:1]
                         if m.get("fidelity_cosine") is not None],
    )
    mem = [r["cuda_max_mem_bytes"] for r in plain if "cuda_max_mem_bytes" in r]
    if mem:
        out["cuda_step_peak_gib_median"] = round(statistics.median(mem) / 2**30, 3)
    if plain and "saved_act_bytes" in plain[-1]["moe"][0]:
        out["saved_act_gib"] = round(sum(m["saved_act_bytes"] for m in plain[-1]["moe"]) / 2**30, 3)
    led = moe[0].get("ledger_total_bytes")
    if led:
        out["ledger_gib"] = round(led / 2**30, 3)
    out["_curve"] = [(r["step"], r["loss"]) for r in tr]
    return out


def main() -> None:
    prefix, runs = sys.argv[1], [Path(p) for p in sys.argv[2:]]
    res = [summarize(r) for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in res:
        s, loss = zip(*r.pop("_curve"))
        ax.plot(s, loss, label=r["run"], lw=1)
        if r["val"]:
            vs, vl = zip(*r["val"])
            ax.scatter(vs, vl, s=12)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (dots: val)")
    ax.set_ylim(top=3.0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(prefix + ".png", dpi=110)
    Path(prefix + ".json").write_text(json.dumps(res, indent=1))
    for r in res:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
