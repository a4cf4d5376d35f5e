"""Activation checkpointing (``--activation-checkpoint``): the loss and every gradient
equal those without it, on one process and under EP on gloo (``full``: the MoE forward,
dispatch included, re-run in backward); the re-run counts nothing twice; fewer bytes are
saved for backward."""

from __future__ import annotations

import copy

import pytest
import torch

from lrmoe.config import ModelConfig
from lrmoe.model import MoEForCausalLM
from lrmoe.model.moe import MoERuntime
from lrmoe.presets import PRESETS

B, T = 4, 16
NAMES = {"qwen": "tiny-qwen3", "glm": "tiny-glm"}


def tiny(model: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(PRESETS[NAMES[model]], num_hidden_layers=2))


def runtime(policy: str, cfg: ModelConfig, G: int = 1, comm=None, **kw) -> MoERuntime:
    from lrmoe.ledger import Ledger
    from lrmoe.policy.lrmoe import LrmoeConfig
    from lrmoe.policy.registry import PolicyConfig, make_policy

    pc = PolicyConfig(name=policy, slots_per_rank=cfg.num_experts // G + 2,
                      lrmoe=LrmoeConfig(min_keep=0.5))
    ledger = None
    if policy == "lrmoe":  # a budget that binds: the rank keeps ~80% of its pairs' rows
        from budgets import balanced_budget
        ledger = Ledger.for_dtype(cfg, G, balanced_budget(cfg, G, B * T // G, 0.8, "fp32"),
                                  "fp32")
    extra = {} if comm is None else {"comm": comm}
    return MoERuntime(policy=make_policy(pc, cfg, G), ledger=ledger, **extra, **kw)


def step(model, batch, mode: str) -> dict:
    """One forward + backward: the loss, aux loss, every gradient, the step's counts."""
    model.set_activation_checkpoint(mode)
    model.zero_grad(set_to_none=True)
    lm, obj = model.loss(batch[:, :-1], batch[:, 1:])
    obj.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"lm": float(lm.detach()), "obj": float(obj.detach()), "grads": grads,
            "counts": [c.clone() for c in model.end_step()]}


def assert_same(got: dict, want: dict, rtol: float = 1e-5) -> None:
    assert got["lm"] == pytest.approx(want["lm"], rel=1e-6)
    assert got["obj"] == pytest.approx(want["obj"], rel=1e-6)
    assert got["grads"].keys() == want["grads"].keys()
    for n, g in want["grads"].items():
        d = float((got["grads"][n] - g).norm())
        assert d <= rtol * float(g.norm()) + 1e-8, f"{n}: {d:.3e}"
    for a, b in zip(got["counts"], want["counts"]):  # the re-run counted nothing twice
        assert torch.equal(a.cpu(), b.cpu())


# ----------------------------------------------------------------------------- one process
@pytest.mark.parametrize("model", ["qwen", "glm"])
@pytest.mark.parametrize("policy,fast", [("static", True), ("symi", False), ("lrmoe", False)])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_checkpointing_leaves_loss_and_gradients_unchanged(model, policy, fast, mode):
    """static runs the one-process local path; symi and lrmoe (a trimmed backward, the
    sampled estimator drawing from the runtime's generator) the exchange path."""
    cfg = tiny(model)
    torch.manual_seed(0)
    ref = MoEForCausalLM(cfg)
    ck = copy.deepcopy(ref)
    batch = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1))
    gens = []
    from lrmoe.parallel.exchange import BackwardOptions
    for m in (ref, ck):
        g = torch.Generator().manual_seed(5)
        gens.append(g)
        m.set_runtime(runtime(policy, cfg, fast_local=fast, generator=g,
                              backward=BackwardOptions(estimator="sampled")))
    want = step(ref, batch, "none")
    got = step(ck, batch, mode)
    assert_same(got, want)
    # the selection drew as often (the re-run draws nothing); the stats are the first
    # forward's, completed by its backward
    assert torch.equal(gens[0].get_state(), gens[1].get_state())
    for a, b in zip(ref.moe_layers, ck.moe_layers):
        sa, sb = (dict(m.runtime.stats[m.moe_index]) for m in (a, b))
        assert {k: v for k, v in sa.items() if not k.endswith("_ms")} == \
            {k: v for k, v in sb.items() if not k.endswith("_ms")}
        assert "bwd_rows" in sb
    if policy == "lrmoe":
        st = ck.moe_layers[0].runtime.stats[0]
        assert st["selected_rows"] < st["fwd_rows"]  # a trimmed backward was checked


