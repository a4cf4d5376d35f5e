"""MoE share of a training step, MODELLED from FLOPs and bytes (issue 14, workloads).

For a model config and a per-rank token count, one EP rank's forward+backward step is
modelled as a sum of stages, each ``FLOPs / rate`` or ``bytes / bandwidth``:

* attention: q/k/v/o projections ``2·H·(q + 2·kv) + 2·q·H`` FLOPs per token per layer,
  plus scores and values ``4·(S/2)·q`` (causal: mean context S/2), at ``--attn-tflops``;
* dense MLPs (GLM's first layers, the shared expert): ``6·H·I`` per token, dense rate;
* MoE: router ``2·H·E`` + experts ``6·H·F`` per pair (k pairs per token) at
  ``--gemm-tflops`` (grouped GEMMs), plus the four all-to-alls (dispatch, combine and
  their backward) of ``k·H·2`` bytes per token, ``(G-1)/G`` of them off the rank;
* LM head ``2·H·V`` per token (embedding lookup free), dense rate;
* optimizer: AdamW over non-expert params + this rank's ``1/G`` of the expert params,
  ~30 bytes moved per param (fp32 p, g, m, v read; p, m, v written; bf16 copy) at HBM;
* gradient all-reduce of non-expert params over the G ranks (ring, bf16).

Backward = 2 × forward FLOPs. Rates default to what RESULTS.md measured on one H200
(dense bf16 742 TFLOP/s; expert grouped GEMMs ~60% of it). Everything here is a model:
the share it prints is labelled MODELLED; the emulated share of a run is read from its
``ttl.json`` (``--ttl``).

  python3 benchmarks/moe_share.py --preset qwen3-30b-a3b --seq-len 4096 --tokens-per-rank 16384
  python3 benchmarks/moe_share.py --config benchmarks/configs/qwen3-30b-a3b-layer-2L.json \
      --seq-len 256 --tokens-per-rank 4096 --ttl benchmarks/results/ttl_gpu_qwen3_v1/ttl.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lrmoe.config import ModelConfig  # noqa: E402
from lrmoe.presets import get_preset  # noqa: E402
from lrmoe.sim.links import get_link  # noqa: E402


def stage_seconds(cfg: ModelConfig, T: int, S: int, G: int, link_Bps: float,
                  dense_tflops: float, attn_tflops: float, gemm_tflops: float,
                  hbm_Bps: float) -> dict[str, float]:
    """Modelled seconds per stage of one rank's training step (fwd + bwd = 3 × fwd)."""
    H, L, V, E, k = (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size,
                     cfg.num_experts, cfg.num_experts_per_tok)
    F = cfg.moe_intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    n_dense = min(cfg.first_k_dense_replace, L)
    n_moe = L - n_dense
    shared = cfg.n_shared_experts * F  # the shared expert's width
    attn_fl = L * T * 3 * (2 * H * (q + 2 * kv) + 2 * q * H + 4 * (S / 2) * q)
    dense_fl = T * 3 * (n_dense * 6 * H * cfg.intermediate_size + n_moe * 6 * H * shared)
    moe_fl = n_moe * T * 3 * (2 * H * E + k * 6 * H * F)
    head_fl = T * 3 * 2 * H * V
    a2a_bytes = n_moe * 4 * T * k * H * 2 * (G - 1) / G
    attn_params = L * (H * (q + 2 * kv) + q * H)
    dense_params = n_dense * 3 * H * cfg.intermediate_size + n_moe * (3 * H * shared + H * E)
    emb_params = V * H * (1 if cfg.tie_word_embeddings else 2)
    expert_params = n_moe * E * 3 * H * F
    non_expert = attn_params + dense_params + emb_params
    return {
        "attention": attn_fl / (attn_tflops * 1e12),
        "dense_mlp": dense_fl / (dense_tflops * 1e12),
        "lm_head": head_fl / (dense_tflops * 1e12),
        "optimizer": (non_expert + expert_params / G) * 30 / hbm_Bps,
        "grad_allreduce": (2 * non_expert * 2 * (G - 1) / G / link_Bps) if G > 1 else 0.0,
        "moe_experts": moe_fl / (gemm_tflops * 1e12),
        "moe_alltoall": a2a_bytes / link_Bps,
    }


def moe_share(st: dict[str, float]) -> float:
    moe = st["moe_experts"] + st["moe_alltoall"]
    return moe / sum(st.values())


def emulated_share(ttl_json: Path) -> dict[str, float]:
    """Mean emulated MoE and step time per policy from a ``bench ttl`` report."""
    rep = json.loads(ttl_json.read_text())
    out = {}
    for name, p in rep["policies"].items():
        steps = p["steps"]
        moe = sum(s["moe_emulated_s"] for s in steps)
        step = sum(s["step_emulated_s"] for s in steps)
        out[name] = moe / step if step else float("nan")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset")
    src.add_argument("--config", type=Path)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--tokens-per-rank", type=int, required=True)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--link", default="nvlink")
    ap.add_argument("--dense-tflops", type=float, default=742.0)
    ap.add_argument("--attn-tflops", type=float, default=400.0,
                    help="attention (projections + SDPA), fwd+bwd mean (assumed)")
    ap.add_argument("--gemm-tflops", type=float, default=440.0)
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="H200 datasheet HBM3e")
    ap.add_argument("--ttl", type=Path, help="bench ttl ttl.json: print its emulated MoE share")
    a = ap.parse_args(argv)
    cfg = get_preset(a.preset) if a.preset else ModelConfig.from_file(a.config)
    st = stage_seconds(cfg, a.tokens_per_rank, a.seq_len, a.ep, get_link(a.link).effective_Bps,
                       a.dense_tflops, a.attn_tflops, a.gemm_tflops, a.hbm_tbps * 1e12)
    name = a.preset or a.config.name
    total = sum(st.values())
    print(f"{name}: {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}, seq {a.seq_len}, "
          f"{a.tokens_per_rank} tokens/rank, EP {a.ep}, {a.link}  (MODELLED)")
    for k_, v in st.items():
        print(f"  {k_:15s} {v * 1e3:9.2f} ms  {v / total:6.1%}")
    print(f"  MoE share (modelled): {moe_share(st):.1%}")
    if a.ttl:
        for pol, s in emulated_share(a.ttl).items():
            print(f"  MoE share (emulated run, {pol}): {s:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
