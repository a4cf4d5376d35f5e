"""``BackwardOptions(router_grad="experts")``: on an exact plan the expert backward
computes each pair's router gradient ``<dout[t] @ w2, silu(g)*u>`` and the combined
expert outputs are not kept for backward. Same gradients as the loop reference (one
process and EP 2); the bytes autograd keeps fall by exactly the ledger's
``combine_rows`` term (``Ledger(router_grad_at_experts=True)``), and not at all on a
trimmed LRMoE plan (its unselected pairs never reach an expert in backward)."""

from __future__ import annotations

import copy

import pytest
import torch

import onerank
import test_compile
import test_ledger_truth as truth
from dist_util import hot_replica_plan, run_world
from lrmoe.ledger import Ledger
from lrmoe.model import MoEForCausalLM
from lrmoe.model.moe import MoERuntime
from lrmoe.ops import experts as ex
from lrmoe.parallel.exchange import BackwardOptions
from lrmoe.policy.base import Policy
from lrmoe.presets import get_preset
from references.moe import moe_layer_reference, swiglu_loop_reference

TOL = dict(rtol=1e-5, atol=1e-6)
EXPERTS = BackwardOptions(router_grad="experts")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rowdot_is_dy_dot_y(dtype, tol):
    g = torch.Generator().manual_seed(5)
    counts, H, F = [5, 0, 7, 3], 16, 8
    R, I = sum(counts), len(counts)
    x = torch.randn(R, H, generator=g).to(dtype)
    w13 = (torch.randn(I, 2 * F, H, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(I, H, F, generator=g) * 0.3).to(dtype)
    dy = torch.randn(R, H, generator=g).to(dtype)
    scale = torch.rand(R, generator=g)
    y = swiglu_loop_reference(x.float(), w13.float(), w2.float(), counts)
    _, gu = ex.swiglu_forward(x, w13, w2, counts)
    *grads, dot = ex.swiglu_backward({"x": x, "gu": gu, "dy": dy}, w13, w2, counts, scale=scale,
                                     rowdot=True)
    want = (dy.float() * y).sum(1)
    assert float((dot - want).norm() / want.norm()) < tol
    again = ex.swiglu_backward({"x": x, "gu": gu, "dy": dy}, w13, w2, counts, scale=scale)
    for a, b in zip(grads, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same kernels otherwise


class _ReplicaPolicy(Policy):
    name = "replica-test"

    def plan(self, counts_GE, inputs):
        return hot_replica_plan(counts_GE, avoid_owner=False)


def _grads(layer, x, coeff, ref=False):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y = moe_layer_reference(layer, x) if ref else layer(x)
    (y * coeff).sum().backward()
    return [y.detach(), x.grad, layer.experts.gate_up_proj.grad.clone(),
            layer.experts.down_proj.grad.clone(), layer.router.weight.grad.clone()]


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-glm"])
def test_one_process_matches_reference(preset):
    torch.manual_seed(0)
    layer = copy.deepcopy(MoEForCausalLM(get_preset(preset)).moe_layers[0])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 24, layer.cfg.hidden_size, generator=g)
    coeff = torch.randn(x.shape, generator=g)
    ref = _grads(layer, x, coeff, ref=True)
    for policy in (None, _ReplicaPolicy()):
        layer.runtime = MoERuntime(backward=EXPERTS) if policy is None else \
            MoERuntime(policy=policy, backward=EXPERTS)
        for a, b in zip(_grads(layer, x, coeff), ref):
            torch.testing.assert_close(a, b, **TOL)
        st = layer.runtime.stats[0]
        assert st["bwd_combine_bytes_sent"] == st["bwd_rows"] * (layer.cfg.hidden_size * 4 + 4)


@pytest.mark.parametrize("router_grad", ["home", "experts"])
def test_capacity_drops_match_a_reference_without_the_dropped_pairs(router_grad):
    """A capacity plan that drops pairs: output and gradients (router included: a dropped
    pair's gate has no effect, so its gradient is 0) are the dense reference's without
    those pairs, wherever the router gradient is computed."""
    from lrmoe.policy.capacity import CapacityPolicy

    plans = []

    class Recording(CapacityPolicy):
        def plan(self, counts_GE, inputs):
            plans.append(super().plan(counts_GE, inputs))
            return plans[-1]

    torch.manual_seed(0)
    layer = copy.deepcopy(MoEForCausalLM(get_preset("tiny-qwen3")).moe_layers[0])
    assert layer.shared_experts is None
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 24, layer.cfg.hidden_size, generator=g)
    coeff = torch.randn(x.shape, generator=g)
    layer.runtime = MoERuntime(policy=Recording(capacity_factor=0.5),
                               backward=BackwardOptions(router_grad=router_grad))
    got = _grads(layer, x, coeff)
    dropped_E = plans[-1].dropped_GE[0]
    assert int(dropped_E.sum()) > 0 and plans[-1].exact
    layer.zero_grad()
    xr = x.clone().requires_grad_()
    out = moe_layer_reference(layer, xr, dropped_E=dropped_E)
    (out * coeff).sum().backward()
    want = [out.detach(), xr.grad, layer.experts.gate_up_proj.grad, layer.experts.down_proj.grad,
            layer.router.weight.grad]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.dist
