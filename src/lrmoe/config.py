"""Model configuration, read from and written to HF ``config.json`` field names.

One dataclass covers both families (``model_type`` ``qwen3_moe`` and ``glm4_moe``);
family-specific fields keep HF's names and defaults. A field we do not implement is
accepted only at its default value: anything else is an :class:`LrmoeError`, never
silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lrmoe.errors import LrmoeError, require

MODEL_TYPES = ("qwen3_moe", "glm4_moe")

# HF fields that change nothing in training math (generation, bookkeeping, dtypes).
_IGNORED_FIELDS = {
    "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "output_router_logits",
    "initializer_range", "max_window_layers", "sliding_window", "_name_or_path",
    "tie_encoder_decoder", "return_dict", "output_hidden_states", "output_attentions",
    "id2label", "label2id", "num_nextn_predict_layers", "layer_types",
    "is_encoder_decoder", "chunk_size_feed_forward", "problem_type", "tokenizer_class",
    "task_specific_params", "model_input_names",
}

# Fields we do not implement, with the only value we accept.
_UNSUPPORTED_AT_DEFAULT = {
    "use_sliding_window": False,
    "rope_scaling": None,
    "hidden_act": "silu",
    "pretraining_tp": 1,
    "attention_dropout": 0.0,  # lrmoe's attention has no dropout
}


def _check_type(f: dataclasses.Field, v: Any) -> None:
    """A config field's JSON value has its field's type (read from the default)."""
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if default is None and v is None:
        return
    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)
    want, ok = {  # by the default's type; int, or int | None (head_dim), otherwise
        bool: ("true or false", isinstance(v, bool)),
        float: ("a number", is_int(v) or isinstance(v, float)),
        str: ("a string", isinstance(v, str)),
        list: ("a list of integers", isinstance(v, list) and all(map(is_int, v))),
    }.get(type(default), ("an integer", is_int(v)))
    require(ok, f"config field {f.name}={v!r} must be {want}")


@dataclass
class ModelConfig:
    """Shapes and routing of a Qwen3-MoE or GLM-4.5-MoE causal LM (HF field names)."""

    model_type: str = "qwen3_moe"
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 256  # dense MLP width (dense layers)
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # MoE
    moe_intermediate_size: int = 64
    num_experts: int = 16  # qwen3 name; GLM's n_routed_experts maps here
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    # Qwen3-MoE only
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001
    # GLM-4.5 only
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    partial_rotary_factor: float = 1.0
    use_qk_norm: bool = True  # qwen3 always has q/k norm; GLM-4.5 configures it
    # Aux-loss-free balancing (GLM): bias += rate * sign(mean - count) after each step.
    bias_update_rate: float = 0.001

    def __post_init__(self) -> None:
        if self.head_dim is None:
            require(
                self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads == 0,
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; give head_dim explicitly or "
                "pick a divisor",
            )
            self.head_dim = self.hidden_size // self.num_attention_heads
        require(self.model_type in MODEL_TYPES,
                f"model_type={self.model_type!r} is not supported; use one of {MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "moe_intermediate_size", "num_experts",
                     "num_experts_per_tok", "intermediate_size", "head_dim"):
            v = getattr(self, name)
            require(isinstance(v, int) and v > 0, f"{name}={v!r} must be a positive integer")
        require(self.num_attention_heads % self.num_key_value_heads == 0,
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        require(self.num_experts_per_tok <= self.num_experts,
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds the number of experts "
                f"({self.num_experts}); it must be between 1 and {self.num_experts}")
        require(self.num_experts % self.n_group == 0,
                f"n_group={self.n_group} must divide the number of experts ({self.num_experts})")
        require(1 <= self.topk_group <= self.n_group,
                f"topk_group={self.topk_group} must be between 1 and n_group={self.n_group}")
        if self.model_type == "glm4_moe" and self.n_group > 1:
            per_group = self.num_experts // self.n_group
            require(per_group >= 2, f"n_group={self.n_group} leaves fewer than 2 experts per group")
            require(self.topk_group * per_group >= self.num_experts_per_tok,
                    f"topk_group={self.topk_group} groups of {per_group} experts cannot hold "
                    f"num_experts_per_tok={self.num_experts_per_tok} experts")
        require(0.0 < self.partial_rotary_factor <= 1.0,
                f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1]")
        require(self.rotary_dim % 2 == 0 and self.rotary_dim > 0,
                f"head_dim*partial_rotary_factor={self.rotary_dim} must be a positive even number")
        require(self.decoder_sparse_step >= 1,
                f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        for i in self.mlp_only_layers:
            require(0 <= i < self.num_hidden_layers,
                    f"mlp_only_layers holds {i}, outside 0..{self.num_hidden_layers - 1}")
        require(0 <= self.first_k_dense_replace <= self.num_hidden_layers,
                f"first_k_dense_replace={self.first_k_dense_replace} must be in "
                f"0..{self.num_hidden_layers}")
        require(self.n_shared_experts >= 0, f"n_shared_experts={self.n_shared_experts} < 0")
        require(self.rms_norm_eps > 0, f"rms_norm_eps={self.rms_norm_eps} must be > 0")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        if self.model_type == "glm4_moe":
            return i >= self.first_k_dense_replace
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def router_kind(self) -> str:
        return "sigmoid_group" if self.model_type == "glm4_moe" else "softmax"

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        require(isinstance(d, dict), "config must be a JSON object of HF config.json fields")
        d = dict(d)
        if "lrmoe_bias_update_rate" in d:
            d["bias_update_rate"] = d.pop("lrmoe_bias_update_rate")
        mt = d.get("model_type")
        require(mt in MODEL_TYPES, f"config model_type={mt!r} is not supported; use one of {MODEL_TYPES}")
        # transformers >= 5 nests rope settings in rope_parameters.
        rp = d.pop("rope_parameters", None)
        if rp is not None:
            require(isinstance(rp, dict), f"rope_parameters={rp!r} must be an object")
            rtype = rp.get("rope_type", "default")
            if rtype != "default":
                raise LrmoeError(f"rope_parameters.rope_type={rtype!r} is not supported; only 'default'")
            for key in ("rope_theta", "partial_rotary_factor"):
                if key in rp:
                    d.setdefault(key, rp[key])
        if mt == "glm4_moe":  # HF's GLM-4.5 defaults where they differ from ModelConfig's
            if "n_routed_experts" in d:
                d["num_experts"] = d.pop("n_routed_experts")
            d.setdefault("use_qk_norm", False)
            d.setdefault("partial_rotary_factor", 0.5)
            d.setdefault("n_shared_experts", 1)
            d.setdefault("first_k_dense_replace", 1)
        kw: dict[str, Any] = {}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for k, v in d.items():
            if k in fields:
                _check_type(fields[k], v)
                kw[k] = v
            elif k in _UNSUPPORTED_AT_DEFAULT:
                if v != _UNSUPPORTED_AT_DEFAULT[k] and not (k == "use_sliding_window" and not v):
                    raise LrmoeError(
                        f"config field {k}={v!r} is not supported; lrmoe implements only "
                        f"{k}={_UNSUPPORTED_AT_DEFAULT[k]!r}")
            elif k not in _IGNORED_FIELDS:
                # Unknown fields are an error only when they are set to something that
                # would change the math; we cannot know that, so we refuse them.
                raise LrmoeError(f"config field {k!r}={v!r} is not supported by lrmoe")
        if mt == "qwen3_moe" and not kw.get("use_qk_norm", True):
            raise LrmoeError("use_qk_norm=False is not a Qwen3-MoE option")
        return cls(**kw)  # every value's type checked above

    def to_hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        bias_rate = d.pop("bias_update_rate")
        if self.model_type == "glm4_moe":
            d["n_routed_experts"] = d.pop("num_experts")
            for k in ("decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef"):
                d.pop(k)
            d["architectures"] = ["Glm4MoeForCausalLM"]
            d["lrmoe_bias_update_rate"] = bias_rate
        else:
            for k in ("n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
                      "first_k_dense_replace", "partial_rotary_factor", "use_qk_norm"):
                d.pop(k)
            d["architectures"] = ["Qwen3MoeForCausalLM"]
        d["hidden_act"] = "silu"
        return d

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf_dict(read_config_json(path))


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A ``config.json`` (or the directory holding one) as a dict, or one error line."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise LrmoeError(f"cannot read config {p}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LrmoeError(f"config {p} is not valid JSON ({e})") from None
    require(isinstance(d, dict), f"config {p} must be a JSON object of HF config.json fields")
    return d
