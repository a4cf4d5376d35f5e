"""Plots of a run's ``metrics.jsonl`` written into the run directory (matplotlib, Agg
backend: no display needed): the loss, and per MoE layer each expert's (and under EP
each rank's) load over the steps, divided by the step's mean (1 = balanced), and its
max/mean (what the straggler waits on)."""

from __future__ import annotations

import math
import os
from pathlib import Path

from lrmoe.errors import require
from lrmoe.train.metrics import METRICS_FILE, read_metrics


def _moving_average(xs: list[float], w: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def _finish(plt, fig, ax, path: Path, ylabel: str, title: str, legend: dict | None) -> Path:
    """Label a per-step line plot (``legend``: its keyword arguments, None for none) and
    write it to ``path``."""
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend is not None:
        ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _load_heatmap(plt, run_dir: Path, train: list[dict], key: str, name: str, ylabel: str,
                  title: str) -> list[Path]:
    """One heatmap per MoE layer of the rows' ``key`` (``[steps][rows]``), each step's values
    divided by their mean; ``[]`` when no row has it in full."""
    import numpy as np

    with_key = [r for r in train if r.get(key)]
    if not with_key:
        return []
    n = len(with_key[0][key])
    ok = [r for r in with_key if len(r[key]) == n and all(c is not None for c in r[key])]
    if not ok:
        return []
    steps = [r["step"] for r in ok]
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols + 1.2, 2.8 * rows + 0.6),
                             squeeze=False, layout="constrained")
    mats = []
    for k in range(n):
        m = np.asarray([r[key][k] for r in ok], dtype=float).T  # [rows, steps]
        mean = m.mean(axis=0, keepdims=True)
        mats.append(np.divide(m, mean, out=np.ones_like(m), where=mean > 0))
    vmax = max([1.0] + [float(np.nanmax(m)) for m in mats if m.size])
    for ax in axes.flat[n:]:
        ax.axis("off")
    for k, (ax, m) in enumerate(zip(axes.flat, mats)):
        im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="magma", vmin=0,
                       vmax=vmax, origin="lower",
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, m.shape[0] - 0.5))
        ax.set_title(f"MoE layer {k}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
    fig.colorbar(im, ax=list(axes.flat), shrink=0.8, label="load / mean")  # n >= 1: im set
    fig.suptitle(title)
    fig.savefig(run_dir / name, dpi=110)
    plt.close(fig)
    return [run_dir / name]


def _loss_plot(plt, run_dir: Path, train: list[dict], val: list[dict]) -> Path:
    steps = [r["step"] for r in train]
    loss = [r["loss"] for r in train]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(steps, loss, color="tab:blue", alpha=0.35, lw=0.8, label="train (per step)")
    ax.plot(steps, _moving_average(loss, max(1, len(loss) // 30)), color="tab:blue",
            label="train (moving average)")
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-",
                color="tab:orange", label="validation")
    return _finish(plt, fig, ax, run_dir / "loss.png", "cross entropy (nats/token)",
                   f"loss: {run_dir.name}", {})


def _balance_plot(plt, run_dir: Path, train: list[dict]) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    series = [r.get("expert_load_max_over_mean") or [] for r in train]
    n_layers = max((len(s) for s in series), default=0)
    for k in range(n_layers):
        pts = [(r["step"], s[k]) for r, s in zip(train, series) if len(s) > k and s[k] is not None]
        if pts:
            ax.plot(*zip(*pts), lw=0.9, color=f"C{k % 10}", label=f"layer {k}: experts")
    if any(len(r.get("rank_load") or []) and r.get("moe") for r in train):  # EP: ranks too
        for key, style, what in (("rank_load_max_over_mean", "--", "ranks fwd"),
                                 ("rank_bwd_load_max_over_mean", ":", "ranks bwd")):
            for k in range(n_layers):
                pts = [(r["step"], r["moe"][k][key]) for r in train
                       if len(r.get("moe") or []) > k and key in r["moe"][k]]
                if pts:
                    ax.plot(*zip(*pts), style, lw=0.9, color=f"C{k % 10}",
                            label=f"layer {k}: {what}")
    ax.axhline(1.0, color="gray", lw=0.6)
    return _finish(plt, fig, ax, run_dir / "load_balance.png", "max / mean load",
                   "load imbalance", {"fontsize": 7, "ncol": 2} if n_layers <= 8 else None)


def write_report(run_dir: str | os.PathLike) -> list[Path]:
    """Write the PNGs for ``run_dir``; returns their paths."""
    run_dir = Path(run_dir)
    mpath = run_dir / METRICS_FILE
    require(mpath.is_file(), f"{run_dir} has no {METRICS_FILE}; is it an lrmoe run directory?")
    rows = read_metrics(mpath)
    train = [r for r in rows if "loss" in r and r.get("kind", "train") == "train"]
    require(bool(train), f"{mpath} holds no training steps yet")
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return ([_loss_plot(plt, run_dir, train, [r for r in rows if "val_loss" in r])]
            + _load_heatmap(plt, run_dir, train, "counts", "expert_load.png", "expert",
                            "expert load (pairs / mean) per step")
            + [_balance_plot(plt, run_dir, train)]
            + _load_heatmap(plt, run_dir, train, "rank_load", "rank_load.png", "rank",
                            "rank load (pairs processed / mean) per step"))
