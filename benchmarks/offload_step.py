"""The host optimizer's exposed time in the trainer's step: pipelined against serial.

Runs ``lrmoe train`` (in this process, its real step: micro-batches, gradient sync,
clipping, the optimizer, ``--optimizer-offload host``) three times on the same data
and seed, each with another optimizer for the experts, and reads each step's measured
wall time (``step_s`` of ``metrics.jsonl``: the trainer synchronises the device at the end
of every step):

* ``pipeline``: :class:`lrmoe.train.offload.HostOffloadAdamW` as the trainer builds it
  (bf16 gradients to the host as they become final, the chunked host AdamW, the
  weights back on a side stream);
* ``serial``: the update as it ran before the pipeline (``tests/references/
  offload_adamw.py``: after backward, fp32 gradients to the host, the host AdamW, the
  weights back, device-wide waits between);
* ``none``: the same optimizer with no host work at all (the experts are not updated):
  the step the other two add to.

Exposed host-optimizer time = median step time of a mode − that of ``none`` (steps
after ``--warmup``). The pipeline's own stage times (CUDA events on its copies, the
update's busy time) give what its stages take back to back, and ``exposed /
back-to-back`` is the fraction of the host optimizer the overlap leaves on the critical
path: the number ``lrmoe bench ttl`` charges its modelled host-optimizer stages by
(:data:`lrmoe.sim.offload.MEASURED_OVERLAP`; the line to paste is printed).

The default workloads are one EP rank's share of the registered headline cells (EP 8):
the two-layer Qwen3-30B-A3B and GLM-4.5-Air-twin configs with 16 of their 128 experts
(a rank's, and so its host optimizer's share), top-8, 16 x 256 tokens a micro-batch
(a rank's 4,096), 4 micro-batches a step; all-to-alls absent. The final checkpoint is
not written.

    python3 benchmarks/offload_step.py --out DIR                       # H200, ~2-3 min
    python3 benchmarks/offload_step.py --out DIR --device cpu --workloads tiny \\
        --steps 4 --warmup 1 --batch-size 2 --seq-len 32 --max-data-bytes 200000  # logic

Writes ``offload_step.json`` and ``offload_step.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from gc import collect
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # the serial reference

import gpu_common as gc  # noqa: E402

from lrmoe.config import ModelConfig  # noqa: E402
from lrmoe.errors import LrmoeError  # noqa: E402
from lrmoe.train.host_pipe import HOST_CHUNK  # noqa: E402

WORKLOADS = {  # name -> (config file or preset, experts kept)
    "qwen3": ("benchmarks/configs/qwen3-30b-a3b-layer-2L.json", 16),
    "glm": ("benchmarks/configs/glm-4.5-air-moe-2L-bias03.json", 16),
    "tiny": ("tiny-qwen3", None),
}
MODES = ("pipeline", "serial", "none")


def model_config(name: str) -> ModelConfig:
    src, experts = WORKLOADS[name]
    if src.endswith(".json"):
        cfg = ModelConfig.from_hf_dict(json.loads((ROOT / src).read_text()))
    else:
        from lrmoe.presets import get_preset
        cfg = get_preset(src)
    return cfg if experts is None else dataclasses.replace(cfg, num_experts=experts)


def optimizer_for(mode: str, times: list, chunk: int = HOST_CHUNK):
    """``build_optimizer``'s stand-in for ``mode``: the experts' optimizer the run uses
    (bf16 device experts, as the trainer on CUDA; on the CPU too, so the pipeline runs);
    each step's pipeline or serial timings appended to ``times``."""
    from lrmoe.train.offload import HostOffloadAdamW, offloaded_params
    from lrmoe.train.optim import param_groups
    from references.offload_adamw import SerialHostOffloadAdamW

    class Timed:
        def step(self, closure=None):
            out = super().step(closure)
            row = {"host_s": self.host_s}
            if isinstance(self, HostOffloadAdamW) and self.pipelined:
                row.update(dataclasses.asdict(self.pipe_times), busy_s=self.pipe_times.busy_s)
            times.append(row)
            return out

        def zero_grad(self, set_to_none=True):
            if times and isinstance(self, HostOffloadAdamW) and self.pipelined:
                times[-1].update(self._pipe.copy_ms())  # the trainer synchronised: done
            super().zero_grad(set_to_none)

    class Pipeline(Timed, HostOffloadAdamW):
        pass

    class Serial(Timed, SerialHostOffloadAdamW):
        pass

    class NoHostWork(HostOffloadAdamW):
        def arm(self, finish):  # no gradient leaves the device
            pass

        def _jobs(self):  # and no host update: the experts stay as they are
            return []

    cls = {"pipeline": Pipeline, "serial": Serial, "none": NoHostWork}[mode.split("@")[0]]
    more = {} if cls is Serial else {"chunk": chunk}

    def build(model, lr, weight_decay, offload="device", host="cpu", router_lr_scale=1.0,
              compute_dtype=None):
        opt = cls(param_groups(model, weight_decay, lr, router_lr_scale),
                  offloaded_params(model), lr=lr, host=host, compute_dtype=torch.bfloat16, **more)
        if cls is Pipeline:
            opt._pipe.timing = True
        return opt
    return build


