"""Training configuration: the fields, their checks, and what they resolve to.

``TrainConfig`` holds every ``lrmoe train`` option (CLI names with dashes);
``check_args`` validates them with messages naming the field, the value and what is
valid; ``resolve_model_config``, ``build_policy``, ``backward_options`` and
``build_ledger`` turn a config into the model config, the planner, the LRMoE backward
options and the memory ledger the trainer uses.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lrmoe.errors import LrmoeError

RUN_CONFIG = "config.json"  # a run directory's saved config (written by the trainer)
RUN_FORMAT = "lrmoe-run-v1"
DIVERGENCE_WARMUP = 1  # steps that set the running minimum before it is checked


# ----------------------------------------------------------------------------- config
@dataclass
class TrainConfig:
    """Everything ``lrmoe train`` takes: one field per flag (``--batch-size`` ->
    ``batch_size``); see ``lrmoe train -h`` for each one's meaning."""

    preset: str | None = None
    config: str | None = None
    data: str | None = None
    max_data_bytes: int | None = 16 * 2**20
    tokenizer: str = "byte"
    steps: int = 300
    batch_size: int = 16
    grad_accum: int = 1
    activation_checkpoint: str = "none"
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    router_lr_scale: float = 1.0
    clip: float = 1.0
    device: str = "cpu"
    seed: int = 0
    out: str | None = None
    resume: bool = False
    eval_every: int = 50
    eval_batches: int = 8
    ckpt_every: int = 100
    keep_ckpts: int = 3
    log_every: int = 0
    progress: bool | None = None
    ep: int = 1
    backend: str | None = None
    timeout_s: float = 300.0
    policy: str = "static"
    capacity_factor: float = 1.25
    slots_per_rank: int | None = None
    recompute: bool = False
    lrmoe_recompute: bool = False
    lrmoe_placement: str = "current"
    optimizer_offload: str = "device"
    router_grad: str = "home"
    mem_budget: str | None = None
    lrmoe_metric: str = "grad_norm"
    lrmoe_estimator: str = "topk"
    lrmoe_min_keep: float = 0.5
    lrmoe_balance: float = 1.0
    lrmoe_compaction: bool = True
    lrmoe_selection: bool = True
    lrmoe_fidelity_every: int = 0
    lrmoe_keep: str = "fixed"
    lrmoe_target_cosine: float = 0.99
    threads: int | None = None
    compile: bool = False
    stop_after: int | None = None
    divergence_factor: float = 10.0


# Fields that leave the loss trajectory alone (``steps`` stretches the cosine schedule:
# allowed, to extend a run). All others must match the run on --resume.
FREE_ON_RESUME = {"preset", "config", "out", "resume", "steps", "eval_every", "eval_batches",
                  "ckpt_every", "keep_ckpts", "log_every", "progress", "backend", "timeout_s",
                  "threads", "compile", "device", "stop_after", "divergence_factor", "ep",
                  "activation_checkpoint"}
_NOT_INHERITED = {"preset", "config", "out", "resume", "progress", "stop_after"}


def default_out(cfg: TrainConfig) -> str | None:
    if cfg.preset:
        return f"runs/{cfg.preset}"
    if cfg.config:
        return f"runs/{Path(cfg.config).stem}"
    return None


def config_from_cli(given: dict) -> TrainConfig:
    """A :class:`TrainConfig` from the flags actually given (``argparse.SUPPRESS``).

    With ``resume`` the run's saved arguments (``RUN/config.json``) fill every flag
    not given, so ``lrmoe train --out runs/x --resume`` continues the run as it was.
    """
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in given.items() if k not in ("func", "command")}
    unknown = sorted(set(given) - names)
    if unknown:
        raise LrmoeError(f"unknown training option(s) {', '.join(unknown)}")
    kw: dict[str, Any] = {}
    if given.get("resume"):
        out = given.get("out") or default_out(TrainConfig(**{k: given.get(k) for k in (
            "preset", "config") if k in given}))
        if out is None:
            raise LrmoeError("--resume needs --out DIR (the run to continue)")
        saved = read_run_config(Path(out))
        if saved is not None:
            kw.update({k: v for k, v in saved.get("train", {}).items()
                       if k in names and k not in _NOT_INHERITED})
    kw.update(given)
    return TrainConfig(**kw)


