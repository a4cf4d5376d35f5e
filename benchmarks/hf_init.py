"""From a HF checkpoint to the first training step: each rank's host memory and the time.

Makes a Qwen3-30B-A3B-shaped HF checkpoint with transformers (random init, bf16; real
widths, 128 experts, the real 151,936-token vocabulary, ``--layers`` layers;
``save_pretrained`` in 1 GB shards, a byte-level BPE tokenizer trained here saved
beside it), then runs ``lrmoe train --init-from`` with ``--optimizer-offload host``
(under torchrun at ``--ep N`` with ``--nproc N``) until ``--steps`` steps are logged, and
stops it (SIGKILL to its process group: no final checkpoint). Measured, per rank: the
bytes it read and the load's seconds, its resident set right after the load and the
high-water mark then (the trainer's ``init`` metrics row), and its peak resident set
over the whole run (``VmHWM``, read from ``/proc`` until the kill); the time from the
launch to the first logged step, and that step's own seconds. MODELLED beside it: the
loading rule's bytes per rank (1/G of the expert bytes, the dense bytes, one tensor's
buffer) for the measured config, where the bytes read are checked against it, and for
the full 48-layer model at EP 8.

    python3 benchmarks/hf_init.py --out runs/hf_init --device cuda        # H200: ~2-3 min
    python3 benchmarks/hf_init.py --out /tmp/hi --device cpu --make-device cpu --layers 2 \\
        --hidden 64 --heads 4 --kv-heads 2 --head-dim 16 --experts 8 \\
        --moe-intermediate 32 --vocab 512 --seq-len 32 --batch-size 2   # logic check

Writes ``hf_init.json`` and ``hf_init.md`` into ``--out``; the checkpoint goes to
``--work`` (default ``OUT/work``), removed afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_common as gc  # noqa: E402

from lrmoe.errors import LrmoeError  # noqa: E402

LABEL = "MODELLED (the loading rule on the config's shapes), not measured"
FULL = dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128,
            moe_intermediate=768, vocab=151936, intermediate=6144)


# ----------------------------------------------------------------------------- the rule
def model_config(s: dict):
    """lrmoe's :class:`ModelConfig` of a Qwen3-MoE shape dict (``FULL``'s keys)."""
    from lrmoe.config import ModelConfig

    return ModelConfig(model_type="qwen3_moe", vocab_size=s["vocab"], hidden_size=s["hidden"],
                       intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
                       num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                       head_dim=s["head_dim"], moe_intermediate_size=s["moe_intermediate"],
                       num_experts=s["experts"], num_experts_per_tok=min(8, s["experts"]),
                       norm_topk_prob=True, max_position_embeddings=40960,
                       rope_theta=1e6, tie_word_embeddings=False)


def rule(cfg, ep: int, file_bytes: int = 2) -> dict:
    """The loading rule per rank at EP ``ep`` from the HF tensors of ``cfg`` (as
    ``save_pretrained`` writes them, ``file_bytes`` each element): bytes read (dense +
    experts / ep), the largest tensor, and the host bytes while loading when the model
    goes to the GPU (one tensor's pages) or stays on the CPU (the rank's fp32
    parameters plus one tensor)."""
    from lrmoe.hf import _plan
    from lrmoe.model.transformer import MoEForCausalLM

    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in MoEForCausalLM(cfg).state_dict().items()}
    expert = dense = largest = 0
    for pc in _plan(shapes, cfg, None):
        n = math.prod(pc.shape)
        largest = max(largest, n * file_bytes)
        if pc.target.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            expert += n
        else:
            dense += n
    read = (dense + expert // ep) * file_bytes
    return {"ep": ep, "expert_bytes": expert * file_bytes, "dense_bytes": dense * file_bytes,
            "largest_tensor_bytes": largest, "read_per_rank_bytes": read,
            "host_loading_cuda_bytes": largest,
            "host_loading_cpu_bytes": 4 * (dense + expert // ep) + largest}


# ----------------------------------------------------------------------------- checkpoint
def make_checkpoint(d: Path, s: dict, a) -> float:
    """The HF directory: transformers' Qwen3-MoE at shape ``s``, random init, bf16,
    sharded; a BPE tokenizer beside it. Returns the seconds it took."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from lrmoe.data import load_corpus

    t0 = time.perf_counter()
    cfg = tf.Qwen3MoeConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
        moe_intermediate_size=s["moe_intermediate"], num_experts=s["experts"],
        num_experts_per_tok=min(8, s["experts"]), norm_topk_prob=True,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    with torch.device(a.make_device):
        model = tf.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(d, max_shard_size=a.shard)
    del model
    if a.make_device == "cuda":
        torch.cuda.empty_cache()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = load_corpus(None, max_bytes=2**18).train_texts
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=min(a.tokenizer_vocab, s["vocab"]), special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(d)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- the run
def train_command(d: Path, run: Path, a) -> list[str]:
    lrmoe = ["-m", "lrmoe", "train", "--init-from", str(d), "--device", a.device,
             "--optimizer-offload", "host", "--steps", "1000", "--batch-size",
             str(a.batch_size), "--seq-len", str(a.seq_len), "--warmup", "1", "--lr", "1e-5",
             "--eval-every", "0", "--ckpt-every", "0", "--eval-batches", "1",
             "--max-data-bytes", "2MiB", "--log-every", "1", "--out", str(run)]
    if a.nproc == 1:
        return [sys.executable, *lrmoe]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--standalone", "--nproc-per-node", str(a.nproc), *lrmoe,
            "--ep", str(a.nproc)]


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k = line.split(":")[0]
                if k in ("VmRSS", "VmHWM"):
                    out[k] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def _workers(p: subprocess.Popen, nproc: int) -> dict[int, int]:
    """rank -> pid: the launched process itself, or torchrun's workers (by RANK)."""
    if nproc == 1:
        return {0: p.pid}
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) != p.pid:
            continue  # not a child of this torchrun
        for kv in env:
            if kv.startswith(b"RANK="):
                out[int(kv[5:])] = int(d.name)
    return out


