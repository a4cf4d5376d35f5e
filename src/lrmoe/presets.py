"""Named model shapes.

Full presets are the published shapes (for planning and layer benchmarks); ``tiny-*``
train on two CPU cores in minutes; ``small-*`` are one-GPU training shapes with the
full models' expert count ratios scaled down (>= 64 experts, top-8).
"""

from __future__ import annotations

from lrmoe.config import ModelConfig
from lrmoe.errors import require

# what the tiny and the small shapes of both families share
_TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=96,
             num_experts=16, norm_topk_prob=True, rope_theta=10000.0,
             max_position_embeddings=2048)
_SMALL = dict(vocab_size=256, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=64,
              num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1_000_000.0,
              max_position_embeddings=4096)
# GLM-4.5's fields the tiny and small GLM shapes keep
_GLM = dict(model_type="glm4_moe", partial_rotary_factor=0.5, n_shared_experts=1,
            first_k_dense_replace=1, attention_bias=True, use_qk_norm=False, rms_norm_eps=1e-5)

PRESETS: dict[str, dict] = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, rope_theta=1_000_000.0, max_position_embeddings=40960,
        rms_norm_eps=1e-6, router_aux_loss_coef=0.001),
    "glm-4.5-air": dict(
        _GLM, vocab_size=151552, hidden_size=4096, intermediate_size=10944,
        num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
        moe_intermediate_size=1408, num_experts=128, num_experts_per_tok=8, n_group=1,
        topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
        rope_theta=1_000_000.0, max_position_embeddings=131072),
    "tiny-qwen3": dict(_TINY, model_type="qwen3_moe", num_experts_per_tok=2,
                       router_aux_loss_coef=0.01),
    "tiny-glm": dict(_TINY, **_GLM, num_experts_per_tok=4, n_group=4, topk_group=2,
                     routed_scaling_factor=2.5, bias_update_rate=0.001),
    "small-qwen3": dict(_SMALL, model_type="qwen3_moe", moe_intermediate_size=192,
                        router_aux_loss_coef=0.001),
    "small-glm": dict(_SMALL, **_GLM, moe_intermediate_size=176, n_group=1, topk_group=1,
                      routed_scaling_factor=1.0),
}


def get_preset(name: str) -> ModelConfig:
    require(name in PRESETS, f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return ModelConfig(**PRESETS[name])


# parameter categories of :func:`param_breakdown`
CATEGORIES = ("experts", "attention", "norms", "routers", "dense_mlp", "embedding", "lm_head")


def layer_params(cfg: ModelConfig, i: int) -> dict[str, int]:
    """Parameters of decoder layer ``i`` by category."""
    H, D = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    out = dict.fromkeys(CATEGORIES, 0)
    out["attention"] = H * q + 2 * H * kv + q * H
    if cfg.attention_bias:  # q/k/v biases; Qwen3's o_proj takes one too (model/layers.py)
        out["attention"] += q + 2 * kv + (H if cfg.model_type == "qwen3_moe" else 0)
    out["norms"] = 2 * H + (2 * D if cfg.use_qk_norm else 0)
    if cfg.is_moe_layer(i):
        out["routers"] = cfg.num_experts * H
        out["experts"] = cfg.num_experts * 3 * H * cfg.moe_intermediate_size
        out["dense_mlp"] = 3 * H * cfg.moe_intermediate_size * cfg.n_shared_experts
    else:
        out["dense_mlp"] = 3 * H * cfg.intermediate_size
    return out


def param_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by category from the shapes alone, each tensor once (a tied head adds none)."""
    out = dict.fromkeys(CATEGORIES, 0)
    for i in range(cfg.num_hidden_layers):
        for k, v in layer_params(cfg, i).items():
            out[k] += v
    out["norms"] += cfg.hidden_size  # the final norm
    out["embedding"] = cfg.vocab_size * cfg.hidden_size
    out["lm_head"] = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return out


def param_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active-per-token) parameter counts from the shapes alone, GLM's router
    correction bias (a buffer) counted with the routers."""
    p = param_breakdown(cfg)
    n_moe = len(cfg.moe_layers)
    bias = n_moe * cfg.num_experts if cfg.model_type == "glm4_moe" else 0
    total = sum(p.values()) + bias
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return total, total - p["experts"] + n_moe * cfg.num_experts_per_tok * per_expert