def _saved_bytes(model, batch, mode: str) -> int:
    """Bytes autograd packs for backward during one forward (saved_tensors_hooks)."""
    model.set_activation_checkpoint(mode)
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, obj = model.loss(batch[:, :-1], batch[:, 1:])
    obj.backward()
    model.end_step()
    return total


def test_checkpointing_saves_fewer_bytes():
    cfg = tiny("qwen")
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    model.set_runtime(runtime("static", cfg))
    batch = torch.randint(0, cfg.vocab_size, (B, 64 + 1), generator=torch.Generator().manual_seed(2))
    none, sel, full = (_saved_bytes(model, batch, m) for m in ("none", "selective", "full"))
    assert none > sel > full > 0
    # each block's attention keeps at least its q, k, v and output rows (4 x B*T*H fp32)
    per_block = 4 * B * 64 * cfg.hidden_size * 4
    assert none - sel >= cfg.num_hidden_layers * per_block


def test_full_checkpoint_frees_the_expert_rows():
    """Under ``full`` the MoE Function keeps no rows of its own: they are saved through
    the checkpoint (dropped after forward, re-run in backward)."""
    from lrmoe.parallel.exchange import ExpertExchange

    cfg = tiny("qwen")
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    model.set_runtime(runtime("static", cfg))
    batch = torch.randint(0, cfg.vocab_size, (B, T + 1))
    for mode, held in (("none", True), ("full", False)):
        model.set_activation_checkpoint(mode)
        _, obj = model.loss(batch[:, :-1], batch[:, 1:])
        nodes, seen, stack = [], set(), [obj.grad_fn]
        while stack:
            n = stack.pop()
            if n is None or n in seen:
                continue
            seen.add(n)
            if type(n).__name__ == ExpertExchange.__name__ + "Backward":
                nodes.append(n)
            stack.extend(f for f, _ in n.next_functions)
        assert len(nodes) == cfg.num_hidden_layers
        assert all(hasattr(n, "kept") == held for n in nodes), mode
        obj.backward()
        model.end_step()


def test_bad_mode_is_one_readable_error():
    from lrmoe.errors import LrmoeError

    model = MoEForCausalLM(tiny("qwen"))
    with pytest.raises(LrmoeError, match="selective"):
        model.set_activation_checkpoint("some")


