"""Expert parallelism on the CPU (gloo): static vs SYMI vs LRMoE on 4 ranks, tiny-qwen3.

Runs ``torchrun --standalone --nproc-per-node 4 -m lrmoe train --ep 4`` once per policy
(and per ``--extra`` ablation), same seed, data and global batch, then reads every run's
``metrics.jsonl``: final validation loss and train loss curve; per-rank forward and
backward load imbalance (``max/mean`` per step and MoE layer, mean and worst); step time
(after the first 5 steps) and tokens/s; lrmoe's keep and retained ratios, backward
all-to-all bytes against the exact backward, and the ledger's retained bytes (retained
pairs x A, A = (H + 2F)·4 bytes a pair and layer) against what the runtime saved
(``saved_act_bytes``). Writes ``OUT/results.json``, ``OUT/results.md`` (also printed)
and the loss plot ``--png``. The times are of 4 processes sharing 2 cores through gloo
on loopback: CPU contention and Python overhead, nothing about GPU speed.

    .venv/bin/python benchmarks/cpu_ep_runs.py            # ~10 min on 2 cores
    .venv/bin/python benchmarks/cpu_ep_runs.py --reuse    # re-analyse finished runs
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESET = "tiny-qwen3"
POLICIES = ("static", "symi", "lrmoe")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/cpu_ep", help="directory for the three runs")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--nproc", type=int, default=4, help="processes = EP size")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--max-data-bytes", default="4MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slots-per-rank", type=int, default=6, help="symi: E/G + 2 for E=16, G=4")
    p.add_argument("--mem-budget", default="30MiB", help="lrmoe: per-rank expert memory budget")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--extra", action="append", default=[], metavar="NAME=FLAGS",
                   help="an extra (ablation) run: NAME and lrmoe train flags added to the "
                        "common ones, e.g. 'lrmoe-nosel=--policy lrmoe --mem-budget 30MiB "
                        "--lrmoe-selection off' (repeatable)")
    p.add_argument("--reuse", action="store_true",
                   help="reuse runs whose metrics already reach --steps")
    p.add_argument("--png", default="benchmarks/cpu_ep_loss.png")
    p.add_argument("--plot", default=",".join(POLICIES),
                   help="runs drawn in --png, comma-separated (default: the three policies)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    return p.parse_args(argv)


def torchrun() -> str:
    exe = Path(sys.executable).with_name("torchrun")
    return str(exe) if exe.exists() else "torchrun"


def train_command(a: argparse.Namespace, policy: str) -> list[str]:
    cmd = [torchrun(), "--standalone", "--nproc-per-node", str(a.nproc), "-m", "lrmoe", "train",
           "--preset", PRESET, "--ep", str(a.nproc), "--out", str(Path(a.out) / policy),
           "--steps", str(a.steps), "--batch-size", str(a.batch_size), "--seq-len",
           str(a.seq_len), "--eval-every", str(a.eval_every), "--eval-batches",
           str(a.eval_batches), "--max-data-bytes", str(a.max_data_bytes), "--seed",
           str(a.seed), "--threads", "1", "--ckpt-every", "0", "--log-every", "25",
           "--timeout-s", "300"]
    if policy == "symi":
        cmd += ["--policy", "symi", "--slots-per-rank", str(a.slots_per_rank)]
    elif policy == "lrmoe":
        cmd += ["--policy", "lrmoe", "--mem-budget", str(a.mem_budget)]
    elif policy in extras(a):
        cmd += shlex.split(extras(a)[policy])
    return cmd


def extras(a: argparse.Namespace) -> dict[str, str]:
    out = {}
    for spec in a.extra:
        name, sep, flags = spec.partition("=")
        if not sep or not name or name in POLICIES or "/" in name:
            raise SystemExit(f"--extra {spec!r}: want NAME=FLAGS with a new NAME")
        out[name] = flags
    return out


def shown(cmd: list[str]) -> str:
    """The command as someone would type it from the repository root."""
    return " ".join(shlex.quote(".venv/bin/torchrun" if c == torchrun() else c) for c in cmd)


def read_rows(run: Path) -> list[dict]:
    p = run / "metrics.jsonl"
    if not p.exists():
        return []
    rows = []
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def launch(a: argparse.Namespace, policy: str) -> float | None:
    """Train one policy (unless reused); returns the wall time in seconds."""
    run = Path(a.out) / policy
    rows = [r for r in read_rows(run) if r.get("kind") == "train"]
    if a.reuse and rows and rows[-1]["step"] >= a.steps:
        print(f"[{policy}] reusing {run}", file=sys.stderr)
        return None
    if run.exists():
        shutil.rmtree(run)
    run.parent.mkdir(parents=True, exist_ok=True)
    cmd = train_command(a, policy)
    print(f"[{policy}] {shown(cmd)}", file=sys.stderr, flush=True)
    log = run.parent / f"{policy}.log"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env,
                            timeout=a.timeout).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"[{policy}] training failed (exit {rc}); see {log}:\n{tail}")
    print(f"[{policy}] done in {wall:.0f}s", file=sys.stderr, flush=True)
    return wall


# ----------------------------------------------------------------------------- analysis
def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def _imbalance(loads: list[float]) -> float:
    m = sum(loads) / len(loads)
    return max(loads) / m if m > 0 else 1.0


def analyse(run: Path, warm: int = 5) -> dict:
    rows = read_rows(run)
    tr = [r for r in rows if r["kind"] == "train"]
    val = [r for r in rows if r["kind"] == "val"]
    if not tr:
        raise SystemExit(f"{run}: no train rows in metrics.jsonl")
    fwd_imb = [_imbalance(loads) for r in tr for loads in r["rank_load"]]
    bwd_imb = [m["rank_bwd_load_max_over_mean"] for r in tr for m in r["moe"]
               if "rank_bwd_load_max_over_mean" in m]
    steady = tr[warm:] if len(tr) > warm else tr
    step_s = [r["step_s"] for r in steady]
    moe = [m for r in tr for m in r["moe"]]
    pairs = sum(m["pairs"] for m in moe)
    out = {
        "run": str(run), "steps": tr[-1]["step"], "tokens": tr[-1]["tokens"],
        "final_val_loss": val[-1]["val_loss"] if val else None,
        "val": [(r["step"], r["val_loss"]) for r in val],
        "train_loss": [r["loss"] for r in tr],
        "train_loss_last20": _mean(r["loss"] for r in tr[-20:]),
        "fwd_rank_imbalance_mean": _mean(fwd_imb), "fwd_rank_imbalance_max": max(fwd_imb),
        "bwd_rank_imbalance_mean": _mean(bwd_imb) if bwd_imb else None,
        "bwd_rank_imbalance_max": max(bwd_imb) if bwd_imb else None,
        "step_s_median": statistics.median(step_s), "step_s_mean": _mean(step_s),
        "train_elapsed_s": tr[-1]["elapsed_s"],
        "tokens_per_s": tr[-1]["tokens"] / tr[-1]["elapsed_s"],
        "expert_fwd_ms_mean": _mean(m.get("expert_fwd_ms", 0) for m in moe),
        "expert_bwd_ms_mean": _mean(m.get("expert_bwd_ms", 0) for m in moe),
        "replicas_mean": _mean(m.get("replicas", 0) for m in moe),
        "pairs": pairs,
        "retained_ratio": sum(m["retained"] for m in moe) / pairs,
        "keep_ratio": sum(m["selected"] for m in moe) / pairs,
        "fwd_bytes_per_step": sum(m["fwd_bytes"] for m in moe) / len(tr),
        "bwd_bytes_per_step": sum(m["bwd_bytes"] for m in moe) / len(tr),
        "bwd_exact_bytes_per_step": sum(m.get("bwd_exact_bytes", 0) for m in moe) / len(tr),
        "saved_act_bytes_per_step": sum(m.get("saved_act_bytes", 0) for m in moe) / len(tr),
        "retained_per_step": sum(m["retained"] for m in moe) / len(tr),
    }
    out["bwd_bytes_over_exact"] = (out["bwd_bytes_per_step"] / out["bwd_exact_bytes_per_step"]
                                   if out["bwd_exact_bytes_per_step"] else None)
    ledger = [m["ledger_total_bytes"] for m in moe if "ledger_total_bytes" in m]
    if ledger:
        out["ledger_total_bytes_max"] = max(ledger)
        out["ledger_budget_bytes"] = tr[-1].get("ledger_budget_bytes")
    return out


def model_shape() -> dict:
    from lrmoe.presets import get_preset

    c = get_preset(PRESET)
    return {"H": c.hidden_size, "F": c.moe_intermediate_size, "E": c.num_experts,
            "k": c.num_experts_per_tok, "L": len(c.moe_layers)}


# ----------------------------------------------------------------------------- report
def fmt(x, nd=3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def markdown(a: argparse.Namespace, res: dict, commands: dict, walls: dict) -> str:
    shape = model_shape()
    A = (shape["H"] + 2 * shape["F"]) * 4
    st = res.get("static")
    lines = [
        f"Date: {datetime.date.today().isoformat()}. Machine: 2-core CPU, 4 processes, "
        "torch.distributed gloo on loopback, fp32, `--threads 1` per process.",
        "",
        f"Model {PRESET} (E={shape['E']}, top-{shape['k']}, {shape['L']} MoE layers, "
        f"H={shape['H']}, F={shape['F']}); {a.steps} steps, global batch {a.batch_size} x "
        f"{a.seq_len} tokens ({a.batch_size // a.nproc} sequences per rank), seed {a.seed}, "
        f"{a.max_data_bytes} of the stdlib corpus, validation every {a.eval_every} steps "
        f"({a.eval_batches} global batches).",
        "",
        "| policy | final val loss | train loss (last 20) | fwd rank max/mean (mean / max) | "
        "bwd rank max/mean (mean / max) | replicas/layer | step s (median) | tokens/s | "
        "retained | keep ratio | bwd bytes/step | bwd / exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p, r in res.items():
        lines.append(
            f"| {p} | {fmt(r['final_val_loss'], 4)} | {fmt(r['train_loss_last20'], 4)} | "
            f"{fmt(r['fwd_rank_imbalance_mean'])} / {fmt(r['fwd_rank_imbalance_max'])} | "
            f"{fmt(r['bwd_rank_imbalance_mean'])} / {fmt(r['bwd_rank_imbalance_max'])} | "
            f"{fmt(r['replicas_mean'], 2)} | {fmt(r['step_s_median'])} | "
            f"{r['tokens_per_s']:,.0f} | {fmt(r['retained_ratio'])} | {fmt(r['keep_ratio'])} | "
            f"{r['bwd_bytes_per_step'] / 2**20:.2f} MiB | {fmt(r['bwd_bytes_over_exact'])} |")
    lines += ["", "Step time relative to static (median step_s): " + ", ".join(
        f"{p} {r['step_s_median'] / st['step_s_median']:.3f}x" for p, r in res.items())
        if st else "", ""]
    lines += ["Wall time per launch (incl. start-up, data, validation): " + ", ".join(
        f"{p} {w:.0f}s" for p, w in walls.items() if w is not None), ""]
    lr = res.get("lrmoe")
    if lr:
        lines += [
            f"LRMoE (budget {a.mem_budget} per rank, default options: topk, grad_norm, "
            "min-keep 0.5, balance 1, compaction on):",
            f"- kept {lr['keep_ratio']:.3f} of the routed pairs for backward "
            f"({lr['retained_ratio']:.3f} retained); backward all-to-all "
            f"{lr['bwd_bytes_per_step'] / 2**20:.2f} MiB/step vs "
            f"{lr['bwd_exact_bytes_per_step'] / 2**20:.2f} MiB/step for the exact backward "
            f"(ratio {lr['bwd_bytes_over_exact']:.3f})"
            + (f"; static's measured exact backward: {st['bwd_bytes_per_step'] / 2**20:.2f} "
               "MiB/step" if st else "") + ".",
            f"- ledger vs runtime: retained pairs x A (A = (H+2F)·4 = {A} B per pair and layer) "
            f"= {lr['retained_per_step'] * A / 2**20:.3f} MiB/step summed over ranks and "
            f"layers; the runtime saved {lr['saved_act_bytes_per_step'] / 2**20:.3f} MiB/step "
            f"(saved_act_bytes).",
        ]
        if "ledger_total_bytes_max" in lr:
            from lrmoe.units import parse_bytes

            lines.append(f"- ledger total per rank (all MoE layers), max over steps and ranks: "
                         f"{lr['ledger_total_bytes_max'] / 2**20:.2f} MiB of the "
                         f"{parse_bytes(a.mem_budget) / 2**20:.2f} MiB budget (the CPU has no "
                         "allocator peak to compare it with).")
    lines += ["", "Commands:", "", "```"] + [commands[p] for p in res] + ["```"]
    return "\n".join(lines)


def plot(res: dict, path: Path, names: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    colors = {"static": "tab:gray", "symi": "tab:blue", "lrmoe": "tab:red"}
    spare = iter(["tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink"])
    for p in names:
        if p not in res:
            continue
        r = res[p]
        colors.setdefault(p, next(spare, "black"))
        y = r["train_loss"]
        ema, s = [], None
        for v in y:
            s = v if s is None else 0.9 * s + 0.1 * v
            ema.append(s)
        x = list(range(1, len(y) + 1))
        c = colors.get(p)
        ax.plot(x, y, color=c, alpha=0.2, lw=0.8)
        ax.plot(x, ema, color=c, lw=1.5, label=f"{p} train (EMA 0.9)")
        if r["val"]:
            vx, vy = zip(*r["val"])
            ax.plot(vx, vy, "o--", color=c, ms=4, lw=0.8, label=f"{p} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("tiny-qwen3, 4 ranks (gloo, 2-core CPU), EP=4")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    a = parse_args(argv)
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise SystemExit(f"unknown policies {bad}; use {POLICIES}")
    policies += list(extras(a))
    out = Path(a.out)
    walls = {p: launch(a, p) for p in policies}
    res = {p: analyse(out / p) for p in policies}
    commands = {p: shown(train_command(a, p)) for p in policies}
    md = markdown(a, res, commands, walls)
    print(md)
    (out / "results.md").write_text(md + "\n")
    summary = {"args": vars(a), "results": res, "walls": walls, "commands": commands}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    if a.png:
        plot(res, Path(a.png), [p.strip() for p in a.plot.split(",") if p.strip()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
