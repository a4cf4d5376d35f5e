"""The keep-ratio controller behind ``--lrmoe-keep auto``."""

import pytest
import torch

from lrmoe.config import ModelConfig
from lrmoe.errors import LrmoeError
from lrmoe.policy.base import PlanInputs
from lrmoe.policy.lrmoe import LrmoeConfig, LrmoePolicy
from lrmoe.policy.registry import FidelityConfig, PolicyConfig, make_policy


def test_auto_needs_fidelity_monitor():
    mcfg = ModelConfig(num_experts=8)
    auto = LrmoeConfig(keep="auto")
    with pytest.raises(LrmoeError, match="fidelity"):
        make_policy(PolicyConfig(name="lrmoe", lrmoe=auto), mcfg, 2)
    pol = make_policy(PolicyConfig(name="lrmoe", lrmoe=auto, fidelity=FidelityConfig(1)), mcfg, 2)
    assert pol.config.keep == "auto"


def test_controller_moves_floor_toward_target_and_round_trips():
    p = LrmoePolicy(LrmoeConfig(keep="auto", min_keep=0.5, target_cosine=0.95))
    p.observe_fidelity(0, 0.80)  # too approximate: keep more
    assert p.min_keep_by_layer[0] == pytest.approx(0.6)
    p.observe_fidelity(0, 0.999)  # comfortably above: keep a little less
    assert p.min_keep_by_layer[0] == pytest.approx(0.58)
    p.observe_fidelity(0, 0.96)  # inside the band: hold
    assert p.min_keep_by_layer[0] == pytest.approx(0.58)
    q = LrmoePolicy(LrmoeConfig(keep="auto"))
    q.load_state_dict(p.state_dict())
    assert q.min_keep_by_layer == p.min_keep_by_layer


def test_auto_floor_reaches_the_plan():
    counts = torch.tensor([[40, 3, 3, 2], [38, 4, 2, 4]])
    p = LrmoePolicy(LrmoeConfig(keep="auto", min_keep=0.2, balance=1.0))
    low = p.plan(counts, PlanInputs(layer=0)).select_GGS.sum()
    for _ in range(8):
        p.observe_fidelity(0, 0.0)
    high = p.plan(counts, PlanInputs(layer=0)).select_GGS.sum()
    assert p.min_keep_by_layer[0] == pytest.approx(1.0)
    assert high >= low
    assert high == counts.sum()  # floor 1: every pair selected


def test_the_trainer_hands_the_ranks_mean_cosine_to_the_policy():
    from lrmoe.train.loop import _observe_fidelity

    p = LrmoePolicy(LrmoeConfig(keep="auto", min_keep=0.5, target_cosine=0.95))
    per_rank = [{0: {"fidelity_cosine": 0.7}, 1: {}}, {0: {"fidelity_cosine": 0.9}, 1: {}}]
    _observe_fidelity(p, {0: {"fidelity_cosine": 0.7}, 1: {}}, per_rank)
    assert p.min_keep_by_layer == {0: pytest.approx(0.6)}  # mean 0.8 < 0.95: keep more
    static = make_policy(PolicyConfig(), ModelConfig(num_experts=8), 2)
    _observe_fidelity(static, {0: {"fidelity_cosine": 0.7}}, per_rank[:1])  # ignored
    assert static.state_dict() == {}
