"""Training configuration: every ``lrmoe train`` option (``TrainConfig``), its checks, and
the one place the model config, backward options, MoE runtime and ledger are made from it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lrmoe.cli_flags import (
    POLICY_FLAT,
    check_choice,
    check_int,
    check_num,
    check_policy_flags,
    check_tokens_read,
    flag,
    flat_policy,
    policy_config,
)
from lrmoe.config import ModelConfig, read_config_json
from lrmoe.errors import LrmoeError
from lrmoe.ledger import Ledger
from lrmoe.model.checkpoint import MODES as CHECKPOINT_MODES
from lrmoe.model.moe import MoERuntime
from lrmoe.parallel.groups import count_reducer
from lrmoe.policy.registry import PolicyConfig
from lrmoe.tokenizer import parse_tokenizer_spec
from lrmoe.units import parse_bytes

RUN_CONFIG = "config.json"  # a run directory's saved config (written by the trainer)
RUN_FORMAT = "lrmoe-run-v1"
DIVERGENCE_WARMUP = 1  # steps that set the running minimum before it is checked


@dataclass
class TrainConfig:
    """Everything ``lrmoe train`` takes: one field per flag, the policy's nested in
    :attr:`policy` (:mod:`lrmoe.cli_flags` maps the flat names); see ``lrmoe train -h``."""

    preset: str | None = None
    config: str | None = None
    init_from: str | None = None  # a HF model directory: config, weights and tokenizer
    data: str | None = None
    max_data_bytes: int | None = 16 * 2**20
    tokenizer: str | None = None  # None: the --init-from directory's, else byte
    steps: int = 300
    batch_size: int = 16
    grad_accum: int = 1
    activation_checkpoint: str = "none"
    loss_chunk: int = 0  # tokens a chunk of the head and loss; 0: the whole micro-batch
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
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    optimizer_offload: str = "device"
    router_grad: str = "home"
    mem_budget: str | None = None
    threads: int | None = None
    compile: bool = False
    stop_after: int | None = None
    divergence_factor: float = 10.0
    log: str | None = None  # "tensorboard": also write TensorBoard events

    @classmethod
    def from_flat(cls, values: dict | None = None, /, **kw) -> TrainConfig:
        """A config from flat names (``policy="lrmoe", lrmoe_min_keep=0.8`` nest into
        :attr:`policy`); a bad policy value raises naming its flag."""
        flat = {**(values or {}), **kw}
        pol = {k: flat.pop(k) for k in POLICY_FLAT if k in flat}
        return cls(policy=policy_config(pol), **flat)

    def flat(self) -> dict[str, Any]:
        """The fields by their flat names, the policy's knobs in place of :attr:`policy`
        (what ``config.json`` stores; runs saved before the nesting read the same)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "policy"}
        return {**out, **flat_policy(self.policy)}


FLAT_NAMES = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name != "policy") \
    + POLICY_FLAT


# Fields that leave the loss trajectory alone (``steps`` stretches the cosine schedule:
# allowed, to extend a run). All others must match the run on --resume, but for
# RESUME_CHANGES.
FREE_ON_RESUME = {"preset", "config", "out", "resume", "steps", "eval_every", "eval_batches",
                  "ckpt_every", "keep_ckpts", "log_every", "progress", "backend", "timeout_s",
                  "threads", "compile", "device", "stop_after", "divergence_factor", "ep",
                  "init_from", "log"}
# Fields --resume may change (what a run stopped out of memory needs), each recorded in
# metrics.jsonl; they leave the model and the data order alone (docs/design.md §7)
RESUME_CHANGES = ("mem_budget", "recompute", "activation_checkpoint", "grad_accum", "loss_chunk")
# init_from: a resume takes the weights from the checkpoint, the model from config.json
_NOT_INHERITED = {"preset", "config", "out", "resume", "progress", "stop_after", "init_from"}


def default_out(cfg: TrainConfig) -> str | None:
    if cfg.preset:
        return f"runs/{cfg.preset}"
    if cfg.config:
        return f"runs/{Path(cfg.config).stem}"
    if cfg.init_from:
        return f"runs/{Path(cfg.init_from).resolve().name}"
    return None


