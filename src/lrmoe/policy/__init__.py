"""Planners: one per policy. Nothing outside this package asks which policy runs."""

from lrmoe.policy.base import PlanInputs, Policy
from lrmoe.policy.plan import Plan, full_plan
from lrmoe.policy.static import StaticPolicy, native_placement

__all__ = ["Plan", "PlanInputs", "Policy", "StaticPolicy", "full_plan", "native_placement"]
