"""``bench ttl``'s settings as one tree (:class:`TTLConfig`), recorded in ``ttl.json`` by
flat names, and the ``--policies`` variants that change lrmoe's knobs by those names."""

from __future__ import annotations

from argparse import ArgumentTypeError
from dataclasses import dataclass, field, fields, replace
from typing import Any

from lrmoe.cli_flags import (
    attr_at,
    check_int,
    check_policy_flags,
    check_tokens_read,
    on_off,
    replace_at,
)
from lrmoe.errors import LrmoeError, require
from lrmoe.parallel.options import BackwardOptions
from lrmoe.policy.lrmoe import LrmoeConfig
from lrmoe.sim.ttl_budget import check_fraction
from lrmoe.train.config import SEED_MAX, TrainConfig, check_join_flags

# the fields bench ttl shares with lrmoe train: held in TTLConfig.train, a TrainConfig, so
# the two read them alike; recorded (ttl.json) and given (--flags) by the same flat names
SHARED = ("preset", "config", "ep", "mem_budget", "steps", "batch_size", "seq_len", "lr",
          "warmup", "min_lr_ratio", "weight_decay", "clip", "seed", "device", "data",
          "max_data_bytes", "eval_every", "eval_batches", "compile", "optimizer_offload",
          "router_grad", "router_lr_scale", "grad_accum", "activation_checkpoint")
# where bench ttl's defaults differ from lrmoe train's (a short run on a small corpus)
BENCH_DEFAULTS = {"ep": 4, "steps": 100, "seq_len": 128, "warmup": 10,
                  "max_data_bytes": 4 * 2**20, "eval_every": 10, "eval_batches": 4}


def bench_train_config(**kw) -> TrainConfig:
    """A :class:`TrainConfig` with bench ttl's defaults for :data:`SHARED` fields."""
    return TrainConfig(**{**BENCH_DEFAULTS, **kw})


@dataclass
class LrmoeKnobs:
    """lrmoe's knobs in a bench run: its planner's config, its backward's options (the run
    sets the router gradient), and whether its replicas are weighed against their link
    cost (priced by the run from the static run's GEMM rate)."""

    planner: LrmoeConfig = field(default_factory=LrmoeConfig)
    backward: BackwardOptions = field(default_factory=BackwardOptions)
    link_cost: bool = True


# lrmoe's knobs by the flat names ttl.json has always recorded -> (their path in LrmoeKnobs,
# their value's type as a policy spec's option, named as the flat name less "lrmoe_";
# None: a switch)
LRMOE_FLAT = {"min_keep": ("planner.min_keep", float), "balance": ("planner.balance", float),
              "lrmoe_max_slots": ("planner.max_slots_per_rank", int),
              "estimator": ("backward.estimator", str),
              "lrmoe_recompute": ("planner.recompute", None),
              "lrmoe_placement": ("planner.placement", str),
              "lrmoe_link_cost": ("link_cost", on_off),
              "lrmoe_select_from": ("planner.select_from", int)}
# a policy spec's options ("lrmoe:recompute+min_keep=0.8") -> the flat name of the knob
VARIANT_OPTIONS = {name.removeprefix("lrmoe_"): name for name in LRMOE_FLAT}


def with_knobs(knobs: LrmoeKnobs, flat: dict[str, Any]) -> LrmoeKnobs:
    """``knobs`` with the knobs ``flat`` names (:data:`LRMOE_FLAT`) set."""
    for name, value in flat.items():
        knobs = replace_at(knobs, LRMOE_FLAT[name][0], value)
    return knobs


def flat_knobs(knobs: LrmoeKnobs) -> dict[str, Any]:
    """``knobs`` by their flat names (:data:`LRMOE_FLAT`)."""
    return {name: attr_at(knobs, path) for name, (path, _) in LRMOE_FLAT.items()}


@dataclass
class TTLConfig:
    """``bench ttl``'s settings: the training run every policy makes (:attr:`train`, the
    fields of :data:`SHARED`), lrmoe's knobs (:attr:`lrmoe`) and the bench's own."""

    train: TrainConfig = field(default_factory=bench_train_config)
    lrmoe: LrmoeKnobs = field(default_factory=LrmoeKnobs)
    policies: tuple[str, ...] = ("static", "symi", "lrmoe")
    slots_per_rank: int | None = None
    link: str = "nvlink"
    target_fraction: float = 0.8
    target_rtol: float = 1e-5
    budget_floor_fraction: float | None = None  # budget: this x static's whole-layer floor
    smooth_window: int = 3  # evaluations in the centred moving average of val curves
    reuse: str | None = None  # an earlier run's ttl(_partial).json: its policies are not re-run
    deterministic: bool = False  # torch's deterministic kernels for every policy
    deterministic_fill: bool = True  # with them, torch's fill of uninitialized memory

    def __post_init__(self) -> None:
        # what a run reads is what ttl.json records (so --reuse compares all of it)
        require(with_knobs(LrmoeKnobs(), flat_knobs(self.lrmoe)) == self.lrmoe,
                f"bench ttl records lrmoe's knobs {', '.join(p for p, _ in LRMOE_FLAT.values())} "
                "only; leave its other planner and backward settings at their defaults")

    @classmethod
    def from_flat(cls, **kw) -> TTLConfig:
        """A config from flat names (``ep=2, estimator="sampled"``): the :data:`SHARED`
        ones go to :attr:`train`, lrmoe's (:data:`LRMOE_FLAT`) to :attr:`lrmoe`."""
        train = bench_train_config(**{k: kw.pop(k) for k in SHARED if k in kw})
        lrmoe = with_knobs(LrmoeKnobs(), {k: kw.pop(k) for k in LRMOE_FLAT if k in kw})
        return cls(train=train, lrmoe=lrmoe, **kw)

    def flat(self) -> dict:
        """Every setting by its flat name (what ``ttl.json`` records)."""
        own = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("train", "lrmoe")}
        return {**{k: getattr(self.train, k) for k in SHARED}, **flat_knobs(self.lrmoe), **own}