def _rows(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    if not f.exists():
        return []
    out = []
    for line in f.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a row being written
    return out


def run_training(d: Path, run: Path, a) -> dict:
    cmd = train_command(d, run, a)
    print("hf_init: running\n  " + " ".join(cmd), flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    log = open(run.parent / "train.log", "w")
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    peaks: dict[int, dict] = {}
    first = None
    try:
        while True:
            for rank, pid in _workers(p, a.nproc).items():
                st = _status(pid)
                if st:
                    peaks[rank] = {"pid": pid, "VmHWM": max(st["VmHWM"], peaks.get(
                        rank, {}).get("VmHWM", 0))}
            train = [r for r in _rows(run) if r.get("kind") == "train"]
            if train and first is None:
                first = time.perf_counter() - t0
            if len(train) >= a.steps:
                break
            if p.poll() is not None:
                log.close()
                tail = (run.parent / "train.log").read_text().strip().splitlines()[-5:]
                raise LrmoeError(f"lrmoe train exited {p.returncode} before {a.steps} steps: "
                                 + " | ".join(tail))
            if time.perf_counter() - t0 > a.timeout:
                raise LrmoeError(f"lrmoe train took over --timeout {a.timeout}s")
            time.sleep(0.1)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # the process group this script started
        p.wait()
        log.close()
    rows = _rows(run)
    init = next(r for r in rows if r.get("kind") == "init")
    train = [r for r in rows if r.get("kind") == "train"]
    ranks = []
    for r, got in enumerate(init["ranks"]):
        ranks.append({"rank": r, **{k: got[k] for k in ("tensors", "bytes_read",
                                                        "largest_bytes", "seconds")},
                      "rss_after_load_bytes": got["host_rss_bytes"],
                      "peak_rss_at_load_bytes": got["host_peak_rss_bytes"],
                      "peak_rss_run_bytes": peaks.get(r, {}).get("VmHWM")})
    return {"command": " ".join(cmd), "wall_to_first_step_s": round(first, 2),
            "first_step_s": train[0]["step_s"], "later_step_s": [r["step_s"] for r in train[1:]],
            "rss_before_build_bytes": train[0].get("host_rss_before_build_bytes"),
            "cuda_max_mem_bytes": max((r.get("cuda_max_mem_bytes") or 0) for r in train) or None,
            "steps": len(train), "ranks": ranks}


# ----------------------------------------------------------------------------- report
def _gib(b) -> str:
    from lrmoe.units import fmt_bytes

    return "—" if b is None else fmt_bytes(b)


def markdown(meta: dict, res: dict) -> str:
    m, here, full = res["measured"], res["rule_measured_config"], res["rule_full_ep8"]
    lines = [f"# From a HF checkpoint to the first step ({meta['device']})", "",
             f"Config: {res['shape']}; checkpoint made in {res['make_s']:.1f}s "
             f"({_gib(res['checkpoint_bytes'])} on disk). Command: `{m['command']}`", "",
             f"Time to the first step (launch to its metrics row): "
             f"**{m['wall_to_first_step_s']:.1f}s**; the step itself {m['first_step_s']:.2f}s,"
             f" later steps {', '.join(f'{x:.2f}' for x in m['later_step_s'])}s. "
             f"GPU peak {_gib(m['cuda_max_mem_bytes'])}.", "",
             "Measured per rank (read: tensor bytes as stored in the files):", "",
             *gc.md_head("rank", "read", "rule: read", "tensors", "load s", "RSS before build",
                      "RSS after load", "peak RSS at load", "peak at load − before build",
                      "rule: host while loading", "peak RSS, whole run")]
    hold = here[f"host_loading_{res['device']}_bytes"]
    for r in m["ranks"]:
        before = m["rss_before_build_bytes"]
        grew = None if before is None else r["peak_rss_at_load_bytes"] - before
        lines.append(f"| {r['rank']} | {_gib(r['bytes_read'])} | "
                     f"{_gib(here['read_per_rank_bytes'])} | {r['tensors']} | "
                     f"{r['seconds']:.1f} | {_gib(before)} | "
                     f"{_gib(r['rss_after_load_bytes'])} | {_gib(r['peak_rss_at_load_bytes'])} | "
                     f"{_gib(grew)} | {_gib(hold)} | {_gib(r['peak_rss_run_bytes'])} |")
    lines += ["", "RSS before build: the largest over the ranks (the first metrics row). The rule while "
              "loading: on the GPU one tensor's pages (the parameters are on the device), on "
              "the CPU the rank's fp32 parameters plus one tensor. The whole run's peak "
              "includes the host optimizer state (`--optimizer-offload host`: fp32 masters and "
              "moments of the rank's experts).",
              "", f"## The full 48-layer Qwen3-30B-A3B at EP {full['ep']} ({LABEL})", "",
              *gc.md_head("term", "bytes"),
              f"| expert bytes (bf16, all ranks) | {_gib(full['expert_bytes'])} |",
              f"| dense bytes (bf16) | {_gib(full['dense_bytes'])} |",
              f"| largest tensor | {_gib(full['largest_tensor_bytes'])} |",
              f"| read per rank: dense + experts / {full['ep']} | "
              f"{_gib(full['read_per_rank_bytes'])} |",
              f"| host while loading, model to the GPU: one tensor | "
              f"{_gib(full['host_loading_cuda_bytes'])} |",
              f"| host while loading, model on the CPU: fp32 parameters + one tensor | "
              f"{_gib(full['host_loading_cpu_bytes'])} |",
              f"| every rank reading the whole checkpoint (before) | "
              f"{_gib(full['expert_bytes'] + full['dense_bytes'])} |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=None, help="where the checkpoint and run go "
                    "(default OUT/work)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and run")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--make-device", default=None, choices=("cuda", "cpu"),
                    help="where transformers builds the model (default --device)")
    ap.add_argument("--nproc", type=int, default=1, help="ranks (torchrun, --ep NPROC)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--shard", default="1GB", help="save_pretrained's max_shard_size")
    ap.add_argument("--tokenizer-vocab", type=int, default=4096)
    ap.add_argument("--timeout", type=float, default=540.0)
    for k, v in FULL.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=4 if k == "layers" else v)
    a = ap.parse_args(argv)
    a.make_device = a.make_device or a.device
    if (a.device == "cuda" or a.make_device == "cuda") and not torch.cuda.is_available():
        raise LrmoeError("no GPU is visible: run on the GPU, or --device cpu --make-device "
                         "cpu for the logic check")
    if a.steps < 1 or a.nproc < 1:
        raise LrmoeError("--steps and --nproc must be >= 1")
    out = gc.out_dir(a.out)
    work = Path(a.work) if a.work else out / "work"
    if work.exists():
        raise LrmoeError(f"--work {work} exists; remove it or give another")
    shape = {k: getattr(a, k) for k in FULL}
    cfg = model_config(shape)
    try:
        work.mkdir(parents=True)
        d = work / "model"
        make_s = make_checkpoint(d, shape, a)
        size = sum(p.stat().st_size for p in d.glob("*.safetensors"))
        measured = run_training(d, work / "run", a)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    here = rule(cfg, a.nproc)
    res = {"shape": shape, "device": a.device, "make_s": round(make_s, 1), "checkpoint_bytes": size,
           "measured": measured, "rule_measured_config": here,
           "rule_full_ep8": rule(model_config(FULL), 8),
           "read_equals_rule": all(r["bytes_read"] == here["read_per_rank_bytes"]
                                   for r in measured["ranks"])}
    meta = gc.run_meta(a.device, argv=argv, label_rule=LABEL)
    gc.write_outputs(out, "hf_init", meta, [res], markdown(meta, res))
    print(markdown(meta, res))
    return 0


if __name__ == "__main__":
    sys.exit(gc.cli(main)())
