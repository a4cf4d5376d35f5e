"""HF checkpoint I/O: round trips, interop with transformers' Qwen3-MoE / GLM-4.5-MoE,
corrupt files and atomic saves."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import lrmoe
from lrmoe.config import ModelConfig
from lrmoe.errors import LrmoeError
from lrmoe.hf import load_hf_config, save_hf
from lrmoe.hf_load import load_hf
from lrmoe.model import MoEForCausalLM

QWEN = dict(model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, rope_theta=1_000_000.0, max_position_embeddings=256,
            rms_norm_eps=1e-6)
GLM = dict(model_type="glm4_moe", vocab_size=128, hidden_size=64, intermediate_size=96,
           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, n_group=2,
           topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
           partial_rotary_factor=0.5, attention_bias=True, routed_scaling_factor=2.0,
           norm_topk_prob=True, use_qk_norm=False, rope_theta=500_000.0,
           max_position_embeddings=256, rms_norm_eps=1e-5)
FAMILIES = {"qwen3": QWEN, "glm": GLM}


def _perturb(module: torch.nn.Module, seed: int) -> None:
    """Weights big enough that every tensor visibly matters (default inits are tiny);
    norms near 1; GLM correction biases large enough to reorder experts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if "inv_freq" in name or not t.is_floating_point():
                continue
            r = torch.randn(t.shape, generator=g)
            if "norm" in name:
                t.copy_(1.0 + 0.2 * r)
            elif "e_score_correction_bias" in name:
                t.copy_(0.5 * r)
            elif name.endswith("bias"):
                t.copy_(0.1 * r)
            else:
                t.copy_(0.15 * r)


def _ours(cfg_kw: dict, seed: int = 0, **over) -> MoEForCausalLM:
    torch.manual_seed(seed)
    m = MoEForCausalLM(ModelConfig(**{**cfg_kw, **over}))
    _perturb(m, seed)
    return m.eval()


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(m, ids):
    out = m(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


# ---------------------------------------------------------------- HF models
def _hf_model(family: str, seed: int = 0, **over):
    tf = pytest.importorskip("transformers")
    kw = dict(FAMILIES[family])
    kw.pop("model_type")
    theta = kw.pop("rope_theta")
    kw.update(over)
    if family == "qwen3":
        cfg = tf.Qwen3MoeConfig(**kw, rope_parameters={"rope_type": "default",
                                                        "rope_theta": theta})
        cls = tf.Qwen3MoeForCausalLM
    else:
        kw["n_routed_experts"] = kw.pop("num_experts")
        prf = kw.pop("partial_rotary_factor")
        cfg = tf.Glm4MoeConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": theta,
                                                       "partial_rotary_factor": prf})
        cls = tf.Glm4MoeForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = cls(cfg).to(torch.float32)
    _perturb(m, seed)
    return m.eval()


def _hf_from_pretrained(family: str, path: Path):
    tf = pytest.importorskip("transformers")
    cls = tf.Qwen3MoeForCausalLM if family == "qwen3" else tf.Glm4MoeForCausalLM
    m, info = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return m.eval()


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize("family", ["qwen3", "glm"])
@pytest.mark.parametrize("shard", [None, 20_000])
def test_roundtrip_identical(tmp_path, family, shard):
    m = _ours(FAMILIES[family])
    kw = {} if shard is None else {"max_shard_bytes": shard}
    out = save_hf(m, tmp_path / "ck", **kw)
    names = sorted(p.name for p in out.iterdir())
    if shard is None:
        assert names == ["config.json", "model.safetensors"]
    else:
        assert "model.safetensors.index.json" in names
        shards = [n for n in names if n.startswith("model-")]
        assert len(shards) > 2
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(shards)
        n = len(shards)  # HF's names: numbered from 1
        assert shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        total = 0
        for name in shards:
            with safe_open(out / name, "pt") as f:
                total += sum(f.get_tensor(k).nbytes for k in f.keys())
        assert index["metadata"]["total_size"] == total
        for n in shards:  # no shard above the limit unless it is a single tensor
            with safe_open(out / n, "pt") as f:
                if len(list(f.keys())) > 1:
                    assert (out / n).stat().st_size < shard + 4096
    m2 = lrmoe.load_hf(out)
    ids = _ids()
    assert torch.equal(_logits(m, ids), _logits(m2, ids))
    assert m2.config == m.config
    for (n1, t1), (n2, t2) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2), n1


