"""HF checkpoint I/O: ``config.json`` + safetensors, as ``Qwen3MoeForCausalLM`` /
``Glm4MoeForCausalLM`` write and read them (docs/design.md §7).

Our names are HF's without the ``model.`` prefix, our router HF's ``mlp.gate``. Experts
come per expert (``mlp.experts.M.{gate_proj,up_proj,down_proj}.weight``: the Hub's
checkpoints and what :func:`save_hf` writes) or fused (``mlp.experts.gate_up_proj [E, 2F,
H]``, gate rows then up rows, and ``down_proj [E, H, F]``: HF's in-memory parameters and
ours); :func:`lrmoe.hf_load.load_hf` reads both.

Legend: E experts, F expert width, H hidden.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import Tensor

from lrmoe.config import ModelConfig, read_config_json
from lrmoe.errors import LrmoeError, require
from lrmoe.files import fsync, mode_for, remove_dead_leftovers, staging_dir
from lrmoe.model.moe import MoELayer
from lrmoe.model.transformer import MoEForCausalLM

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16}
_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
                "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float64": torch.float64}

# HF config-class defaults (transformers 5.x), used for fields a config.json leaves out,
# so a hand-written config means what it means to HF (e.g. Qwen3-MoE's norm_topk_prob).
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
        decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8,
        num_experts=128, norm_topk_prob=False, router_aux_loss_coef=0.001, mlp_only_layers=[]),
    "glm4_moe": dict(
        vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
        num_attention_heads=96, num_key_value_heads=8, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
        moe_intermediate_size=1408, num_experts_per_tok=8, n_shared_experts=1,
        n_routed_experts=128, routed_scaling_factor=1.0, n_group=1, topk_group=1,
        first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False,
        num_nextn_predict_layers=1),
}
_ROPE_THETA_DEFAULT = 10000.0
FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")  # our names' endings
# what a save writes, per HF tensor: (name, shape, dtype, materialise)
Entries = list[tuple[str, tuple[int, ...], torch.dtype, Callable[[], Tensor]]]


def _normalize_hf_config(raw: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """HF ``config.json`` -> (dict for :meth:`ModelConfig.from_hf_dict`, MTP layer count)."""
    d = dict(raw)
    mt = d.get("model_type")
    if mt not in _HF_DEFAULTS:
        raise LrmoeError(f"config model_type={mt!r} is not supported; use 'qwen3_moe' "
                         "(Qwen3MoeForCausalLM) or 'glm4_moe' (Glm4MoeForCausalLM)")
    # Aliases HF writes: Qwen3MoeConfig maps num_experts -> num_local_experts,
    # Glm4MoeConfig maps num_mtp_layers -> num_nextn_predict_layers.
    alias = {"qwen3_moe": ("num_local_experts", "num_experts"),
             "glm4_moe": ("num_mtp_layers", "num_nextn_predict_layers")}[mt]
    if alias[0] in d:
        v = d.pop(alias[0])
        if alias[1] in d and d[alias[1]] != v:
            raise LrmoeError(f"config gives both {alias[0]}={v!r} and {alias[1]}={d[alias[1]]!r}")
        d[alias[1]] = v
    if mt == "glm4_moe" and "num_experts" in d and "n_routed_experts" not in d:
        d["n_routed_experts"] = d.pop("num_experts")
    for k, v in _HF_DEFAULTS[mt].items():
        d.setdefault(k, v)
    # RoPE: HF gives rope_parameters priority over top-level rope_theta /
    # partial_rotary_factor; Qwen3-MoE's rotary ignores partial_rotary_factor.
    rp = d.get("rope_parameters")
    if rp is None:
        rp = d.pop("rope_scaling", None)
    require(rp is None or isinstance(rp, dict), f"config rope_parameters={rp!r} must be an object")
    rp = dict(rp or {})
    if "type" in rp:
        rp.setdefault("rope_type", rp.pop("type"))
    rp.setdefault("rope_type", "default")
    rp.setdefault("rope_theta", d.pop("rope_theta", _ROPE_THETA_DEFAULT))
    prf = d.pop("partial_rotary_factor", None)
    if mt == "glm4_moe":
        rp.setdefault("partial_rotary_factor", 0.5 if prf is None else prf)
    else:
        rp.pop("partial_rotary_factor", None)
    d["rope_parameters"] = rp
    mtp = d.get("num_nextn_predict_layers", 0) if mt == "glm4_moe" else 0
    if not isinstance(mtp, int) or mtp < 0:
        raise LrmoeError(f"config num_nextn_predict_layers={mtp!r} must be an integer >= 0")
    return d, mtp


def _read_config(path: Path) -> tuple[ModelConfig, int]:
    cfile = path / CONFIG_NAME
    if not cfile.is_file():
        raise LrmoeError(f"{path} has no {CONFIG_NAME}; a HF checkpoint directory needs "
                         f"{CONFIG_NAME} beside its *.safetensors files")
    raw = read_config_json(cfile)
    if raw.get("format") == "lrmoe-run-v1":
        raise LrmoeError(f"{path} is an lrmoe train run directory, not a HF checkpoint (its "
                         f"{CONFIG_NAME} is the run's); evaluate it with `lrmoe eval {path}`, "
                         "or save its model with save_hf into another directory")
    d, mtp = _normalize_hf_config(raw)
    try:
        cfg = ModelConfig.from_hf_dict(d)
    except LrmoeError as e:
        raise LrmoeError(f"{cfile}: {e}") from None
    return cfg, mtp


def load_hf_config(path: str | os.PathLike) -> ModelConfig:
    """The :class:`ModelConfig` of a HF checkpoint directory, without reading weights."""
    return _read_config(_as_dir(path))[0]


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """``config.json`` contents for ``cfg`` in the layout this transformers version writes
    (RoPE settings nested in ``rope_parameters``; lrmoe extras HF ignores)."""
    d = cfg.to_hf_dict()
    rp: dict[str, Any] = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
    prf = d.pop("partial_rotary_factor", None)
    if cfg.model_type == "glm4_moe":
        rp["partial_rotary_factor"] = prf
        d["num_nextn_predict_layers"] = 0  # no multi-token-prediction layers saved
    d["rope_parameters"] = rp
    if dtype is not None:
        d["dtype"] = str(dtype).removeprefix("torch.")
    return d


def _hf_name(name: str) -> str:
    """Our state-dict name -> HF's (fused experts form)."""
    if name.startswith("lm_head."):
        return name
    return "model." + name.replace(".mlp.router.", ".mlp.gate.")