def config_from_cli(given: dict) -> TrainConfig:
    """A :class:`TrainConfig` from the flags actually given (``argparse.SUPPRESS``); with
    ``resume`` the run's ``config.json`` fills every flag not given."""
    names = set(FLAT_NAMES)
    given = {k: v for k, v in given.items() if k not in ("func", "command")}
    unknown = sorted(set(given) - names)
    if unknown:
        raise LrmoeError(f"unknown training option(s) {', '.join(unknown)}")
    out = given.get("out") or default_out(TrainConfig(**{k: given.get(k) for k in (
        "preset", "config", "init_from") if k in given}))
    # without --out, check_args refuses the resume
    saved = read_run_config(Path(out)) if given.get("resume") and out else None
    inherited = {} if saved is None else {k: v for k, v in saved.get("train", {}).items()
                                          if k in names and k not in _NOT_INHERITED}
    return TrainConfig.from_flat(inherited, **given)


SEED_MAX = 2**64 - 1  # torch's generators take any unsigned 64-bit seed


def check_join_flags(cfg: TrainConfig) -> None:
    """The flags joining a torchrun job reads."""
    check_int("ep", cfg.ep, 1)
    check_choice("device", cfg.device, ("cpu", "cuda"))
    if cfg.backend is not None:  # None = the device's default
        check_choice("backend", cfg.backend, ("gloo", "nccl"))
    check_num("timeout_s", cfg.timeout_s, 0.0, open_low=True)


def check_args(cfg: TrainConfig) -> None:
    """Every other check that needs no file: raise :class:`LrmoeError` naming the flag."""
    for name in ("steps", "batch_size", "grad_accum", "seq_len", "eval_batches"):
        check_int(name, getattr(cfg, name), 1)
    for name in ("warmup", "eval_every", "ckpt_every", "keep_ckpts", "log_every", "loss_chunk"):
        check_int(name, getattr(cfg, name), 0)
    check_tokens_read(cfg.steps, cfg.grad_accum, cfg.batch_size, cfg.seq_len)
    check_int("seed", cfg.seed, 0, high=SEED_MAX)
    check_int("threads", cfg.threads, 1, allow_none=True, high=4 * (os.cpu_count() or 1))
    check_int("stop_after", cfg.stop_after, 1, allow_none=True)
    check_int("max_data_bytes", cfg.max_data_bytes, 1, allow_none=True)
    check_num("lr", cfg.lr, 0.0, open_low=True)
    check_num("min_lr_ratio", cfg.min_lr_ratio, 0.0, 1.0)
    check_num("weight_decay", cfg.weight_decay, 0.0)
    check_num("router_lr_scale", cfg.router_lr_scale, 0.0, open_low=True)
    check_num("clip", cfg.clip, 0.0)
    check_num("divergence_factor", cfg.divergence_factor, 0.0)
    if 0 < cfg.divergence_factor <= 1:
        raise LrmoeError(f"--divergence-factor {cfg.divergence_factor!r} must be > 1 (a multiple "
                         "of the loss's running minimum), or 0 to disable the check")
    check_policy_flags({"optimizer_offload": cfg.optimizer_offload, "router_grad": cfg.router_grad,
                        "mem_budget": cfg.mem_budget, **flat_policy(cfg.policy)})
    check_choice("activation_checkpoint", cfg.activation_checkpoint, CHECKPOINT_MODES)
    if cfg.compile and cfg.activation_checkpoint != "none":
        raise LrmoeError(f"--activation-checkpoint {cfg.activation_checkpoint} with --compile "
                         "is not supported (the checkpointed blocks hold the MoE layers' "
                         "graph breaks); drop one of them")
    if cfg.log is not None:  # --log tensorboard needs the optional tensorboard package
        check_choice("log", cfg.log, ("tensorboard",))
        if importlib.util.find_spec("tensorboard") is None:
            raise LrmoeError("--log tensorboard needs the tensorboard package: pip install "
                             "'lrmoe[tensorboard]'")
    if cfg.init_from is not None and (cfg.preset is not None or cfg.config is not None):
        given = "--preset" if cfg.preset is not None else "--config"
        raise LrmoeError(f"--init-from {cfg.init_from} takes the model from its config.json; "
                         f"{given} would describe another: drop {given}")
    if cfg.init_from is not None:  # absolute: a resume may run from another directory
        cfg.init_from = os.path.abspath(cfg.init_from)
    if cfg.tokenizer is None:
        cfg.tokenizer = cfg.init_from or "byte"
    if parse_tokenizer_spec(cfg.tokenizer)[0] == "hf":
        cfg.tokenizer = os.path.abspath(cfg.tokenizer)
    if cfg.preset is None and cfg.config is None and cfg.init_from is None and not cfg.resume:
        raise LrmoeError("give a model: --preset NAME (see `lrmoe presets`), --config FILE "
                         "or --init-from HF_DIR")
    if cfg.out is None:
        cfg.out = default_out(cfg)
        if cfg.out is None:
            raise LrmoeError("--resume needs --out DIR (the run to continue)")


