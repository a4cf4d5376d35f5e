"""Targets and crossings on smoothed validation curves (lrmoe.sim.target)."""

import math
import random

import pytest

from lrmoe.sim.target import crossing, eval_noise, smooth, target_at


def curve(vals, dt=2.0, every=10):
    return [{"step": every * (i + 1), "val_loss": v, "cum_emulated_s": dt * (i + 1)}
            for i, v in enumerate(vals)]


def test_smooth_is_a_centred_mean_that_keeps_the_ends():
    assert smooth([3.0, 1.0, 2.0, 6.0], 3) == [3.0, 2.0, 3.0, 6.0]
    assert smooth([1.0, 5.0], 1) == [1.0, 5.0]
    with pytest.raises(ValueError):
        smooth([1.0], 2)


def test_crossing_interpolates_step_and_time_between_evaluations():
    ev = curve([4.0, 3.0, 2.0, 1.0], dt=2.0)  # smoothed: 4.0, 3.0, 2.0, 1.0
    step, t = crossing(ev, 2.5, window=1)
    assert step == pytest.approx(25.0) and t == pytest.approx(5.0)
    assert crossing(ev, 0.5, window=1) == (None, None)
    assert crossing(ev, 9.0, window=1) == (10.0, 2.0)


def test_one_noisy_dip_does_not_decide_the_crossing():
    """A single evaluation below the target ahead of the trend is smoothed away."""
    ev = curve([4.0, 3.6, 2.0, 3.2, 2.9, 2.6, 2.3])
    raw_step, _ = crossing(ev, 2.5, window=1)
    step, _ = crossing(ev, 2.5, window=3)
    assert raw_step < 30 < step


def test_target_reads_the_smoothed_curve_at_a_step():
    ev = curve([4.0, 3.0, 2.0, 1.0], every=10)
    assert target_at(ev, 25, window=1) == pytest.approx(2.5)
    assert target_at(ev, 5, window=1) == 4.0 and target_at(ev, 99, window=1) == 1.0
    assert target_at(ev, 20, window=3) == pytest.approx(3.0)


def test_paired_noise_removes_what_every_evaluation_shares():
    """Batches of very different difficulty, evaluated at every step: a large standard
    error of each evaluation, but the change between evaluations is measured precisely
    (the paired standard error of the per-batch differences)."""
    rnd = random.Random(1)
    offsets = [rnd.gauss(0, 2.0) for _ in range(16)]  # how hard each batch is
    ev = curve([4.0, 3.0, 2.0, 1.0])
    for e in ev:
        e["val_batch_losses"] = [e["val_loss"] + o + rnd.gauss(0, 0.01) for o in offsets]
    n = eval_noise(ev, 30, window=1)
    d = [a - b for a, b in zip(ev[2]["val_batch_losses"], ev[1]["val_batch_losses"])]
    md = sum(d) / 16
    want = (sum((x - md) ** 2 for x in d) / 15) ** 0.5 / 4
    assert n["paired_std_error"] == pytest.approx(want)
    assert n["std_error"] > 0.25 and not n["ok"]  # the shared offsets dominate the SE
    assert n["paired_std_error"] < 0.01 and n["paired_ok"]
    # the first evaluation has no previous one: not defined, never ok
    n0 = eval_noise(ev, 10, window=1)
    assert math.isnan(n0["paired_std_error"]) and not n0["paired_ok"]
    assert n0["neighbour_change"] == pytest.approx(1.0)  # to the one neighbour it has
    assert eval_noise(ev, 40, window=1)["neighbour_change"] == pytest.approx(1.0)


def test_eval_noise_compares_standard_error_with_neighbour_change():
    rnd = random.Random(0)
    ev = curve([4.0, 3.0, 2.0, 1.0])
    for e in ev:
        e["val_batch_losses"] = [e["val_loss"] + rnd.gauss(0, 0.4) for _ in range(16)]
    n = eval_noise(ev, 30, window=1)
    sd = (sum((x - sum(ev[2]["val_batch_losses"]) / 16) ** 2
              for x in ev[2]["val_batch_losses"]) / 15) ** 0.5
    assert n["std_error"] == pytest.approx(sd / 4) and n["neighbour_change"] == pytest.approx(1.0)
    assert n["ok"] == (n["std_error"] < 0.25)
    for e in ev:  # 16 times noisier: the check must fail
        e["val_batch_losses"] = [e["val_loss"] + 16 * (x - e["val_loss"])
                                 for x in e["val_batch_losses"]]
    assert not eval_noise(ev, 30, window=1)["ok"]
    assert math.isnan(eval_noise(curve([1.0, 0.5]), 10)["std_error"])


def test_the_step_zero_evaluation_is_left_out():
    """The evaluation before training (step 0) is no point of the curve: it neither
    enters the smoothing nor can be the crossing."""
    ev = [{"step": 0, "val_loss": 10.0, "cum_emulated_s": 0.0}] + curve([4.0, 3.0, 2.0, 1.0])
    assert target_at(ev, 10, window=3) == 4.0  # smoothed [4, 3, 2, 1] keeps its first point
    assert target_at(ev, 0, window=1) == 4.0
    assert crossing(ev, 9.0, window=1) == (10.0, 2.0)


def test_crossing_interpolates_from_the_last_point_above_the_target():
    """Between smoothed losses 3.0 (step 20, 4 s) and 2.0 (step 30, 6 s) the target 2.8
    is a fifth of the way: step 22, 4.4 s."""
    step, t = crossing(curve([4.0, 3.0, 2.0, 1.0], dt=2.0), 2.8, window=1)
    assert step == pytest.approx(22.0) and t == pytest.approx(4.4)


def test_eval_noise_is_ok_below_a_quarter_of_the_change():
    """Two batches ``loss -+ d`` give a standard error of exactly ``d``; the neighbour change
    is 1.0, so ``d = 0.3`` is too noisy (not below 0.25) and ``d = 0.2`` is not."""
    for d, ok in ((0.3, False), (0.2, True)):
        ev = curve([4.0, 3.0, 2.0, 1.0])
        for e in ev:
            e["val_batch_losses"] = [e["val_loss"] - d, e["val_loss"] + d]
        n = eval_noise(ev, 30, window=1)
        assert n["std_error"] == pytest.approx(d) and n["neighbour_change"] == pytest.approx(1.0)
        assert n["ok"] is ok


def test_a_curve_that_reaches_the_target_exactly_crosses_there():
    """Reaching the target is crossing it: the last evaluation, equal to the target, is
    the crossing (not ``None``)."""
    assert crossing(curve([4.0, 3.0, 2.0, 1.0], dt=2.0), 1.0, window=1) == (40.0, 8.0)
