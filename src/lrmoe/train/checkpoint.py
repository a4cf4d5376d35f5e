"""Checkpoints: one directory per step, written with ``torch.distributed.checkpoint``
(DCP) under world-size-independent keys (:mod:`.ckpt_state`), a hashed manifest, an
atomic rename last. The layout and what a resume at another world or EP size restores:
docs/design.md §7.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lrmoe.errors import LrmoeError
from lrmoe.files import fsync, mode_for
from lrmoe.train import ckpt_state
from lrmoe.train.ckpt_write import BoundedFileWriter
from lrmoe.train.ranks import agree, all_gather, raise_first

FORMAT = "lrmoe-checkpoint-v2"
OLD_FORMATS = {"lrmoe-checkpoint-v1": "one torch.save shard per rank"}
CKPT_DIR = "checkpoints"
PREFIX = "ckpt-"
PARTIAL = ".tmp"
MANIFEST = "manifest.json"


# ----------------------------------------------------------------------------- atomic I/O
def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one
    (mode: the old file's, else the umask's)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode_for(path))  # mkstemp's 0600 would ignore the umask
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # best effort: some file systems refuse a directory's
        fsync(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class CheckpointWriteError(LrmoeError):
    """A checkpoint save failed (a full disk, a quota...). ``local``: only this rank hit it;
    otherwise every rank raises it alike (DCP's write step is collective)."""


def _cause(e: BaseException) -> str:
    """The first line of what went wrong: the rank's own error inside DCP's wrapper."""
    fails = getattr(e, "failures", None)
    if fails:
        rank, wrapped = min(fails.items(), key=lambda kv: kv[0])
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {_cause(inner)}" if len(fails) < 2 and rank else _cause(inner)
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f" ({e.filename})" if e.filename else "")
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _free(d: Path) -> str:
    try:
        return f"{shutil.disk_usage(d).free / 2**20:.1f} MiB free"
    except OSError:
        return "free space unknown"


def _write_failed(e: BaseException, tmp: Path, rank: int, local: bool) -> CheckpointWriteError:
    """The one-line error for a failed save; the partial directory is removed first (on
    rank 0, or by the rank that alone failed), so the free space it reports is real."""
    if rank == 0 or local:
        shutil.rmtree(tmp, ignore_errors=True)
    gone = "removed" if not tmp.exists() or rank else "could not remove"
    return CheckpointWriteError(
        f"cannot write checkpoint {tmp.name[1:-len(PARTIAL)]} into {tmp.parent}: "
        f"{_cause(e)}; {_free(tmp.parent)} there ({gone} the partial save {tmp.name}). A "
        "full disk, a quota or a file-size limit (ulimit -f) does this; free space or "
        "--keep-ckpts fewer", local=local)


@contextlib.contextmanager
def _one_process_is_fine():
    """DCP warns that it runs in one process even when asked to (``no_dist``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ----------------------------------------------------------------------------- naming
def ckpt_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CKPT_DIR


def ckpt_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return ckpt_root(run_dir) / f"{PREFIX}{step:08d}"


def partial_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return ckpt_root(run_dir) / f".{PREFIX}{step:08d}{PARTIAL}"


def _step_of(d: Path) -> int | None:
    if not d.name.startswith(PREFIX) or not d.is_dir():
        return None
    try:
        return int(d.name[len(PREFIX):])
    except ValueError:
        return None


def _entries(run_dir: str | os.PathLike) -> list[Path]:
    root = ckpt_root(run_dir)
    return list(root.iterdir()) if root.is_dir() else []


def checkpoint_dirs(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every ``ckpt-*`` directory (complete or not), by step."""
    return sorted((s, d) for d in _entries(run_dir) if (s := _step_of(d)) is not None)


def partial_dirs(run_dir: str | os.PathLike) -> list[Path]:
    """Interrupted saves (``.ckpt-*.tmp``)."""
    return sorted(d for d in _entries(run_dir)
                  if d.name.startswith("." + PREFIX) and d.name.endswith(PARTIAL))


# ----------------------------------------------------------------------------- manifest
@dataclass
class Checkpoint:
    """A complete checkpoint; ``notes``: why newer directories were passed over."""

    path: Path
    step: int
    manifest: dict
    notes: list[str] = field(default_factory=list)

    @property
    def world(self) -> int:
        return int(self.manifest["world"])

    @property
    def ep_size(self) -> int:
        return int(self.manifest["ep_size"])

    def describe(self) -> str:
        """One line: which checkpoint is used, written by which layout, what was skipped."""
        s = (f"resuming from {self.path} (step {self.step}, written by world size "
             f"{self.world} with --ep {self.ep_size})")
        return s + ("; " + "; ".join(self.notes) if self.notes else "")


