"""``--optimizer-offload host`` on a real device: same losses, step time, peak memory.

Trains the same model twice with ``lrmoe train`` (one process), once with the experts'
AdamW on the device and once with it in host memory (``HostOffloadAdamW``: gradients to
pinned host buffers, fused CPU AdamW on fp32 masters, weights back), and writes
``offload_check.json`` and ``offload_check.md`` into ``--out``: per mode the mean
measured step time (first 3 steps dropped), the measured peak CUDA memory, the final
validation loss, and the largest relative difference of the training losses between the
two runs. Everything here is measured, on whatever device runs it.

    python3 benchmarks/offload_check.py --out DIR [--preset small-qwen3] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def run(args) -> dict:
    import torch

    from lrmoe.train import TrainConfig, train
    from lrmoe.train.metrics import read_metrics

    out = Path(args.out)
    res = {"device": args.device, "preset": args.preset, "steps": args.steps,
           "batch_size": args.batch_size, "seq_len": args.seq_len, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
           "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                time.gmtime()),
           "modes": {}}
    losses = {}
    # "device_repeat": the same device run again, the run-to-run spread of this device
    # (non-deterministic kernels under bf16 autocast) against which host's difference reads
    for name in ("device", "device_repeat", "host"):
        mode = name.removesuffix("_repeat")
        run_dir = out / f"run_{name}"
        cfg = TrainConfig(preset=args.preset, out=str(run_dir), steps=args.steps,
                          batch_size=args.batch_size, seq_len=args.seq_len,
                          device=args.device, warmup=max(1, args.steps // 10),
                          eval_every=0, eval_batches=2, ckpt_every=0, keep_ckpts=1,
                          max_data_bytes=args.max_data_bytes, optimizer_offload=mode,
                          threads=args.threads)
        r = train(cfg)
        rows = [x for x in read_metrics(run_dir / "metrics.jsonl") if x.get("kind") == "train"]
        losses[name] = [x["loss"] for x in rows]
        steady = [x["step_s"] for x in rows[3:]] or [x["step_s"] for x in rows]
        mem = [x["cuda_max_mem_bytes"] for x in rows if "cuda_max_mem_bytes" in x]
        res["modes"][name] = {"final_val_loss": r["final_val_loss"],
                              "mean_step_s": statistics.mean(steady),
                              "peak_cuda_mem_bytes": max(mem) if mem else None}
    def diff(x, y):
        return max(abs(a - b) / abs(a) for a, b in zip(losses[x], losses[y]))
    res["max_rel_train_loss_diff"] = diff("device", "host")
    res["max_rel_train_loss_diff_device_repeat"] = diff("device", "device_repeat")
    return res


def markdown(res: dict) -> str:
    lines = [f"# --optimizer-offload host check ({res['device']}"
             f"{', ' + res['gpu'] if res['gpu'] else ''}; measured)", "",
             f"`{res['command']}` ({res['date']}, torch {res['torch']}); {res['preset']}, "
             f"{res['steps']} steps of {res['batch_size']}x{res['seq_len']} tokens.", "",
             "| optimizer | mean step (s) | peak CUDA memory (GiB) | final val loss |",
             "|---|---|---|---|"]
    for mode, m in res["modes"].items():
        mem = "-" if m["peak_cuda_mem_bytes"] is None else f"{m['peak_cuda_mem_bytes'] / 2**30:.3f}"
        lines.append(f"| {mode} | {m['mean_step_s']:.4f} | {mem} | {m['final_val_loss']:.5f} |")
    lines += ["", f"Largest relative difference of the training losses, device vs host: "
                  f"{res['max_rel_train_loss_diff']:.2e}; device vs the same device run "
                  f"repeated: {res['max_rel_train_loss_diff_device_repeat']:.2e}"]
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
    args = p.parse_args(argv)
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
