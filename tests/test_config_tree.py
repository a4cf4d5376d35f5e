"""One config tree: the flat flags land in the planner's knobs (``LrmoeConfig``), the
backward's (``BackwardOptions``) and the fidelity monitor's, and the trainer's backward
options are built from them."""

from __future__ import annotations

import dataclasses

from lrmoe.parallel.options import BackwardOptions
from lrmoe.policy.lrmoe import LrmoeConfig
from lrmoe.train.config import TrainConfig, backward_options


def test_runtime_knobs_leave_the_planner_config():
    planner = {f.name for f in dataclasses.fields(LrmoeConfig)}
    assert not planner & {"metric", "estimator", "compaction", "fidelity_every",
                          "retention_order"}


def test_flags_reach_the_backward_options():
    cfg = TrainConfig.from_flat(policy="lrmoe", lrmoe_estimator="sampled", lrmoe_metric="gate",
                                lrmoe_compaction=False, lrmoe_fidelity_every=3,
                                lrmoe_min_keep=0.3, router_grad="experts")
    assert backward_options(cfg) == BackwardOptions(metric="gate", estimator="sampled",
                                                    compaction=False, router_grad="experts")
    assert cfg.policy.fidelity.every == 3 and cfg.policy.lrmoe.min_keep == 0.3
    assert backward_options(TrainConfig()) == BackwardOptions()
    # the flat names round-trip (a run's config.json)
    assert TrainConfig.from_flat(cfg.flat()) == cfg


def test_bench_ttl_trains_with_a_train_config():
    from lrmoe.sim.ttl import SHARED, TTLConfig, recorded_settings

    assert set(SHARED) <= {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TTLConfig.from_flat(ep=2, steps=7, grad_accum=2, estimator="sampled",
                              lrmoe_placement="previous")
    assert isinstance(cfg.train, TrainConfig)
    assert (cfg.train.ep, cfg.train.steps, cfg.train.grad_accum) == (2, 7, 2)
    assert (cfg.estimator, cfg.lrmoe_placement) == ("sampled", "previous")
    rec = recorded_settings(cfg)  # the flat names ttl.json has always recorded
    assert (rec["ep"], rec["steps"], rec["estimator"], rec["seq_len"]) == (2, 7, "sampled", 128)
    assert "train" not in rec
    assert TTLConfig.from_flat(**cfg.flat()) == cfg
