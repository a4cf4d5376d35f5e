"""Checkpoints: one directory per step, one ``torch.save`` shard per rank, a manifest last.

Layout (``RUN/checkpoints/ckpt-00000300/``)::

    shard-rank00000-of-00002.pt   # rank 0's state (torch.save, weights_only-loadable)
    shard-rank00001-of-00002.pt
    manifest.json                 # written last, by rank 0, after every shard is on disk

Every file is written atomically: a temp file in the same directory, ``fsync``, then
``os.replace`` and an ``fsync`` of the directory. The manifest lists each shard's byte
size and SHA-256, so a truncated or corrupt shard is detected before anything is
loaded; a directory without a manifest is an interrupted save and is ignored (an
earlier complete checkpoint is used). A shard holds the rank's model state (its expert
shard under EP), optimizer and scheduler state, the step, the RNG states (torch CPU,
CUDA, the runtime's generator), each MoE layer's previous-step counts, the data
position and the run's progress counters.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from lrmoe.errors import LrmoeError
from lrmoe.parallel.groups import is_expert_param

FORMAT = "lrmoe-checkpoint-v1"
CKPT_DIR = "checkpoints"
PREFIX = "ckpt-"
MANIFEST = "manifest.json"


# ----------------------------------------------------------------------------- atomic I/O
def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------- naming
def ckpt_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CKPT_DIR


def ckpt_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return ckpt_root(run_dir) / f"{PREFIX}{step:08d}"


def shard_name(rank: int, world: int) -> str:
    return f"shard-rank{rank:05d}-of-{world:05d}.pt"


def _step_of(d: Path) -> int | None:
    if not d.name.startswith(PREFIX) or not d.is_dir():
        return None
    try:
        return int(d.name[len(PREFIX):])
    except ValueError:
        return None


def checkpoint_dirs(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every ``ckpt-*`` directory (complete or not), by step."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return []
    out = [(s, d) for d in root.iterdir() if (s := _step_of(d)) is not None]
    return sorted(out)


@dataclass
class Checkpoint:
    """A complete checkpoint: its directory, step and manifest."""

    path: Path
    step: int
    manifest: dict

    @property
    def world(self) -> int:
        return int(self.manifest["world"])

    @property
    def ep_size(self) -> int:
        return int(self.manifest["ep_size"])

    def shard(self, rank: int) -> Path:
        return self.path / shard_name(rank, self.world)


def read_manifest(d: Path) -> dict:
    p = d / MANIFEST
    try:
        m = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LrmoeError(f"checkpoint manifest {p} is unreadable or corrupt ({e}); delete "
                         f"{d} to resume from an earlier checkpoint") from None
    ok = (isinstance(m, dict) and m.get("format") == FORMAT and isinstance(m.get("files"), dict)
          and isinstance(m.get("world"), int) and isinstance(m.get("ep_size"), int)
          and isinstance(m.get("step"), int))
    if not ok:
        raise LrmoeError(f"checkpoint manifest {p} is not an {FORMAT} manifest; delete {d} "
                         "to resume from an earlier checkpoint")
    return m


def latest_checkpoint(run_dir: str | os.PathLike) -> Checkpoint | None:
    """The newest checkpoint that has a manifest (an interrupted save has none)."""
    for step, d in reversed(checkpoint_dirs(run_dir)):
        if (d / MANIFEST).exists():
            m = read_manifest(d)
            return Checkpoint(d, step, m)
    return None


def verify_shard(ck: Checkpoint, rank: int) -> Path:
    """Check a shard's presence, size and SHA-256 against the manifest (reads the file)."""
    name = shard_name(rank, ck.world)
    p = ck.path / name
    entry = ck.manifest["files"].get(name)
    hint = f"delete {ck.path} to resume from an earlier checkpoint"
    if entry is None:
        raise LrmoeError(f"checkpoint {ck.path} has no shard for rank {rank} in its manifest; "
                         f"{hint}")
    if not p.is_file():
        raise LrmoeError(f"checkpoint file {p} is missing; {hint}")
    size = p.stat().st_size
    if size != entry.get("bytes"):
        raise LrmoeError(f"checkpoint file {p} is truncated or corrupt ({size} bytes, the "
                         f"manifest says {entry.get('bytes')}); {hint}")
    if sha256_file(p) != entry.get("sha256"):
        raise LrmoeError(f"checkpoint file {p} is corrupt (SHA-256 does not match the "
                         f"manifest); {hint}")
    return p


