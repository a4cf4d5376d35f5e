"""Virtual EP emulator: G expert-parallel ranks of one MoE layer in one process, with
per-rank kernel times and modelled link times (docs/design.md §9). Results are *emulated*."""

from lrmoe.sim.cost import StepTimes, step_times
from lrmoe.sim.links import LINKS, Link, alltoall_time, get_link
from lrmoe.sim.virtual import VirtualEPLayer, VirtualStats, virtual_all_to_all

__all__ = ["LINKS", "Link", "StepTimes", "VirtualEPLayer", "VirtualStats", "alltoall_time",
           "get_link", "step_times", "virtual_all_to_all"]
