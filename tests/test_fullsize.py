"""The whole-model step ledger (``benchmarks/step_ledger.py``) against the model and the trainer:
its parameter count is the model's, its GPU/host split under host offload is what the
trainer's optimizer allocates, and what it says a layer keeps for backward is what
autograd keeps (CPU, bf16 autocast: the CUDA trainer's precision)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import test_ledger_truth as truth
from lrmoe.model import MoEForCausalLM
from lrmoe.presets import CATEGORIES, get_preset, param_breakdown, param_counts
from lrmoe.train.host_pipe import HOST_CHUNK, RING, HostPipeline
from lrmoe.train.setup import pinned_bytes
from references.offload_adamw import staging_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import fullsize  # noqa: E402
from step_ledger import StepLedger  # noqa: E402


def _category(name: str) -> str:
    if ".experts.gate_up_proj" in name or ".experts.down_proj" in name:
        return "experts"
    if "norm" in name:
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if ".router." in name:
        return "routers"
    if ".mlp." in name:
        return "dense_mlp"
    return {"embed_tokens.weight": "embedding", "lm_head.weight": "lm_head"}[name]


CONFIGS = {
    "tiny-qwen3": get_preset("tiny-qwen3"),
    "tiny-glm": get_preset("tiny-glm"),  # dense first layer, shared expert, biases
    "qwen3-tied-sparse": dataclasses.replace(
        get_preset("tiny-qwen3"), tie_word_embeddings=True, decoder_sparse_step=2,
        attention_bias=True),
    "qwen3-mlp-only": dataclasses.replace(get_preset("tiny-qwen3"), mlp_only_layers=[1, 3]),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_param_breakdown_is_the_models(name):
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    got = dict.fromkeys(CATEGORIES, 0)
    for n, p in model.named_parameters():  # each tensor once (a tied head is the embedding)
        got[_category(n)] += p.numel()
    assert param_breakdown(cfg) == got
    assert sum(got.values()) == sum(p.numel() for p in model.parameters())
    if cfg.model_type == "qwen3_moe":  # GLM's correction bias is a buffer, not a parameter
        assert sum(got.values()) == param_counts(cfg)[0]


def test_full_qwen3_counts():
    p = param_breakdown(get_preset("qwen3-30b-a3b"))
    assert p["experts"] == 48 * 128 * 3 * 2048 * 768
    assert sum(p.values()) == 30_532_122_624


def _tensor_bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def test_offload_split_is_what_the_trainer_allocates():
    """After a step of the trainer's own optimizer (host offload, bf16 device experts as
    on CUDA), every tensor of the state is priced on the side it lives on, term by term,
    and nothing is left over."""
    from lrmoe.train.accum import accumulate
    from lrmoe.train.offload import offloaded_params
    from lrmoe.train.optim import build_optimizer

    cfg = get_preset("tiny-glm")  # dense layer, shared expert and biases: every category
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    opt = build_optimizer(model, 1e-3, 0.1, offload="host", compute_dtype=torch.bfloat16)
    batch = torch.randint(0, cfg.vocab_size, (2, 17))
    opt.zero_grad(set_to_none=True)
    accumulate(model, lambda m: batch, 2)
    opt.step()
    off = {id(p) for p in offloaded_params(model)}
    params = list(model.parameters())
    dev = [p for p in params if id(p) not in off]
    host = [p for p in params if id(p) in off]
    assert host and all(p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16
                        for p in host)

    def state(ps, keys):
        return [opt.state[p][k] for p in ps for k in keys]

    got_gpu = {"weights_fp32": _tensor_bytes(dev), "grads_fp32": _tensor_bytes(p.grad for p in dev),
               "adam_moments": _tensor_bytes(state(dev, ("exp_avg", "exp_avg_sq"))),
               "offloaded_weights": _tensor_bytes(host),
               "offloaded_grads": _tensor_bytes(p.grad for p in host)}
    got_host = {"masters": _tensor_bytes(state(host, ("master",))),
                "moments": _tensor_bytes(state(host, ("exp_avg", "exp_avg_sq"))),
                "grad_buffer": _tensor_bytes(opt._grad_buf.values()),
                "pipeline_staging": staging_bytes(opt)}
    assert all(b.dtype == torch.bfloat16 for b in opt._grad_buf.values())  # as computed
    # on the CPU nothing is pinned: every host tensor at its exact size
    led = StepLedger(cfg, optimizer_offload="host", compute_dtype="bf16",
                     device="cpu").state()
    assert led["gpu"] == got_gpu
    assert led["host"] == got_host
    # nothing else: every state tensor but AdamW's step counters is in one of the terms
    every = [t for st in opt.state.values() for k, t in st.items() if k != "step"]
    assert _tensor_bytes(every) + _tensor_bytes(opt._grad_buf.values()) + \
        staging_bytes(opt) == sum(led["host"].values()) + got_gpu["adam_moments"]
    # device offload: everything fp32 on the GPU, 16 bytes a parameter, nothing on the host
    d = StepLedger(cfg, optimizer_offload="device", compute_dtype="bf16").state()
    assert sum(d["gpu"].values()) == 16 * sum(p.numel() for p in params)
    assert sum(d["host"].values()) == 0


def _tensors(obj, seen=None):
    """Every tensor ``obj`` reaches through its attributes, dicts, lists and tuples."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, seen)
    elif isinstance(obj, (torch.optim.Optimizer, HostPipeline)):
        yield from _tensors(vars(obj), seen)