# Flags that only some policies read: given to another, they would be silently ignored.
_POLICY_ONLY = (*((n, ("lrmoe",)) for n in POLICY_FLAT if n.startswith("lrmoe_")
                  and n not in ("lrmoe_placement", "lrmoe_fidelity_every")),
                ("capacity_factor", ("capacity",)), ("slots_per_rank", ("symi", "lrmoe")))


def ignored_flags(cfg: TrainConfig, world: int) -> list[str]:
    """One warning per flag set away from its default that this run does not read."""
    d, now, name = TrainConfig().flat(), cfg.flat(), cfg.policy.name
    out = [f"{flag(n)} {now[n]!r} has no effect with --policy {name} (it "
           f"applies to --policy {' and '.join(users)})"
           for n, users in _POLICY_ONLY if name not in users and now[n] != d[n]]
    if cfg.policy.recompute and cfg.mem_budget is None and name in ("static", "symi"):
        out.append("--recompute has no effect without --mem-budget (it recomputes only on a "
                   "rank over the budget)")
    if cfg.backend == "nccl" and world == 1:
        out.append("--backend nccl has no effect on one process (no collectives run)")
    return out


def data_reuse_warning(cfg: TrainConfig, num_windows: int) -> str | None:
    """A warning when one optimizer step reads more sequences than the training data holds."""
    per_step = cfg.grad_accum * cfg.batch_size
    if per_step <= num_windows:
        return None
    return (f"--grad-accum {cfg.grad_accum} x --batch-size {cfg.batch_size} = {per_step} "
            f"sequences a step, {per_step / num_windows:.3g} times the {num_windows} windows "
            f"of {cfg.seq_len} tokens in the training data: every step reads all of it more "
            "than once")


def resolve_model_config(cfg: TrainConfig, vocab_size: int | None):
    """The model: ``--init-from``'s ``config.json``, or the preset's overridden by
    ``--config`` (replaced when it names another ``model_type``), with the tokenizer's
    ``vocab_size`` unless ``--config`` sets one; ``None`` when no flag gives one."""
    from lrmoe.presets import get_preset

    if cfg.init_from is not None:
        from lrmoe.hf import load_hf_config
        return load_hf_config(cfg.init_from)

    d: dict[str, Any] = get_preset(cfg.preset).to_hf_dict() if cfg.preset else {}
    user = read_config_json(cfg.config) if cfg.config else None
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


def backward_options(cfg: TrainConfig):
    """The exchange's backward options: the policy's selection knobs and
    ``--router-grad`` (the trainer turns ``fidelity`` on at the monitor's steps)."""
    return dataclasses.replace(cfg.policy.backward, fidelity=False, router_grad=cfg.router_grad)


def build_runtime(cfg: TrainConfig, ctx, policy, ledger, generator):
    """The MoE layers' shared runtime."""
    return MoERuntime(comm=ctx.comm(), policy=policy, backward=backward_options(cfg),
                      ledger=ledger, generator=generator, count_reduce=count_reducer(ctx),
                      dp_size=ctx.world // ctx.ep_size)


def build_ledger(cfg: TrainConfig, mcfg, ctx):
    """The memory ledger for ``--mem-budget`` (``None`` without a budget)."""
    if cfg.mem_budget is None:
        return None
    dtype = "bf16" if ctx.device.type == "cuda" else "fp32"
    return Ledger.for_dtype(mcfg, ctx.ep_size, parse_bytes(cfg.mem_budget), dtype,
                            optimizer_offload=cfg.optimizer_offload,
                            router_grad_at_experts=cfg.router_grad == "experts")


def trajectory_mismatch(cfg: TrainConfig, saved: dict) -> str:
    """``"lr=0.001 (run: 0.003), ..."`` for trajectory fields that differ; "" if none."""
    return ", ".join(f"{name}={now!r} (run: {saved[name]!r})" for name, now in cfg.flat().items()
                     if name not in FREE_ON_RESUME and name not in RESUME_CHANGES
                     and name in saved and now != saved[name])


def resume_changes(cfg: TrainConfig, saved: dict) -> dict[str, list]:
    """``{"mem_budget": [run's, now], ...}``: the :data:`RESUME_CHANGES` this resume makes
    (``saved``: the run's ``config.json`` ``train`` fields)."""
    now = cfg.flat()
    default = TrainConfig().flat()
    return {k: [saved.get(k, default[k]), now[k]] for k in RESUME_CHANGES
            if now[k] != saved.get(k, default[k])}


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
