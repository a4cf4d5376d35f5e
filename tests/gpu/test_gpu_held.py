"""A placement held over the step on CUDA: the bytes alive between micro-batches are the
held slots' bf16 weights and gradient sums the ledger prices. Bytes are the allocator's
requested bytes (what the tensors asked for): its block bytes round a request up by as
much as 1 MiB depending on which cached segment serves it, more than the check's 16 KiB.
One rank of a 4-rank group with synthetic peers (``tests/onerank.py``), bf16 autocast,
3 micro-batches; the CPU checks are ``tests/test_held_placement.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_util import needs_cuda, report_dir  # noqa: E402

pytestmark = needs_cuda


def test_held_bytes_on_cuda_are_the_ledgers():
    from lrmoe.config import ModelConfig
    from lrmoe.ledger import Ledger
    from lrmoe.model import MoEForCausalLM
    from lrmoe.model.moe import MoERuntime
    from lrmoe.parallel.groups import ParallelContext, shard_experts
    from lrmoe.policy.base import PlanInputs
    from lrmoe.presets import PRESETS
    from lrmoe.train.accum import accumulate
    from onerank import OneRankComm
    from test_held_placement import LAYERS, MicroRouter, N, Scripted, T, tables

    dev, G = torch.device("cuda"), 4
    cfg = ModelConfig.from_hf_dict(dict(PRESETS["tiny-qwen3"], num_hidden_layers=LAYERS,
                                        hidden_size=512, moe_intermediate_size=256,
                                        router_aux_loss_coef=0.0))
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    for i, layer in enumerate(model.moe_layers):
        tabs = [t.to(dev) for t in tables(cfg, 0, 1, 10 + i)]
        layer.router = MicroRouter(tabs, cfg.num_experts, cfg.hidden_size,
                                   lambda m=layer: m.runtime.micro)
    shard_experts(model, ParallelContext(world=G, rank=0, ep_size=G))
    model.to(dev)
    policy = Scripted({m: [(5, 0), (3, 1), (9, 0)] for m in range(N)})
    peers = torch.full((G, cfg.num_experts), 8, dtype=torch.long)
    model.set_runtime(MoERuntime(comm=OneRankComm(0, peers), policy=policy))
    g = torch.Generator().manual_seed(4)
    mbs = [torch.randint(0, cfg.vocab_size, (1, T + 1), generator=g).to(dev) for _ in range(N)]
    experts = [p for m in model.moe_layers for p in (m.experts.gate_up_proj, m.experts.down_proj)]
    at, casts = [], []

    def requested() -> int:
        return torch.cuda.memory_stats()["requested_bytes.all.current"]

    def measure(m, pair):
        if pair is not None:
            torch.cuda.synchronize()
            at.append(requested())
            if m == 0:  # the step's bf16 casts of the owned experts, freed with the step
                casts.append(sum(c.untyped_storage().nbytes() for x in model.moe_layers
                                 for c in x.experts.casts.values()))
                assert all(p.grad is None for p in experts)  # sums held on the slots

    for _ in range(2):  # the first step warms the allocator and the kernels
        model.zero_grad(set_to_none=True)
        at.clear()
        casts.clear()
        accumulate(model, lambda i: mbs[i], N,
                   lambda: torch.autocast("cuda", torch.bfloat16), on_micro=measure)
    torch.cuda.synchronize()
    end = requested()
    plan = policy.plan(peers, PlanInputs())
    t = Ledger.for_dtype(cfg, G, None, "bf16", num_moe_layers=1).rank_terms(plan)[0]
    priced = LAYERS * (t["instance_weights"] + t["instance_grads"])
    grads = sum(p.grad.untyped_storage().nbytes() for p in experts)  # fp32, made at the end
    held = at[0] - end + grads - casts[0]
    out = report_dir("held_bytes")
    if out is not None:
        (out / "held_bytes.txt").write_text(
            f"{torch.cuda.get_device_name()}: held {held} B, ledger {priced} B, "
            f"allocated after each micro-batch {at}, after the step {end}\n")
    assert abs(at[1] - at[0]) <= 16 * 1024, at  # held: a later micro-batch moves nothing
    assert abs(held - priced) <= 16 * 1024, (held, priced, at, end)
