"""The emulator charges what each rank does on its critical path.

A planner slowed by a known sleep, and a selection slowed the same way, raise the
emulated step time by that sleep: every rank computes the plan (and every home rank
selects), so every rank is charged. A clock that only sleeps advance makes the measured
stages exact, so the test cannot pass or fail on timing noise.
"""

from __future__ import annotations

import time

import pytest
import torch

from dist_util import FixedRouter, hot_replica_plan, trimmed
from emulated import EmulatedLayer
from lrmoe.config import ModelConfig
from lrmoe.model.moe import MoELayer
from lrmoe.parallel import stages
from lrmoe.policy.base import Policy
from lrmoe.sim.cost import rank_stage_seconds, step_times
from lrmoe.sim.links import LINKS

T, H, E, K, F, G = 16, 16, 8, 2, 8, 4
SLEEP = 0.05


class PartialPolicy(Policy):
    """Replicas on other ranks, 80% retained, 60% of those selected."""

    name = "partial-test"

    def plan(self, counts_GE, inputs):
        return trimmed(hot_replica_plan(counts_GE, avoid_owner=True))


class Slow(Policy):
    """A planner that sleeps ``delay`` seconds before planning."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay, self.name = inner, delay, inner.name

    def plan(self, counts_GE, inputs):
        time.sleep(self.delay)
        return self.inner.plan(counts_GE, inputs)


def _layer(seed: int = 0) -> tuple[MoELayer, torch.Tensor]:
    torch.manual_seed(seed)
    cfg = ModelConfig(hidden_size=H, moe_intermediate_size=F, num_experts=E,
                      num_experts_per_tok=K, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1)
    layer = MoELayer(cfg, 0)
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(G * T)])
    idx[: G * T // 2, 0] = 0  # expert 0 is hot
    layer.router = FixedRouter(idx, E, H)
    return layer, torch.randn(G * T, H, generator=g)


class FakeClock:
    """A clock that only a sleep advances: every measured stage then costs exactly the
    sleeps inside it, so the emulated times are deterministic."""

    def __init__(self, monkeypatch):
        self.now = 0.0
        monkeypatch.setattr(time, "perf_counter", lambda: self.now)
        monkeypatch.setattr(time, "sleep", self.sleep)

    def sleep(self, s: float) -> None:
        self.now += s


def _step(policy):
    """The step's times and each stage's per-rank seconds."""
    layer, x = _layer()
    v = EmulatedLayer(layer, G, policy)
    x = x.clone().requires_grad_()
    v(x).sum().backward()
    return step_times(v.stats, LINKS["nvlink"]), rank_stage_seconds(v.stats, LINKS["nvlink"])


def test_slow_planner_raises_the_step_time_by_at_least_the_delay(monkeypatch):
    FakeClock(monkeypatch)
    (base, _), (slow, per) = _step(PartialPolicy()), _step(Slow(PartialPolicy(), SLEEP))
    assert base.plan == 0.0 and base.total > 0  # links are modelled from bytes
    # every rank is charged the planning time (each computes the plan)
    assert per["plan"] == pytest.approx([SLEEP] * G, rel=1e-9)
    assert slow.total - base.total == pytest.approx(SLEEP, rel=1e-9)
    assert slow.total == pytest.approx(sum(slow.stages().values()) + slow.non_moe)


def test_slow_selection_raises_the_step_time_by_at_least_the_delay(monkeypatch):
    FakeClock(monkeypatch)
    base = _step(PartialPolicy())[0]
    inner = stages.select_and_compact

    def slow_select(*a, **kw):
        time.sleep(SLEEP)
        return inner(*a, **kw)
    monkeypatch.setattr(stages, "select_and_compact", slow_select)
    slow, per = _step(PartialPolicy())
    assert per["select"] == pytest.approx([SLEEP] * G, rel=1e-9)  # every home rank
    assert slow.total - base.total == pytest.approx(SLEEP, rel=1e-9)


def test_real_clock_charges_the_planner_on_every_rank():
    """Without the fake clock: the measured planning time lands on every rank."""
    slow, per = _step(Slow(PartialPolicy(), SLEEP))
    assert min(per["plan"]) >= SLEEP
    assert slow.total >= SLEEP


class SlowPrepare(Slow):
    """Sleeps ``delay`` in ``prepare`` (what it plans from the previous step's counts,
    before this step's exist), then plans at once."""

    def prepare(self, prev_counts, G, inputs, home_pairs=None):
        time.sleep(self.delay)

    def plan(self, counts_GE, inputs):
        return self.inner.plan(counts_GE, inputs)


def test_prepare_check_and_pricing_are_reported_not_charged(monkeypatch):
    """Only the plan from this step's counts sits on the critical path: a slow
    ``prepare`` is reported (``prepare_ms``) and a slow plan check or ledger pricing
    is not charged."""
    from lrmoe.policy.plan import Plan
    FakeClock(monkeypatch)
    base, base_per = _step(PartialPolicy())
    layer, x = _layer()
    v = EmulatedLayer(layer, G, SlowPrepare(PartialPolicy(), SLEEP))
    v(x.clone().requires_grad_()).sum().backward()
    assert v.stats.prepare_ms == pytest.approx(SLEEP * 1e3, rel=1e-9)
    slow = step_times(v.stats, LINKS["nvlink"]), rank_stage_seconds(v.stats, LINKS["nvlink"])
    check = Plan.check
    monkeypatch.setattr(Plan, "check", lambda p, c: (time.sleep(SLEEP), check(p, c)))
    checked = _step(PartialPolicy())
    for st, per in (slow, checked):
        assert per["plan"] == base_per["plan"]
        assert st.total == pytest.approx(base.total, rel=1e-9)
