"""The declared policy interface: every planner is a :class:`Policy`, and a planner that
writes only ``plan`` gets hooks that do nothing (the runtime calls them directly)."""

from __future__ import annotations

import re

import pytest
import torch

from lrmoe.config import ModelConfig
from lrmoe.errors import LrmoeError
from lrmoe.policy.base import PlanInputs, Policy, prepare
from lrmoe.policy.lrmoe import LrmoeConfig
from lrmoe.policy.plan import native_plan
from lrmoe.policy.registry import POLICY_NAMES, PolicyConfig, make_policy
from lrmoe.policy.static import StaticPolicy


class PlanOnly(Policy):
    name = "plan-only"

    def plan(self, counts_GE, inputs):
        return native_plan(counts_GE)


def test_every_registered_policy_implements_the_interface():
    cfg = ModelConfig(num_experts=8)
    for name in POLICY_NAMES:
        assert isinstance(make_policy(PolicyConfig(name=name), cfg, 2), Policy), name


def test_plan_is_the_only_hook_a_policy_must_write():
    with pytest.raises(TypeError):
        Policy()  # plan is abstract
    p = PlanOnly()
    inputs = PlanInputs(prev_counts_E=torch.tensor([3, 1, 0, 4]))
    assert p.prepare(inputs.prev_counts_E, 2, inputs, 4) is None
    assert prepare(p, inputs.prev_counts_E, 2, inputs, 4).prepared is None
    assert p.plans_natives_exactly() is False  # the local path is static's alone
    assert p.observe_fidelity(0, 0.5) is None
    assert p.state_dict() == {}
    p.load_state_dict({})


def test_only_plain_static_plans_natives_exactly():
    class Sub(StaticPolicy):
        pass
    cfg = ModelConfig(num_experts=8)
    flags = {n: make_policy(PolicyConfig(name=n), cfg, 2).plans_natives_exactly()
             for n in POLICY_NAMES}
    assert flags == {"static": True, "capacity": False, "symi": False, "lrmoe": False}
    assert Sub().plans_natives_exactly() is False


def test_symi_and_lrmoe_prepare_from_the_previous_counts():
    cfg = ModelConfig(num_experts=8)
    prev = torch.tensor([40, 1, 1, 1, 1, 1, 1, 2])
    inputs = PlanInputs(prev_counts_E=prev)
    for pc in (PolicyConfig(name="symi"),
               PolicyConfig(name="lrmoe", lrmoe=LrmoeConfig(placement="previous"))):
        pol = make_policy(pc, cfg, 2)
        got = prepare(pol, prev, 2, inputs, 24).prepared
        assert got is not None and got.inst_expert_GS.shape == (2, 6)
    assert prepare(make_policy(PolicyConfig(), cfg, 2), prev, 2, inputs, 24).prepared is None


@pytest.mark.parametrize("name, field, ok, bad, want", [
    ("symi", "slots_per_rank", 4, 3, "slots_per_rank=3 must be an integer >= E/G = 4"),
    ("lrmoe", "slots_per_rank", 4, 3, "slots_per_rank=3 must be an integer >= E/G = 4"),
    ("capacity", "capacity_factor", 1e-3, 0.0, "capacity_factor=0.0 must be > 0")])
def test_policy_settings_hold_at_their_bounds(name, field, ok, bad, want):
    """A rank holds at least its native experts; a capacity factor is positive."""
    cfg = ModelConfig(num_experts=8)
    make_policy(PolicyConfig(name=name, **{field: ok}), cfg, 2)
    with pytest.raises(LrmoeError, match=re.escape(want)):
        make_policy(PolicyConfig(name=name, **{field: bad}), cfg, 2)


@pytest.mark.parametrize("G, want", [(0, "EP size 0 must be a positive integer"),
                                     (2.0, "EP size 2.0 must be a positive integer"),
                                     (3, "EP size 3 does not divide the number of experts 8")])
def test_an_ep_size_must_divide_the_experts(G, want):
    with pytest.raises(LrmoeError, match=re.escape(want)):
        make_policy(PolicyConfig(name="static"), ModelConfig(num_experts=8), G)