def run_mode(name: str, mode: str, a, work: Path) -> dict:
    import lrmoe.train.loop as loop
    from lrmoe.train import TrainConfig, train
    from lrmoe.train.metrics import read_metrics

    cfg = model_config(name)
    cfg_path = work / f"{name}.json"
    cfg_path.write_text(json.dumps(cfg.to_hf_dict()))
    times: list[dict] = []
    chunk = int(mode.split("@")[1]) if "@" in mode else HOST_CHUNK
    patched = {"build_optimizer": optimizer_for(mode, times, chunk)}
    saved = {k: getattr(loop, k) for k in patched}
    save = loop._Run.save
    try:
        for k, v in patched.items():
            setattr(loop, k, v)
        loop._Run.save = lambda self, step: None  # no final checkpoint: not timed anyway
        out = work / f"{name}_{mode}"
        train(TrainConfig.from_flat(
            config=str(cfg_path), out=str(out), steps=a.steps, batch_size=a.batch_size,
            seq_len=a.seq_len, grad_accum=a.grad_accum, lr=1e-3, warmup=a.steps,
            device=a.device, seed=a.seed, eval_every=0, eval_batches=1, ckpt_every=0,
            optimizer_offload="host", max_data_bytes=a.max_data_bytes, progress=False,
            threads=a.threads))
        rows = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    finally:
        for k, v in saved.items():
            setattr(loop, k, v)
        loop._Run.save = save
        collect()
        if a.device == "cuda":
            torch.cuda.empty_cache()
    later = slice(a.warmup, None)
    dts = [r["step_s"] * 1e3 for r in rows][later]
    res = {"workload": name, "mode": mode, "step_ms": dts, "median_step_ms": statistics.median(dts),
           "losses": [r["loss"] for r in rows]}
    if times:
        t = times[later]
        for k in ("host_s", "update_s", "busy_s", "grad_wait_s", "ring_wait_s"):
            if got := [x[k] for x in t if k in x]:
                res[f"median_{k[:-2]}_ms"] = statistics.median(got) * 1e3
        for k in ("d2h", "h2d"):  # resolved at the next step's start: not the last step
            if got := [x[k] for x in t if x.get(k) is not None]:
                res[f"median_{k}_ms"] = statistics.median(got)
    return res


def summarize(name: str, rows: dict[str, dict], cfg: ModelConfig) -> dict:
    """Exposed times against ``none``, the pipeline's back-to-back stage sum, the
    fraction left exposed, and the emulator's modelled serial charge for these bytes."""
    from lrmoe.sim.offload import OffloadModel

    base = rows["none"]["median_step_ms"]
    exp = {m: rows[m]["median_step_ms"] - base for m in ("pipeline", "serial")}
    p = rows["pipeline"]
    stages = p.get("median_d2h_ms", 0.0) + p["median_busy_ms"] + p.get("median_h2d_ms", 0.0)
    P = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    serial = OffloadModel(cfg.num_experts, 1, P * len(cfg.moe_layers), 2, "owner", overlap=None)
    modelled = sum(v[0] for v in serial.rank_seconds(None, None).values()) * 1e3
    # a mode no slower than ``none`` (step-time noise above the host work): no ratio
    return {"workload": name, "params_offloaded": P * cfg.num_experts * len(cfg.moe_layers),
            "exposed_serial_ms": exp["serial"], "exposed_pipeline_ms": exp["pipeline"],
            "pipeline_over_serial": (exp["pipeline"] / exp["serial"]
                                     if exp["serial"] > 0 and exp["pipeline"] > 0 else None),
            "pipeline_stages_back_to_back_ms": stages,
            "exposed_fraction": (exp["pipeline"] / stages
                                 if stages > 0 and exp["pipeline"] > 0 else None),
            "emulator_modelled_serial_ms": modelled,
            "same_losses_pipeline_serial": rows["pipeline"]["losses"] == rows["serial"]["losses"]}


