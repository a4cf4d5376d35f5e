"""The policy and memory flags, declared once for every command: a knob's flag, type,
default (read from :class:`~lrmoe.policy.registry.PolicyConfig`), help and value check
live only in :data:`KNOBS`; its flat name is the argparse destination and a run's
``config.json`` key."""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lrmoe.errors import LrmoeError, require
from lrmoe.parallel.options import ESTIMATORS, METRICS
from lrmoe.policy.lrmoe import PLACEMENTS
from lrmoe.policy.registry import POLICY_NAMES, PolicyConfig
from lrmoe.units import parse_bytes

INT64_MAX = 2**63 - 1


def flag(name: str) -> str:
    """The flag of a flat name or argparse destination (``min_keep`` -> ``--min-keep``)."""
    return "--" + name.replace("_", "-")


def check_int(name: str, v: Any, low: int, allow_none: bool = False,
              high: int = INT64_MAX) -> None:
    """Raise naming ``--name`` unless ``v`` is an integer in ``[low, high]``."""
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        big = isinstance(v, int) and not isinstance(v, bool) and v > high
        raise LrmoeError(f"{flag(name)} {v!r} must be an integer >= {low}"
                         + (f" and <= {high}" if big else ""))


def check_tokens_read(steps: int, grad_accum: int, batch_size: int, seq_len: int) -> None:
    """Raise unless the tokens a run reads (``steps x grad_accum x batch_size x seq_len``,
    the count its metrics and checkpoints carry) stay within int64: past it a micro-batch
    count is no longer a count of anything a run could read."""
    total = steps * grad_accum * batch_size * seq_len
    require(total <= INT64_MAX,
            f"--grad-accum {grad_accum} with --steps {steps}, --batch-size {batch_size} and "
            f"--seq-len {seq_len} reads {total:.3g} tokens, beyond int64 ({INT64_MAX:.3g}); "
            "lower --steps or --grad-accum")


def check_num(name: str, v: Any, low: float, high: float = math.inf,
              open_low: bool = False) -> None:
    """Raise naming ``--name`` unless ``v`` is a finite number in the range."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > low if open_low else v >= low) and v <= high
    if not ok:
        rng = f"> {low}" if open_low else f">= {low}"
        rng += f" and <= {high}" if high != math.inf else ""
        raise LrmoeError(f"{flag(name)} {v!r} must be a finite number {rng}")


def check_choice(name: str, v: Any, choices: tuple) -> None:
    """Raise naming ``--name`` unless ``v`` is one of ``choices``."""
    require(v in choices, f"{flag(name)} {v!r} is not valid; use one of "
                          f"{', '.join(str(c) for c in choices)}")


def _bytes(name: str, v: Any) -> None:
    if v is not None:
        parse_bytes(v)


def byte_size(v: str) -> int:
    """argparse type of a byte size (``40GiB``, ``500MiB``)."""
    try:
        return parse_bytes(v)
    except LrmoeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def on_off(v: str) -> bool:
    """argparse type of ``on|off`` flags."""
    if v not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{v!r} is not on or off")
    return v == "on"


@dataclass(frozen=True)
class Knob:
    """One flag. ``field``: its path in :class:`PolicyConfig` (``lrmoe.min_keep``), whose
    default is the flag's; ``None`` for a memory knob (``default`` given here)."""

    dest: str
    help: str
    check: Callable[[str, Any], None]
    field: str | None = None
    default: Any = None
    type: Callable | None = str
    metavar: str | None = None
    switch: bool = False  # store_true

    @property
    def flag(self) -> str:
        return flag(self.dest)

    def default_value(self) -> Any:
        return self.default if self.field is None else attr_at(PolicyConfig(), self.field)


def attr_at(obj: Any, path: str) -> Any:
    """``obj``'s attribute at the dotted ``path`` (``lrmoe.min_keep``)."""
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def replace_at(obj: Any, path: str, value: Any) -> Any:
    """``obj`` with the field at the dotted ``path`` set (each record on the way checks
    itself)."""
    head, _, rest = path.partition(".")
    return dataclasses.replace(obj, **{head: replace_at(getattr(obj, head), rest, value)
                                       if rest else value})


