"""``--optimizer-offload host`` on a real device: same losses, step time, peak memory.

Trains the same model with ``lrmoe train`` (one process), the experts' AdamW on the
device and in host memory (``HostOffloadAdamW``: gradients to pinned host buffers, fused
CPU AdamW on fp32 masters, weights back), at each seed of ``--seeds`` (default 0) each
``--repeats`` times (default 3) in turn, and writes ``offload_check.json`` and
``offload_check.md`` into ``--out``: per run the mean measured step time (first 3 steps
dropped), the measured peak CUDA memory and the final validation loss; per mode the
final validation loss's mean and range; the relative difference of the training losses,
its largest step and its mean over the steps, between two runs of the same mode (bf16
non-determinism) and between the modes;
whether host's mean lies outside the device runs' range; and the paired difference
host − device of the final validation loss per seed (each mode's mean over its repeats),
with its mean and, from 2 seeds, its 95% interval (Student t). Runs that differ in one
rounding drift apart over tens of bf16 steps in either direction, so only the paired
difference over several seeds tells a bias from that drift. The training runs live in a
temporary folder (only the summary is kept). Everything here is measured, on whatever
device runs it.

    PYTHONPATH=src python3 tests/gpu/offload_check.py --out DIR [--preset small-qwen3]
        [--device cuda] [--repeats 3] [--seeds 0,1,2]

``tests/gpu/test_gpu_offload.py`` runs it on CUDA (``pytest -m gpu tests/gpu``);
``tests/test_offload.py`` runs it on the CPU at tiny shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def run(args) -> dict:
    import torch

    from lrmoe.train import TrainConfig, train
    from lrmoe.train.metrics import read_metrics

    res = {"device": args.device, "preset": args.preset, "steps": args.steps,
           "batch_size": args.batch_size, "seq_len": args.seq_len, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
           "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                time.gmtime()),
           "modes": {}}
    losses = {}
    # each mode run --repeats times in turn: the spread of each mode (non-deterministic
    # kernels under bf16 autocast) is what the difference between the modes reads against.
    # The training runs (checkpoints included) live in a temporary folder: only the
    # summary is written to --out.
    with tempfile.TemporaryDirectory() as td:
        for seed, r in [(s, r) for s in args.seeds for r in range(args.repeats)]:
            for mode in ("device", "host"):
                name = f"{mode}_{r}" if args.seeds == [0] else f"{mode}_s{seed}_{r}"
                run_dir = Path(td, f"run_{name}")
                cfg = TrainConfig.from_flat(preset=args.preset, out=str(run_dir), steps=args.steps,
                                  seed=seed,
                                  batch_size=args.batch_size, seq_len=args.seq_len,
                                  device=args.device, warmup=max(1, args.steps // 10),
                                  eval_every=0, eval_batches=2, ckpt_every=0, keep_ckpts=1,
                                  max_data_bytes=args.max_data_bytes, optimizer_offload=mode,
                                  threads=args.threads)
                rep = train(cfg)
                rows = [x for x in read_metrics(run_dir / "metrics.jsonl")
                        if x.get("kind") == "train"]
                losses[name] = [x["loss"] for x in rows]
                steady = [x["step_s"] for x in rows[3:]] or [x["step_s"] for x in rows]
                mem = [x["cuda_max_mem_bytes"] for x in rows if "cuda_max_mem_bytes" in x]
                res["modes"][name] = {"mode": mode, "seed": seed,
                                      "final_val_loss": rep["final_val_loss"],
                                      "mean_step_s": statistics.mean(steady),
                                      "peak_cuda_mem_bytes": max(mem) if mem else None}
    res["summary"] = summarize(res["modes"], losses)
    return res


def summarize(modes: dict, losses: dict) -> dict:
    """Per mode: final validation losses (mean, min, max); the relative training-loss
    difference (its largest step, its mean over the steps and pairs) between two runs of
    the same mode, and between modes (runs of one seed); the paired difference by seed
    (:func:`paired`)."""
    def rel(x, y):
        return [abs(a - b) / abs(a) for a, b in zip(losses[x], losses[y])]
    out = {}
    names = list(modes)
    same_seed = {(a, b) for a in names for b in names
                 if modes[a].get("seed", 0) == modes[b].get("seed", 0)}
    for mode in ("device", "host"):
        v = [m["final_val_loss"] for m in modes.values() if m["mode"] == mode]
        out[mode] = {"final_val_mean": statistics.mean(v), "final_val_min": min(v),
                     "final_val_max": max(v)}
    within = [rel(a, b) for i, a in enumerate(names) for b in names[i + 1:]
              if modes[a]["mode"] == modes[b]["mode"] and (a, b) in same_seed]
    across = [rel(a, b) for a, b in same_seed
              if modes[a]["mode"] == "device" and modes[b]["mode"] == "host"]
    for key, pairs in (("within_mode", within), ("device_vs_host", across)):
        out[f"max_rel_train_loss_diff_{key}"] = max(map(max, pairs)) if pairs else None
        out[f"mean_rel_train_loss_diff_{key}"] = (statistics.mean(x for d in pairs for x in d)
                                                  if pairs else None)
    d, h = out["device"], out["host"]
    out["host_mean_outside_device_range"] = not (d["final_val_min"] <= h["final_val_mean"]
                                                 <= d["final_val_max"])
    out["paired"] = paired(modes)
    return out


def paired(modes: dict) -> dict:
    """host − device final validation loss per seed (each mode's mean over its repeats),
    their mean and, from 2 seeds, the mean's 95% interval (Student t)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from summarize_ttl import ci95

    by: dict[int, dict[str, list[float]]] = {}
    for m in modes.values():
        by.setdefault(m.get("seed", 0), {}).setdefault(m["mode"], []).append(m["final_val_loss"])
    diffs = {s: statistics.mean(v["host"]) - statistics.mean(v["device"])
             for s, v in sorted(by.items()) if "host" in v and "device" in v}
    ci = ci95(list(diffs.values()))
    return {"host_minus_device_by_seed": diffs,
            "mean": statistics.mean(diffs.values()) if diffs else None,
            "ci95": list(ci) if ci else None}


def markdown(res: dict) -> str:
    lines = [f"# --optimizer-offload host check ({res['device']}"
             f"{', ' + res['gpu'] if res['gpu'] else ''}; measured)", "",
             f"`{res['command']}` ({res['date']}, torch {res['torch']}); {res['preset']}, "
             f"{res['steps']} steps of {res['batch_size']}x{res['seq_len']} tokens.", "",
             "| optimizer | mean step (s) | peak CUDA memory (GiB) | final val loss |",
             "|---|---|---|---|"]
    for name, m in res["modes"].items():
        mem = "-" if m["peak_cuda_mem_bytes"] is None else f"{m['peak_cuda_mem_bytes'] / 2**30:.3f}"
        lines.append(f"| {name} | {m['mean_step_s']:.4f} | {mem} | {m['final_val_loss']:.5f} |")
    sm = res["summary"]
    within = sm["max_rel_train_loss_diff_within_mode"]
    lines += ["", "| mode | final val mean | min | max |", "|---|---|---|---|"]
    lines += [f"| {k} | {sm[k]['final_val_mean']:.5f} | {sm[k]['final_val_min']:.5f} | "
              f"{sm[k]['final_val_max']:.5f} |" for k in ("device", "host")]
    lines += ["", "Largest relative difference of the training losses: device vs host "
                  f"{sm['max_rel_train_loss_diff_device_vs_host']:.2e}; two runs of the same "
                  "mode " + ("—" if within is None else f"{within:.2e}") + "; mean over steps "
                  f"{sm['mean_rel_train_loss_diff_device_vs_host']:.2e} against "
                  + ("—" if within is None else f"{sm['mean_rel_train_loss_diff_within_mode']:.2e}")
                  + ". Host's mean final "
                  "val loss is " + ("OUTSIDE" if sm["host_mean_outside_device_range"] else
                                    "inside") + " the device runs' range."]
    pr = sm["paired"]
    lines += ["", "Final val loss, host − device, per seed (mean over the repeats): "
              + ", ".join(f"seed {s}: {d:+.4f}" for s, d in pr["host_minus_device_by_seed"].items())
              + f"; mean {pr['mean']:+.4f}"
              + (f", 95% interval {pr['ci95'][0]:+.4f} to {pr['ci95'][1]:+.4f} (t)"
                 if pr["ci95"] else " (one seed: no interval)") + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="small-qwen3")
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-data-bytes", type=int, default=4 * 2**20)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3, help="runs per mode and seed (default 3)")
    p.add_argument("--seeds", default="0", help="comma-separated training seeds (default 0)")
    args = p.parse_args(argv)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        print(f"offload_check: --seeds {args.seeds!r}: give integers, e.g. 0,1,2",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        print(f"offload_check: --out {out} is not empty; give a new folder", file=sys.stderr)
        return 2
    res = run(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "offload_check.json").write_text(json.dumps(res, indent=1))
    (out / "offload_check.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
