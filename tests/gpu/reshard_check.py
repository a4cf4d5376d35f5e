"""Resume on another EP size on CUDA/NCCL (a check, not a speed measurement).

    PYTHONPATH=src python3 tests/gpu/reshard_check.py --out DIR [--nproc 2] [--device cuda]

Trains tiny-qwen3 at ``--ep NPROC`` on NPROC processes to step 3 (checkpoint), then
resumes copies of that run for one step at the same size (the reference), at ``--ep 1``
on one process and, with NPROC >= 4, under DP2 x EP(NPROC/2). Writes ``reshard.json``
and ``reshard.md`` into DIR: step 4's loss of each resume, its relative difference to
the same-size resume, and the wall time of each launch (start-up included). Needs
NPROC GPUs with ``--device cuda``; ``--device cpu`` runs the same on gloo (for testing
the script). About 2 minutes on 2 H200s (four launches). ``tests/gpu/test_gpu_reshard.py``
runs it on every GPU of the machine (at least 2) and checks the resumes' losses.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAVED_AT = 3
COMMON = ["--preset", "tiny-qwen3", "--steps", "6", "--ckpt-every", "3", "--batch-size", "8",
          "--seq-len", "64", "--max-data-bytes", "200000", "--eval-every", "0",
          "--eval-batches", "1", "--warmup", "1", "--timeout-s", "120"]


def launch(nproc: int, args: list[str], log: Path) -> float:
    """Run ``lrmoe train ARGS`` on ``nproc`` processes; returns the wall seconds."""
    py = [sys.executable]
    cmd = (py + ["-m", "lrmoe"] if nproc == 1 else
           py + ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                 "-m", "lrmoe"]) + ["train", *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"{' '.join(cmd)} exited {rc}; see {log}:\n{log.read_text()[-3000:]}")
    return time.perf_counter() - t0


def step_loss(run: Path, step: int) -> float:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    return next(r["loss"] for r in rows if r.get("kind") == "train" and r["step"] == step)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    n, dev = a.nproc, ["--device", a.device]
    saved = out / "saved"
    shutil.rmtree(saved, ignore_errors=True)
    wall = {"save": launch(n, [*COMMON, *dev, "--ep", str(n), "--out", str(saved),
                               "--stop-after", str(SAVED_AT)], out / "save.log")}
    resumes = {f"ep{n} (same size)": (n, n), "ep1 (one process)": (1, 1)}
    if n >= 4 and n % 2 == 0:
        resumes[f"dp2 x ep{n // 2}"] = (n, n // 2)
    loss = {}
    for name, (procs, ep) in resumes.items():
        run = out / name.split()[0]
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(saved, run)
        wall[name] = launch(procs, ["--out", str(run), "--resume", "--ep", str(ep), *dev,
                                    "--stop-after", str(SAVED_AT + 1)],
                            out / f"{run.name}.log")
        loss[name] = step_loss(run, SAVED_AT + 1)
    ref = loss[f"ep{n} (same size)"]
    rel = {k: abs(v - ref) / abs(ref) for k, v in loss.items()}
    import torch

    report = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
              "torch": torch.__version__, "nproc": n, "saved_at": SAVED_AT,
              "command": " ".join(sys.argv), "loss_next_step": loss,
              "rel_diff_to_same_size": rel, "wall_s": wall}
    (out / "reshard.json").write_text(json.dumps(report, indent=1))
    lines = [f"# Resume on another EP size ({report['device']}, torch {report['torch']})", "",
             f"Saved at step {SAVED_AT} by {n} processes at --ep {n}; step {SAVED_AT + 1} "
             "loss of each resume (measured).", "",
             "| resume | step loss | rel. diff to same size | launch wall s |",
             "|---|---|---|---|"]
    lines += [f"| {k} | {loss[k]:.6f} | {rel[k]:.1e} | {wall[k]:.1f} |" for k in loss]
    lines += ["", f"Command: `{report['command']}`", ""]
    (out / "reshard.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return report


if __name__ == "__main__":
    main()