KNOBS: dict[str, Knob] = {k.dest: k for k in (
    Knob("policy", f"the planner: {', '.join(POLICY_NAMES)}",
         lambda n, v: check_choice(n, v, POLICY_NAMES), "name", metavar="NAME"),
    Knob("capacity_factor", "capacity policy: pairs per expert as a multiple of the mean",
         lambda n, v: check_num(n, v, 0.0, open_low=True), "capacity_factor", type=float, metavar="F"),
    Knob("slots_per_rank", "symi: expert slots per rank (train: default E/G + 2; plan and "
         "bench: the largest that fits --mem-budget, else E/G + 2; plan --compare: the s of "
         "least busiest-rank GEMM work); lrmoe: the most slots per rank",
         lambda n, v: check_int(n, v, 1, allow_none=True), "slots_per_rank", type=int,
         metavar="S"),
    Knob("mem_budget", "per-rank bytes for all MoE layers' experts, e.g. 40GiB", _bytes,
         metavar="SIZE"),
    Knob("recompute", "static/symi: a rank over --mem-budget recomputes the fewest rows' "
         "gate_up outputs in backward instead of stopping; where that cannot fit, the MoE "
         "layer is checkpointed whole (its forward, all-to-alls included, re-run in "
         "backward)", lambda n, v: None, "recompute",
         switch=True),
    Knob("optimizer_offload", "host: keep the experts' fp32 masters and AdamW moments in host "
         "memory and update them there (same update); --mem-budget then counts only the "
         "GPU's bytes, and the emulator and plan --compare charge the modelled traffic",
         lambda n, v: check_choice(n, v, ("device", "host")), default="device",
         metavar="device|host"),
    Knob("router_grad", "experts: on exact plans the expert backward computes the router "
         "gradient, so the combined expert outputs are not kept (less memory, same math up "
         "to rounding); bench ttl and plan --compare apply it to static and symi, lrmoe "
         "stays home", lambda n, v: check_choice(n, v, ("home", "experts")), default="home",
         metavar="home|experts"),
    Knob("lrmoe_recompute", "lrmoe: retain more pairs by saving only some pairs' input rows "
         "and recomputing their gate_up outputs in backward", lambda n, v: None,
         "lrmoe.recompute", switch=True),
    Knob("lrmoe_placement", "lrmoe: place replicas from each micro-batch's counts (current) "
         "or, before the count exchange, from the previous step's (previous, as SYMI does); "
         "step and step-previous hold one placement for the optimizer step, placed from its "
         "first micro-batch's counts or from the previous step's (its replicas' weights sent "
         "and their gradients reduced once a step)",
         lambda n, v: check_choice(n, v, PLACEMENTS), "lrmoe.placement",
         metavar="|".join(PLACEMENTS)),
    Knob("lrmoe_metric", "lrmoe: backward recalibration metric, grad_norm or gate",
         lambda n, v: check_choice(n, v, tuple(METRICS)),
         "backward.metric", metavar="grad_norm|gate"),
    Knob("lrmoe_estimator", "lrmoe: backward estimator, topk (highest metric) or sampled "
         "(Horvitz-Thompson, unbiased over the retained pairs)",
         lambda n, v: check_choice(n, v, ESTIMATORS), "backward.estimator",
         metavar="topk|sampled"),
    Knob("lrmoe_min_keep", "lrmoe: floor on each block's kept fraction",
         lambda n, v: check_num(n, v, 0.0, 1.0), "lrmoe.min_keep", type=float, metavar="F"),
    Knob("lrmoe_balance", "lrmoe: how far backward quotas trim toward the mean, 0..1",
         lambda n, v: check_num(n, v, 0.0, 1.0), "lrmoe.balance", type=float, metavar="B"),
    Knob("lrmoe_compaction", "lrmoe: remove unselected rows (on) or zero them (off)",
         lambda n, v: None, "backward.compaction", type=on_off, metavar="on|off"),
    Knob("lrmoe_selection", "lrmoe: backward selection; off = every retained pair "
         "(memory-aware placement only)", lambda n, v: None, "lrmoe.selection", type=on_off,
         metavar="on|off"),
    Knob("lrmoe_select_from", "lrmoe: backward selection from this optimizer step on; "
         "before it, every retained pair (a keep warm-up through the fast descent)",
         lambda n, v: check_int(n, v, 0), "lrmoe.select_from", type=int, metavar="N"),
    Knob("lrmoe_fidelity_every", "lrmoe: compare the selected to the exact expert gradient "
         "every N steps, 0 = never", lambda n, v: check_int(n, v, 0), "fidelity.every",
         type=int, metavar="N"),
    Knob("lrmoe_keep", "lrmoe: fixed, or auto (hold --lrmoe-target-cosine)",
         lambda n, v: check_choice(n, v, ("auto", "fixed")), "lrmoe.keep",
         metavar="fixed|auto"),
    Knob("lrmoe_target_cosine", "lrmoe: the auto keep's target cosine",
         lambda n, v: check_num(n, v, -1.0, 1.0), "lrmoe.target_cosine", type=float, metavar="C"),
    Knob("lrmoe_max_slots", "lrmoe: most slots per rank (default: --slots-per-rank, else "
         "E/G + 2)", lambda n, v: check_int(n, v, 1, allow_none=True),
         "lrmoe.max_slots_per_rank", type=int, metavar="S"),
)}