def test_ep2_matches_reference(tmp_path):
    """Replicas across ranks, eager (the worker of ``test_compile`` without compiling)."""
    run_world(2, test_compile._ep_worker, None, EXPERTS, tmp_path=tmp_path)


@pytest.mark.parametrize("case", ["static", "symi_replicas", "static_recompute", "lrmoe_trimmed"])
def test_kept_bytes_fall_by_the_ledgers_combine_rows(case, monkeypatch):
    """What autograd keeps (measured as in ``test_ledger_truth``) with ``router_grad``
    "experts" vs "home", against the two ledgers' ``combine_rows`` on each rank."""
    layer, x, counts = truth._layer_and_tokens()
    layer.runtime_peers = counts
    policy, ledger = truth._policy_and_ledger(case, counts)
    one = Ledger(truth._cfg(), truth.G, num_moe_layers=1)
    lean = Ledger(truth._cfg(), truth.G, num_moe_layers=1, router_grad_at_experts=True)
    kept = {}
    for opts in (BackwardOptions(), EXPERTS):
        monkeypatch.setattr(truth, "one_rank_layer", lambda *a, o=opts: onerank.one_rank_layer(
            *a, backward=o))
        kept[opts.router_grad] = [truth.measure(layer, x, me, policy, ledger)
                                  for me in range(truth.G)]
    saved_any = False
    for me in range(truth.G):
        a, b = kept["home"][me], kept["experts"][me]
        plan = b["plan"]
        assert plan.exact == (case != "lrmoe_trimmed")
        drop = sum(a["by"]["exchange"].values()) - sum(b["by"]["exchange"].values())
        want = one.rank_terms(plan)[me]["combine_rows"] - lean.rank_terms(plan)[me]["combine_rows"]
        assert drop == want, (case, me, drop, want)
        saved_any |= drop > 0
    assert saved_any == (case != "lrmoe_trimmed")


def test_train_flag_same_losses_and_bad_value(tmp_path, capsys):
    """``lrmoe train --router-grad experts`` trains to the same losses as ``home`` (the
    static plan is exact); a value that is neither is one line, exit code 2."""
    from lrmoe.cli import main
    from lrmoe.train.metrics import read_metrics

    small = ["--preset", "tiny-qwen3", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
             "--max-data-bytes", "100000", "--eval-every", "0", "--eval-batches", "1",
             "--threads", "1", "--warmup", "1"]
    losses, bwd_bytes = {}, {}
    for rg in ("home", "experts"):
        assert main(["train", "--out", str(tmp_path / rg), *small, "--router-grad", rg]) == 0
        rows = [r for r in read_metrics(tmp_path / rg / "metrics.jsonl") if r.get("kind") == "train"]
        losses[rg] = [r["loss"] for r in rows]
        bwd_bytes[rg] = [m["bwd_bytes"] for r in rows for m in r["moe"]]
    assert len(losses["home"]) == 3
    # the option took effect: each backward row carries its router gradient (4 bytes) home
    assert all(b > a for a, b in zip(bwd_bytes["home"], bwd_bytes["experts"]))
    torch.testing.assert_close(losses["experts"], losses["home"], rtol=1e-5, atol=1e-6)
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "bad"), *small, "--router-grad", "away"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--router-grad 'away'" in err[0], err
    assert not (tmp_path / "bad").exists()
