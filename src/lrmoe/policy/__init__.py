"""Planners: one per policy. Nothing outside this package asks which policy runs."""

from lrmoe.policy.base import PlanInputs
from lrmoe.policy.capacity import CapacityPolicy
from lrmoe.policy.lrmoe import LrmoeConfig, LrmoePolicy
from lrmoe.policy.static import StaticPolicy
from lrmoe.policy.symi import SymiPolicy

__all__ = ["CapacityPolicy", "LrmoeConfig", "LrmoePolicy", "PlanInputs", "StaticPolicy",
           "SymiPolicy"]