def _storage_bytes(ts) -> int:
    """Bytes of the distinct storages of ``ts``, each once; 0-dim tensors (AdamW's step
    counters, which the ledgers leave out) not counted."""
    got = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts if t.dim()}
    return sum(got.values())


@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_cpu_host_state_is_what_the_optimizer_holds(compute):
    """``lrmoe train --device cpu --optimizer-offload host``: the ledger's host state is
    the bytes of the distinct storages the trainer's optimizer holds beyond the
    parameters and their gradients, and with those every byte of the state. In fp32
    (the trainer on the CPU) each expert is its own master and its gradient is read in
    place, so only the moments are extra; bf16 device experts (forced) have separate
    masters and gradient buffers."""
    from lrmoe.train.accum import accumulate
    from lrmoe.train.offload import offloaded_params
    from lrmoe.train.optim import build_optimizer

    cfg = get_preset("tiny-glm")
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    dtype = torch.bfloat16 if compute == "bf16" else None
    opt = build_optimizer(model, 1e-3, 0.1, offload="host", compute_dtype=dtype)
    batch = torch.randint(0, cfg.vocab_size, (2, 17))
    for _ in range(2):  # the second step runs on what the first allocated
        opt.zero_grad(set_to_none=True)
        accumulate(model, lambda m: batch, 1)
        opt.step()
    params = list(model.parameters())
    off = {id(p) for p in offloaded_params(model)}
    # the parameters, their gradients and the device-stepped ones' AdamW state: the
    # ledger's "gpu" terms (on the CPU, host memory too)
    dev = params + [p.grad for p in params] + [
        t for p in params if id(p) not in off for t in _tensors(opt.state[p])]
    priced = {t.untyped_storage().data_ptr() for t in dev}
    held = [t for t in _tensors(opt) if t.untyped_storage().data_ptr() not in priced]
    led = StepLedger(cfg, compute_dtype=compute, device="cpu")
    host = led.state()["host"]
    assert sum(host.values()) == _storage_bytes(held)
    assert (host["masters"] == 0) == (compute == "fp32")
    everything = params + [p.grad for p in params] + list(_tensors(opt))
    assert led.host_bytes() == _storage_bytes(everything)
    # the trainer's pre-check on the CPU asks the same host state
    from lrmoe.train.setup import state_bytes
    if compute == "fp32":
        assert state_bytes(cfg, 1, offload=True, device="cpu")[1] == sum(host.values())