# ----------------------------------------------------------------------------- EP on gloo
def _ep_worker(rank: int, world: int, model_name: str) -> None:
    import torch.distributed as dist

    from lrmoe.parallel.groups import ParallelContext, is_expert_param, shard_experts, sync_grads

    torch.set_num_threads(1)
    cfg = tiny(model_name)
    ctx = ParallelContext(world=world, rank=rank, ep_size=world, ep_group=dist.group.WORLD)
    batch = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(3))
    mine = batch[rank * B // world:(rank + 1) * B // world]
    pr = cfg.num_experts // world
    for policy in ("static", "symi"):
        torch.manual_seed(0)
        ref = MoEForCausalLM(cfg)
        ep = copy.deepcopy(ref)
        ref.set_runtime(runtime(policy, cfg))
        want = step(ref, batch, "none")
        shard_experts(ep, ctx)
        ep.set_runtime(runtime(policy, cfg, world, comm=ctx.comm()))
        for m in ep.moe_layers:  # a skewed popularity: SYMI places replicas
            m.prev_counts_E = torch.arange(cfg.num_experts) ** 2
        ep.set_activation_checkpoint("full")
        ep.zero_grad(set_to_none=True)
        lm, obj = ep.loss(mine[:, :-1], mine[:, 1:])
        obj.backward()
        sync_grads(ep, ctx)
        counts = ep.end_step()
        tot = torch.stack([lm.detach(), obj.detach()])
        dist.all_reduce(tot)
        got = {"lm": float(tot[0]) / world, "obj": float(tot[1]) / world,
               "grads": {n: p.grad for n, p in ep.named_parameters() if p.grad is not None},
               "counts": counts}
        for n in list(want["grads"]):
            if is_expert_param(n):
                want["grads"][n] = want["grads"][n][rank * pr:(rank + 1) * pr]
        assert_same(got, want, rtol=1e-4)


@pytest.mark.parametrize("model", ["qwen", "glm"])
def test_full_checkpoint_under_ep_equals_one_process(model, tmp_path):
    from dist_util import run_world

    run_world(2, _ep_worker, model, tmp_path=tmp_path)


# ----------------------------------------------------------------------------- the commands
def test_train_with_full_checkpoint_and_accumulation_matches(tmp_path, capsys):
    """``lrmoe train``: the same losses and gradient norms with and without ``full``."""
    from lrmoe.cli import main
    from lrmoe.train.metrics import read_metrics

    args = ["train", "--preset", "tiny-glm", "--policy", "symi", "--steps", "3",
            "--batch-size", "2", "--seq-len", "32", "--grad-accum", "2",
            "--max-data-bytes", "100000", "--eval-batches", "1", "--eval-every", "0",
            "--threads", "1", "--warmup", "1"]
    rows = {}
    for mode in ("none", "full"):
        assert main(args + ["--out", str(tmp_path / mode), "--activation-checkpoint", mode]) == 0
        rows[mode] = [r for r in read_metrics(tmp_path / mode / "metrics.jsonl")
                      if r["kind"] == "train"]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in rows["full"]]),
                                   torch.tensor([r[key] for r in rows["none"]]),
                                   rtol=1e-5, atol=0)
    assert [r["counts"] for r in rows["full"]] == [r["counts"] for r in rows["none"]]
    capsys.readouterr()
    assert main(args + ["--out", str(tmp_path / "bad"), "--activation-checkpoint", "all"]) == 2
    assert "--activation-checkpoint 'all' is not valid" in capsys.readouterr().err


def test_bench_ttl_charges_the_full_checkpoint_re_run(tmp_path):
    """``bench ttl --activation-checkpoint full``: the same training; each MoE layer's
    re-run is charged as a whole-layer recompute (its forward stages again)."""
    import json

    from lrmoe.cli import main

    common = ["bench", "ttl", "--preset", "tiny-qwen3", "--ep", "2", "--steps", "2",
              "--batch-size", "4", "--seq-len", "32", "--eval-every", "2",
              "--max-data-bytes", "200000", "--threads", "1", "--policies", "static,symi"]
    assert main(common + ["--out", str(tmp_path / "n")]) == 0
    assert main(common + ["--activation-checkpoint", "full", "--out", str(tmp_path / "f")]) == 0
    n, f = (json.loads((tmp_path / x / "ttl.json").read_text()) for x in ("n", "f"))
    for name in ("static", "symi"):
        a, b = n["policies"][name]["steps"], f["policies"][name]["steps"]
        torch.testing.assert_close(torch.tensor([s["train_loss"] for s in b]),
                                   torch.tensor([s["train_loss"] for s in a]), rtol=1e-5, atol=0)
        for s in b:
            st = s["stages_emulated_s"]
            # per layer the slowest rank's forward stages, at most the stages' maxima
            assert 0 < st["bwd_recompute"] <= (
                st["fwd_dispatch"] + st["fwd_experts"] + st["fwd_combine"]) * (1 + 1e-9)
            assert st["bwd_recompute"] >= st["fwd_experts"]
        assert all(s["stages_emulated_s"]["bwd_recompute"] == 0 for s in a)
