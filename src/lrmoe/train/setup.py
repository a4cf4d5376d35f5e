"""The trainer's setup steps that must end with every rank agreeing: the same flags
(:func:`check_same_flags`), an error on any rank raised on all (:func:`.ranks.agree`), and
the run directory taken once every input is valid (:func:`open_run_dir`, :mod:`.rundir`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lrmoe.cli_flags import flag
from lrmoe.config import ModelConfig
from lrmoe.errors import LrmoeError, quiet_unless, require
from lrmoe.ledger import DTYPE_BYTES
from lrmoe.train import checkpoint as ckpt
from lrmoe.train import rundir
from lrmoe.train.config import RUN_CONFIG, TrainConfig, resolve_model_config
from lrmoe.train.metrics import METRICS_FILE, proc_kib, truncate_metrics
from lrmoe.train.ranks import agree, all_gather, raise_first

# Flags that may differ between ranks: where files are on this node (the data, tokenizer
# and model are compared by content instead) and how this process runs
PER_RANK_FLAGS = ("out", "data", "preset", "config", "init_from", "tokenizer", "threads",
                  "timeout_s", "log_every", "progress")


def flags_fingerprint(cfg: TrainConfig) -> dict:
    """``{"--lr": 0.003, ..., "model config's hidden_size": 64, ...}``: what every rank
    must agree on (model keys absent on a resume that takes the model from the run)."""
    fp = {flag(k): v for k, v in cfg.flat().items() if k not in PER_RANK_FLAGS}
    mcfg = resolve_model_config(cfg, vocab_size=None)
    if mcfg is not None:
        fp.update({f"model config's {k}": v for k, v in mcfg.to_hf_dict().items()})
    return fp


def check_same_flags(cfg: TrainConfig, rank: int, world: int,
                     early: LrmoeError | None = None) -> None:
    """Collective: raise on every rank if any rank's flags or model config differ from rank
    0's, or a rank's flags were refused before it joined (``early``)."""
    err, fp = None if early is None else str(early), {}
    try:
        if err is None:
            fp = flags_fingerprint(cfg)
    except LrmoeError as e:
        err = str(e)
    got = all_gather((err, json.dumps(fp, default=repr)), world)
    raise_first([e for e, _ in got], rank=rank)
    if all(text == got[0][1] for _, text in got):
        return
    r = next(i for i, (_, text) in enumerate(got) if text != got[0][1])
    fps = [json.loads(text) for _, text in got]
    keys = list(fps[0]) + [k for k in fps[r] if k not in fps[0]]
    k = next(k for k in keys if fps[r].get(k, "(none)") != fps[0].get(k, "(none)"))
    same = "--preset and --config" if k.startswith("model") else "flags"
    raise quiet_unless(LrmoeError(
        f"rank {r}'s {k} ({fps[r].get(k, '(none)')}) differs from rank 0's "
        f"({fps[0].get(k, '(none)')}): give every rank the same {same}"), rank == 0)


def leave_process_group(agreed: bool) -> None:
    """Leave the job's process group, if joined: after an error every rank raised alike
    (``agreed``) a barrier first, so no rank tears down a connection a peer still uses (a
    process exiting with the group alive can abort in C++ at exit)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if agreed:
        with contextlib.suppress(Exception):
            dist.barrier()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def pinned_bytes(nbytes: int) -> int:
    """Host bytes a pinned tensor of ``nbytes`` holds: PyTorch's caching host allocator rounds
    every request up to the next power of two (unless ``pinned_max_round_threshold`` is set)."""
    n = int(nbytes)
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def offloaded_numels(cfg: ModelConfig, ep_size: int = 1, dense: bool = False) -> list[int]:
    """Elements of each tensor one EP rank's host offload keeps (``dense``: every parameter)."""
    from lrmoe.model import MoEForCausalLM
    from lrmoe.train.offload import offloaded_params

    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    if dense:
        return [p.numel() for p in model.parameters()]
    return [p.numel() // ep_size for p in offloaded_params(model)]


def host_state(numels: list[int], device: str = "cuda", compute_dtype: str = "bf16",
               master_bytes: int = 4, moment_bytes: int = 8, grad_bytes: int | None = None,
               staging: bool = False) -> dict[str, int]:
    """Host bytes by term of the offloaded tensors of ``numels`` elements, as ``HostOffloadAdamW``
    allocates them on ``device``; ``staging``: one gradient buffer of the largest tensor."""
    from lrmoe.train.host_pipe import HOST_CHUNK, RING

    require(device in ("cuda", "cpu"), f"device {device!r}: use cuda or cpu")
    moments = moment_bytes * sum(numels)
    if device == "cpu" and compute_dtype == "fp32":  # HostOffloadAdamW._own_master
        return {"masters": 0, "moments": moments, "grad_buffer": 0, "pipeline_staging": 0}
    size = pinned_bytes if device == "cuda" else int
    bw = DTYPE_BYTES[compute_dtype]
    gb = bw if grad_bytes is None else grad_bytes
    grads = [max(numels, default=0) * gb] if staging else [gb * n for n in numels]
    span = min(HOST_CHUNK, max(numels, default=0))
    pipe = 4 * span + (RING * pinned_bytes(bw * span) if device == "cuda" else 0)
    return {"masters": sum(size(master_bytes * n) for n in numels),
            "moments": moments,
            "grad_buffer": sum(size(b) for b in grads if b),
            "pipeline_staging": pipe}


def state_bytes(mcfg, ep_size: int, offload: bool = False,
                device: str = "cuda") -> tuple[int, int]:
    """``(device, host)`` bytes of one rank's model state where it trains: 16 bytes a
    parameter (experts 1/``ep_size``); with ``offload`` the experts' state on the host."""
    from lrmoe.presets import param_breakdown, param_counts

    total, _ = param_counts(mcfg)
    experts = param_breakdown(mcfg)["experts"]
    mine = experts // ep_size
    if offload:
        dtype = "bf16" if device == "cuda" else "fp32"  # the trainer's compute dtype
        host = host_state(offloaded_numels(mcfg, ep_size), device, dtype)
        return 16 * (total - experts) + 2 * DTYPE_BYTES[dtype] * mine, sum(host.values())
    return 16 * (total - experts) + 16 * mine, 0


def check_model_fits(mcfg, cfg: TrainConfig, ctx) -> None:
    """Refuse, before anything is allocated, a model whose parameters, gradients and
    optimizer state alone exceed the GPU's memory or the host's (activations come on top)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    on_host = "the host has available (MemAvailable)" + (
        f", for its {local} ranks" if local > 1 else "")
    dev, host = state_bytes(mcfg, ctx.ep_size, cfg.optimizer_offload == "host",
                            ctx.device.type)
    avail = proc_kib("/proc/meminfo", "MemAvailable")
    if ctx.device.type == "cuda":
        checks = [(dev, 1, torch.cuda.mem_get_info(ctx.device)[1],
                   f"GPU {ctx.device} has in all")]
        if host:
            checks.append((host, local, avail, on_host + " for the offloaded optimizer state"))
    else:  # parameters, gradients and optimizer state all in host memory
        checks = [(dev + host, local, avail, on_host)]
    for per, n, have, where in checks:
        if have is not None and per * n > have:
            raise LrmoeError(
                f"the model needs about {per * n / 2**30:,.1f} GiB for its parameters, "
                f"gradients and AdamW state ({per / 2**30:,.1f} GiB a rank at --ep "
                f"{ctx.ep_size}), more than the {have / 2**30:,.1f} GiB {where}; use a "
                "smaller model or a larger --ep")


def train_fields(cfg: TrainConfig, saved: dict | None) -> dict:
    """``config.json``'s ``train``: the flags, a resume keeping the model's origin
    (``--preset`` / ``--config`` / ``--init-from`` are not re-given on resume)."""
    train = cfg.flat()
    for k in ("preset", "config", "init_from"):
        if train[k] is None and saved is not None:
            train[k] = saved.get("train", {}).get(k)
    return train


def _write_run_dir(cfg: TrainConfig, run_dir: Path, ck, run_cfg: dict, tok,
                   need_bytes: int) -> None:
    """Rank 0, holding the lock: re-check (another run may have written meanwhile), write."""
    try:
        has_ck = bool(ckpt.checkpoint_dirs(run_dir))
        rundir.check_out(run_dir, cfg.resume, has_ck)
        now = ckpt.latest_checkpoint(run_dir)
        if (ck is None and has_ck) or (ck is not None and (now is None
                                                               or now.step != ck.step)):
            raise LrmoeError(f"--out {run_dir} changed while this run started (another run "
                             "wrote checkpoints); give another --out")
        rundir.mark(run_dir)
        left = ckpt.partial_dirs(run_dir)  # interrupted saves: they may hold the space
        rundir.probe_writable(run_dir, 0, left)
        rundir.probe_writable(ckpt.ckpt_root(run_dir), need_bytes, left)
        if ck is None:
            (run_dir / METRICS_FILE).unlink(missing_ok=True)
        else:
            torn = truncate_metrics(run_dir / METRICS_FILE, ck.step)
            if torn:
                print(f"lrmoe train: note: dropped {len(torn)} cut-off row(s) of "
                      f"{run_dir / METRICS_FILE} (line {', '.join(map(str, torn))}: written "
                      "in part when the run was stopped)", file=sys.stderr, flush=True)
        tok.save(run_dir)
        ckpt.atomic_write_text(run_dir / RUN_CONFIG, json.dumps(run_cfg, indent=1))
    except OSError as e:
        raise LrmoeError(rundir.os_error_line(e, "cannot write")) from None


def open_run_dir(cfg: TrainConfig, run_dir: Path, ck, run_cfg: dict, tok, model,
                 ctx) -> None:
    """Take and write the run directory (rank 0), check every rank sees it and can write
    its shards (``ck``: the checkpoint resumed, or None); a refusal leaves it as it was."""
    # about one shard: weights plus AdamW's two moments, with 10% slack
    need = int(sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 * 1.1)
    created = agree(lambda: rundir.take(run_dir) if ctx.is_main else None, ctx)
    try:
        if ctx.distributed:
            lock = run_dir / rundir.LOCK
            holder = all_gather(rundir.read_lock(lock) if ctx.is_main else None, ctx.world)[0]
            agree(lambda: None if ctx.is_main else rundir.check_shared(run_dir, holder), ctx)
        agree(lambda: _write_run_dir(cfg, run_dir, ck, run_cfg, tok, need)
              if ctx.is_main else None, ctx)
    except LrmoeError:
        if ctx.is_main:
            rundir.give_up(run_dir, created, (ckpt.ckpt_root(run_dir),))
        raise
    agree(lambda: None if ctx.is_main else rundir.probe_writable(ckpt.ckpt_root(run_dir), need),
          ctx)