def _saved_per_layer(model: MoEForCausalLM, ids: torch.Tensor) -> list[int]:
    """Bytes each decoder layer keeps for backward: autograd's saved tensors (each
    storage once, parameters left out) plus the rows the MoE layers' autograd Function
    keeps as attributes (so its backward can free them one by one)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out, done = [], set()

    def wrap(layer):
        fwd = layer.forward

        def run(*a, **k):
            seen: dict[int, int] = {}

            def pack(t):
                st = t.untyped_storage()
                if st.data_ptr() not in params:
                    seen[st.data_ptr()] = st.nbytes()
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = fwd(*a, **k)
            todo = [y.grad_fn]
            while todo:  # the layer's expert Function: its kept rows and indices
                node = todo.pop()
                if node is None or id(node) in done:
                    continue
                done.add(id(node))
                if type(node).__name__ == "ExpertExchangeBackward":
                    held: list[torch.Tensor] = []
                    truth._tensors(vars(node), held, set())  # ctx attributes, state
                    for t in held:
                        pack(t)
                todo += [n for n, _ in node.next_functions]
            out.append(sum(seen.values()))
            return y
        layer.forward = run

    for layer in model.layers:
        wrap(layer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids)
    return out


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-glm"])
@pytest.mark.parametrize("mode", ["none", "selective"])
def test_layer_saved_is_what_autograd_keeps(preset, mode):
    cfg = dataclasses.replace(get_preset(preset), num_hidden_layers=3)
    if preset == "tiny-glm":  # the dense layer and the shared expert are covered too
        assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1) and cfg.n_shared_experts
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    for m in model.moe_layers:  # host offload on CUDA: bf16 device experts
        m.experts.to(torch.bfloat16)
    model.set_activation_checkpoint(mode)
    model.train()
    B, S = 2, 48
    got = _saved_per_layer(model, torch.randint(0, cfg.vocab_size, (B, S)))
    led = StepLedger(cfg)
    N = B * S
    for i, g in enumerate(got):
        want = led.layer_saved(i, N, mode)
        want += 2 * 4 * S * cfg.rotary_dim + led.layer_casts(i)  # the shared cos and sin
        # tables (fp32, [S, rotary_dim]) are seen here
        if mode == "selective":  # the checkpointed attention keeps no casts
            want -= led.layer_casts(i, attention_only=True)
        elif cfg.partial_rotary_factor < 1:  # on the CPU SDPA keeps the layout of the
            # rotary's cat, so o_proj's input is a copy of its output (CUDA's flash and
            # efficient kernels return the transposed layout: a view)
            want += N * 2 * cfg.num_attention_heads * cfg.head_dim
        assert g == want, (i, g, want)


@pytest.mark.parametrize("chunk", [0, 24])
def test_head_saved_is_what_autograd_keeps(chunk):
    """The head's kept bytes: what autograd saves between the last layer and the loss
    (bf16 autocast), the logits (priced apart), the head's weight cast (a weight cast)
    and the integer targets (the batch's own) aside: the final residual, and without a
    chunked loss its norm's rows and row scale and the head's input."""
    cfg = dataclasses.replace(get_preset("tiny-qwen3"), num_hidden_layers=1)
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    model.train()
    model.set_loss_chunk(chunk)
    B, S, V = 2, 48, cfg.vocab_size
    ids, targets = torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = model.hidden(ids)
    model.hidden = lambda _: x
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if (st.data_ptr() not in params and t.is_floating_point() and t.dim()
                and t.shape[-1] != V):
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(ids, targets)
    led = StepLedger(cfg, loss_chunk_tokens=chunk or None)
    assert sum(seen.values()) == led.activations(B * S, "none")["head_saved"]


def test_fullsize_tool_reports_the_whole_model(tmp_path):
    assert fullsize.main(["--out", str(tmp_path), "--sizes", "1x4096", "--modes", "full"]) == 0
    res = json.loads((tmp_path / "fullsize.json").read_text())
    row = res["results"][0]
    assert row["mode"] == "full" and row["tokens"] == 4096
    # per layer: gate_up_proj 1.5 GiB and down_proj 0.75 GiB in fp32, the masters pinned
    # at 2 GiB and 1 GiB, the bf16 gradient buffers at 1 GiB and 0.5 GiB; the moments 8 B
    # a parameter, pageable; once, the pipeline's fp32 chunk and ring of 4 bf16 chunks
    per_layer = (2**31 + 2**30) + (2**30 + 2**29) + 8 * 128 * 3 * 2048 * 768
    staging = 4 * HOST_CHUNK + RING * 2 * HOST_CHUNK
    assert row["host_total"] == 48 * per_layer + staging and not row["fits_host"]
    # the peak is the largest phase, and names it
    top = max(row["phases"].values())
    assert row["gpu_peak"] == top == row["phases"][row["gpu_peak_phase"]]
    assert len(set(row["phases"].values())) == 4  # a wrong pick cannot tie
    assert "MODELLED" in (tmp_path / "fullsize.md").read_text()
    for bad in (["--sizes", "4096"], ["--measure", "--layers", "49", "--device", "cpu"]):
        assert fullsize.main(["--out", str(tmp_path / "x"), *bad]) == 2
        assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- pinned host memory
def _next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def test_pinned_bytes_is_the_allocators_power_of_two():
    cases = {0: 0, 1: 1, 2: 2, 3: 4, 5: 8, 1000: 1024, 1024: 1024, 1025: 2048,
             4 * 128 * 1536 * 2048: 2**31, 4 * 128 * 2048 * 768: 2**30, 2**40 + 1: 2**41}
    assert {n: pinned_bytes(n) for n in cases} == cases


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-glm", "qwen3-tied-sparse"])
def test_host_state_prices_each_pinned_tensor_at_its_rounded_size(name):
    """On CUDA the masters and gradient buffers are pinned, one allocation per expert
    tensor of the model the trainer builds, each rounded up to a power of two; the
    moments are pageable."""
    from lrmoe.train.offload import offloaded_params
    from lrmoe.train.setup import state_bytes

    cfg = dataclasses.replace(CONFIGS[name], moe_intermediate_size=40)  # not a power of 2
    model = MoEForCausalLM(cfg)
    shapes = [tuple(p.shape) for p in offloaded_params(model)]
    assert len(shapes) == 2 * len(cfg.moe_layers)
    numels = [math.prod(s) for s in shapes]
    pinned = sum(_next_pow2(4 * n) for n in numels)
    pinned_bf16 = sum(_next_pow2(2 * n) for n in numels)  # the gradients cross as bf16
    assert pinned > 4 * sum(numels)  # the rounding is seen
    span = min(HOST_CHUNK, max(numels))  # the pipeline's chunk: fp32 scratch, a pinned ring

    def staging(cuda, span=span):
        return 4 * span + (RING * _next_pow2(2 * span) if cuda else 0)
    led = StepLedger(cfg)  # the trainer on CUDA
    assert led.state()["host"] == {"masters": pinned, "moments": 8 * sum(numels),
                                   "grad_buffer": pinned_bf16, "pipeline_staging": staging(True)}
    staged = StepLedger(cfg, host_grad_staging=True).state()["host"]["grad_buffer"]
    assert staged == _next_pow2(2 * max(numels))
    exact = StepLedger(cfg, device="cpu").state()["host"]
    assert exact == {"masters": 4 * sum(numels), "moments": 8 * sum(numels),
                     "grad_buffer": 2 * sum(numels), "pipeline_staging": staging(False)}
    # the trainer's pre-check asks the same host bytes, per EP rank's shard of each tensor
    for ep in (1, 2, 4):
        mine = [s[0] // ep * math.prod(s[1:]) for s in shapes]
        want = (sum(_next_pow2(4 * n) + _next_pow2(2 * n) for n in mine) + 8 * sum(mine)
                + staging(True, min(HOST_CHUNK, max(mine))))
        assert state_bytes(cfg, ep, offload=True)[1] == want