INT64_MAX = 2**63 - 1
SEED_MAX = 2**64 - 1  # torch's generators take any unsigned 64-bit seed


def _int(name: str, v: Any, low: int, allow_none: bool = False, high: int = INT64_MAX) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        big = isinstance(v, int) and not isinstance(v, bool) and v > high
        raise LrmoeError(f"--{name.replace('_', '-')} {v!r} must be an integer >= {low}"
                         + (f" and <= {high}" if big else ""))


def _num(name: str, v: Any, low: float, high: float = math.inf, open_low: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > low if open_low else v >= low) and v <= high
    if not ok:
        rng = f"> {low}" if open_low else f">= {low}"
        rng += f" and <= {high}" if high != math.inf else ""
        raise LrmoeError(f"--{name.replace('_', '-')} {v!r} must be a finite number {rng}")


def _choice(name: str, v: Any, choices: tuple) -> None:
    if v not in choices:
        raise LrmoeError(f"--{name.replace('_', '-')} {v!r} is not valid; use one of "
                         f"{', '.join(str(c) for c in choices)}")


def check_args(cfg: TrainConfig) -> None:
    """Every check that needs no file: raise :class:`LrmoeError` naming the flag."""
    from lrmoe.tokenizer import parse_tokenizer_spec

    for name in ("steps", "batch_size", "grad_accum", "seq_len", "eval_batches", "ep"):
        _int(name, getattr(cfg, name), 1)
    for name in ("warmup", "eval_every", "ckpt_every", "keep_ckpts", "log_every",
                 "lrmoe_fidelity_every"):
        _int(name, getattr(cfg, name), 0)
    _int("seed", cfg.seed, 0, high=SEED_MAX)
    _int("threads", cfg.threads, 1, allow_none=True, high=4 * (os.cpu_count() or 1))
    _int("stop_after", cfg.stop_after, 1, allow_none=True)
    _int("max_data_bytes", cfg.max_data_bytes, 1, allow_none=True)
    _int("slots_per_rank", cfg.slots_per_rank, 1, allow_none=True)
    _num("lr", cfg.lr, 0.0, open_low=True)
    _num("min_lr_ratio", cfg.min_lr_ratio, 0.0, 1.0)
    _num("weight_decay", cfg.weight_decay, 0.0)
    _num("router_lr_scale", cfg.router_lr_scale, 0.0, open_low=True)
    _num("clip", cfg.clip, 0.0)
    _num("timeout_s", cfg.timeout_s, 0.0, open_low=True)
    _num("divergence_factor", cfg.divergence_factor, 0.0)
    if 0 < cfg.divergence_factor <= 1:
        raise LrmoeError(f"--divergence-factor {cfg.divergence_factor!r} must be > 1 (a multiple "
                         "of the loss's running minimum), or 0 to disable the check")
    _num("capacity_factor", cfg.capacity_factor, 0.0, open_low=True)
    _num("lrmoe_min_keep", cfg.lrmoe_min_keep, 0.0, 1.0)
    _num("lrmoe_balance", cfg.lrmoe_balance, 0.0, 1.0)
    _num("lrmoe_target_cosine", cfg.lrmoe_target_cosine, -1.0, 1.0)
    _choice("device", cfg.device, ("cpu", "cuda"))
    if cfg.backend is not None:  # None = the device's default
        _choice("backend", cfg.backend, ("gloo", "nccl"))
    _choice("lrmoe_estimator", cfg.lrmoe_estimator, ("topk", "sampled"))
    _choice("lrmoe_keep", cfg.lrmoe_keep, ("auto", "fixed"))
    _choice("lrmoe_placement", cfg.lrmoe_placement, ("current", "previous"))
    _choice("optimizer_offload", cfg.optimizer_offload, ("device", "host"))
    from lrmoe.model.checkpoint import MODES as CHECKPOINT_MODES
    _choice("activation_checkpoint", cfg.activation_checkpoint, CHECKPOINT_MODES)
    if cfg.compile and cfg.activation_checkpoint != "none":
        raise LrmoeError(f"--activation-checkpoint {cfg.activation_checkpoint} with --compile "
                         "is not supported (the checkpointed blocks hold the MoE layers' "
                         "graph breaks); drop one of them")
    _choice("router_grad", cfg.router_grad, ("home", "experts"))
    from lrmoe.parallel.exchange import METRICS
    _choice("lrmoe_metric", cfg.lrmoe_metric, tuple(METRICS))
    try:
        from lrmoe.policy.registry import POLICY_NAMES
    except ImportError:  # TODO(policy registry): drop once lrmoe.policy.registry lands
        POLICY_NAMES = ("static",)
    _choice("policy", cfg.policy, tuple(POLICY_NAMES))
    parse_tokenizer_spec(cfg.tokenizer)
    if cfg.mem_budget is not None:
        from lrmoe.memory import parse_bytes
        parse_bytes(cfg.mem_budget)
    if cfg.preset is None and cfg.config is None and not cfg.resume:
        raise LrmoeError("give a model: --preset NAME (see `lrmoe presets`) or --config FILE")
    if cfg.out is None:
        cfg.out = default_out(cfg)
        if cfg.out is None:
            raise LrmoeError("--resume needs --out DIR (the run to continue)")