def test_roundtrip_tied_and_dense_layers(tmp_path):
    m = _ours(QWEN, tie_word_embeddings=True, num_hidden_layers=3, mlp_only_layers=[1])
    save_hf(m, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    assert "model.layers.1.mlp.gate_proj.weight" in keys
    assert not any("inv_freq" in k for k in keys)
    m2 = load_hf(tmp_path)
    assert m2.lm_head.weight is m2.embed_tokens.weight
    assert torch.equal(_logits(m, _ids()), _logits(m2, _ids()))


def test_save_dtype_casts_all_but_glms_router(tmp_path):
    """``save_hf(dtype=bfloat16)``: every tensor in the file is the model's cast to bf16,
    GLM's router (weight and bias) stays fp32 as HF keeps it, and config.json says bf16."""
    m = _ours(GLM)
    save_hf(m, tmp_path, dtype="bfloat16")
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    router = {k for k in got if ".mlp.gate." in k}
    assert {k.rsplit(".", 1)[1] for k in router} == {"weight", "e_score_correction_bias"}
    assert all(got[k].dtype == torch.float32 for k in router)
    assert {got[k].dtype for k in got.keys() - router} == {torch.bfloat16}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    back = load_hf(tmp_path).state_dict()
    for k, v in m.state_dict().items():
        want = v if ".mlp.router." in k else v.to(torch.bfloat16).to(v.dtype)
        assert torch.equal(back[k], want), k


def test_two_shards_get_an_index(tmp_path):
    """A limit just under the model's size cuts it into exactly two shards, which need the
    index as much as more do."""
    m = _ours(QWEN)
    total = sum(t.nbytes for t in m.state_dict().values())
    out = save_hf(m, tmp_path / "ck", max_shard_bytes=total - 1)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json"]
    assert torch.equal(_logits(load_hf(out), _ids()), _logits(m, _ids()))


def test_load_dtype_keeps_glm_router_fp32(tmp_path):
    save_hf(_ours(GLM), tmp_path)
    m = load_hf(tmp_path, dtype="bfloat16")
    layer = m.layers[1].mlp
    assert m.embed_tokens.weight.dtype == torch.bfloat16
    assert layer.experts.gate_up_proj.dtype == torch.bfloat16
    assert layer.router.weight.dtype == torch.float32
    assert layer.router.e_score_correction_bias.dtype == torch.float32
    assert m.rotary.inv_freq.dtype == torch.float32
    assert _logits(m, _ids()).isfinite().all()


def test_saved_key_names_and_config(tmp_path):
    save_hf(_ours(GLM), tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    for k in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
              "model.layers.1.mlp.experts.7.gate_proj.weight",
              "model.layers.1.mlp.experts.0.up_proj.weight",
              "model.layers.2.mlp.experts.3.down_proj.weight",
              "model.layers.1.mlp.shared_experts.down_proj.weight",
              "model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_proj.bias",
              "model.norm.weight", "lm_head.weight"):
        assert k in keys, k
    assert not any("router" in k or "gate_up_proj" in k for k in keys)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Glm4MoeForCausalLM"]
    assert cfg["n_routed_experts"] == 8 and cfg["lrmoe_bias_update_rate"] == 0.001
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 500_000.0,
                                      "partial_rotary_factor": 0.5}
    assert load_hf_config(tmp_path) == ModelConfig(**GLM)


