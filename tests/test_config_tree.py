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
