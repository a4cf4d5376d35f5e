"""Can the whole Qwen3-30B-A3B train on one GPU with host optimizer offload? MODELLED.

The whole-model step ledger (:class:`step_ledger.StepLedger`, from the config
alone) prices, for every micro-batch size and checkpoint mode asked, the GPU bytes by
term (weights, gradients, AdamW state where they live, the activations and transients
of a step's largest phase) and the host bytes (fp32 masters, moments and gradient buffer
of the offloaded experts; the pinned ones at the caching host allocator's power-of-two
sizes) against the GPU's and the host's memory; then, for the first
size and the last mode, what would make it fit (each side's changes cumulative, and the
smallest set that fits both).

    python3 benchmarks/fullsize.py --out runs/fullsize              # the table (CPU)

``--measure`` also runs ``lrmoe train`` (host offload, the checkpoint mode, gradient
accumulation, a few steps) on the config cut to ``--layers`` layers (real widths and
vocabulary) and writes its tokens/s, ``cuda_max_mem_bytes`` and host memory beside the
ledger's prediction: the resident set over the training steps (the metrics rows'
``host_rss_bytes``) against the ledger's host state plus the process's resident set
before the model was built, and the whole process's peak (model build and final
checkpoint save included). Its final checkpoint lands in a temporary folder under
``--run-root`` (size printed first), removed afterwards:

    python3 benchmarks/fullsize.py --out runs/fullsize_4L --measure --layers 4 \\
        --device cuda                                              # H200, ~3-5 min
    python3 benchmarks/fullsize.py --out /tmp/fs --measure --config tiny-qwen3 \\
        --layers 2 --device cpu --seq-len 64 --micro-batches 1    # logic check only

Writes ``fullsize.json`` and ``fullsize.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import gpu_common as gc  # noqa: E402
from step_ledger import MODES, StepLedger  # noqa: E402

from lrmoe.config import ModelConfig  # noqa: E402
from lrmoe.errors import LrmoeError  # noqa: E402
from lrmoe.presets import PRESETS, get_preset  # noqa: E402
from lrmoe.sim.offload import PCIE5_X16  # noqa: E402
from lrmoe.units import fmt_bytes, parse_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FULL_CONFIG = ROOT / "benchmarks" / "configs" / "qwen3-30b-a3b-full.json"
# nvidia-smi's total on the H200s here (device notes: 143771 MiB; NVIDIA's "141 GB")
H200_BYTES = "143771MiB"
HOST_BYTES = "128GiB"
LABEL = "MODELLED (ledger), not measured"


def load_config(spec: str, layers: int | None) -> ModelConfig:
    """A preset name or an HF config.json path, optionally cut to ``layers`` layers."""
    if spec in PRESETS:
        cfg = get_preset(spec)
    else:
        p = Path(spec)
        if not p.is_file():
            raise LrmoeError(f"--config {spec}: no such file and no preset of that name")
        try:
            cfg = ModelConfig.from_hf_dict(json.loads(p.read_text()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise LrmoeError(f"--config {spec} is unreadable ({e})") from None
    if layers is not None:
        if not 1 <= layers <= cfg.num_hidden_layers:
            raise LrmoeError(f"--layers {layers} must be in 1..{cfg.num_hidden_layers}")
        cfg = dataclasses.replace(cfg, num_hidden_layers=layers)
    return cfg


def rows_for(cfg, sizes: list[tuple[int, int]], modes: list[str], gpu: int, host: int) -> list:
    led = StepLedger(cfg)
    build = 4 * sum(led.params.values())  # the trainer builds the fp32 model on the CPU
    out = []
    for b, s in sizes:
        for m in modes:
            r = led.report(b * s, m)
            r.update(batch=b, seq_len=s, fits_gpu=r["gpu_peak"] <= gpu,
                     host_at_build=build, fits_host=max(r["host_total"], build) <= host)
            out.append(r)
    return out


def link_bytes(led: StepLedger, mode: str, accum: int) -> int:
    """Host-link bytes a step moves (both directions): the offloaded gradients down and
    the bf16 weights up once a step, as the trainer does (each gradient in its own
    dtype, bf16: :attr:`StepLedger.grad_link_bytes`); streamed expert gradients go down
    every micro-batch, streamed expert weights come up for every pass of every
    micro-batch (three with full checkpointing: forward, re-run, backward)."""
    off, ex = led.offloaded_params, led.params["experts"]
    down = led.grad_link_bytes
    grads = down * (off + (accum - 1) * ex if led.expert_grad_resident_layers else off)
    passes = 3 if mode == "full" else 2
    weights = 2 * (off + (accum * passes - 1) * ex if led.expert_resident_layers else off)
    return grads + weights


GPU_SIDE = [
    ("as the trainer runs", {}),
    ("loss over 1,024-token chunks (--loss-chunk 1024)", dict(loss_chunk_tokens=1024)),
    ("dense params bf16 on GPU, their fp32 master + moments on host", dict(offload_dense=True)),
    ("expert grads to host layer by layer in backward (2 layers resident)",
     dict(expert_grad_resident_layers=2, host_grad_bytes=2)),
    ("expert weights streamed per layer (2 layers resident)", dict(expert_resident_layers=2)),
]
HOST_SIDE = [
    ("as the trainer runs", {}),
    ("host grad buffer: one tensor's staging, not one per parameter",
     dict(host_grad_staging=True)),
    ("bf16 moments", dict(moment_bytes=4)),
    ("8-bit moments", dict(moment_bytes=2)),
    ("bf16 master (stochastic rounding)", dict(master_bytes=2)),
]
SMALLEST = ("loss chunks + grad staging + bf16 master + 8-bit moments",
            dict(loss_chunk_tokens=1024, host_grad_staging=True, master_bytes=2, moment_bytes=2))


def remedies(cfg, tokens: int, mode: str, gpu: int, host: int, accum: int) -> list[dict]:
    """What-ifs (:class:`StepLedger` fields), each chain cumulative, then the smallest
    change that fits both sides; each with the GPU peak, the host total it leaves and the
    host-link bytes of a step of ``accum`` micro-batches."""
    out = []
    for side, chain in (("gpu", GPU_SIDE), ("host", HOST_SIDE), ("both", [SMALLEST])):
        kw: dict = {}
        for what, more in chain:
            kw.update(more)
            led = StepLedger(cfg, **kw)
            r = led.report(tokens, mode)
            link = link_bytes(led, mode, accum)
            out.append({"side": side, "change": what, "gpu_peak": r["gpu_peak"],
                        "phase": r["gpu_peak_phase"], "host_total": r["host_total"],
                        "link_bytes_per_step": link,
                        "link_s_per_step": link / PCIE5_X16.bandwidth_Bps,
                        "fits_gpu": r["gpu_peak"] <= gpu, "fits_host": r["host_total"] <= host,
                        "ledger_fields": dict(kw)})
    return out


def max_layers(cfg, tokens: int, mode: str, gpu: int, host: int) -> int:
    """Most layers (real widths) the trainer as it runs fits on both sides."""
    best = 0
    for n in range(1, cfg.num_hidden_layers + 1):
        c = dataclasses.replace(cfg, num_hidden_layers=n)
        r = StepLedger(c).report(tokens, mode)
        if r["gpu_peak"] <= gpu and max(r["host_total"], 4 * sum(StepLedger(c).params.values())) <= host:
            best = n
    return best


def g(b: int) -> str:
    return f"{b / 2**30:,.1f}"


def markdown(cfg, rows, fixes, fix_at, most, gpu, host, refuse) -> str:
    led = StepLedger(cfg)
    st = led.state()
    p = led.params
    lines = [f"# Whole {cfg.num_hidden_layers}-layer Qwen3-MoE on one GPU — {LABEL}", "",
             f"{sum(p.values()) / 1e9:.3f}B parameters ({p['experts'] / 1e9:.3f}B in experts, "
             f"{(sum(p.values()) - p['experts']) / 1e9:.3f}B dense: attention "
             f"{p['attention'] / 1e9:.3f}B, embedding {p['embedding'] / 1e9:.3f}B, head "
             f"{p['lm_head'] / 1e9:.3f}B, routers {p['routers'] / 1e6:.1f}M, norms "
             f"{p['norms'] / 1e6:.2f}M). `--optimizer-offload host`, bf16 autocast; GPU "
             f"{g(gpu)} GiB, host {g(host)} GiB.", "",
             "State (every micro-batch size), GiB:", "",
             "| GPU term | GiB | | host term | GiB |", "|---|---:|---|---|---:|"]
    gk, hk = list(st["gpu"]), list(st["host"])
    for i in range(max(len(gk), len(hk))):
        a = (gk[i], g(st["gpu"][gk[i]])) if i < len(gk) else ("", "")
        b = (hk[i], g(st["host"][hk[i]])) if i < len(hk) else ("", "")
        lines.append(f"| {a[0]} | {a[1]} | | {b[0]} | {b[1]} |")
    lines.append(f"| **total** | **{g(sum(st['gpu'].values()))}** | | **total** | "
                 f"**{g(sum(st['host'].values()))}** |")
    lines += ["", f"Per micro-batch (GiB; peak = the largest phase; {LABEL}):", "",
              "| micro-batch | checkpoint | saved acts | weight casts | logits (bwd) | "
              "GPU peak | phase | fits GPU | host | host at build | fits host |",
              "|---|---|---:|---:|---:|---:|---|---|---:|---:|---|"]
    for r in rows:
        a = r["activations"]
        lines.append(
            f"| {r['batch']}×{r['seq_len']} | {r['mode']} | {g(a['saved_layers'])} | "
            f"{g(a['weight_casts'])} | {g(a['logits_backward'])} | {g(r['gpu_peak'])} | "
            f"{r['gpu_peak_phase']} | {'yes' if r['fits_gpu'] else 'NO'} "
            f"({g(gpu - r['gpu_peak'])} left) | {g(r['host_total'])} | {g(r['host_at_build'])} | "
            f"{'yes' if r['fits_host'] else 'NO'} |")
    lines += ["", f"What would make it fit ({fix_at}; each side's changes cumulative; host link at "
              f"{PCIE5_X16.bandwidth_Bps / 1e9:.0f} GB/s, the PCIe 5.0 x16 datasheet peak; {LABEL}):",
              "", "| side | + change | GPU peak | fits GPU | host | fits host | host link a step |",
              "|---|---|---:|---|---:|---|---:|"]
    for f in fixes:
        lines.append(f"| {f['side']} | {f['change']} | {g(f['gpu_peak'])} | "
                     f"{'yes' if f['fits_gpu'] else 'NO'} | "
                     f"{g(f['host_total'])} | {'yes' if f['fits_host'] else 'NO'} | "
                     f"{f['link_bytes_per_step'] / 1e9:,.0f} GB, {f['link_s_per_step']:.1f} s |")
    lines += ["", f"The trainer builds the fp32 model on the CPU before moving it: "
              f"{g(4 * sum(p.values()))} GiB of host at build, and as much on the GPU until "
              "the optimizer casts the experts to bf16 (both below the capacities). The host "
              "masters and gradient buffer are pinned, priced at the caching host "
              "allocator's power-of-two size per tensor; the moments are pageable.",
              "", f"Most layers (real widths) the trainer as it runs fits on both sides at "
              f"{fix_at}: {most}.",
              f"The trainer's own pre-check (`check_model_fits`: 16 B per dense and 4 B per "
              f"expert parameter on the GPU, the ledger's host state on the host) asks "
              f"{g(refuse[0])} GiB of GPU and {g(refuse[1])} GiB of host"
              + (" and refuses this model here." if refuse[0] > gpu or refuse[1] > host
                 else ".")]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- measure
def train_command(cfg_path: Path, run_dir: Path, a) -> list[str]:
    """The ``lrmoe train`` invocation the measurement runs (and prints)."""
    return [sys.executable, "-m", "lrmoe", "train", "--config", str(cfg_path),
            "--device", a.device, "--optimizer-offload", "host",
            "--activation-checkpoint", a.measure_mode, "--grad-accum", str(a.grad_accum),
            "--batch-size", str(a.micro_batches), "--seq-len", str(a.seq_len),
            "--steps", str(a.steps), "--warmup", "1", "--lr", "1e-4", "--eval-every", "0",
            "--eval-batches", "1", "--ckpt-every", "0", "--keep-ckpts", "1", "--log-every", "1",
            "--max-data-bytes", "4MiB", "--out", str(run_dir)]


def measure(cfg, a, out: Path) -> dict:
    """Run the trainer on ``cfg`` and read its metrics; the ledger's numbers beside."""
    cuda = a.device == "cuda"
    led = StepLedger(cfg, compute_dtype="bf16" if cuda else "fp32", device=a.device)
    tokens = a.micro_batches * a.seq_len
    state = led.state()
    pred = led.report(tokens, a.measure_mode) if cuda else {
        "gpu_state": state["gpu"], "host_state": state["host"]}
    host_pred = led.host_bytes()
    ckpt = (2 * led.offloaded_params + 4 * led.device_stepped_params  # weights
            + (led.master_bytes + led.moment_bytes) * led.offloaded_params
            + 8 * led.device_stepped_params)  # optimizer state
    root = Path(a.run_root)
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if free < 1.1 * ckpt:
        raise LrmoeError(f"--run-root {root} has {fmt_bytes(free)} free; the run's final "
                         f"checkpoint needs about {fmt_bytes(ckpt)}: give a larger --run-root")
    cfg_path = out / "measure_config.json"
    cfg_path.write_text(json.dumps(cfg.to_hf_dict(), indent=1))
    tmp = Path(tempfile.mkdtemp(prefix="fullsize_run_", dir=root))
    cmd = train_command(cfg_path, tmp / "run", a)
    print(f"fullsize: checkpoint of the run ~{fmt_bytes(ckpt)}; running:\n  {' '.join(cmd)}",
          flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        metrics = tmp / "run" / "metrics.jsonl"
        rows = ([json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
                if metrics.exists() else [])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise LrmoeError(f"lrmoe train exited {proc.returncode}: {' | '.join(tail)}")
    steps = [r for r in rows if r.get("kind", "train") == "train" and "tokens_per_s" in r]
    later = steps[1:] or steps  # the first step allocates the moments and warms up

    def most(rs, key):
        got = [r[key] for r in rs if r.get(key) is not None]
        return max(got) if got else None
    base = most(steps[:1], "host_rss_before_build_bytes")
    return {
        "command": " ".join(cmd), "device": a.device, "layers": cfg.num_hidden_layers,
        "tokens_per_micro_batch": tokens, "grad_accum": a.grad_accum,
        "mode": a.measure_mode, "wall_s": round(wall, 1),
        "measured": {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in later)
                     if later else None,
                     "cuda_max_mem_bytes": most(steps, "cuda_max_mem_bytes"),
                     "host_max_rss_bytes": rss,
                     "host_rss_steps_bytes": most(steps, "host_rss_bytes"),
                     "host_rss_later_steps_bytes": most(later, "host_rss_bytes"),
                     "host_rss_before_build_bytes": base, "steps": len(steps)},
        "ledger": {"gpu_peak": pred.get("gpu_peak"), "phase": pred.get("gpu_peak_phase"),
                   "phases": pred.get("phases"), "gpu_state": pred["gpu_state"],
                   "host_total": host_pred, "host_state": state["host"],
                   "host_pinned": led.pinned_host,
                   "host_at_build": 4 * sum(led.params.values())},
    }


def measure_markdown(m: dict) -> str:
    me, le = m["measured"], m["ledger"]

    def b(v):
        return "—" if v is None else fmt_bytes(v)
    tps = "—" if me["tokens_per_s"] is None else f"{me['tokens_per_s']:,.0f}"
    base = me["host_rss_before_build_bytes"]
    steady = None if base is None else base + le["host_total"]
    pinned = ("pinned at power-of-two sizes" if le["host_pinned"]
              else "nothing pinned; on the CPU every parameter's")
    return "\n".join([
        f"## Measured run ({m['device']}, {m['layers']} layers, {m['tokens_per_micro_batch']} "
        f"tokens × {m['grad_accum']} micro-batches, checkpoint {m['mode']})", "",
        f"`{m['command']}`", "",
        "| | measured | ledger (MODELLED) |", "|---|---:|---:|",
        f"| tokens/s (median, steps 2..) | {tps} | — |",
        f"| GPU peak (max_memory_allocated) | {b(me['cuda_max_mem_bytes'])} | "
        f"{b(le['gpu_peak'])} ({le['phase'] or '—'}) |",
        f"| host RSS before the model is built | {b(base)} | — |",
        f"| host RSS at the end of a step, max over steps 2.. | "
        f"{b(me['host_rss_later_steps_bytes'])} | {b(steady)} (state + RSS before build) |",
        f"| host RSS at the end of a step, max over all steps | "
        f"{b(me['host_rss_steps_bytes'])} | {b(le['host_total'])} state ({pinned}) |",
        f"| host peak RSS (whole process: model build, steps, final checkpoint save) | "
        f"{b(me['host_max_rss_bytes'])} | {b(le['host_at_build'])} at build |", ""])


# ----------------------------------------------------------------------------- main
def _sizes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        b, _, s = part.strip().partition("x")
        if not (b.isdigit() and s.isdigit() and int(b) > 0 and int(s) > 0):
            raise LrmoeError(f"--sizes {text!r}: write BxS pairs, e.g. 1x4096,2x4096")
        out.append((int(b), int(s)))
    return out


@gc.cli
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default=str(FULL_CONFIG), help="HF config.json or preset")
    ap.add_argument("--sizes", default="1x4096,2x4096,4x4096",
                    help="micro-batches BxS (sequences x tokens)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--gpu-bytes", default=H200_BYTES)
    ap.add_argument("--host-bytes", default=HOST_BYTES)
    ap.add_argument("--measure", action="store_true", help="also run lrmoe train (see above)")
    ap.add_argument("--layers", type=int, help="cut the config to this many layers (measure)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--measure-mode", default="full")
    ap.add_argument("--micro-batches", type=int, default=1, help="--batch-size of the run")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--run-root", default=tempfile.gettempdir())
    a = ap.parse_args(argv)
    modes = gc.csv(a.modes.replace(" ", ""))
    if bad := [m for m in modes + [a.measure_mode] if m not in MODES]:
        raise LrmoeError(f"--modes/--measure-mode {bad[0]!r}: use {', '.join(MODES)}")
    for name in ("micro_batches", "seq_len", "grad_accum", "steps"):
        if getattr(a, name) < 1:
            raise LrmoeError(f"--{name.replace('_', '-')} must be >= 1")
    if a.measure:
        gc.check_device(a.device)
    sizes = _sizes(a.sizes)
    gpu, host = parse_bytes(a.gpu_bytes), parse_bytes(a.host_bytes)
    whole = load_config(a.config, None)
    cut = load_config(a.config, a.layers) if a.measure else None
    out = gc.out_dir(a.out)
    from lrmoe.train.setup import state_bytes
    rows = rows_for(whole, sizes, modes, gpu, host)
    (b0, s0), m0 = sizes[0], modes[-1]
    fix_at = f"{b0}×{s0} tokens × {a.grad_accum} micro-batches, checkpoint {m0}"
    fixes = remedies(whole, b0 * s0, m0, gpu, host, a.grad_accum)
    most = max_layers(whole, b0 * s0, m0, gpu, host)
    refuse = state_bytes(whole, 1, offload=True)
    md = markdown(whole, rows, fixes, fix_at, most, gpu, host, refuse)
    meas = measure(cut, a, out) if a.measure else None
    if meas:
        md += "\n" + measure_markdown(meas)
    meta = gc.run_meta("cpu", argv=argv, device=None, label=LABEL, config=a.config,
                       gpu_bytes=gpu, host_bytes=host, trainer_precheck_bytes=list(refuse),
                       max_layers_as_is=most)
    gc.write_outputs(out, "fullsize", meta, rows + [{"remedies_at": fix_at, "remedies": fixes}]
                     + ([{"measure": meas}] if meas else []), md)
    print(md)


if __name__ == "__main__":
    sys.exit(main())