# ---------------------------------------------------------------- interop with transformers
@pytest.mark.parametrize("family", ["qwen3", "glm"])
@pytest.mark.parametrize("sharded", [False, True])
def test_load_hf_save_pretrained(tmp_path, family, sharded):
    hf = _hf_model(family)
    hf.save_pretrained(tmp_path, max_shard_size="40KB" if sharded else "5GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    ours = load_hf(tmp_path)
    ids = _ids()
    ref = _logits(hf, ids)
    assert (_logits(ours, ids) - ref).abs().max().item() < 1e-5
    assert ref.std() > 0.3  # the weights are large enough for the comparison to mean something


def test_load_hf_qk_norm_glm_and_tied(tmp_path):
    hf = _hf_model("glm", use_qk_norm=True, tie_word_embeddings=True, first_k_dense_replace=0)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    assert ours.config.use_qk_norm and ours.config.tie_word_embeddings
    assert (_logits(ours, _ids()) - _logits(hf, _ids())).abs().max().item() < 1e-5


def test_qwen3_attention_bias_both_ways(tmp_path):
    """HF Qwen3-MoE puts a bias on o_proj too when attention_bias is set."""
    hf = _hf_model("qwen3", attention_bias=True)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    assert ours.layers[0].self_attn.o_proj.bias is not None
    assert (_logits(ours, _ids()) - _logits(hf, _ids())).abs().max().item() < 1e-5
    ours = _ours(QWEN, attention_bias=True)
    save_hf(ours, tmp_path / "ours")
    hf = _hf_from_pretrained("qwen3", tmp_path / "ours")
    assert (_logits(hf, _ids()) - _logits(ours, _ids())).abs().max().item() < 1e-5


def test_glm_mtp_layers_skipped(tmp_path):
    """GLM-4.5 Hub checkpoints carry num_nextn_predict_layers extra layers (multi-token
    prediction) after the last decoder layer; HF's model skips them, so do we."""
    m = _ours(GLM)
    d = save_hf(m, tmp_path / "ck")
    _rewrite(d, lambda sd: sd.update({"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
                                      "model.layers.3.mlp.experts.0.up_proj.weight":
                                      torch.zeros(32, 64)}))
    with pytest.raises(LrmoeError, match=r"unexpected tensor model\.layers\.3\."):
        load_hf(d)  # save_hf wrote num_nextn_predict_layers=0
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    assert torch.equal(_logits(load_hf(d), _ids()), _logits(m, _ids()))


HUB_QWEN = {  # the layout of Qwen/Qwen3-30B-A3B's config.json, tiny shapes
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
    "eos_token_id": 151645, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 32, "norm_topk_prob": True, "num_attention_heads": 4,
    "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 128}
HUB_GLM = {  # the layout of zai-org/GLM-4.5-Air's config.json, tiny shapes
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 64, "partial_rotary_factor": 0.5,
    "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 131072,
    "model_type": "glm4_moe", "moe_intermediate_size": 32, "norm_topk_prob": True,
    "num_attention_heads": 4, "n_group": 2, "topk_group": 1, "n_routed_experts": 8,
    "n_shared_experts": 1, "routed_scaling_factor": 2.0, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "num_hidden_layers": 3, "num_key_value_heads": 2,
    "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0", "use_cache": True, "use_qk_norm": False,
    "vocab_size": 128}


@pytest.mark.parametrize("raw,expect", [(HUB_QWEN, QWEN), (HUB_GLM, GLM)])
def test_hub_config_layouts(tmp_path, raw, expect):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    want = ModelConfig(**{**expect, "max_position_embeddings": raw["max_position_embeddings"]})
    assert load_hf_config(tmp_path) == want


def test_glm_config_without_partial_rotary_factor_takes_hfs_half(tmp_path):
    """GLM-4.5's config class rotates half of each head when config.json leaves
    ``partial_rotary_factor`` out (top level or in ``rope_parameters``)."""
    raw = {k: v for k, v in HUB_GLM.items() if k != "partial_rotary_factor"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_hf_config(tmp_path).partial_rotary_factor == 0.5
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw.pop("rope_theta")}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_hf_config(tmp_path).partial_rotary_factor == 0.5


def test_load_fused_expert_names(tmp_path):
    """Checkpoints written with HF's in-memory (fused) expert names load too."""
    hf = _hf_model("qwen3")
    sd = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd
    hf.config.save_pretrained(tmp_path)
    safetensors.torch.save_file(sd, str(tmp_path / "model.safetensors"), {"format": "pt"})
    ours = load_hf(tmp_path)
    assert (_logits(ours, _ids()) - _logits(hf, _ids())).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", ["qwen3", "glm"])
def test_hf_from_pretrained_loads_save_hf(tmp_path, family):
    ours = _ours(FAMILIES[family], seed=3)
    save_hf(ours, tmp_path, max_shard_bytes=30_000)
    hf = _hf_from_pretrained(family, tmp_path)
    ids = _ids(5)
    assert (_logits(hf, ids) - _logits(ours, ids)).abs().max().item() < 1e-5


def test_hf_from_pretrained_tied(tmp_path):
    ours = _ours(QWEN, tie_word_embeddings=True)
    save_hf(ours, tmp_path)
    hf = _hf_from_pretrained("qwen3", tmp_path)
    assert (_logits(hf, _ids()) - _logits(ours, _ids())).abs().max().item() < 1e-5


def test_glm_router_matches_hf_with_negative_choice_scores():
    """Group-limited top-k must mask dropped groups with -inf: with negative correction
    biases, a 0.0 fill would pick experts from groups that were not selected."""
    tf = pytest.importorskip("transformers")
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from lrmoe.model.router import SigmoidGroupRouter
    cfg = ModelConfig(**{**GLM, "num_experts_per_tok": 3})
    ours = SigmoidGroupRouter(cfg)
    hf = Glm4MoeTopkRouter(tf.Glm4MoeConfig(hidden_size=64, n_routed_experts=8,
                                            num_experts_per_tok=3, n_group=2, topk_group=1,
                                            routed_scaling_factor=2.0))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(8, 64, generator=g))
        ours.e_score_correction_bias.copy_(torch.tensor([0.0, -2, -2, -2, -0.5, -0.5, -2, -2]))
        hf.weight.copy_(ours.weight)
        hf.e_score_correction_bias.copy_(ours.e_score_correction_bias)
    x = torch.randn(64, 64, generator=g)
    r = ours(x)
    _, w, idx = hf(x)
    o1, o2 = r.idx_TK.sort(-1), idx.sort(-1)
    assert torch.equal(o1.values, o2.values)
    assert torch.allclose(r.gate_TK.gather(1, o1.indices), w.gather(1, o2.indices))


# ---------------------------------------------------------------- checkpoint errors
def _saved(tmp_path, family="qwen3", **kw) -> Path:
    return save_hf(_ours(FAMILIES[family]), tmp_path / "ck", **kw)


def test_truncated_file(tmp_path):
    d = _saved(tmp_path)
    f = d / "model.safetensors"
    os.truncate(f, f.stat().st_size // 2)
    with pytest.raises(LrmoeError, match="model.safetensors is corrupt or truncated"):
        load_hf(d)


def test_garbage_header(tmp_path):
    d = _saved(tmp_path)
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"\x00garbage!" * 3 + b"\xff" * 5
    f.write_bytes(bytes(data))
    with pytest.raises(LrmoeError, match="corrupt or truncated"):
        load_hf(d)
    data[:8] = (2**40).to_bytes(8, "little")  # absurd header length
    f.write_bytes(bytes(data))
    with pytest.raises(LrmoeError, match="corrupt or truncated"):
        load_hf(d)


def test_truncated_shard_detected_before_loading(tmp_path, monkeypatch):
    import lrmoe.hf_load as hf_load

    d = _saved(tmp_path, max_shard_bytes=20_000)
    last = sorted(d.glob("model-*.safetensors"))[-1]
    os.truncate(last, last.stat().st_size - 10)
    built = []
    monkeypatch.setattr(hf_load, "empty_model", lambda *a, **kw: built.append(a))
    with pytest.raises(LrmoeError, match=f"{last.name} is corrupt or truncated"):
        load_hf(d)
    assert not built  # refused by the header checks: no model was built, let alone filled


def test_a_tensor_the_mapping_leaves_unread_is_never_trained_on(tmp_path):
    """If the name mapping read no piece into a tensor (a defect of the mapping, not of the
    checkpoint), the load refuses, naming it, rather than leave it as initialised."""
    from lrmoe.hf_load import empty_model, load_owned, open_checkpoint

    ck = open_checkpoint(_saved(tmp_path))
    ck.pieces = [pc for pc in ck.pieces if pc.target != "norm.weight"]
    with pytest.raises(LrmoeError, match=r"left norm.weight unfilled$"):
        load_owned(empty_model(ck.config), ck)


def test_every_file_is_flushed_before_it_is_renamed_in(tmp_path, monkeypatch):
    """A crash after a rename never leaves a name pointing at unflushed bytes: each weight
    file, the index and config.json are fsynced before they are renamed into place."""
    import lrmoe.hf as hf

    events, real_fsync, real_replace = [], hf.fsync, os.replace
    monkeypatch.setattr(hf, "fsync", lambda p: (events.append(("fsync", str(p))), real_fsync(p)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a))),
                                                     real_replace(a, b)))
    _saved(tmp_path, max_shard_bytes=20_000)
    renamed = [p for e, p in events if e == "replace"]
    assert len(renamed) > 3
    for p in renamed:
        assert ("fsync", p) in events[:events.index(("replace", p))], p


