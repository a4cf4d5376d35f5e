"""The emulator's measured MoE wall (``Emulator.wall``, a ``bench ttl`` step row's
``moe_wall_s``): per MoE layer its forward call plus its backward from the grad hook on
the layer's output to the end of the exchange's backward, each part measured and each
inside the span that encloses it."""

from __future__ import annotations

import time

import pytest
import torch

from lrmoe.model.transformer import MoEForCausalLM
from lrmoe.parallel.exchange import BackwardOptions
from lrmoe.policy.static import StaticPolicy
from lrmoe.presets import get_preset
from lrmoe.sim.virtual import VirtualEPLayer
from lrmoe.sim.vmodel import Emulator


def test_moe_wall_is_each_layers_forward_plus_its_backward(monkeypatch):
    cfg = get_preset("tiny-qwen3")
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (4, 33))
    em = Emulator(model, 2, StaticPolicy(), BackwardOptions(), None)
    calls: list[float] = []  # each layer's forward call, timed from inside the emulator
    backs: list[float] = []  # what each layer's backward adds to the wall
    routed, done = VirtualEPLayer.routed, Emulator._backward_done

    def timed_routed(self, *a):
        t0 = time.perf_counter()
        out = routed(self, *a)
        calls.append(time.perf_counter() - t0)
        return out

    def counted_done(self, *a):
        before = self.wall
        done(self, *a)
        backs.append(self.wall - before)

    monkeypatch.setattr(VirtualEPLayer, "routed", timed_routed)
    monkeypatch.setattr(Emulator, "_backward_done", counted_done)
    model.train()
    t0 = time.perf_counter()
    loss = model.loss(ids[:, :-1], ids[:, 1:])[1]
    forward_s = time.perf_counter() - t0
    fwd = em.wall
    n = len(model.moe_layers)
    assert len(calls) == n and not backs
    # the forward part holds every layer's whole call and nothing outside the forward
    assert 0 < sum(calls) <= fwd <= forward_s, (calls, fwd, forward_s)
    t0 = time.perf_counter()
    loss.backward()
    backward_s = time.perf_counter() - t0
    assert len(calls) == n, "the backward re-ran a forward (no checkpoint is set)"
    assert len(backs) == n and all(b > 0 for b in backs), backs
    assert sum(backs) <= backward_s, (backs, backward_s)
    # the total is the forward part plus the backward parts, nothing else
    assert em.wall == pytest.approx(fwd + sum(backs), rel=1e-12, abs=0)


def test_timed_gives_the_blocks_milliseconds_on_the_cpu():
    """Off CUDA, :func:`lrmoe.timing.timed` hands the block's wall milliseconds to
    ``on_ms`` once, and records no events."""
    from lrmoe.timing import timed

    got, events = [], []
    t0 = time.perf_counter()
    with timed(torch.device("cpu"), got.append, lambda a, b: events.append((a, b))):
        time.sleep(0.03)
    wall = (time.perf_counter() - t0) * 1e3
    assert len(got) == 1 and 30 <= got[0] <= wall and not events