def markdown(meta: dict, rows: list[dict], sums: list[dict]) -> str:
    lines = [f"# Host optimizer in the trainer's step ({meta['device']})", "",
             f"`{meta['command']}` — torch {meta['torch']}, {meta['date']}. Measured: each "
             "step's wall time (`step_s`, the trainer synchronises at its end), median over the "
             "steps after the warm-up.", "",
             *gc.md_head("workload", "mode", "step ms", "host_s ms", "host update ms",
                         "update busy ms", "waiting for gradients ms", "waiting for ring slots ms",
                         "D2H ms (device)", "H2D ms (device)")]
    for r in rows:
        def f(k, r=r):
            return gc.fmt(r.get(k), ".1f")
        lines.append(f"| {r['workload']} | {r['mode']} | {r['median_step_ms']:.1f} | "
                     f"{f('median_host_ms')} | {f('median_update_ms')} | {f('median_busy_ms')} | "
                     f"{f('median_grad_wait_ms')} | {f('median_ring_wait_ms')} | "
                     f"{f('median_d2h_ms')} | {f('median_h2d_ms')} |")
    lines += ["", *gc.md_head("workload", "offloaded params", "exposed serial ms",
                              "exposed pipeline ms", "pipeline / serial",
                              "pipeline stages back to back ms", "exposed fraction",
                              "emulator's modelled serial ms (MODELLED)", "same losses")]
    for s in sums:
        lines.append(f"| {s['workload']} | {s['params_offloaded'] / 1e6:.1f}M | "
                     f"{s['exposed_serial_ms']:.1f} | {s['exposed_pipeline_ms']:.1f} | "
                     f"{gc.fmt(s['pipeline_over_serial'], '.3f')} | "
                     f"{s['pipeline_stages_back_to_back_ms']:.1f} | "
                     f"{gc.fmt(s['exposed_fraction'], '.3f')} | "
                     f"{s['emulator_modelled_serial_ms']:.1f} | {s['same_losses_pipeline_serial']} |")
    return "\n".join(lines) + "\n"


@gc.cli
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workloads", default="qwen3,glm", help=f"of {sorted(WORKLOADS)}")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-data-bytes", type=int, default=16 * 2**20)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--chunks", default="", help="more pipeline runs, each with this many "
                    "elements a host-update chunk (the trainer's: %d)" % HOST_CHUNK)
    a = ap.parse_args(argv)
    gc.check_device(a.device)
    names = gc.csv(a.workloads)
    if bad := [n for n in names if n not in WORKLOADS]:
        raise LrmoeError(f"--workloads: unknown {bad}; valid: {sorted(WORKLOADS)}")
    if not 0 <= a.warmup < a.steps:
        raise LrmoeError(f"--warmup {a.warmup}: want 0 <= warmup < --steps {a.steps}")
    d = gc.out_dir(a.out)
    rows, sums = [], []
    with tempfile.TemporaryDirectory() as td:
        for name in names:
            modes = MODES + tuple(f"pipeline@{c}" for c in gc.csv(a.chunks, int, "--chunks"))
            got = {m: run_mode(name, m, a, Path(td)) for m in modes}
            for m in modes:
                print(f"[{name}] {m}: median step {got[m]['median_step_ms']:.1f} ms", flush=True)
            rows += list(got.values())
            sums.append(summarize(name, got, model_config(name)))
    meta = gc.run_meta(a.device, threads=torch.get_num_threads())
    md = markdown(meta, rows, sums)
    gc.write_outputs(d, "offload_step", meta, rows + sums, md)
    print(md)
    for s in sums:
        if s["exposed_fraction"] is not None:
            print(f"sim/offload.py MEASURED_OVERLAP candidate ({s['workload']}): exposed "
                  f"fraction {s['exposed_fraction']:.3f} ({meta['device']}, {meta['date']})")


if __name__ == "__main__":
    sys.exit(main())
