"""One config tree: the flat flags land in the planner's knobs (``LrmoeConfig``), the
backward's (``BackwardOptions``) and the fidelity monitor's, and the trainer's backward
options are built from them."""

from __future__ import annotations

import dataclasses
import re

import pytest

from lrmoe.errors import LrmoeError
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
    from lrmoe.sim.ttl_config import SHARED, TTLConfig, recorded_settings

    assert set(SHARED) <= {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TTLConfig.from_flat(ep=2, steps=7, grad_accum=2, estimator="sampled",
                              lrmoe_placement="previous")
    assert isinstance(cfg.train, TrainConfig)
    assert (cfg.train.ep, cfg.train.steps, cfg.train.grad_accum) == (2, 7, 2)
    assert (cfg.lrmoe.backward.estimator, cfg.lrmoe.planner.placement) == ("sampled", "previous")
    rec = recorded_settings(cfg)  # the flat names ttl.json has always recorded
    assert (rec["ep"], rec["steps"], rec["estimator"], rec["seq_len"]) == (2, 7, "sampled", 128)
    assert "train" not in rec and "lrmoe" not in rec
    assert TTLConfig.from_flat(**cfg.flat()) == cfg


# lrmoe's knobs as ttl.json has recorded them (flat names), each with a value other than
# its default, and where bench ttl's config holds it
KNOBS = {"min_keep": 0.8, "balance": 0.25, "lrmoe_max_slots": 5, "estimator": "sampled",
         "lrmoe_recompute": True, "lrmoe_placement": "step", "lrmoe_link_cost": False}


def test_lrmoe_knobs_nest_in_the_planner_and_backward_configs_and_round_trip():
    from lrmoe.sim.ttl_config import LrmoeKnobs, TTLConfig

    cfg = TTLConfig.from_flat(ep=2, **KNOBS)
    assert cfg.lrmoe == LrmoeKnobs(
        planner=LrmoeConfig(min_keep=0.8, balance=0.25, max_slots_per_rank=5, recompute=True,
                            placement="step"),
        backward=BackwardOptions(estimator="sampled"), link_cost=False)
    flat = cfg.flat()
    assert {k: flat[k] for k in KNOBS} == KNOBS
    assert TTLConfig.from_flat(**flat) == cfg
    # a setting bench ttl does not record cannot be set (a --reuse would not see it)
    with pytest.raises(LrmoeError, match="records lrmoe's knobs"):
        TTLConfig(lrmoe=LrmoeKnobs(backward=BackwardOptions(metric="gate")))


def test_policy_variant_sets_lrmoe_knobs_and_refuses_bad_values_naming_the_spec():
    """A ``--policies`` spec sets lrmoe's knobs (``link_cost`` by on|off, as the flags read
    on|off); a bad spec is one line naming it."""
    from lrmoe.sim.ttl_config import TTLConfig, policy_variant

    base = TTLConfig.from_flat(ep=2)
    name, cfg = policy_variant("lrmoe:link_cost=off+min_keep=0.5+recompute", base)
    assert name == "lrmoe" and cfg.lrmoe.link_cost is False
    assert (cfg.lrmoe.planner.min_keep, cfg.lrmoe.planner.recompute) == (0.5, True)
    assert policy_variant("lrmoe:link_cost=on", base)[1].lrmoe.link_cost is True
    assert policy_variant("lrmoe:select_from=16", base)[1].lrmoe.planner.select_from == 16
    assert policy_variant("symi", base) == ("symi", base)
    for spec, words in (("lrmoe:link_cost=maybe", "link_cost: 'maybe' is not on or off"),
                        ("lrmoe:min_keep=x", "min_keep='x' is not a valid float"),
                        ("lrmoe:min_keep=2", "lrmoe.min_keep=2.0 must be in [0, 1]"),
                        ("lrmoe:link_cost", "'link_cost' needs a value"),
                        ("symi:recompute", "only lrmoe takes options")):
        with pytest.raises(LrmoeError, match=re.escape(f"--policies: {spec!r}")) as e:
            policy_variant(spec, base)
        assert words in str(e.value) and "\n" not in str(e.value), (spec, str(e.value))


def _reuse(tmp_path, recorded: dict, cfg):
    """``load_reused`` of a ttl.json that recorded ``recorded`` (no policies), for ``cfg``."""
    import json

    from lrmoe.sim.ttl import load_reused

    f = tmp_path / "ttl.json"
    f.write_text(json.dumps({"config": recorded, "policies": {}}))
    return load_reused(dataclasses.replace(cfg, reuse=str(f)), ["static"], 1.0)


@pytest.mark.parametrize("knob", list(KNOBS))
def test_reuse_sees_each_lrmoe_knob(tmp_path, knob):
    """--reuse of a file recorded with one lrmoe knob changed is refused naming it; with
    the same knobs it is taken (an older file: the same flat names)."""
    from lrmoe.sim.ttl_config import TTLConfig, recorded_settings

    base = TTLConfig.from_flat(ep=2)
    older = recorded_settings(base) | {knob: KNOBS[knob]}  # as an earlier run wrote it
    with pytest.raises(LrmoeError, match=f"it ran with {knob}="):
        _reuse(tmp_path, older, base)
    assert _reuse(tmp_path, older, TTLConfig.from_flat(ep=2, **{knob: KNOBS[knob]})) == {}


@pytest.mark.parametrize("field,ok,bad", [
    ("target_fraction", 1.0, 1.0001), ("target_fraction", 1e-9, 0.0),
    ("smooth_window", 2**31 - 1, 2**31 + 1), ("smooth_window", 1, 2),
    ("max_data_bytes", 1, 0), ("seed", 2**64 - 1, 2**64), ("eval_every", 2**63 - 1, 2**63)])
def test_bench_ttl_ranges_hold_at_their_bounds(field, ok, bad):
    """``bench ttl``'s range checks at each bound: the last value in is taken, the first
    value out is one line naming the flag."""
    from lrmoe.sim.ttl_config import TTLConfig, check_ttl_config

    check_ttl_config(TTLConfig.from_flat(preset="tiny-qwen3", **{field: ok}))
    with pytest.raises(LrmoeError, match="--" + field.replace("_", "-")) as e:
        check_ttl_config(TTLConfig.from_flat(preset="tiny-qwen3", **{field: bad}))
    assert "\n" not in str(e.value)