def test_config_json_renamed_in_last(tmp_path, monkeypatch):
    moved, real = [], os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (moved.append(Path(b).name), real(a, b)))
    _saved(tmp_path, max_shard_bytes=20_000)
    # a reader that finds config.json finds the weights it describes
    assert moved[-2:] == ["model.safetensors.index.json", "config.json"]
    assert len(moved) > 3 and all(n.startswith("model-") for n in moved[:-2])


@pytest.mark.parametrize("field, value, want", [
    ("hidden_size", "64", "an integer"), ("tie_word_embeddings", 1, "true or false"),
    ("rms_norm_eps", "1e-6", "a number"), ("mlp_only_layers", [0.5], "a list of integers")])
def test_config_field_types(field, value, want):
    with pytest.raises(LrmoeError, match=re.escape(f"config field {field}={value!r} must be {want}")):
        ModelConfig.from_hf_dict({**QWEN, field: value})


@pytest.mark.parametrize("base, ok, bad, want", [
    ("QWEN", {"hidden_size": 64}, {"hidden_size": 0}, "hidden_size=0 must be a positive integer"),
    ("QWEN", {"num_key_value_heads": 4}, {"num_key_value_heads": 3},
     "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ("QWEN", {"num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": None},
     {"num_attention_heads": 0, "num_key_value_heads": 1, "head_dim": None},
     "hidden_size=64 is not divisible by num_attention_heads=0"),
    ("QWEN", {"num_experts_per_tok": 8}, {"num_experts_per_tok": 9},
     "num_experts_per_tok=9 exceeds the number of experts (8)"),
    ("GLM", {"n_group": 4}, {"n_group": 3}, "n_group=3 must divide the number of experts (8)"),
    ("GLM", {"topk_group": 2}, {"topk_group": 3}, "topk_group=3 must be between 1 and n_group=2"),
    ("GLM", {"topk_group": 1}, {"topk_group": 0}, "topk_group=0 must be between 1 and n_group=2"),
    ("GLM", {"n_group": 4, "topk_group": 4}, {"n_group": 8, "topk_group": 4},
     "n_group=8 leaves fewer than 2 experts per group"),
    ("GLM", {"n_group": 4, "topk_group": 1}, {"n_group": 4, "topk_group": 1,
                                              "num_experts_per_tok": 3},
     "topk_group=1 groups of 2 experts cannot hold num_experts_per_tok=3 experts"),
    ("GLM", {"partial_rotary_factor": 1.0}, {"partial_rotary_factor": 1.01},
     "partial_rotary_factor=1.01 must be in (0, 1]"),
    ("GLM", {"partial_rotary_factor": 0.125}, {"partial_rotary_factor": 0.0625},
     "head_dim*partial_rotary_factor=1 must be a positive even number"),
    ("QWEN", {"decoder_sparse_step": 1}, {"decoder_sparse_step": 0},
     "decoder_sparse_step=0 must be >= 1"),
    ("QWEN", {"mlp_only_layers": [1]}, {"mlp_only_layers": [2]},
     "mlp_only_layers holds 2, outside 0..1"),
    ("GLM", {"first_k_dense_replace": 3}, {"first_k_dense_replace": 4},
     "first_k_dense_replace=4 must be in 0..3"),
    ("GLM", {"n_shared_experts": 0}, {"n_shared_experts": -1}, "n_shared_experts=-1 < 0"),
    ("QWEN", {"rms_norm_eps": 1e-12}, {"rms_norm_eps": 0.0}, "rms_norm_eps=0.0 must be > 0")])