def read_manifest(d: Path) -> dict:
    p = d / MANIFEST
    hint = f"delete {d} to resume from an earlier checkpoint"
    try:
        m = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LrmoeError(f"checkpoint manifest {p} is unreadable or corrupt ({e}); "
                         f"{hint}") from None
    fmt = m.get("format") if isinstance(m, dict) else None
    if fmt in OLD_FORMATS:
        raise LrmoeError(f"checkpoint {d} is in the old {fmt} format ({OLD_FORMATS[fmt]}), "
                         "which this lrmoe cannot read; continue that run with the lrmoe "
                         "version that wrote it, or start a new run in another --out")
    ok = (fmt == FORMAT and isinstance(m.get("files"), dict) and ".metadata" in m["files"]
          and isinstance(m.get("world"), int) and isinstance(m.get("ep_size"), int)
          and isinstance(m.get("step"), int))
    if not ok:
        raise LrmoeError(f"checkpoint manifest {p} is not an {FORMAT} manifest; {hint}")
    return m


def latest_checkpoint(run_dir: str | os.PathLike) -> Checkpoint | None:
    """The newest checkpoint that has a manifest; ``notes`` say what was passed over."""
    notes = []
    for step, d in reversed(checkpoint_dirs(run_dir)):
        if (d / MANIFEST).exists():
            notes += [f"ignored {p.name}: an interrupted save" for p in partial_dirs(run_dir)]
            return Checkpoint(d, step, read_manifest(d), notes)
        notes.append(f"skipped the newer {d.name}: it has no {MANIFEST}, so its save "
                     "never finished")
    return None


def verify_files(ck: Checkpoint, rank: int = 0, world: int = 1) -> None:
    """Check presence, size and SHA-256 of this rank's share of the files (``i % world``)."""
    hint = f"delete {ck.path} to resume from an earlier checkpoint"
    for name, entry in sorted(ck.manifest["files"].items())[rank::world]:
        p = ck.path / name
        if not p.is_file():
            raise LrmoeError(f"checkpoint file {p} is missing; {hint}")
        size = p.stat().st_size
        if size != entry.get("bytes"):
            raise LrmoeError(f"checkpoint file {p} is truncated or corrupt ({size} bytes, "
                             f"the manifest says {entry.get('bytes')}); {hint}")
        if sha256_file(p) != entry.get("sha256"):
            raise LrmoeError(f"checkpoint file {p} is corrupt (SHA-256 does not match the "
                             f"manifest); {hint}")


# ----------------------------------------------------------------------------- save
def save_checkpoint(run_dir: str | os.PathLike, step: int, model, opt, *, trainer: dict,
                    rng: dict, rank: int, world: int, ep_size: int, keep: int = 0) -> Path:
    """Write a checkpoint collectively; returns its directory. ``trainer`` is the global
    state (rank 0's is kept), ``rng`` this rank's RNG states; ``keep`` > 0 keeps only the
    newest ``keep`` checkpoints."""
    tmp, final, err = partial_dir(run_dir, step), ckpt_dir(run_dir, step), None
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an interrupted save
        try:
            tmp.mkdir(parents=True)
        except OSError as e:  # a failure every rank sees: each raises it at the barrier
            err = str(_write_failed(e, tmp, rank, local=False))
    raise_first(all_gather(err, world), CheckpointWriteError)
    # one copy of the global state: rank 0's (ranks differ only in timings)
    state = ckpt_state.state_to_save(model, opt, trainer if rank == 0 else None, rng, rank)
    try:
        with _one_process_is_fine():
            dcp.save(state, storage_writer=BoundedFileWriter(str(tmp)),
                     planner=dcp.DefaultSavePlanner(flatten_state_dict=False,
                                                    flatten_sharded_tensors=False),
                     no_dist=world == 1)
    except (CheckpointException, OSError) as e:  # DCP raises it on every rank alike
        raise _write_failed(e, tmp, rank, local=False) from None
    try:
        _finish_save(run_dir, step, tmp, final, trainer, rank, world, ep_size, keep)
    except OSError as e:  # this rank's own write or read (a manifest, a hash, a rename)
        raise _write_failed(e, tmp, rank, local=True) from None
    return final


def _finish_save(run_dir, step: int, tmp: Path, final: Path, trainer: dict, rank: int,
                 world: int, ep_size: int, keep: int) -> None:
    """Hash the files (each rank a share), write the manifest, rename into place."""
    names = all_gather(sorted(p.name for p in tmp.iterdir() if p.is_file()), world)[0]
    mine, err = {}, None
    for name in names[rank::world]:
        p = tmp / name
        if not p.is_file():
            err = (f"checkpoint file {p} (written by another rank) is not visible on "
                   f"rank {rank}: --out must be on a filesystem every rank shares")
            break
        mine[name] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    entries = all_gather((mine, err), world)
    raise_first([e for _, e in entries])
    if rank == 0:
        files = {k: v for m, _ in entries for k, v in m.items()}
        manifest = {"format": FORMAT, "step": step, "world": world, "ep_size": ep_size,
                    "files": files, "meta": trainer.get("progress")}
        atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        if final.exists():  # re-saving a step, or a stale directory without a manifest
            old = final.with_name(f".{final.name}.old{PARTIAL}")
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
        with contextlib.suppress(OSError):  # best effort, as above
            fsync(final.parent)
        for p in partial_dirs(run_dir):
            shutil.rmtree(p, ignore_errors=True)
        if keep > 0:
            prune(run_dir, keep)
    all_gather(None, world)  # the barrier: no rank goes on before the rename


