"""Build a policy from its config: the one place that maps policy names to planners."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lrmoe.config import ModelConfig
from lrmoe.errors import LrmoeError, require
from lrmoe.parallel.options import BackwardOptions
from lrmoe.policy.base import Policy
from lrmoe.policy.capacity import CapacityPolicy
from lrmoe.policy.lrmoe import LrmoeConfig, LrmoePolicy, slots_per_rank
from lrmoe.policy.static import StaticPolicy
from lrmoe.policy.symi import DEFAULT_EXTRA_SLOTS, SymiPolicy, require_slots

POLICY_NAMES = ("static", "capacity", "symi", "lrmoe")


@dataclass
class FidelityConfig:
    """The fidelity monitor: every ``every`` optimizer steps (0: never) the cosine of an
    approximate plan's expert weight gradient to the exact one."""

    every: int = 0


@dataclass
class PolicyConfig:
    """Which policy plans each step and its knobs; ``slots_per_rank``: symi's slots (None:
    ``E/G + 2``), lrmoe's most unless its own is set; ``recompute``: for static and symi."""

    name: str = "static"
    capacity_factor: float = 1.25
    slots_per_rank: int | None = None
    lrmoe: LrmoeConfig = field(default_factory=LrmoeConfig)
    recompute: bool = False
    backward: BackwardOptions = field(default_factory=BackwardOptions)
    fidelity: FidelityConfig = field(default_factory=FidelityConfig)


def make_policy(cfg: PolicyConfig, model_cfg: ModelConfig, G: int) -> Policy:
    """The policy ``cfg.name`` for ``model_cfg`` on an EP group of ``G`` ranks."""
    E = model_cfg.num_experts
    require(isinstance(G, int) and G >= 1, f"EP size {G!r} must be a positive integer")
    require(E % G == 0, f"EP size {G} does not divide the number of experts {E}; "
                        f"use a divisor of {E}")
    n_nat = E // G
    s = cfg.slots_per_rank
    if s is not None and cfg.name in ("symi", "lrmoe"):  # the others do not read it
        require_slots(s, n_nat)
    require(not cfg.recompute or cfg.name in ("static", "symi"),
            f"--recompute applies to the exact policies static and symi, not {cfg.name!r} "
            "(lrmoe fits a budget by its retention quotas; --lrmoe-recompute is its own)")
    if cfg.name == "static":
        return StaticPolicy(cfg.recompute)
    if cfg.name == "capacity":
        return CapacityPolicy(cfg.capacity_factor)
    if cfg.name == "symi":
        return SymiPolicy(s if s is not None else n_nat + DEFAULT_EXTRA_SLOTS, cfg.recompute)
    if cfg.name == "lrmoe":
        lc = cfg.lrmoe
        if lc.max_slots_per_rank is None and s is not None:
            lc = dataclasses.replace(lc, max_slots_per_rank=s)
        require(lc.keep != "auto" or cfg.fidelity.every > 0,
                "--lrmoe-keep auto needs the fidelity monitor: give "
                "--lrmoe-fidelity-every N with N > 0")
        slots_per_rank(lc, G, E)  # refuses max_slots_per_rank below E/G
        return LrmoePolicy(lc)
    raise LrmoeError(f"policy name={cfg.name!r} is not known; use one of "
                     f"{', '.join(POLICY_NAMES)}")
