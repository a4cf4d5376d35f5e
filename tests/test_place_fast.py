"""lrmoe's placement (pass 1) against its numpy-search reference.

:func:`lrmoe.policy.lrmoe_place.place_replicas` prunes destinations by a bound and skips
capacities it can infer; ``tests/references/lrmoe_place_numpy.py`` asks the ledger's view
every time and tests every rank in numpy. Both must place exactly the same replicas, so
the policy makes exactly the same plans (every field) on routings of every shape: Zipf
skews, uniform, one hot expert, every pair to one rank's experts.
"""

import dataclasses

import numpy as np
import pytest
import torch

from lrmoe.errors import LrmoeError
from lrmoe.ledger import Ledger
from lrmoe.policy import LrmoePolicy, PlanInputs
from lrmoe.policy import lrmoe as lrmoe_mod
from lrmoe.policy.base import prepare
from lrmoe.policy.ledger_view import LedgerView
from lrmoe.policy.lrmoe import LrmoeConfig, slots_per_rank
from lrmoe.policy.lrmoe_place import place_replicas
from lrmoe.policy.plan import Plan
from lrmoe.presets import get_preset
from references import lrmoe_place_numpy
from test_planner_fast import _budget

E = 128
KINDS = ("zipf1", "zipf2", "zipf3", "uniform", "hot", "one_rank")
FRACS = (np.nan, 1.5, 0.9, 0.6, 0.3, 0.1, -0.2)  # no budget, loose ... binding, too small