# What each command reads (the others would be silently ignored there, so it lacks them).
TRAIN = tuple(k for k in KNOBS if k != "lrmoe_max_slots")
POLICY_FLAT = tuple(k for k in TRAIN if KNOBS[k].field is not None)  # TRAIN's PolicyConfig knobs
PLAN = ("policy", "capacity_factor", "slots_per_rank", "mem_budget", "optimizer_offload",
        "router_grad", "lrmoe_recompute", "lrmoe_placement", "lrmoe_min_keep",
        "lrmoe_balance", "lrmoe_selection")
BENCH = ("slots_per_rank", "mem_budget", "optimizer_offload", "router_grad",
         "lrmoe_recompute", "lrmoe_placement", "lrmoe_estimator", "lrmoe_min_keep",
         "lrmoe_balance", "lrmoe_select_from", "lrmoe_max_slots")

# Spellings used before: refused with the current one.
RENAMED = {"--min-keep": "--lrmoe-min-keep", "--balance": "--lrmoe-balance",
           "--no-selection": "--lrmoe-selection off", "--estimator": "--lrmoe-estimator"}


class _Renamed(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {RENAMED[option_string]}")


def _shown(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return "none" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def add_policy_flags(parser, names: Iterable[str], defaults: bool = True) -> None:
    """Add the knobs ``names`` to ``parser`` (or an argument group). ``defaults=False``
    leaves unset flags out of the namespace (``lrmoe train``: a resume takes the run's)."""
    for name in names:
        k = KNOBS[name]
        help = f"{k.help} (default {_shown(k.default_value())})"
        kw: dict[str, Any] = {"dest": k.dest, "help": help}
        if defaults:
            kw["default"] = k.default_value()
        if k.switch:
            parser.add_argument(k.flag, action="store_true", **kw)
        else:
            parser.add_argument(k.flag, type=k.type, metavar=k.metavar, **kw)
    for old in RENAMED:
        parser.add_argument(old, nargs="?", action=_Renamed, help=argparse.SUPPRESS,
                            default=argparse.SUPPRESS)


def check_policy_flags(values: Mapping[str, Any]) -> None:
    """Check every knob in ``values`` (flat names), raising one line naming the flag."""
    for name, v in values.items():
        if name in KNOBS:
            KNOBS[name].check(name, v)


def policy_config(values: Mapping[str, Any]) -> PolicyConfig:
    """The defaults with the policy knobs in ``values`` (flat names) set; checked first, so
    a bad value names its flag."""
    check_policy_flags(values)
    pc = PolicyConfig()
    for name, v in values.items():
        if name in KNOBS and KNOBS[name].field is not None:
            pc = replace_at(pc, KNOBS[name].field, v)
    return pc


def flat_policy(pc: PolicyConfig) -> dict[str, Any]:
    """The knobs of ``pc`` by their flat names (:data:`POLICY_FLAT`)."""
    return {n: attr_at(pc, KNOBS[n].field) for n in POLICY_FLAT}
