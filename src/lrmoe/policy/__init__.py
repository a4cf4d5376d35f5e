"""Planners: one per policy. Nothing outside this package asks which policy runs."""

from lrmoe.policy.base import PlanInputs, Policy
from lrmoe.policy.capacity import CapacityPolicy
from lrmoe.policy.lrmoe import LrmoeConfig, LrmoePolicy
from lrmoe.policy.plan import Plan
from lrmoe.policy.plan_numpy import full_plan
from lrmoe.policy.registry import POLICY_NAMES, PolicyConfig, make_policy
from lrmoe.policy.static import StaticPolicy
from lrmoe.policy.symi import SymiPolicy, largest_feasible_slots

__all__ = ["POLICY_NAMES", "CapacityPolicy", "LrmoeConfig", "LrmoePolicy", "Plan",
           "PlanInputs", "Policy", "PolicyConfig", "StaticPolicy", "SymiPolicy", "full_plan",
           "largest_feasible_slots", "make_policy"]