def load_shard(ck: Checkpoint, rank: int, map_location: Any = "cpu",
               verify: bool = True) -> dict:
    p = verify_shard(ck, rank) if verify else ck.shard(rank)
    try:
        state = torch.load(p, map_location=map_location, weights_only=True)
    except Exception as e:  # the checksum passed, so this is a format problem
        raise LrmoeError(f"checkpoint file {p} cannot be loaded ({e})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise LrmoeError(f"checkpoint file {p} is not an {FORMAT} shard")
    return state


# ----------------------------------------------------------------------------- save
def save_shard(state: dict, d: Path, rank: int, world: int) -> dict:
    """Write this rank's shard atomically; returns its manifest entry."""
    buf = io.BytesIO()
    torch.save({"format": FORMAT, **state}, buf)
    data = buf.getvalue()
    name = shard_name(rank, world)
    atomic_write_bytes(d / name, data)
    return {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def save_checkpoint(run_dir: str | os.PathLike, step: int, state: dict, *, rank: int,
                    world: int, ep_size: int, meta: dict,
                    all_gather: Callable[[Any], list] | None = None, keep: int = 0) -> Path:
    """Every rank writes its shard; rank 0 writes the manifest last, then prunes.

    ``all_gather(obj) -> list`` collects one object per rank (and is the barrier that
    orders the manifest after every shard); ``None`` on one process. ``keep`` > 0 keeps
    only the newest ``keep`` complete checkpoints.
    """
    d = ckpt_dir(run_dir, step)
    d.mkdir(parents=True, exist_ok=True)
    stale = d / MANIFEST  # re-saving a step (after a resume): the old manifest goes first
    if rank == 0 and stale.exists():
        stale.unlink()
    if all_gather is not None:
        all_gather(None)  # nobody writes a shard before the stale manifest is gone
    entry = save_shard(state, d, rank, world)
    entries = all_gather(entry) if all_gather is not None else [entry]
    if rank == 0:
        manifest = {"format": FORMAT, "step": step, "world": world, "ep_size": ep_size,
                    "files": {e["name"]: {"bytes": e["bytes"], "sha256": e["sha256"]}
                              for e in entries},
                    "meta": meta}
        atomic_write_text(d / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        if keep > 0:
            prune(run_dir, keep)
    if all_gather is not None:
        all_gather(None)
    return d


def prune(run_dir: str | os.PathLike, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; drop older and interrupted ones."""
    dirs = checkpoint_dirs(run_dir)
    complete = [s for s, d in dirs if (d / MANIFEST).exists()]
    if not complete:
        return
    kept = set(complete[-keep:])
    newest = complete[-1]
    for s, d in dirs:
        if s not in kept and s < newest:
            shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------- merge
def merged_model_state(ck: Checkpoint, map_location: Any = "cpu") -> tuple[dict, dict]:
    """The whole (unsharded) model state of a checkpoint and rank 0's shard.

    Under EP each rank of the first EP group holds a contiguous slice of every MoE
    layer's experts; concatenating them in rank order gives the single-process tensors.
    Dense parameters are identical on every rank, so rank 0's are taken.
    """
    first = load_shard(ck, 0, map_location)
    if ck.ep_size == 1:
        return first["model"], first
    state = dict(first["model"])
    parts = {k: [v] for k, v in state.items() if is_expert_param(k)}
    for r in range(1, ck.ep_size):
        sh = load_shard(ck, r, map_location)["model"]
        for k in parts:
            parts[k].append(sh[k])
    for k, vs in parts.items():
        state[k] = torch.cat(vs, dim=0)
    return state, first


# ----------------------------------------------------------------------------- trainer state
def rng_state(generator: torch.Generator | None, device: torch.device) -> dict:
    s = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        s["cuda"] = torch.cuda.get_rng_state(device)
    if generator is not None:
        s["runtime"] = generator.get_state()
    return s


def set_rng_state(s: dict, generator: torch.Generator | None, device: torch.device) -> None:
    torch.set_rng_state(s["torch"].cpu())
    if device.type == "cuda" and "cuda" in s:
        torch.cuda.set_rng_state(s["cuda"].cpu(), device)
    if generator is not None and "runtime" in s:
        generator.set_state(s["runtime"].cpu())


def training_state(model, opt, sched, policy, generator, device: torch.device,
                   progress: dict, data: dict) -> dict:
    """What one rank saves: everything that evolves during training."""
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "moe_prev_counts": [m.prev_counts_E for m in model.moe_layers],
            "policy": policy.state_dict() if hasattr(policy, "state_dict") else None,
            "rng": rng_state(generator, device), "data": data, "progress": progress}


def restore_training_state(st: dict, path: Path, model, opt, sched, policy, generator,
                           device: torch.device) -> dict:
    """Load a shard's state into freshly built objects; returns its ``progress``."""
    try:
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise LrmoeError(f"checkpoint {path} does not match this model: {e}") from None
    for m, c in zip(model.moe_layers, st.get("moe_prev_counts") or []):
        m.prev_counts_E = None if c is None else c.cpu()
    if st.get("policy") is not None and hasattr(policy, "load_state_dict"):
        policy.load_state_dict(st["policy"])
    set_rng_state(st["rng"], generator, device)
    return st["progress"]
