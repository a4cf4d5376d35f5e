"""A HF checkpoint read into one rank's part of the model: the dense weights and the
rank's own experts, one tensor at a time (the per-rank loading rule, docs/design.md §7).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import safetensors
import torch
from torch import Tensor

from lrmoe.config import ModelConfig
from lrmoe.errors import LrmoeError
from lrmoe.hf import (
    _DTYPES,
    FUSED_EXPERTS,
    _as_dir,
    _as_dtype,
    _corrupt,
    _fp32_names,
    _Piece,
    _plan,
    _read_config,
    _scan,
)
from lrmoe.model.layers import Rotary
from lrmoe.model.transformer import MoEForCausalLM

_MTP_RE = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class HfCheckpoint:
    """A checked HF checkpoint directory: its config and where each model tensor comes from."""

    path: Path
    config: ModelConfig
    pieces: list[_Piece]  # in the full (single-process) model's names and indices
    where: dict[str, Path]  # checkpoint tensor -> its file
    meta: dict[str, tuple[str, tuple[int, ...]]]  # checkpoint tensor -> (dtype, shape)


@dataclass
class LoadReport:
    """What :func:`load_owned` read (a row range of a fused expert tensor counts as one)."""

    tensors: int = 0
    bytes_read: int = 0
    largest_bytes: int = 0
    seconds: float = 0.0


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def open_checkpoint(path: str | os.PathLike) -> HfCheckpoint:
    """Read and check a HF checkpoint directory's config and headers (no tensor data)."""
    p = _as_dir(path)
    cfg, mtp = _read_config(p)
    meta, where = _scan(p)
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in MoEForCausalLM(cfg).state_dict().items()}
    pieces = _plan(shapes, cfg, set(meta))
    used = {pc.key for pc in pieces}
    missing = [pc.key for pc in pieces if pc.key not in meta]
    if missing:
        raise LrmoeError(f"checkpoint {p} is missing tensor {missing[0]}{_more(missing)}, "
                         f"which the {cfg.model_type} config needs")

    def ignorable(k: str) -> bool:
        if cfg.tie_word_embeddings and k == "lm_head.weight":
            return True  # tied: HF ties it to the embedding and ignores the stored copy
        m = _MTP_RE.match(k)  # GLM multi-token-prediction layers, unused by HF's model too
        return m is not None and cfg.num_hidden_layers <= int(m[1]) < cfg.num_hidden_layers + mtp

    unexpected = sorted(k for k in meta if k not in used and not ignorable(k))
    if unexpected:
        raise LrmoeError(f"checkpoint {p} has unexpected tensor {unexpected[0]}"
                         f"{_more(unexpected)}, which the {cfg.model_type} config does not use")
    for pc in pieces:
        sdt, shape = meta[pc.key]
        if shape != pc.shape:
            raise LrmoeError(f"tensor {pc.key} in {where[pc.key].name} has shape {list(shape)}, "
                             f"the config needs {list(pc.shape)}")
        if sdt not in _DTYPES:
            raise LrmoeError(f"tensor {pc.key} in {where[pc.key].name} has dtype {sdt}; only "
                             f"{', '.join(_DTYPES)} checkpoints are supported")
    return HfCheckpoint(p, cfg, pieces, where, meta)


def empty_model(cfg: ModelConfig, ctx=None, device: torch.device | str = "cpu"
                ) -> MoEForCausalLM:
    """This rank's model (experts sharded for ``ctx``; ``None``: every expert), allocated on
    ``device`` but not initialised, the rotary frequencies (not saved) aside."""
    from lrmoe.parallel.groups import shard_experts

    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    if ctx is not None and ctx.ep_size > 1:
        shard_experts(model, ctx)
    model.to_empty(device=device)  # new Parameters off the meta device: ties are undone
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    with torch.no_grad():
        model.rotary.inv_freq.copy_(Rotary(cfg.rotary_dim, cfg.rope_theta).inv_freq)
    return model


def _owned(model: MoEForCausalLM, pc: _Piece) -> tuple[tuple, slice | None] | None:
    """Where piece ``pc`` goes in this rank's tensor: ``(index, rows of a fused expert
    tensor or None)``; None when the piece is another rank's expert."""
    if not pc.target.endswith(FUSED_EXPERTS):
        return pc.index, None
    ex = model.get_submodule(pc.target.rsplit(".", 1)[0])
    first, count = ex.first, ex.count
    if pc.index == ():  # fused: the rank's rows of [E, ...]
        return (), None if count == ex.num_experts else slice(first, first + count)
    e = pc.index[0]
    if not first <= e < first + count:
        return None
    return (e - first, *pc.index[1:]), None


def _read_into(dst: Tensor, file: Path, key: str, rows: slice | None) -> None:
    """Copy checkpoint tensor ``key`` (its ``rows`` only, when given) into ``dst``. The
    file is opened for this one tensor: closing it unmaps the pages just read."""
    try:
        f = safetensors.safe_open(str(file), framework="pt")
    except Exception as e:  # changed since it was checked
        raise _corrupt(file, str(e)) from None
    with f:
        try:
            t = f.get_tensor(key) if rows is None else f.get_slice(key)[rows]
        except Exception as e:
            raise _corrupt(file, f"reading tensor {key}: {e}") from None
        if t.device != dst.device:  # a blocking copy_ from the host converts the dtype
            t = t.to(dst.device)    # there, in a host copy: move the file's bytes first
        dst.copy_(t)
        del t  # the view holds the mapping open


def load_owned(model: MoEForCausalLM, ck: HfCheckpoint) -> LoadReport:
    """Fill every persistent tensor this rank holds from ``ck``, reading no other rank's."""
    t0 = time.perf_counter()
    report = LoadReport()
    sd = model.state_dict()
    filled = dict.fromkeys(sd, 0)
    with torch.no_grad():
        for pc in ck.pieces:
            where = _owned(model, pc)
            if where is None:
                continue
            index, rows = where
            dst = sd[pc.target][index]
            _read_into(dst, ck.where[pc.key], pc.key, rows)
            nbytes = dst.numel() * _DTYPES[ck.meta[pc.key][0]].itemsize
            report.tensors += 1
            report.bytes_read += nbytes
            report.largest_bytes = max(report.largest_bytes, nbytes)
            filled[pc.target] += dst.numel()
    tied = "lm_head.weight" if ck.config.tie_word_embeddings else None
    short = [n for n, k in filled.items() if k != sd[n].numel() and n != tied]
    if short:  # a defect of the mapping, not of the checkpoint: never train on garbage
        raise LrmoeError(f"loading {ck.path} left {short[0]} unfilled{_more(short)}")
    report.seconds = time.perf_counter() - t0
    return report


def load_hf(path: str | os.PathLike, *, dtype: torch.dtype | str | None = None
            ) -> MoEForCausalLM:
    """Load a HF checkpoint directory into a new :class:`MoEForCausalLM` on the CPU, in eval
    mode, with parameters in ``dtype`` (default fp32; GLM's router stays fp32, as in HF)."""
    dt = _as_dtype(dtype)
    ck = open_checkpoint(path)  # every check before a byte is copied
    model = empty_model(ck.config)
    load_owned(model, ck)
    if dt != torch.float32:
        # Persistent state only: non-persistent buffers (rotary inv_freq) stay fp32.
        keep, persistent = _fp32_names(model), set(model.state_dict())
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point() and name in persistent and name not in keep:
                t.data = t.data.to(dt)
    model.eval()
    return model