def prune(run_dir: str | os.PathLike, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; drop older and unfinished ones."""
    dirs = checkpoint_dirs(run_dir)
    complete = [s for s, d in dirs if (d / MANIFEST).exists()]  # the one just saved among them
    kept = set(complete[-keep:])
    newest = complete[-1]
    for s, d in dirs:
        if s not in kept and s < newest:
            shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------- load
def checkpoint_metadata(ck: Checkpoint) -> dict:
    """Every key of a checkpoint: ``{key: TensorStorageMetadata | BytesStorageMetadata}``."""
    try:
        return dcp.FileSystemReader(str(ck.path)).read_metadata().state_dict_metadata
    except (Exception, CheckpointException) as e:  # the checksum passed: a format problem
        raise LrmoeError(f"checkpoint {ck.path} cannot be read ({_cause(e)})") from None


def _read(ck: Checkpoint, state: dict, distributed: bool, failed: str = "cannot be loaded",
          hint: str = "; delete it to resume from an earlier checkpoint") -> None:
    """Load ``state`` in place: tensors are copied into, objects replaced (our keys are
    flat, so both flattening passes are off and the planner writes into ``state``)."""
    try:
        with _one_process_is_fine():
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(ck.path)),
                     planner=dcp.DefaultLoadPlanner(flatten_state_dict=False,
                                                    flatten_sharded_tensors=False),
                     no_dist=not distributed)
    except (Exception, CheckpointException) as e:  # DCP wraps the reader's error (EOFError...)
        raise LrmoeError(f"checkpoint {ck.path} {failed} ({_cause(e)}){hint}") from None
    if ckpt_state.TRAINER in state and state[ckpt_state.TRAINER] is None:
        raise LrmoeError(f"checkpoint {ck.path} has no trainer state")


def load_checkpoint(ck: Checkpoint, model, opt, sched, policy, generator, *, ctx,
                    seed: int) -> dict:
    """Load a (verified) checkpoint into freshly built objects at any world / EP size
    (``ctx``'s); returns the trainer state. Collective on more than one process."""
    same = (ck.world, ck.ep_size) == (ctx.world, ctx.ep_size)
    # every rank enters the collective load, or none
    tpl = agree(lambda: ckpt_state.Template(model, opt, checkpoint_metadata(ck),
                                            ctx.rank if same else None, str(ck.path)), ctx)
    _read(ck, tpl.dict, distributed=ctx.distributed)
    trainer = tpl.dict[ckpt_state.TRAINER]
    try:
        opt.load_state_dict(tpl.optimizer_state())
        sched.load_state_dict(trainer["scheduler"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise LrmoeError(f"checkpoint {ck.path} does not match this model: {e}") from None
    for m, c in zip(model.moe_layers, trainer.get("moe_prev_counts") or []):
        m.prev_counts_E = None if c is None else c.cpu()
    if trainer.get("policy") is not None:  # None: saved by a policy without state
        policy.load_state_dict(trainer["policy"])
    rng = tpl.dict.get(ckpt_state.rng_key(ctx.rank)) if same else None
    ckpt_state.apply_rng(rng, generator, ctx.device, (seed, ck.step, ctx.rank))
    return trainer


def trainer_state(model, sched, policy, progress: dict, data: dict) -> dict:
    """The global part of a checkpoint (everything but model, optimizer and RNG)."""
    return {"scheduler": sched.state_dict(),
            "moe_prev_counts": [m.prev_counts_E for m in model.moe_layers],
            "policy": policy.state_dict(),
            "progress": progress, "data": data}


def merged_model_state(ck: Checkpoint) -> tuple[dict, dict]:
    """The whole model state of a checkpoint (expert rows stacked by global id) and its
    trainer state, read on one process into CPU tensors."""
    verify_files(ck)
    md = checkpoint_metadata(ck)
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.items()
             if k.startswith("model/")}
    state[ckpt_state.TRAINER] = None
    _read(ck, state, distributed=False)
    trainer = state.pop(ckpt_state.TRAINER)
    out: dict[str, Any] = {}
    rows: dict[str, dict[int, torch.Tensor]] = {}
    for k, v in state.items():
        base, _, last = k[len("model/"):].rpartition("/")
        if base and last[:1] == "e" and last[1:].isdigit():
            rows.setdefault(base, {})[int(last[1:])] = v
        else:
            out[k[len("model/"):]] = v
    for name, by_id in rows.items():
        out[name] = torch.stack([by_id[e] for e in sorted(by_id)])
    return out, trainer


def read_tensors(ck: Checkpoint, keys: list[str], md: dict) -> dict[str, torch.Tensor]:
    """Tensors ``keys`` of a (verified) checkpoint, read on one process: only their bytes
    (``md``: its :func:`checkpoint_metadata`)."""
    state = {k: torch.empty(tuple(md[k].size), dtype=md[k].properties.dtype) for k in keys}
    _read(ck, state, False, "cannot be read", "")
    return state
