"""A run's checkpoint written as a HF model directory (``lrmoe export RUN OUT``; docs/
design.md §7), with its tokenizer: the run's copy of a model's files, or a ``bpe:N`` run's
``tokenizer.json`` with a ``tokenizer_config.json``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lrmoe.errors import LrmoeError, require
from lrmoe.hf import (
    DEFAULT_MAX_SHARD_BYTES,
    FUSED_EXPERTS,
    _as_dtype,
    _fp32_names,
    _plan,
    check_target,
    write_checkpoint,
)


@dataclass
class ExportReport:
    """What :func:`export_run` wrote and what it held at once."""

    out: Path
    step: int
    checkpoint: Path
    tensors: int = 0
    files: list[str] = field(default_factory=list)
    bytes_written: int = 0  # tensor bytes
    most_read_at_once: int = 0  # tensor bytes read for one shard, the largest


def _checkpoint(run_dir: Path, step: int | None):
    from lrmoe.train import checkpoint as ckpt

    if step is None:
        ck = ckpt.latest_checkpoint(run_dir)
        require(ck is not None, f"{run_dir} has no checkpoint to export")
        return ck
    d = ckpt.ckpt_dir(run_dir, step)
    if not (d / ckpt.MANIFEST).is_file():
        have = [s for s, p in ckpt.checkpoint_dirs(run_dir) if (p / ckpt.MANIFEST).is_file()]
        raise LrmoeError(f"{run_dir} has no complete checkpoint of step {step}; it has "
                         f"{', '.join(map(str, have)) or 'none'}")
    return ckpt.Checkpoint(d, step, ckpt.read_manifest(d))


def _tokenizer_files(run_dir: Path, saved: dict) -> dict[str, bytes]:
    from lrmoe.tokenizer import EOS_TOKEN, TOKENIZER_FILE
    from lrmoe.tokenizer_load import FILES, RUN_SUBDIR

    spec = saved.get("tokenizer", {}).get("spec", "byte")
    if spec.startswith("hf:"):
        d = run_dir / RUN_SUBDIR
        return {n: (d / n).read_bytes() for n in FILES if (d / n).is_file()}
    if spec.startswith("bpe:") and (run_dir / TOKENIZER_FILE).is_file():
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN}
        return {TOKENIZER_FILE: (run_dir / TOKENIZER_FILE).read_bytes(),
                "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode()}
    return {}


class _ShardReader:
    """The checkpoint tensors of one output shard, read together, handed out as HF tensors."""

    def __init__(self, ck, md: dict, sources: dict[str, str], by_key: dict, out_dtypes: dict):
        self.ck, self.md, self.sources, self.by_key = ck, md, sources, by_key
        self.out_dtypes = out_dtypes
        self.cache: dict[str, torch.Tensor] = {}
        self.most = 0

    def _key(self, pc) -> tuple[str, tuple]:
        src = self.sources[pc.target]
        if pc.target.endswith(FUSED_EXPERTS):
            return f"{src}/e{pc.index[0]}", pc.index[1:]
        return src, pc.index

    def load(self, names: list[str]) -> None:
        from lrmoe.train.checkpoint import read_tensors

        self.cache = {}  # the previous shard's tensors go before this one's are read
        keys = sorted({self._key(self.by_key[n])[0] for n in names})
        self.most = max(self.most, sum(math.prod(self.md[k].size)
                                       * self.md[k].properties.dtype.itemsize for k in keys))
        self.cache = read_tensors(self.ck, keys, self.md)

    def get(self, name: str) -> torch.Tensor:
        pc = self.by_key[name]
        key, index = self._key(pc)
        t = self.cache[key]
        out = t[index].to(self.out_dtypes[pc.target])
        # a slice of a row is copied: safetensors versions differ on slices sharing storage
        return out.clone() if index and out.data_ptr() == t[index].data_ptr() else out


def export_run(run_dir: str | os.PathLike, out: str | os.PathLike, step: int | None = None,
               max_shard_bytes: int | None = None, dtype: str | None = None) -> ExportReport:
    """Write checkpoint ``step`` (default: the latest) of ``run_dir`` as a HF model
    directory ``out``."""
    from lrmoe.config import ModelConfig
    from lrmoe.model.transformer import MoEForCausalLM
    from lrmoe.train import checkpoint as ckpt
    from lrmoe.train.config import read_run_config

    run_dir, out = Path(run_dir), Path(out)
    require(run_dir.is_dir(), f"run directory {run_dir} does not exist")
    saved = read_run_config(run_dir)
    require(saved is not None, f"{run_dir} is not an lrmoe run directory (no config.json)")
    out_dt = None if dtype is None else _as_dtype(dtype)
    ck = _checkpoint(run_dir, step)
    check_target(out)
    extra = _tokenizer_files(run_dir, saved)
    for name, data in extra.items():
        if (out / name).is_file() and (out / name).read_bytes() != data:
            raise LrmoeError(f"{out} holds a {name} that is not this run's; export replaces "
                             "only its own files: give a new or empty directory")
    ckpt.verify_files(ck)
    md = ckpt.checkpoint_metadata(ck)
    cfg = ModelConfig.from_hf_dict(saved["model"])
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    keep32 = _fp32_names(model) if out_dt is not None else set()
    sources, out_dtypes = {}, {}
    for name, shape in shapes.items():
        experts = shape[0] if name.endswith(FUSED_EXPERTS) else None
        master = f"optim/{name}/master"  # the fp32 master where the optimizer kept one apart
        has_master = (master if experts is None else f"{master}/e0") in md
        src = sources[name] = master if has_master else f"model/{name}"
        keys = [src] if experts is None else [f"{src}/e{e}" for e in range(experts)]
        want = shape if experts is None else shape[1:]
        for k in keys:
            got = tuple(md[k].size) if hasattr(md.get(k), "size") else "none"
            if got != want:
                raise LrmoeError(f"checkpoint {ck.path} does not match the run's model: "
                                 f"{k} has shape {got}, the model {want}")
        src_dt = md[keys[0]].properties.dtype
        out_dtypes[name] = src_dt if out_dt is None or name in keep32 else out_dt
    pieces = _plan(shapes, cfg, None)
    by_key = {pc.key: pc for pc in pieces}
    reader = _ShardReader(ck, md, sources, by_key, out_dtypes)
    entries = [(pc.key, pc.shape, out_dtypes[pc.target], lambda k=pc.key: reader.get(k))
               for pc in pieces]
    shard = DEFAULT_MAX_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes
    write_checkpoint(out, cfg, entries, shard, out_dtypes["embed_tokens.weight"],
                     extra_files=extra, before_shard=reader.load)
    reader.cache = {}
    files = sorted(p.name for p in out.iterdir() if p.name.startswith("model")
                   or p.name == "config.json" or p.name in extra)
    return ExportReport(out, ck.step, ck.path, len(entries), files,
                        sum(torch.Size(s).numel() * d.itemsize for _, s, d, _ in entries),
                        reader.most)