@dataclass
class _Piece:
    """``target[index] <- checkpoint[key]`` (index ``()`` is the whole tensor)."""

    target: str
    index: tuple
    key: str
    shape: tuple[int, ...]


def _legacy_pieces(target: str, hf: str, shape: tuple[int, ...]) -> list[_Piece]:
    """``experts.gate_up_proj`` / ``experts.down_proj`` as HF's per-expert tensors."""
    E, rows, cols = shape
    prefix, kind = hf.rsplit(".", 1)  # "model.layers.N.mlp.experts", "gate_up_proj"
    if kind == "gate_up_proj":
        F = rows // 2
        return [_Piece(target, (e, slice(h * F, (h + 1) * F)),
                       f"{prefix}.{e}.{proj}.weight", (F, cols))
                for e in range(E) for h, proj in enumerate(("gate_proj", "up_proj"))]
    return [_Piece(target, (e,), f"{prefix}.{e}.down_proj.weight", (rows, cols))
            for e in range(E)]


def _plan(model_shapes: dict[str, tuple[int, ...]], cfg: ModelConfig,
          ckpt: set[str] | None) -> list[_Piece]:
    """The model's tensors as checkpoint tensors: experts in the form ``ckpt`` (the
    checkpoint's names) holds them, or HF's per-expert form to save (``ckpt`` None);
    a tied head is left out."""
    pieces: list[_Piece] = []
    for name, shape in model_shapes.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        hf = _hf_name(name)
        if not name.endswith(FUSED_EXPERTS):
            pieces.append(_Piece(name, (), hf, shape))
            continue
        per_expert = _legacy_pieces(name, hf, shape)
        has_per_expert = ckpt is not None and any(p.key in ckpt for p in per_expert)
        if has_per_expert and hf in ckpt:
            raise LrmoeError(f"checkpoint holds both the fused tensor {hf} and per-expert "
                             f"tensors {hf.rsplit('.', 1)[0]}.M.*; keep one form")
        fused = ckpt is not None and not has_per_expert  # (a missing tensor: named fused)
        pieces += [_Piece(name, (), hf, shape)] if fused else per_expert
    return pieces


def _as_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    require(p.exists(), f"checkpoint directory {p} does not exist")
    require(p.is_dir(), f"{p} is not a directory; give the HF checkpoint directory "
                        f"(holding {CONFIG_NAME} and *.safetensors)")
    return p


def _corrupt(file: Path, why: str) -> LrmoeError:
    return LrmoeError(f"checkpoint file {file} is corrupt or truncated: {why}")