def test_config_ranges_hold_at_their_bounds(base, ok, bad, want):
    """Each range check on a HF config at its bound: the last value in loads, the first
    value out is refused with a message naming the field and the range."""
    d = {"QWEN": QWEN, "GLM": GLM}[base]
    ModelConfig.from_hf_dict({**d, **ok})
    with pytest.raises(LrmoeError, match=re.escape(want)):
        ModelConfig.from_hf_dict({**d, **bad})


def test_both_expert_forms_refused(tmp_path):
    d = _saved(tmp_path)
    f = d / "model.safetensors"
    sd = safetensors.torch.load_file(str(f))
    sd["model.layers.0.mlp.experts.down_proj"] = torch.stack(
        [sd[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] for e in range(QWEN["num_experts"])])
    safetensors.torch.save_file(sd, str(f), {"format": "pt"})
    with pytest.raises(LrmoeError, match="both the fused tensor model.layers.0.mlp.experts"
                                         ".down_proj and per-expert tensors"):
        load_hf(d)


def test_missing_config_and_weights(tmp_path):
    d = _saved(tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(LrmoeError, match="config.json"):
        load_hf(d)
    with pytest.raises(LrmoeError, match="does not exist"):
        load_hf(tmp_path / "nope")
    d2 = _saved(tmp_path / "b")
    (d2 / "model.safetensors").unlink()
    with pytest.raises(LrmoeError, match="neither model.safetensors"):
        load_hf(d2)


def _rewrite(d: Path, fn) -> None:
    f = d / "model.safetensors"
    with safe_open(f, "pt") as h:
        sd = {k: h.get_tensor(k) for k in h.keys()}
    fn(sd)
    safetensors.torch.save_file(sd, str(f), {"format": "pt"})


def test_missing_unexpected_misshapen_tensors(tmp_path):
    d = _saved(tmp_path)
    _rewrite(d, lambda sd: [sd.pop(f"model.layers.1.mlp.experts.{e}.up_proj.weight")
                            for e in (3, 5)])
    with pytest.raises(LrmoeError, match=r"missing tensor model\.layers\.1\.mlp\.experts\.3\."
                                         r"up_proj\.weight \(and 1 more\), which"):
        load_hf(d)

    d = _saved(tmp_path / "b")
    _rewrite(d, lambda sd: sd.update({"model.layers.0.mlp.bogus.weight": torch.zeros(2)}))
    with pytest.raises(LrmoeError, match=r"unexpected tensor model\.layers\.0\.mlp\.bogus\.weight, "
                                         r"which"):
        load_hf(d)

    d = _saved(tmp_path / "c")
    _rewrite(d, lambda sd: sd.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(LrmoeError, match=r"model\.norm\.weight .*shape \[63\].*\[64\]"):
        load_hf(d)

    d = _saved(tmp_path / "d")
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 16
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LrmoeError, match=r"experts\.0\.(gate|up|down)_proj\.weight .*shape"):
        load_hf(d)

    d = _saved(tmp_path / "e")
    _rewrite(d, lambda sd: sd.update(
        {"model.layers.1.mlp.experts.gate_up_proj": torch.zeros(8, 64, 64)}))
    with pytest.raises(LrmoeError, match="both the fused tensor"):
        load_hf(d)


def test_config_errors(tmp_path):
    d = _saved(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(LrmoeError, match="model_type='llama' is not supported"):
        load_hf(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(LrmoeError, match="not valid JSON"):
        load_hf(d)


def test_hf_config_defaults_apply(tmp_path):
    """A config.json without norm_topk_prob means HF's Qwen3-MoE default (False)."""
    d = _saved(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["norm_topk_prob"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_hf_config(d).norm_topk_prob is False


def test_hf_config_defaults_are_transformers_own():
    """Every key a config.json may leave out takes the value transformers' own config class
    gives it (``Qwen3MoeConfig``, ``Glm4MoeConfig``)."""
    from lrmoe.hf import _HF_DEFAULTS

    tf = pytest.importorskip("transformers")
    for mt, cls in (("qwen3_moe", tf.Qwen3MoeConfig), ("glm4_moe", tf.Glm4MoeConfig)):
        theirs = cls()
        assert {k: getattr(theirs, k) for k in _HF_DEFAULTS[mt]} == _HF_DEFAULTS[mt], mt


# ---------------------------------------------------------------- atomic / safe saves
def test_failed_save_leaves_old_checkpoint(tmp_path, monkeypatch):
    d = _saved(tmp_path, max_shard_bytes=20_000)
    (d / "tokenizer.json").write_text("{}")
    before = _files(d)
    calls = []
    real = safetensors.torch.save_file

    def flaky(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            real(dict(list(tensors.items())[:1]), filename, metadata)  # half-written
            raise OSError(28, "No space left on device")
        real(tensors, filename, metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", flaky)
    with pytest.raises(LrmoeError, match="No space left"):
        save_hf(_ours(QWEN, seed=9), d, max_shard_bytes=20_000)
    assert len(calls) == 2
    assert _files(d) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp dirs left


def test_overwrite_replaces_shards_and_keeps_other_files(tmp_path):
    d = _saved(tmp_path, max_shard_bytes=20_000)
    (d / "tokenizer.json").write_text('{"x": 1}')
    m = _ours(QWEN, seed=4)
    save_hf(m, d)  # unsharded now: old shards and index must go
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors",
                                                   "tokenizer.json"]
    assert (d / "tokenizer.json").read_text() == '{"x": 1}'
    assert torch.equal(_logits(load_hf(d), _ids()), _logits(m, _ids()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_save_moves_and_repermissions_only_its_own_files(tmp_path, monkeypatch):
    """Into an existing directory: every rename is one of save_hf's temporary files onto
    its final name inside the directory; the user's files and the directory itself are
    never moved (a kill at any moment cannot hide them) and the mode is kept."""
    d = _saved(tmp_path, max_shard_bytes=20_000)
    (d / "notes").mkdir()
    for i in range(50):
        (d / "notes" / f"n{i}.txt").write_text(str(i))
    (d / "tokenizer.json").write_text("{}")
    d.chmod(0o700)
    mine = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()
            and not p.name.startswith("model") and p.name != "config.json"}
    moves = []
    for mod, name in ((os, "rename"), (os, "replace"), (shutil, "move")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda a, b, _r=real, **kw: (moves.append(
            (Path(a), Path(b))), _r(a, b, **kw))[1])
    save_hf(_ours(QWEN, seed=5), d)
    monkeypatch.undo()
    assert moves
    for a, b in moves:  # from the save's own staging directory (lrmoe.files)
        assert a.parent.parent == d == b.parent and a.name == b.name, (a, b)
        assert a.parent.name.startswith(".lrmoe-save-"), (a, b)
    assert {p: p.read_bytes() for p in mine} == mine
    assert d.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors",
                                                   "notes", "tokenizer.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_save_writes_through_a_symlinked_directory(tmp_path):
    real = _saved(tmp_path)
    (real / "tokenizer.json").write_text("{}")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    m = _ours(QWEN, seed=6)
    save_hf(m, link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert sorted(p.name for p in real.iterdir()) == ["config.json", "model.safetensors",
                                                      "tokenizer.json"]
    assert torch.equal(_logits(load_hf(real), _ids()), _logits(m, _ids()))
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")
    with pytest.raises(LrmoeError, match="symlink to .*gone, which does not exist"):
        save_hf(m, dangling)


@pytest.mark.parametrize("what", ["other weights", "other model", "weights, no config"])
def test_save_refuses_a_directory_of_another_model(tmp_path, what):
    d = tmp_path / "d"
    if what == "other model":
        save_hf(_ours(QWEN, hidden_size=48), d)
    else:
        d.mkdir()
        name = "pytorch_model.bin" if what == "other weights" else "model.safetensors"
        (d / name).write_bytes(b"someone else's weights")
    (d / "README.md").write_text("mine")
    before = _files(d)
    with pytest.raises(LrmoeError) as e:
        save_hf(_ours(QWEN), d)
    msg = str(e.value)
    assert str(d) in msg and "new or empty directory" in msg
    assert {"other weights": "pytorch_model.bin", "other model": "hidden_size=48",
            "weights, no config": "config.json"}[what] in msg
    assert _files(d) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_save_refuses_sharded_experts_and_bad_args(tmp_path):
    m = _ours(QWEN)
    m.layers[1].mlp.experts.count = 4  # an expert-parallel shard's (shard_experts)
    with pytest.raises(LrmoeError, match="gather the experts first"):
        save_hf(m, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(LrmoeError, match="max_shard_bytes"):
        save_hf(_ours(QWEN), tmp_path / "y", max_shard_bytes=0)
    (tmp_path / "file").write_text("")
    with pytest.raises(LrmoeError, match="not a directory"):
        save_hf(_ours(QWEN), tmp_path / "file")
