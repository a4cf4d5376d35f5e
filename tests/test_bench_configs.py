"""The benchmark workloads' model configs (benchmarks/configs/*.json) load as HF configs
(the whole Qwen3-30B-A3B's equals its preset), and the GLM variants differ from the
GLM-4.5-Air-shaped base only in the loss-free bias rate they name (what RESULTS.md says about them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lrmoe.config import ModelConfig

CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda p: p.name)
def test_every_benchmark_config_loads(path):
    cfg = ModelConfig.from_hf_dict(json.loads(path.read_text()))
    assert cfg.num_experts == 128 and cfg.num_experts_per_tok == 8
    assert cfg.num_hidden_layers == (48 if path.name.endswith("-full.json") else 2)


def test_full_qwen3_config_is_the_preset():
    """The whole-model config (benchmarks/fullsize.py) is HF's Qwen3-30B-A3B: the preset."""
    from lrmoe.presets import get_preset

    cfg = ModelConfig.from_hf_dict(json.loads((CONFIGS / "qwen3-30b-a3b-full.json").read_text()))
    assert cfg == get_preset("qwen3-30b-a3b") and not cfg.tie_word_embeddings


@pytest.mark.parametrize("name,rate", [("glm-4.5-air-layer-2L-fastbias.json", 0.01),
                                       ("glm-4.5-air-layer-2L-bias03.json", 0.03)])
def test_glm_variants_change_only_the_bias_rate(name, rate):
    base = json.loads((CONFIGS / "glm-4.5-air-layer-2L.json").read_text())
    var = json.loads((CONFIGS / name).read_text())
    assert {k: v for k, v in var.items() if k != "lrmoe_bias_update_rate"} == \
        {k: v for k, v in base.items() if k != "lrmoe_bias_update_rate"}
    assert ModelConfig.from_hf_dict(var).bias_update_rate == rate
    assert ModelConfig.from_hf_dict(base).bias_update_rate != rate


@pytest.mark.parametrize("name,rate", [("glm-4.5-air-moe-2L.json", 0.001),
                                       ("glm-4.5-air-moe-2L-bias03.json", 0.03)])
def test_glm_twin_without_a_dense_layer(name, rate):
    """The GLM twin of the memory study: both decoder layers MoE (the real model has one
    dense layer in 46), otherwise the GLM layer config, with its bias rate."""
    base = json.loads((CONFIGS / "glm-4.5-air-layer-2L.json").read_text())
    twin = json.loads((CONFIGS / name).read_text())
    keep = ("first_k_dense_replace", "lrmoe_bias_update_rate")
    assert {k: v for k, v in twin.items() if k not in keep} == \
        {k: v for k, v in base.items() if k not in keep}
    cfg = ModelConfig.from_hf_dict(twin)
    assert all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert cfg.bias_update_rate == rate
