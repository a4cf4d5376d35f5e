"""The whole-model step ledger of ``fullsize.py``: what one process's training step holds on
the GPU and on the host, MODELLED from the code's allocations (docs/design.md §5,
"Whole-model step"). Imported with ``src/`` on the path.

Legend: N tokens of a micro-batch, H hidden, F expert width, E experts, K top-k,
V vocabulary, D head dim, L decoder layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from lrmoe.config import ModelConfig
from lrmoe.errors import require
from lrmoe.ledger import DTYPE_BYTES, Ledger
from lrmoe.presets import layer_params, param_breakdown
from lrmoe.train.setup import host_state, offloaded_numels

MODES = ("none", "selective", "full")
# what the one-process path (parallel/exchange.py) keeps per pair besides its gate: its row
# and the pair of each row (int64); the exchange keeps one more index (ledger.py)
LOCAL_INDEX_BYTES = 2 * 8


@dataclass(frozen=True)
class StepLedger:
    """One process's training step: GPU and host bytes by term (``cuda``/``bf16``, or
    ``cpu``/``fp32`` where activations are not priced)."""

    cfg: ModelConfig
    optimizer_offload: str = "host"
    compute_dtype: str = "bf16"
    router_grad_at_experts: bool = False
    device: str = "cuda"
    # what-ifs the trainer does not do, for what would make a model fit (docs/design.md
    # §5); their defaults are what it does
    offload_dense: bool = False
    expert_resident_layers: int | None = None
    expert_grad_resident_layers: int | None = None
    loss_chunk_tokens: int | None = None
    master_bytes: int = 4
    moment_bytes: int = 8
    host_grad_bytes: int | None = None
    host_grad_staging: bool = False

    def __post_init__(self) -> None:
        require(self.optimizer_offload in ("device", "host"),
                f"optimizer offload {self.optimizer_offload!r}: use device or host")
        require(self.compute_dtype in ("bf16", "fp32"),
                f"compute dtype {self.compute_dtype!r}: use bf16 or fp32")
        require(self.device in ("cuda", "cpu"), f"device {self.device!r}: use cuda or cpu")
        require(self.optimizer_offload == "host" or not (
            self.offload_dense or self.expert_resident_layers or self.expert_grad_resident_layers),
            "the host-side what-ifs need optimizer_offload='host'")

    @property
    def pinned_host(self) -> bool:
        """The host masters and gradient buffers are pinned (the parameters on CUDA)."""
        return self.device == "cuda"

    @property
    def params(self) -> dict[str, int]:
        return param_breakdown(self.cfg)

    @property
    def offloaded_params(self) -> int:
        """Parameters whose master and moments live on the host."""
        if self.optimizer_offload != "host":
            return 0
        p = self.params
        return sum(p.values()) if self.offload_dense else p["experts"]

    @property
    def device_stepped_params(self) -> int:
        """Parameters AdamW steps on the GPU (fp32 weight, grad, two moments)."""
        return sum(self.params.values()) - self.offloaded_params

    def _resident(self, layers: int | None) -> int:
        """Expert parameters on the GPU when only ``layers`` MoE layers' are resident."""
        c = self.cfg
        per = [layer_params(c, i)["experts"] for i in range(c.num_hidden_layers)]
        if layers is None:
            return sum(per)
        return sum(sorted(per, reverse=True)[:layers])

    def state(self) -> dict[str, dict[str, int]]:
        """``{"gpu": {...}, "host": {...}}``: parameters, gradients and optimizer state by term."""
        bw = DTYPE_BYTES[self.compute_dtype]
        dev, off = self.device_stepped_params, self.offloaded_params
        dense_off = off - (self.params["experts"] if off else 0)
        gpu = {"weights_fp32": 4 * dev, "grads_fp32": 4 * dev, "adam_moments": 8 * dev,
               "offloaded_weights": 0, "offloaded_grads": 0}
        if off:
            gpu["offloaded_weights"] = bw * (dense_off + self._resident(self.expert_resident_layers))
            gpu["offloaded_grads"] = bw * (dense_off
                                           + self._resident(self.expert_grad_resident_layers))
        host = host_state(self._offloaded_numels if off else [], self.device,
                          self.compute_dtype, self.master_bytes, self.moment_bytes,
                          self.host_grad_bytes, self.host_grad_staging)
        return {"gpu": gpu, "host": host}

    def host_bytes(self) -> int:
        """Host memory the state takes (on the CPU the "gpu" terms too)."""
        st = self.state()
        return sum(st["host"].values()) + (sum(st["gpu"].values()) if self.device == "cpu" else 0)

    @cached_property
    def _offloaded_numels(self) -> list[int]:
        """Elements of each offloaded tensor (:func:`offloaded_numels`)."""
        return offloaded_numels(self.cfg, dense=self.offload_dense)

    def _moe_ledger(self) -> Ledger:
        return Ledger.for_dtype(self.cfg, 1, None, "bf16", num_moe_layers=1,
                                router_grad_at_experts=self.router_grad_at_experts)

    def layer_saved(self, i: int, tokens: int, mode: str) -> int:
        """Bytes autograd keeps for backward of layer ``i`` in ``mode``, weight casts and the
        shared rotary tables aside."""
        require(mode in MODES, f"activation checkpoint {mode!r}: use one of {', '.join(MODES)}")
        c, N = self.cfg, int(tokens)
        H, D, E, K = c.hidden_size, c.head_dim, c.num_experts, c.num_experts_per_tok
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        q, kv = heads * D, kv_heads * D
        block_in = 4 * H
        if mode == "full":
            return N * block_in
        # input norm (normed rows, row scale), the q/k/v input casts, q and k (q/k norm:
        # the fp32 copy, its row scales and the bf16 normed rows; SDPA's bf16 cast), v,
        # the output and its logsumexp
        attn = 4 * H + 4 + 3 * 2 * H + 2 * (q + kv) + 2 * kv + 2 * q + 4 * heads
        if c.use_qk_norm:
            attn += 6 * (q + kv) + 4 * (heads + kv_heads)
        per_tok = block_in + 8 * H + 4 + (attn if mode == "none" else 0)  # + mid norm
        const = rows = 0
        if c.is_moe_layer(i):  # router: input cast, probabilities, index (gate, its sum)
            g = 4 if c.router_kind == "softmax" else 2  # GLM's sigmoid runs on bf16 logits
            per_tok += 2 * H + g * E + 8 * K + ((g * K + g) if c.norm_topk_prob else 0)
            if c.router_kind == "softmax" and c.router_aux_loss_coef > 0:
                const += 4 * E  # the aux loss's expert fractions
            if c.n_shared_experts:
                per_tok += 4 * H + 8 * c.moe_intermediate_size * c.n_shared_experts
            P = N * K
            t = self._moe_ledger().terms(E, P, P, P, exact=True)
            rows = t["retained_acts"] + t["combine_rows"] + P * (g + LOCAL_INDEX_BYTES) + 4 * E
        else:
            per_tok += 4 * H + 8 * c.intermediate_size
        return N * per_tok + rows + const

    def weight_casts(self, checkpointed: bool = False) -> int:
        """bf16 copies autocast makes of the fp32 weight matrices in one forward; ``checkpointed``
        (full): only the head's, which backward keeps."""
        if self.compute_dtype != "bf16" or self.offload_dense:  # bf16 weights: no casts
            return 0
        p = self.params
        head = 2 * (p["lm_head"] if p["lm_head"] else p["embedding"])
        if checkpointed:
            return head
        return head + sum(self.layer_casts(i) for i in range(self.cfg.num_hidden_layers))

    def layer_casts(self, i: int, attention_only: bool = False) -> int:
        """One layer's bf16 weight casts (what a re-run block makes again); ``attention_only``:
        its attention matrices' (a selective checkpoint keeps none of them)."""
        if self.compute_dtype != "bf16" or self.offload_dense:
            return 0
        c = self.cfg
        one = layer_params(c, i)
        H, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        attn = 2 * H * q + 2 * H * kv
        experts = one["experts"] if self.optimizer_offload == "device" else 0
        return 2 * (attn if attention_only else attn + one["routers"] + one["dense_mlp"] + experts)

    def activations(self, tokens: int, mode: str) -> dict[str, int]:
        """Per micro-batch of ``tokens`` tokens: the terms the phases add up."""
        require(self.compute_dtype == "bf16",
                "activations are priced for the CUDA trainer (bf16 autocast) only")
        c, N = self.cfg, int(tokens)
        H, V = c.hidden_size, c.vocab_size
        L = c.num_hidden_layers
        saved = sum(self.layer_saved(i, N, mode) for i in range(L))
        chunk = min(N, self.loss_chunk_tokens or N)
        NV = chunk * V  # a chunked loss: one chunk's logits
        # the final residual; the whole head also keeps its norm (normed rows, row scale)
        # and the head's input, a chunked one re-runs them in backward
        head = 4 * H + (4 * H + 4 + 2 * H if chunk == N else 0)
        worst = max(range(L), key=lambda i: self.layer_saved(i, N, "none") + self.layer_casts(i))
        moe = self._moe_ledger()
        P = N * c.num_experts_per_tok
        buffers = moe.rows_buffer_bytes(P, P, P, exact=True) if c.moe_layers else 0
        expert_grad = (DTYPE_BYTES[self.compute_dtype if self.optimizer_offload == "host"
                                   else "fp32"] * layer_params(c, worst)["experts"])
        return {
            "saved_layers": saved,
            "head_saved": N * head,
            "weight_casts": self.weight_casts(),
            "weight_casts_kept": self.weight_casts(mode == "full") - (
                sum(self.layer_casts(i, True) for i in range(L)) if mode == "selective" else 0),
            "logits_forward": 10 * NV,
            "logits_backward": 12 * NV,
            "rerun_block": (self.layer_saved(worst, N, "none") + self.layer_casts(worst)
                            if mode == "full" else 0),
            "moe_buffers": buffers,
            "expert_grad_transient": expert_grad,
        }

    def phases(self, tokens: int, mode: str) -> dict[str, int]:
        """GPU bytes at each phase of a step (persistent state included)."""
        s = sum(self.state()["gpu"].values())
        a = self.activations(tokens, mode)
        kept = a["saved_layers"] + a["head_saved"]
        return {
            "forward_end": s + kept + a["weight_casts"] + a["logits_forward"],
            "loss_backward": s + kept + a["weight_casts_kept"] + a["logits_backward"],
            "block_backward": (s + kept + a["weight_casts_kept"] + a["rerun_block"]
                               + a["moe_buffers"] + a["expert_grad_transient"]),
            "optimizer_step": s + 4 * self.device_stepped_params,
        }

    @property
    def grad_link_bytes(self) -> int:
        """Bytes an offloaded gradient element takes over the host link and in its host buffer."""
        bw = DTYPE_BYTES[self.compute_dtype]
        return bw if self.host_grad_bytes is None else self.host_grad_bytes

    def report(self, tokens: int, mode: str) -> dict:
        """Everything the whole-model table shows for one micro-batch size and mode."""
        st = self.state()
        ph = self.phases(tokens, mode)
        peak = max(ph, key=ph.get)
        return {"tokens": int(tokens), "mode": mode, "gpu_state": st["gpu"],
                "host_state": st["host"], "activations": self.activations(tokens, mode),
                "phases": ph, "gpu_peak": ph[peak], "gpu_peak_phase": peak,
                "host_total": self.host_bytes()}