def _read_header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A safetensors file's tensors, name -> (dtype, shape), once safetensors has checked
    its header against the file (length, offsets, each tensor's byte span)."""
    try:
        with safetensors.safe_open(str(file), framework="pt") as f:
            return {k: (s.get_dtype(), tuple(s.get_shape())) for k in f.keys()
                    for s in [f.get_slice(k)]}
    except OSError as e:
        raise LrmoeError(f"cannot read checkpoint file {file}: {e.strerror or e}") from None
    except Exception as e:  # SafetensorError, ...
        raise _corrupt(file, str(e)) from None


def _checkpoint_files(path: Path) -> tuple[list[Path], dict[str, str]]:
    """The checkpoint's safetensors files and its index's weight map (empty without one)."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
            files = sorted(set(wmap.values()))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError,
                AttributeError) as e:
            raise LrmoeError(f"index {index} is unreadable or has no weight_map: {e}") from None
        for f in files:
            if not isinstance(f, str) or "/" in f or "\\" in f or not (path / f).is_file():
                raise LrmoeError(f"index {index} names shard {f!r}, which is not in {path}")
        return [path / f for f in files], wmap
    single = path / WEIGHTS_NAME
    if single.is_file():
        return [single], {}
    found = sorted(p.name for p in path.glob("*.safetensors"))
    extra = f" (found {', '.join(found)} without an index)" if found else ""
    raise LrmoeError(f"{path} has neither {WEIGHTS_NAME} nor {INDEX_NAME}{extra}")


def _scan(path: Path) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, Path]]:
    files, wmap = _checkpoint_files(path)
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    where: dict[str, Path] = {}
    for f in files:
        for name, info in _read_header(f).items():
            if name in where:
                raise LrmoeError(f"tensor {name} appears in both {where[name].name} and {f.name}")
            meta[name], where[name] = info, f
    for name, fname in wmap.items():
        if where.get(name) is None or where[name].name != fname:
            raise LrmoeError(f"index {path / INDEX_NAME} puts tensor {name} in {fname}, "
                             "but that file does not hold it")
    return meta, where


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise LrmoeError(f"dtype={dtype!r} is not supported; use one of "
                             f"{sorted(set(_DTYPE_NAMES))}")
        return _DTYPE_NAMES[dtype]
    if dtype not in _DTYPES.values():
        raise LrmoeError(f"dtype={dtype} is not supported; use float32, bfloat16 or float16")
    return dtype


def _fp32_names(model: MoEForCausalLM) -> set[str]:
    """Tensors HF keeps in fp32 whatever the model dtype: GLM's router (bias and weight)."""
    if model.config.model_type != "glm4_moe":
        return set()
    return {n for n in model.state_dict() if ".mlp.router." in n}


def _hf_entries(model: MoEForCausalLM, dtype: torch.dtype | None) -> Entries:
    """The model's :data:`Entries` in model order, per-expert form."""
    keep32 = _fp32_names(model) if dtype is not None else set()
    sd = model.state_dict(keep_vars=True)
    for name, t in sd.items():
        if not t.is_floating_point():
            raise LrmoeError(f"model tensor {name} has dtype {t.dtype}; expected a float tensor")
    out = []
    for pc in _plan({n: tuple(t.shape) for n, t in sd.items()}, model.config, None):
        t = sd[pc.target][pc.index]
        dt = t.dtype if dtype is None or pc.target in keep32 else dtype
        out.append((pc.key, pc.shape, dt,
                    lambda t=t, dt=dt: t.detach().to("cpu", dt).contiguous().clone()))
    return out


def _is_checkpoint_file(name: str) -> bool:
    return name in (CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME) or bool(_SHARD_RE.match(name))


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


def _check_target_files(target: Path, cfg: ModelConfig) -> list[Path]:
    """The checkpoint files of ``target`` this save replaces; refuses other weights and models."""
    try:
        names = sorted(p.name for p in target.iterdir())
    except OSError as e:
        raise LrmoeError(f"cannot list {target}: {e.strerror or e}") from None
    ours = [n for n in names if _is_checkpoint_file(n)]
    foreign = [n for n in names if not _is_checkpoint_file(n) and n.endswith(_WEIGHT_SUFFIXES)]
    why = ""
    if foreign:
        why = f"weight files save_hf does not write ({', '.join(foreign[:3])})"
    elif ours:
        try:
            old = _read_config(target)[0]
        except LrmoeError as e:
            why = f"a checkpoint it cannot match to this model ({e})"
        else:
            if old != cfg:
                diff = next(f.name for f in dataclasses.fields(cfg)
                            if getattr(old, f.name) != getattr(cfg, f.name))
                why = (f"another model's checkpoint ({CONFIG_NAME} has {diff}="
                       f"{getattr(old, diff)!r}, this model {getattr(cfg, diff)!r})")
    if why:
        raise LrmoeError(f"{target} holds {why}; save_hf replaces only a checkpoint of the "
                         "same model: give a new or empty directory")
    return [target / n for n in ours]


def save_hf(model: MoEForCausalLM, path: str | os.PathLike, *,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            dtype: torch.dtype | str | None = None) -> Path:
    """Save ``model`` (every expert) as a HF checkpoint directory ``from_pretrained`` loads,
    in shards with an index beyond ``max_shard_bytes``; ``dtype`` (default: each tensor's
    own) casts the saved tensors, GLM's router stays fp32 (docs/design.md §7)."""
    if not isinstance(model, MoEForCausalLM):
        raise LrmoeError(f"save_hf needs an MoEForCausalLM, got {type(model).__name__}")
    dt = None if dtype is None else _as_dtype(dtype)
    for layer in model.layers:
        m = layer.mlp
        if isinstance(m, MoELayer) and m.experts.count != m.experts.num_experts:
            raise LrmoeError(
                f"layer {m.moe_index} holds {m.experts.count} of {m.experts.num_experts} experts "
                "(expert-parallel shard); gather the experts first: save_hf needs the full model")
    target = Path(path)
    check_target(target)
    entries = _hf_entries(model, dt)
    cdtype = model.embed_tokens.weight.dtype if dt is None else dt
    return write_checkpoint(target, model.config, entries, max_shard_bytes, cdtype)


def check_target(target: Path) -> None:
    """Refuse a target that cannot hold a HF checkpoint (a dangling link, a file, a run)."""
    if target.is_symlink() and not target.exists():
        raise LrmoeError(f"{target} is a symlink to {os.readlink(target)}, which does not "
                         "exist; create that directory or give another path")
    if target.exists() and not target.is_dir():
        raise LrmoeError(f"{target} exists and is not a directory")
    from lrmoe.train.rundir import is_run_dir
    if is_run_dir(target):
        raise LrmoeError(f"{target} is an lrmoe run directory: a HF checkpoint there would "
                         "replace its config.json, which lrmoe train --resume and lrmoe eval "
                         f"read; save to another directory (e.g. {target / 'hf'})")


def write_checkpoint(target: Path, cfg: ModelConfig, entries: Entries, max_shard_bytes: int,
                     cdtype: torch.dtype, extra_files: dict[str, bytes] | None = None,
                     before_shard: Callable[[list[str]], None] | None = None) -> Path:
    """Write ``entries`` in shards of ``max_shard_bytes`` (each made just before it is written,
    ``before_shard(names)`` first), ``extra_files`` and config.json, all renamed in at the end."""
    from lrmoe.train.ckpt_write import files_of

    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) \
            or max_shard_bytes <= 0:
        raise LrmoeError(f"max_shard_bytes={max_shard_bytes!r} must be a positive integer")
    old = _check_target_files(target, cfg) if target.exists() else []
    nbytes = [math.prod(s) * d.itemsize for _, s, d, _ in entries]
    shards = files_of(list(range(len(entries))), max_shard_bytes, lambda i: nbytes[i])
    n = len(shards)
    names = [WEIGHTS_NAME] if n == 1 else [
        f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]

    created = not target.exists()
    stage = None  # this save's files until they are renamed into place (lrmoe.files)
    try:
        target.mkdir(parents=True, exist_ok=True)
        remove_dead_leftovers(target)  # of an earlier save that was killed
        stage = staging_dir(target)
        weight_map: dict[str, str] = {}
        for fname, idx in zip(names, shards):
            if before_shard is not None:
                before_shard([entries[i][0] for i in idx])
            safetensors.torch.save_file({entries[i][0]: entries[i][3]() for i in idx},
                                        str(stage / fname), metadata={"format": "pt"})
            weight_map.update({entries[i][0]: fname for i in idx})
        texts: dict[str, str | bytes] = {}
        if n > 1:
            texts[INDEX_NAME] = json.dumps({"metadata": {"total_size": sum(nbytes)},
                                            "weight_map": dict(sorted(weight_map.items()))},
                                           indent=2) + "\n"
        texts |= extra_files or {}
        texts[CONFIG_NAME] = json.dumps(hf_config_dict(cfg, cdtype), indent=2,
                                        sort_keys=True) + "\n"
        for fname, text in texts.items():
            (stage / fname).write_bytes(text if isinstance(text, bytes) else text.encode())
        written = names + list(texts)  # weights first, config.json last
        for fname in written:
            fsync(stage / fname)
            os.chmod(stage / fname, mode_for(target / fname))
        for fname in written:
            os.replace(stage / fname, target / fname)
        for p in old:  # the old checkpoint's shards and index this save does not write
            if p.name not in written:
                p.unlink(missing_ok=True)
        stage.rmdir()
        fsync(target)
    except BaseException as e:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                target.rmdir()
        if isinstance(e, OSError):
            where = e.filename or target
            raise LrmoeError(f"cannot write checkpoint {target}: {e.strerror or e} "
                             f"({where})") from None
        raise
    return target