# Flags that only one policy reads: given to another, they would be silently ignored.
_LRMOE_ONLY = ("lrmoe_min_keep", "lrmoe_balance", "lrmoe_selection", "lrmoe_keep",
               "lrmoe_target_cosine", "lrmoe_recompute", "lrmoe_metric", "lrmoe_estimator",
               "lrmoe_compaction")


def ignored_flags(cfg: TrainConfig, world: int) -> list[str]:
    """One warning per flag set away from its default that this run does not read."""
    d, out = TrainConfig(), []

    def flag(name: str) -> str:
        return f"--{name.replace('_', '-')} {getattr(cfg, name)!r}"
    if cfg.policy != "lrmoe":
        out += [f"{flag(n)} has no effect with --policy {cfg.policy} (it applies to --policy "
                "lrmoe)" for n in _LRMOE_ONLY if getattr(cfg, n) != getattr(d, n)]
    if cfg.policy != "capacity" and cfg.capacity_factor != d.capacity_factor:
        out.append(f"{flag('capacity_factor')} has no effect with --policy {cfg.policy} "
                   "(it applies to --policy capacity)")
    if cfg.policy not in ("symi", "lrmoe") and cfg.slots_per_rank is not None:
        out.append(f"{flag('slots_per_rank')} has no effect with --policy {cfg.policy} "
                   "(it applies to --policy symi and lrmoe)")
    if cfg.recompute and cfg.mem_budget is None:
        out.append("--recompute has no effect without --mem-budget (it recomputes only on a "
                   "rank over the budget)")
    if cfg.backend == "nccl" and world == 1:
        out.append("--backend nccl has no effect on one process (no collectives run)")
    return out


