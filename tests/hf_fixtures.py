"""Tiny HF model directories for the tests: a Qwen3-MoE or GLM-4.5-MoE built with
transformers (random init, weights scaled up so that every tensor matters), saved with
``save_pretrained`` in small shards, and a byte-level BPE tokenizer trained here (no
downloads) saved beside it as transformers saves one; plus the reference losses."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 320  # the model's embedding rows; the tokenizer below has fewer ids (padding rows)
TOKENIZER_VOCAB = 300
SHARD = "60KB"  # several shards for the models below
EOS = "<|im_end|>"

QWEN = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6,
            router_aux_loss_coef=0.01)
GLM = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
           topk_group=1, first_k_dense_replace=1, n_shared_experts=1, attention_bias=True,
           routed_scaling_factor=2.0, norm_topk_prob=True, use_qk_norm=False,
           max_position_embeddings=256, rms_norm_eps=1e-5)

TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
        "        self.x = x\n        self.y = y\n\nfor i in range(10):\n    print(i * i)\n")


def hf_model(family: str, seed: int = 0):
    """A transformers model in fp32 with eager attention, weights ~0.1 (HF's init is
    ~0.02: logits would barely depend on the experts)."""
    import transformers as tf

    torch.manual_seed(seed)
    if family == "qwen3":
        cfg = tf.Qwen3MoeConfig(**QWEN, rope_parameters={"rope_type": "default",
                                                         "rope_theta": 1e6})
        cls = tf.Qwen3MoeForCausalLM
    else:
        cfg = tf.Glm4MoeConfig(**GLM, rope_parameters={
            "rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5})
        cls = tf.Glm4MoeForCausalLM
    cfg._attn_implementation = "eager"
    m = cls(cfg).to(torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in m.named_parameters():
            r = torch.randn(t.shape, generator=g)
            t.copy_(1 + 0.1 * r if "norm" in name else 0.1 * r)
        for name, t in m.named_buffers():
            if "e_score_correction_bias" in name:
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
    return m.eval()


def train_tokenizer(vocab: int = TOKENIZER_VOCAB):
    """A byte-level BPE with ``<|endoftext|>`` (id 0) and ``<|im_end|>`` (id 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TEXT] * 20, trainer=trainer)
    return tok


def save_tokenizer(d: Path, added: int = 0) -> None:
    """tokenizer.json + tokenizer_config.json (eos_token <|im_end|>), as transformers
    writes them, and a generation_config.json naming two end ids, <|endoftext|> first
    (the tokenizer config's <|im_end|> is the end-of-document id); ``added`` more special
    tokens after the BPE's ids."""
    import transformers as tf

    tok = train_tokenizer()
    tok.add_special_tokens([f"<|extra_{i}|>" for i in range(added)])
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.save_pretrained(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 1]}))


def hf_dir(root: Path, family: str, seed: int = 0, shard: str = SHARD) -> tuple[Path, object]:
    """``root/family``: config, sharded safetensors and tokenizer; and the HF model."""
    d = root / family
    m = hf_model(family, seed)
    m.save_pretrained(d, max_shard_size=shard)
    save_tokenizer(d)
    return d, m


def write_rows(path: Path, n: int = 120, text_every: int = 0) -> Path:
    """A prompt/completion ``.jsonl`` (every ``text_every``-th line a text line)."""
    lines = []
    for i in range(n):
        if text_every and i % text_every == 0:
            lines.append({"text": f"# note {i}\n" + TEXT[: 40 + i % 50]})
        else:
            lines.append({"prompt": f"def f{i}(x):\n    return ",
                          "completion": f"x * {i} + {i % 7}\n" + TEXT[: 10 + i % 60]})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def write_text(path: Path, n: int = 60) -> Path:
    path.write_text("".join(json.dumps({"text": TEXT + f"# {i}\n"}) + "\n" for i in range(n)))
    return path


@torch.no_grad()
def hf_loss(model, rows: torch.Tensor, targets: torch.Tensor) -> float:
    """transformers' own loss of a batch: ``rows [b, L + 1]`` as input ids, labels
    aligned with them (transformers shifts inside: ``targets[:, t]`` scores position
    ``t``; -100 ignored), the mean over the labelled targets."""
    labels = torch.cat([torch.full_like(targets[:, :1], -100), targets], dim=1)
    return float(model(input_ids=rows, labels=labels).loss)