# settings no longer chosen, still recorded with the one value today's code runs, so that
# --reuse tells files apart: the ledger prices a layer's transients as the code holds its
# rows (files from before 2026-12-02 lack the key: they priced a per-row bound)
RETIRED_SETTINGS = {"ledger_transients": "code",
                    # before 2026-12-03 symi stopped out of memory where its slots did not
                    # fit, and lrmoe placed replicas whatever their link cost
                    "replica_rules": "symi-fewer-replicas,lrmoe-link-cost"}


def recorded_settings(cfg: TTLConfig) -> dict:
    """The settings a ``ttl.json`` or ``ttl_partial.json`` records."""
    return cfg.flat() | RETIRED_SETTINGS


def check_ttl_config(cfg: TTLConfig) -> None:
    """The argument checks that need no file, one line naming the flag, before anything is
    read or trained: integers within int64 (``--seed`` any unsigned 64-bit value, as
    torch's generators take), the run's tokens within int64, and the other ranges."""
    t = cfg.train
    require(t.preset or t.config, "give a model: --preset NAME or --config FILE")
    check_join_flags(t)  # --ep and --device, as lrmoe train checks them
    for k in ("steps", "batch_size", "seq_len", "eval_batches", "grad_accum"):
        check_int(k, getattr(t, k), 1)
    for k in ("eval_every", "warmup"):
        check_int(k, getattr(t, k), 0)
    check_int("seed", t.seed, 0, high=SEED_MAX)
    check_int("max_data_bytes", t.max_data_bytes, 1, allow_none=True)
    check_tokens_read(t.steps, t.grad_accum, t.batch_size, t.seq_len)
    require(0 < cfg.target_fraction <= 1, "--target-fraction must be in (0, 1]")
    require(t.mem_budget is None or cfg.budget_floor_fraction is None,
            "give --mem-budget or --budget-floor-fraction, not both")
    check_fraction(cfg.budget_floor_fraction)
    require(t.batch_size % t.ep == 0, f"--batch-size {t.batch_size} must be divisible by "
                                      f"--ep {t.ep} (one home rank per share of the batch)")
    check_policy_flags({"optimizer_offload": t.optimizer_offload, "router_grad": t.router_grad})
    from lrmoe.model.checkpoint import check_mode
    check_mode(t.activation_checkpoint)
    require(isinstance(cfg.smooth_window, int) and 1 <= cfg.smooth_window <= 2**31
            and cfg.smooth_window % 2 == 1,
            f"--smooth-window {cfg.smooth_window!r} must be an odd integer >= 1")


def policy_variant(spec: str, cfg: TTLConfig) -> tuple[str, TTLConfig]:
    """``"lrmoe:recompute+min_keep=0.8"`` -> ``("lrmoe", cfg with those lrmoe knobs)``;
    only lrmoe takes options, and a bad one is refused naming the spec, before any run."""
    base, _, opts = spec.partition(":")
    require(base in ("static", "symi", "lrmoe"),
            f"--policies: {spec!r} is not supported; use static, symi, lrmoe or "
            f"lrmoe:OPTION[+OPTION] (options: {', '.join(VARIANT_OPTIONS)})")
    if not opts:
        return base, cfg
    require(base == "lrmoe", f"--policies: {spec!r}: only lrmoe takes options")
    changes = {}
    for opt in opts.split("+"):
        key, eq, val = opt.partition("=")
        require(key in VARIANT_OPTIONS, f"--policies: {spec!r}: unknown option {key!r}; use "
                                        f"{', '.join(VARIANT_OPTIONS)}")
        name = VARIANT_OPTIONS[key]
        conv = LRMOE_FLAT[name][1]
        require((conv is None) == (not eq), f"--policies: {spec!r}: {key!r} "
                + ("takes no value" if conv is None else "needs a value (key=value)"))
        try:
            changes[name] = True if conv is None else conv(val)
        except ValueError:
            raise LrmoeError(f"--policies: {spec!r}: {key}={val!r} is not a valid "
                             f"{conv.__name__}") from None
        except ArgumentTypeError as e:  # on_off's own words
            raise LrmoeError(f"--policies: {spec!r}: {key}: {e}") from None
    try:
        return base, replace(cfg, lrmoe=with_knobs(cfg.lrmoe, changes))
    except LrmoeError as e:
        raise LrmoeError(f"--policies: {spec!r}: {e}") from None