def _read_model_json(path: str) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise LrmoeError(f"cannot read config {p}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LrmoeError(f"config {p} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise LrmoeError(f"config {p} must be a JSON object of HF config.json fields")
    return d


def resolve_model_config(cfg: TrainConfig, vocab_size: int | None):
    """The model: the preset's HF dict, overridden by ``--config`` (replaced when the
    config names another ``model_type``). ``vocab_size`` (the tokenizer's) is used
    unless ``--config`` sets one. ``None`` when neither flag is given (a resume)."""
    from lrmoe.config import ModelConfig
    from lrmoe.presets import get_preset

    d: dict[str, Any] = get_preset(cfg.preset).to_hf_dict() if cfg.preset else {}
    user = _read_model_json(cfg.config) if cfg.config else None
    if user is not None:
        if d and user.get("model_type", d["model_type"]) != d["model_type"]:
            d = {}
        if d and {"hidden_size", "num_attention_heads"} & user.keys() and "head_dim" not in user:
            d.pop("head_dim", None)  # the preset's head_dim followed its own shapes
        d.update(user)
    if not d:
        return None
    if "model_type" not in d:
        again = (" (on --resume the run's --preset is not applied under a --config: give "
                 "--preset too, or drop --config)") if cfg.resume else ""
        raise LrmoeError(f"--config {cfg.config} has no model_type and no --preset gives one; "
                         f"add \"model_type\": \"qwen3_moe\" or \"glm4_moe\", or give "
                         f"--preset NAME to override{again}")
    if vocab_size is not None and not (user and "vocab_size" in user):
        d["vocab_size"] = vocab_size
    return ModelConfig.from_hf_dict(d)


def build_policy(cfg: TrainConfig, mcfg, G: int):
    """The planner from the policy flags (names map to planners only in the registry)."""
    from lrmoe.policy.lrmoe import LrmoeConfig
    from lrmoe.policy.registry import PolicyConfig, make_policy

    lc = LrmoeConfig(balance=cfg.lrmoe_balance, min_keep=cfg.lrmoe_min_keep,
                     estimator=cfg.lrmoe_estimator, compaction=cfg.lrmoe_compaction,
                     selection=cfg.lrmoe_selection, keep=cfg.lrmoe_keep,
                     target_cosine=cfg.lrmoe_target_cosine,
                     fidelity_every=cfg.lrmoe_fidelity_every, recompute=cfg.lrmoe_recompute,
                     placement=cfg.lrmoe_placement,
                     # the runtime has no whole-layer checkpoint yet (docs/design.md §10):
                     # a step that would need it is out of memory, not run over budget
                     whole_layer=False)
    pc = PolicyConfig(name=cfg.policy, capacity_factor=cfg.capacity_factor,
                      slots_per_rank=cfg.slots_per_rank, lrmoe=lc, recompute=cfg.recompute)
    return make_policy(pc, mcfg, G)


def backward_options(cfg: TrainConfig):
    from lrmoe.parallel.exchange import BackwardOptions

    return BackwardOptions(metric=cfg.lrmoe_metric, estimator=cfg.lrmoe_estimator,
                           compaction=cfg.lrmoe_compaction, fidelity=False,
                           router_grad=cfg.router_grad)


def build_ledger(cfg: TrainConfig, mcfg, ctx):
    """The memory ledger for ``--mem-budget`` (``None`` without a budget)."""
    if cfg.mem_budget is None:
        return None
    from lrmoe.memory import Ledger, parse_bytes

    dtype = "bf16" if ctx.device.type == "cuda" else "fp32"
    return Ledger.for_dtype(mcfg, ctx.ep_size, parse_bytes(cfg.mem_budget), dtype,
                            optimizer_offload=cfg.optimizer_offload,
                            router_grad_at_experts=cfg.router_grad == "experts")


def trajectory_mismatch(cfg: TrainConfig, saved: dict) -> str:
    """``"lr=0.001 (run: 0.003), ..."`` for trajectory fields that differ; "" if none."""
    bad = []
    for f in dataclasses.fields(TrainConfig):
        if f.name in FREE_ON_RESUME or f.name not in saved:
            continue
        now = getattr(cfg, f.name)
        if now != saved[f.name]:
            bad.append(f"{f.name}={now!r} (run: {saved[f.name]!r})")
    return ", ".join(bad)


def read_run_config(run_dir: Path) -> dict | None:
    """A run directory's saved config, ``None`` if it has none; unreadable -> error."""
    p = run_dir / RUN_CONFIG
    if not p.exists():
        return None
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LrmoeError(f"run config {p} is unreadable ({e})") from None
    if not isinstance(d, dict) or d.get("format") != RUN_FORMAT:
        raise LrmoeError(f"{p} is not an lrmoe run config; use another --out")
    return d