def _routing(rng, kind: str, G: int, pairs: int) -> torch.Tensor:
    """``[G, E]`` counts, each home routing ``pairs``: Zipf over a random expert order,
    uniform, one expert taking half of every home's pairs, or all to rank 0's experts."""
    w = np.ones(E)
    if kind.startswith("zipf"):
        w = 1.0 / np.arange(1, E + 1) ** (float(kind[4:]) * rng.uniform(0.6, 1.0))
        w = w[rng.permutation(E)]
    elif kind == "hot":
        w[rng.integers(E)] = E - 1
    elif kind == "one_rank":
        w[E // G:] = 0
    return torch.from_numpy(rng.multinomial(pairs, w / w.sum(), size=G)).long()


def _layers(seed: int, Gs=(8, 16, 32), repeats: int = 1):
    """``(where, counts, ledger)`` over EP sizes, routings (``repeats`` draws of
    each) and budgets."""
    rng = np.random.default_rng(seed)
    for G in Gs:
        for kind in KINDS * repeats:
            preset = ("qwen3-30b-a3b", "glm-4.5-air")[int(rng.integers(2))]
            mcfg = get_preset(preset)
            counts = _routing(rng, kind, G, int(rng.choice([256, 2048, 8192, 65536])))
            for frac in FRACS:
                budget = None if np.isnan(frac) else _budget(mcfg, G, counts, frac)
                yield (f"{preset} EP {G} {kind} frac {frac}", counts,
                       Ledger.for_dtype(mcfg, G, budget))


def _configs(rng, G: int):
    """The knobs that reach placement: the keep floor, the replica cap, the slots."""
    yield LrmoeConfig()
    yield LrmoeConfig(min_keep=float(rng.choice([0.0, 0.25, 1.0])),
                      max_slots_per_rank=E // G + int(rng.choice([1, 3, 4])))
    yield LrmoeConfig(min_keep=float(rng.uniform(0, 1)),
                      max_replicas_per_step=int(rng.integers(1, 12)))


def _placements(counts: torch.Tensor, cfg: LrmoeConfig, ledger):
    c = counts.numpy()
    G = c.shape[0]
    view = LedgerView(ledger, c.sum(1))
    S = slots_per_rank(cfg, G, E)
    return (place_replicas(c.sum(0), G, S, cfg, view),
            lrmoe_place_numpy.place_replicas(c.sum(0), G, S, cfg, view))


def test_placement_equals_the_numpy_reference():
    """Same slots and loads, exactly, on every layer and knob setting."""
    rng = np.random.default_rng(5)
    replicas = 0
    for where, counts, ledger in _layers(seed=3, repeats=4):
        for cfg in _configs(rng, counts.shape[0]):
            (inst, load), (ref_inst, ref_load) = _placements(counts, cfg, ledger)
            assert np.array_equal(inst, ref_inst), f"{where} {cfg}"
            assert np.array_equal(load, ref_load), f"{where} {cfg}"
            replicas += int((ref_inst >= 0).sum()) - E
    assert replicas > 1000


def test_placement_equals_the_reference_without_the_bound(monkeypatch):
    """Where the bound is not available (pieces that are not monotone, or numbers that
    could overflow) the placement tests every free rank, with the same result."""
    rng = np.random.default_rng(6)
    for what, patch in (("monotone", lambda self: False), ("received_bound", lambda *a: None)):
        with monkeypatch.context() as m:
            m.setattr(LedgerView, what, patch)
            for where, counts, ledger in _layers(seed=4, Gs=(8, 16)):
                cfg = next(_configs(rng, counts.shape[0]))
                (inst, load), (ref_inst, ref_load) = _placements(counts, cfg, ledger)
                assert np.array_equal(inst, ref_inst) and np.array_equal(load, ref_load), where


def _outcome(policy, counts, inputs):
    try:
        return policy.plan(counts, inputs), None
    except LrmoeError as e:
        return None, str(e)


def _assert_same_plan(a: Plan, b: Plan, where: str) -> None:
    """Every field of the two plans equal: tensors exactly, the rest by ``==``."""
    for f in dataclasses.fields(Plan):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert x is not None and y is not None and x.dtype == y.dtype, (where, f.name)
            assert torch.equal(x, y), (where, f.name)
        else:
            assert x == y, (where, f.name)


@pytest.mark.parametrize("placement", ["current", "previous"])
@pytest.mark.parametrize("recompute", [False, True])
def test_policy_plans_equal_with_the_reference_placement(monkeypatch, placement, recompute):
    """The policy's plans (its ladder included) with the fast placement and with the
    reference one: every field equal, or the same error."""
    rng = np.random.default_rng(7)
    plans = 0
    for where, counts, ledger in _layers(seed=11):
        G = counts.shape[0]
        cfg = dataclasses.replace(next(_configs(rng, G)), recompute=recompute,
                                  placement=placement)
        prev = _routing(rng, "zipf1", G, int(counts.sum(1)[0]))
        out = []
        for fn in (place_replicas, lrmoe_place_numpy.place_replicas):
            monkeypatch.setattr(lrmoe_mod, "place_replicas", fn)
            pol = LrmoePolicy(cfg)
            inputs = prepare(pol, prev, G, PlanInputs(ledger=ledger), int(counts.sum(1)[0]))
            out.append(_outcome(pol, counts, inputs))
        (got, err), (ref, ref_err) = out
        assert err == ref_err, where
        if ref is not None:
            _assert_same_plan(got, ref, where)
            plans += 1
    assert plans >= 80


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "glm-4.5-air"])
def test_received_bound_is_an_upper_bound(preset):
    """No received count above :meth:`LedgerView.received_bound` fits with the kept
    fraction it assumes; a count at the bound with the fraction rounded down often does
    (the bound is close)."""
    rng = np.random.default_rng(8)
    mcfg = get_preset(preset)
    G = 16
    counts = _routing(rng, "zipf1", G, 8192)
    ledger = Ledger.for_dtype(mcfg, G, _budget(mcfg, G, counts, 0.5))
    view = LedgerView(ledger, counts.numpy().sum(1))
    assert view.monotone()
    close = 0
    for _ in range(200):
        n = rng.integers(E // G, E // G + 4, size=G)
        fd = int(rng.integers(1, 100_000))
        fn = int(rng.integers(0, fd + 10))
        bound = view.received_bound(n, fn, fd)
        for step in (1, 2, 17):
            R = np.where(bound < 0, step - 1, bound + step)  # below 0: nothing fits
            k = np.minimum(R, -(-(min(fn, fd) * R) // fd))
            assert not view.fits(n, R, k).any(), (fn, fd)
        k = np.minimum(bound, (min(fn, fd) * bound) // fd)
        close += int(view.fits(n, np.maximum(bound, 0), np.maximum(k, 0)).sum())
    assert close > 200 * G // 2


def test_the_keep_floor_follows_the_ranks_retained_pairs_move_by_move():
    """The greedy's ``min_keep`` level, kept as a running sum, is ``ceil(min_keep ·
    mean retained pairs)`` over the ranks as they stand before every move, and a rank
    retains ``min(load, capacity)`` pairs."""
    import math

    from lrmoe.policy.lrmoe_place import _Greedy

    rng = np.random.default_rng(8)
    levels = set()
    for where, counts, ledger in _layers(seed=4, Gs=(8, 16)):
        if ledger.budget_bytes is None:
            continue
        c = counts.numpy()
        G = c.shape[0]
        cfg = LrmoeConfig(min_keep=float(rng.uniform(0.3, 1)))
        g = _Greedy(c.sum(0), G, slots_per_rank(cfg, G, E), cfg.min_keep, LedgerView(ledger, c.sum(1)))
        for _ in range(40):
            assert g.kept == [min(R, max(k, 0)) for R, k in zip(g.load, g.cap)], where
            top = max(g.load)
            hot = [r for r in range(G) if g.load[r] == top]
            level = g._floor(top, hot)[0]
            if all(g.cap[r] >= min(g.n_inst[r], g.load[r]) for r in hot):
                assert level == math.ceil(cfg.min_keep * sum(g.kept) / G), where
                levels.add(level)
            if g.move() is None:
                break
    assert len(levels) > 20


def test_a_hot_rank_retaining_one_pair_per_instance_keeps_the_floor():
    """A hot rank whose capacity is exactly one pair per instance fits: a destination must
    still retain the ``min_keep`` level and the smallest kept fraction; one byte less and it
    does not fit, and any destination that fits itself will do (level 0, fraction 0)."""
    import math
    from fractions import Fraction

    from lrmoe.policy.lrmoe_place import _Greedy

    mcfg, G, n = get_preset("qwen3-30b-a3b"), 8, E // 8
    counts = _routing(np.random.default_rng(3), "hot", G, 2048).numpy()
    load, home = counts.sum(0).reshape(G, n).sum(1), counts.sum(1)
    hot = int(load.argmax())
    assert (load == load[hot]).sum() == 1

    def cap(budget):
        return Ledger.for_dtype(mcfg, G, budget).retain_capacity(n, int(load[hot]), int(home[hot]))
    lo, hi = 1, 1 << 50  # the least budget at which the hot rank retains one pair per instance
    while lo < hi:
        lo, hi = (lo, (lo + hi) // 2) if cap((lo + hi) // 2) >= n else ((lo + hi) // 2 + 1, hi)
    assert cap(lo) == n
    for budget, fits in ((lo, True), (lo - 1, False)):
        g = _Greedy(counts.sum(0), G, n + 2, 0.5, LedgerView(Ledger.for_dtype(mcfg, G, budget), home))
        level, fn, fd = g._floor(int(load[hot]), [hot])
        if fits:
            assert g.kept[hot] == n and level == math.ceil(0.5 * sum(g.kept) / G) > 0
            assert Fraction(fn, fd) == min(Fraction(k, R) for k, R in zip(g.kept, g.load) if R) > 0
        else:
            assert (level, fn) == (0, 0)


def test_a_destination_must_retain_the_kept_fraction_rounded_up():
    """A replica's destination must still retain ``ceil(fn/fd · R)`` of its ``R`` pairs: a
    fraction just above ``capacity / R`` refuses it, the fraction ``capacity / R`` takes it."""
    from lrmoe.policy.lrmoe_place import _Greedy, _Move

    mcfg, G = get_preset("qwen3-30b-a3b"), 8
    counts = _routing(np.random.default_rng(2), "zipf2", G, 8192)
    c = counts.numpy()
    for frac in (0.6, 0.4, 0.2, 0.1, 0.05):
        ledger = Ledger.for_dtype(mcfg, G, _budget(mcfg, G, counts, frac))
        g = _Greedy(c.sum(0), G, E // G + 2, 0.0, LedgerView(ledger, c.sum(1)))
        e = max(range(E), key=lambda x: g.total[x])
        d = min((r for r in range(G) if r != e // (E // G)), key=lambda r: g.load[r])
        any_dest = _Move(max(g.load), 1, 0, 0, 1, first=0)
        inst, q, extra, cap = g._try_dest(e, d, any_dest)
        i = next(j for j, (r, _) in enumerate(inst) if r == d)
        R = g.load[d] + q + (i < extra)
        if g.n_inst[d] + 1 < cap < R:
            break
    else:
        pytest.fail("no budget leaves the destination short of its pairs")
    K = R + 1  # (cap·K + 1) / (R·K): above cap/R, below 1; times R it rounds up to cap + 1
    assert g._try_dest(e, d, _Move(max(g.load), 1, 0, cap * K + 1, R * K, first=0)) is None
    assert g._try_dest(e, d, _Move(max(g.load), 1, 0, cap, R, first=0)) is not None
