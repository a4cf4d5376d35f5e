"""Expert-parallel training (gloo on loopback) against one process on the same global batch.

``torchrun`` start-up costs several seconds per launch on two cores, so this file is also
the worker script: ``torchrun --standalone --nproc-per-node N tests/test_ep_training.py
JOBS.json`` joins one gloo group and runs every job (an ``lrmoe train ...`` argument list,
through :func:`lrmoe.cli.main`, exactly as ``-m lrmoe train`` would) one after another.
One launch of 2 processes and one of 4 run every multi-rank configuration; the
one-process references run in the pytest process.

Checked (tiny-qwen3 and tiny-glm, 5 AdamW steps of 8 x 32 tokens):

* ``--ep 2`` / ``--ep 4`` (and DP x EP: 4 processes with ``--ep 2``) give the single
  process's per-step losses, grad norms and final parameters (checkpoints merged from
  the EP shards, and ``lrmoe eval`` on an EP checkpoint);
* symi (replicas, placement changing from step to step), lrmoe with a budget where
  everything fits and no backward trimming, and capacity with a huge factor all equal
  static;
* an EP checkpoint resumes bit for bit;
* after every optimizer step, every instance of every expert (natives and replicas on
  other ranks) holds bit-identical weights, equal to single-process AdamW's.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lrmoe.policy.base import Policy

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")

STEPS = 5
COMMON = ["--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32",
          "--max-data-bytes", "100000", "--eval-batches", "1", "--eval-every", "0",
          "--threads", "1", "--warmup", "1", "--log-every", "100", "--timeout-s", "60"]
E = 16  # tiny-qwen3 and tiny-glm both have 16 routed experts

# name -> (preset, extra flags); the one-process references run in pytest's process.
SINGLE = {
    "qwen-1": ("tiny-qwen3", []),
    "glm-1": ("tiny-glm", []),
    "qwen-capacity-1": ("tiny-qwen3", ["--policy", "capacity", "--capacity-factor", "1000"]),
    "qwen-noaux-1": ("tiny-qwen3", ["--config", "{root}/noaux.json"]),
    "glm-accum-1": ("tiny-glm", ["--grad-accum", "2"]),
}
WORLD2 = {  # torchrun --nproc-per-node 2
    "qwen-ep2": ("tiny-qwen3", ["--ep", "2"]),
    "glm-ep2": ("tiny-glm", ["--ep", "2"]),
    "qwen-symi-ep2": ("tiny-qwen3", ["--ep", "2", "--policy", "symi", "--slots-per-rank",
                                     str(E // 2 + 2)]),
    "qwen-lrmoe-ep2": ("tiny-qwen3", ["--ep", "2", "--policy", "lrmoe", "--mem-budget", "1GiB",
                                      "--lrmoe-min-keep", "1"]),
    "glm-symi-accum-ep2": ("tiny-glm", ["--ep", "2", "--grad-accum", "2", "--policy", "symi",
                                        "--slots-per-rank", str(E // 2 + 2)]),
}
WORLD4 = {  # torchrun --nproc-per-node 4
    "qwen-ep4": ("tiny-qwen3", ["--ep", "4"]),
    "glm-ep4": ("tiny-glm", ["--ep", "4"]),
    "qwen-symi-ep4": ("tiny-qwen3", ["--ep", "4", "--policy", "symi", "--slots-per-rank",
                                     str(E // 4 + 2)]),
    "glm-symi-ep4": ("tiny-glm", ["--ep", "4", "--policy", "symi", "--slots-per-rank",
                                  str(E // 4 + 2)]),
    "qwen-lrmoe-ep4": ("tiny-qwen3", ["--ep", "4", "--policy", "lrmoe", "--mem-budget", "1GiB",
                                      "--lrmoe-selection", "off"]),
    "qwen-dp2xep2": ("tiny-qwen3", ["--ep", "2"]),
    "qwen-noaux-dp2xep2": ("tiny-qwen3", ["--ep", "2", "--config", "{root}/noaux.json"]),
    "glm-dp2xep2": ("tiny-glm", ["--ep", "2"]),
}
RESUME_STOP = 3  # the resume run stops after this step, then continues with --resume


def _jobs(table: dict, root: Path) -> list[list[str]]:
    return [["train", "--preset", preset, "--out", str(root / name), *COMMON,
             *(x.format(root=root) for x in extra)]
            for name, (preset, extra) in table.items()]


def _launch(nproc: int, jobs: list[list[str]], root: Path, tag: str) -> subprocess.Popen:
    jobfile = root / f"jobs-{tag}.json"
    jobfile.write_text(json.dumps(jobs))
    log = open(root / f"log-{tag}.txt", "w")
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc),
           str(Path(__file__).resolve()), str(jobfile)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                         start_new_session=True)
    p.log_path = root / f"log-{tag}.txt"  # type: ignore[attr-defined]
    return p


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text() if d.name.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
            out.append(int(d.name))
    return out


def _stop(p: subprocess.Popen) -> None:
    """End a torchrun launch: its workers run in their own sessions, so they are killed
    by pid (recorded while they are still the agent's children), then the agent."""
    if p.poll() is not None:
        return
    workers = _children(p.pid)
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.kill()
    p.wait()


def _wait(p: subprocess.Popen, timeout: float) -> None:
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(p)
        raise AssertionError(f"torchrun did not finish in {timeout:.0f}s:\n"
                             f"{p.log_path.read_text()[-4000:]}") from None
    assert rc == 0, f"torchrun exited {rc}:\n{p.log_path.read_text()[-6000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Every run of this file: the two torchrun launches overlap the in-process ones."""
    from lrmoe.cli import main

    root = tmp_path_factory.mktemp("ep")
    (root / "noaux.json").write_text(json.dumps({"router_aux_loss_coef": 0.0}))
    resume = ["train", "--preset", "tiny-qwen3", "--out", str(root / "qwen-ep2-resumed"),
              *COMMON, "--ep", "2"]
    w2 = _launch(2, _jobs(WORLD2, root) + [
        resume + ["--stop-after", str(RESUME_STOP)],
        # on --resume every flag not given comes from the run's config.json
        ["train", "--out", str(root / "qwen-ep2-resumed"), "--resume", "--threads", "1"],
    ], root, "w2")
    w4 = _launch(4, _jobs(WORLD4, root), root, "w4")
    try:
        for argv in _jobs(SINGLE, root):
            assert main(argv) == 0, argv
        _wait(w2, 150)
        _wait(w4, 150)
    finally:
        for p in (w2, w4):
            _stop(p)
    out = {name: root / name for name in (*SINGLE, *WORLD2, *WORLD4)}
    out["qwen-ep2-resumed"] = root / "qwen-ep2-resumed"
    return out


# ----------------------------------------------------------------------------- helpers
def rows(run: Path) -> list[dict]:
    from lrmoe.train.metrics import read_metrics

    return [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]


def series(run: Path, key: str) -> list[float]:
    return [r[key] for r in rows(run)]


def final_state(run: Path) -> tuple[dict, object]:
    from lrmoe.train import checkpoint as ckpt

    ck = ckpt.latest_checkpoint(run)
    assert ck is not None and ck.step == STEPS, run
    state, _ = ckpt.merged_model_state(ck)
    return state, ck


def assert_same_weights(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Weights after a few AdamW steps, to fp32 tolerance.

    5 steps at lr 3e-3 move weights by ~1e-2 (10-50% of their norm), so a wrong gradient
    shows as a relative difference > 1e-2. Reordered fp32 sums leave ~1e-6, except where
    Adam normalises a gradient element that is nearly zero (cancelling contributions):
    its step's sign can flip, so single elements may differ by a fraction of lr.
    """
    d = (got - want).float()
    rel = float(d.norm() / want.norm().clamp(min=1e-12))
    assert float(d.norm()) <= 1e-3 * float(want.norm()) + 1e-5 * d.numel() ** 0.5, \
        f"{what}: relative difference {rel:.2e}"
    assert float(d.abs().max()) < 1e-3, f"{what}: max difference {float(d.abs().max()):.2e}"


def assert_same_training(a: Path, b: Path, loss_rtol: float = 1e-5) -> None:
    """Same per-step losses and grad norms, and the same final (merged) parameters."""
    la, lb = series(a, "loss"), series(b, "loss")
    assert len(la) == len(lb) == STEPS
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=loss_rtol, atol=0)
    # AdamW is scale-invariant, so a wrongly scaled gradient would leave the weights
    # alone: the (pre-clip) gradient norm catches it.
    torch.testing.assert_close(torch.tensor(series(b, "grad_norm")),
                               torch.tensor(series(a, "grad_norm")), rtol=1e-4, atol=0)
    sa, cka = final_state(a)
    sb, ckb = final_state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].shape == sb[k].shape, k
        assert_same_weights(sb[k], sa[k], f"{k} ({a.name} vs {b.name})")


def moe_rows(run: Path) -> list[dict]:
    return [m for r in rows(run) for m in r["moe"]]


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("model", ["qwen", "glm"])
@pytest.mark.parametrize("ep", [2, 4])
def test_ep_equals_one_process(runs, model, ep):
    run = runs[f"{model}-ep{ep}"]
    assert_same_training(runs[f"{model}-1"], run)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["parallel"] == {"world": ep, "ep_size": ep}
    _, ck = final_state(run)
    assert ck.world == ck.ep_size == ep
    for r in rows(run):  # every rank processes its share; the loads add up to the pairs
        assert all(sum(loads) == m["pairs"] for loads, m in zip(r["rank_load"], r["moe"]))
        assert all(len(loads) == ep for loads in r["rank_load"])


def test_report_of_an_ep_run_plots_what_its_metrics_hold(runs, tmp_path, monkeypatch):
    """``lrmoe report`` on an EP run: per MoE layer, the rank-load heatmap is each step's
    rank loads over their mean, one column a step; the balance plot's lines are the
    metrics' max/mean of the experts and of the ranks, forward and backward."""
    import shutil

    import matplotlib.axes
    import numpy as np

    from lrmoe import report

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(runs["qwen-ep2"] / "metrics.jsonl", run)
    lines, images = {}, []
    finish, imshow = report._finish, matplotlib.axes.Axes.imshow

    def spy_finish(plt, fig, ax, path, *a):
        lines[path.name] = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()))
                            for ln in ax.get_lines()}
        return finish(plt, fig, ax, path, *a)

    def spy_imshow(ax, m, **kw):
        images.append((np.array(m), kw["extent"]))
        return imshow(ax, m, **kw)
    monkeypatch.setattr(report, "_finish", spy_finish)
    monkeypatch.setattr(matplotlib.axes.Axes, "imshow", spy_imshow)
    names = [p.name for p in report.write_report(run)]
    assert names == ["loss.png", "expert_load.png", "load_balance.png", "rank_load.png"]
    train = rows(run)
    steps, n = [r["step"] for r in train], len(train[0]["moe"])
    assert n >= 2 and len(images) == 2 * n  # the expert heatmaps, then the ranks'
    for k, (m, extent) in enumerate(images[n:]):
        loads = np.array([r["rank_load"][k] for r in train], dtype=float).T  # [ranks, steps]
        np.testing.assert_allclose(m, loads / loads.mean(0))
        assert extent == (steps[0] - 0.5, steps[-1] + 0.5, -0.5, 1.5)
    got = lines["load_balance.png"]
    for k in range(n):
        want = {"experts": [r["expert_load_max_over_mean"][k] for r in train],
                "ranks fwd": [r["moe"][k]["rank_load_max_over_mean"] for r in train],
                "ranks bwd": [r["moe"][k]["rank_bwd_load_max_over_mean"] for r in train]}
        for what, ys in want.items():
            assert got[f"layer {k}: {what}"] == (steps, ys), (k, what)


def test_ep_checkpoint_evaluates_on_one_process(runs):
    """``lrmoe eval`` rebuilds the whole model from the EP shards."""
    from lrmoe.commands.eval import evaluate_run
    from lrmoe.train.metrics import read_metrics

    ref = [r for r in read_metrics(runs["qwen-1"] / "metrics.jsonl") if r["kind"] == "val"]
    got = evaluate_run(runs["qwen-ep4"])
    assert got["step"] == STEPS
    assert got["val_loss"] == pytest.approx(ref[-1]["val_loss"], rel=1e-5)


def _dp_x_ep(runs, name: str, ref: str) -> None:
    run = runs[name]
    assert json.loads((run / "config.json").read_text())["parallel"] == {"world": 4, "ep_size": 2}
    _, ck = final_state(run)
    assert (ck.world, ck.ep_size) == (4, 2)
    for r in rows(run):  # rank_load has one entry per process (each EP group's plan)
        assert all(len(loads) == 4 for loads in r["rank_load"])
    assert_same_training(runs[ref], run)


@pytest.mark.parametrize("name,ref", [("qwen-noaux-dp2xep2", "qwen-noaux-1"),
                                      ("glm-dp2xep2", "glm-1")])
def test_dp_x_ep_equals_one_process(runs, name, ref):
    """4 processes, --ep 2: two EP groups of 2, each expert's gradient summed over its
    expert-DP pair. (tiny-glm: no aux loss, router bias updated from global counts.)"""
    _dp_x_ep(runs, name, ref)


def test_dp_x_ep_with_aux_loss_equals_one_process(runs):
    _dp_x_ep(runs, "qwen-dp2xep2", "qwen-1")


def _placements(run: Path, slots: int, G: int) -> list[tuple]:
    """SYMI's placement of every step after the first, from the logged popularity."""
    from references.plans import contiguous_placement, replica_counts

    out = []
    rr = rows(run)
    for prev in rr[:-1]:
        for c in prev["counts"]:
            cnt = replica_counts(torch.tensor(c), E, G * slots)
            out.append(tuple(contiguous_placement(cnt, G, slots).flatten().tolist()))
    return out


@pytest.mark.parametrize("name,ref,G", [("qwen-symi-ep2", "qwen-1", 2),
                                        ("qwen-symi-ep4", "qwen-1", 4),
                                        ("glm-symi-ep4", "glm-1", 4)])
def test_symi_equals_static(runs, name, ref, G):
    slots = E // G + 2
    assert_same_training(runs[ref], runs[name])
    ms = moe_rows(runs[name])
    assert all(m["replicas"] == G * slots - E for m in ms)
    assert all(m["pairs"] == m["retained"] == m["selected"] for m in ms)  # exact backward
    # replication really moved: the placement changes from step to step (and layer to layer)
    assert len(set(_placements(runs[name], slots, G))) > 1
    # ... and the forward load per rank differs from static's (same routing, same counts)
    static = moe_rows(runs[f"{ref.split('-')[0]}-ep{G}"])
    assert [m["rank_load_max_over_mean"] for m in ms] != \
        [m["rank_load_max_over_mean"] for m in static]


@pytest.mark.parametrize("name,G", [("qwen-lrmoe-ep2", 2), ("qwen-lrmoe-ep4", 4)])
def test_lrmoe_with_everything_kept_equals_static(runs, name, G):
    assert_same_training(runs["qwen-1"], runs[name])
    ms = moe_rows(runs[name])
    assert all(m["pairs"] == m["retained"] == m["selected"] for m in ms)
    assert any(m["replicas"] > 0 for m in ms), "the planner added no replica: a vacuous test"
    # replicas only go where they lower the busiest rank's load
    static = moe_rows(runs[f"qwen-ep{G}"])
    assert all(m["rank_load_max_over_mean"] <= s["rank_load_max_over_mean"]
               for m, s in zip(ms, static))


def test_ep_with_grad_accum_equals_one_process(runs):
    """torchrun, EP 2, SYMI, 2 micro-batches a step: the one-process accumulating run's
    training (GLM: its bias updates once per optimizer step from the summed counts)."""
    ref, run = runs["glm-accum-1"], runs["glm-symi-accum-ep2"]
    assert_same_training(ref, run)
    assert series(ref, "loss") != series(runs["glm-1"], "loss")  # 2x the data a step
    assert all(m["replicas"] > 0 for m in moe_rows(run))
    for i, r in enumerate(rows(run)):
        assert r["micro_batches"] == 2 and r["tokens"] == (i + 1) * 2 * 8 * 32


def test_capacity_with_huge_factor_equals_static(runs):
    assert_same_training(runs["qwen-1"], runs["qwen-capacity-1"])


def test_ep_resume_is_bit_exact(runs):
    a, b = runs["qwen-ep2"], runs["qwen-ep2-resumed"]
    ra, rb = rows(a), rows(b)
    assert [r["step"] for r in rb] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "counts", "rank_load"):
        assert [r[key] for r in ra] == [r[key] for r in rb], key
    sa, _ = final_state(a)
    sb, ck = final_state(b)
    assert (ck.world, ck.ep_size) == (2, 2)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


# ----------------------------------------------------------------------------- instances
def _instances_worker(rank: int, world: int, steps: int) -> None:
    """Train a 2-layer tiny-qwen3 under symi (replicas on other ranks) and, next to it, the
    whole model on one process with the whole batch. After every optimizer step, each
    instance that the next forward computes with must be bit-identical to its expert's
    master weights on the owner rank, and match single-process AdamW."""
    import torch.distributed as dist

    import lrmoe.model.moe as moe_mod
    from lrmoe.config import ModelConfig
    from lrmoe.model import MoEForCausalLM
    from lrmoe.model.moe import MoERuntime
    from lrmoe.parallel.comm import EPComm
    from lrmoe.parallel.groups import (
        ParallelContext,
        clip_grad_norm,
        shard_experts,
        sync_grads,
    )
    from lrmoe.parallel.instances import instance_weight_list
    from lrmoe.policy.symi import SymiPolicy
    from lrmoe.presets import PRESETS
    from lrmoe.train.optim import build_optimizer

    torch.set_num_threads(1)
    cfg = ModelConfig.from_hf_dict(dict(PRESETS["tiny-qwen3"], num_hidden_layers=2))
    torch.manual_seed(0)
    ref = MoEForCausalLM(cfg)
    model = copy.deepcopy(ref)
    G, per, S = world, E // world, E // world + 3
    ctx = ParallelContext(world=world, rank=rank, ep_size=world, ep_group=dist.group.WORLD)
    comm = EPComm(dist.group.WORLD)
    shard_experts(model, ctx)
    model.set_runtime(MoERuntime(comm=comm, policy=SymiPolicy(S)))
    opt = build_optimizer(model, 3e-3, 0.1)
    ref_opt = build_optimizer(ref, 3e-3, 0.1)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (placement, instance weights)

    def recording(ws_own, plan, c, n_experts):
        outs = instance_weight_list(ws_own, plan, c, n_experts)
        seen.extend((plan.inst_expert_GS.clone(), out.detach().clone()) for out in outs)
        return outs

    moe_mod.instance_weight_list = recording
    gen = torch.Generator().manual_seed(7)
    B, T = 2 * world, 24
    names = [(f"layers.{i}.mlp.experts.{p}", i, p) for i in range(cfg.num_hidden_layers)
             for p in ("gate_up_proj", "down_proj")]
    ref_w = {n: dict(ref.named_parameters())[n].detach().clone() for n, _, _ in names}
    placements = set()

    def check_instances(step: int) -> None:
        # calls are per layer (gate_up, then down) in forward order
        assert len(seen) == len(names), len(seen)
        for (name, _, _), (ie, inst) in zip(names, seen):
            placements.add(tuple(ie.flatten().tolist()))
            allv = [torch.empty_like(inst) for _ in range(world)]
            dist.all_gather(allv, inst.contiguous())
            master = [torch.empty_like(inst[:per]) for _ in range(world)]
            w_own = dict(model.named_parameters())[name].detach().contiguous()
            dist.all_gather(master, w_own)
            master_E = torch.cat(master)
            for r in range(world):
                for s in range(S):
                    e = int(ie[r, s])
                    if e < 0:
                        continue
                    assert torch.equal(allv[r][s], master_E[e]), \
                        f"step {step} {name}: rank {r} slot {s} (expert {e}) differs"
            assert_same_weights(master_E, ref_w[name], f"step {step} {name} vs one-process AdamW")

    for step in range(steps):
        batch = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=gen)
        mine = batch[rank * 2:(rank + 1) * 2]
        seen.clear()
        _, obj = model.loss(mine[:, :-1], mine[:, 1:])
        if step > 0:  # the instances this forward used carry the previous update
            check_instances(step)
        opt.zero_grad(set_to_none=True)
        obj.backward()
        sync_grads(model, ctx)
        clip_grad_norm(model, 1.0, ctx)
        _, robj = ref.loss(batch[:, :-1], batch[:, 1:])
        ref_opt.zero_grad(set_to_none=True)
        robj.backward()
        clip_grad_norm(ref, 1.0, ParallelContext())
        # replica gradients are summed into each owner's expert gradient
        for name, _, _ in names:
            g = dict(model.named_parameters())[name].grad
            rg = dict(ref.named_parameters())[name].grad[rank * per:(rank + 1) * per]
            rel = float((g - rg).norm() / rg.norm())
            assert rel < 1e-4, f"step {step} {name}: gradient differs by {rel:.2e} (relative)"
        opt.step()
        ref_opt.step()
        model.end_step()
        ref.end_step()
        ref_w = {n: dict(ref.named_parameters())[n].detach().clone() for n, _, _ in names}
    seen.clear()
    with torch.no_grad():
        model.loss(mine[:, :-1], mine[:, 1:])
    check_instances(steps)
    # replicas really were spread over ranks, and the placement moved between steps
    assert len(placements) > 1
    assert any(e >= 0 and e // per != r for p in placements
               for r, row in enumerate(torch.tensor(p).view(G, S).tolist()) for e in row)


def test_every_instance_holds_adamw_weights(tmp_path):
    from dist_util import run_world

    run_world(4, _instances_worker, 4, tmp_path=tmp_path)


# ----------------------------------------------------------------------------- trimmed backward
def _trimmed_worker(rank: int, world: int, case: str) -> None:
    """One MoE layer under EP with a plan that trims the backward of *some* instances
    (what LRMoE does: only the busiest ranks are cut), against a masked single-process
    reference: each block (home rank, instance) keeps its ``select`` highest-metric pairs
    (metric ``g·||dy||``); kept pairs give the expert weight gradient and the expert
    path of dx, every pair gives the router path."""
    import torch.distributed as dist
    from torch import nn

    from lrmoe.config import ModelConfig
    from lrmoe.model.moe import MoELayer, MoERuntime
    from lrmoe.model.router import Routing
    from lrmoe.parallel.comm import EPComm
    from lrmoe.parallel.exchange import BackwardOptions
    from lrmoe.parallel.groups import ParallelContext, shard_experts
    from lrmoe.policy.lrmoe import LrmoeConfig, LrmoePolicy
    from lrmoe.policy.plan import Plan
    from lrmoe.policy.plan_numpy import full_plan

    T, H, NE, K, F = 64, 16, 8, 2, 8
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=32, hidden_size=H,
                      num_attention_heads=2, num_key_value_heads=1, moe_intermediate_size=F,
                      num_experts=NE, num_experts_per_tok=K, num_hidden_layers=1,
                      intermediate_size=32)

    class FixedRouter(nn.Module):  # skewed routing table, differentiable gates
        def __init__(self, idx):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(NE, H) * 0.5)
            self.idx = idx

        def forward(self, x):
            probs = torch.softmax(x @ self.weight.t(), dim=-1)
            return Routing(self.idx, probs.gather(1, self.idx), None)

    class HalfOnRankZero(Policy):  # natives; only rank 0's instances keep half their pairs
        name = "half-on-rank-0"

        def plan(self, counts_GE, inputs):
            p = full_plan(counts_GE, torch.arange(NE).reshape(world, NE // world))
            sel = p.assign_GGS.clone()
            sel[:, 0] = p.assign_GGS[:, 0] // 2
            return Plan(p.inst_expert_GS, p.assign_GGS, p.assign_GGS.clone(), sel)

    plans = []

    class Recording(Policy):
        name = "recording"

        def __init__(self, inner):
            self.inner = inner

        def plan(self, counts_GE, inputs):
            plans.append(self.inner.plan(counts_GE, inputs))
            return plans[-1]

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(11)
    n = world * T
    hot = torch.tensor([8.0, 6, 1, 1, 1, 1, 1, 1])
    idx = torch.stack([torch.multinomial(hot, K, generator=gen) for _ in range(n)])
    layer = MoELayer(cfg, 0)
    layer.router = FixedRouter(idx)
    x = torch.randn(n, H, generator=gen)
    coeff = torch.randn(n, H, generator=gen)
    ref = copy.deepcopy(layer)

    sl = slice(rank * T, (rank + 1) * T)
    layer.router.idx = idx[sl]
    shard_experts(layer, ParallelContext(world=world, rank=rank, ep_size=world,
                                         ep_group=dist.group.WORLD))
    inner = HalfOnRankZero() if case == "natives" else LrmoePolicy(LrmoeConfig())
    layer.runtime = MoERuntime(comm=EPComm(dist.group.WORLD), policy=Recording(inner),
                               backward=BackwardOptions(metric="grad_norm", estimator="topk"))
    xl = x[sl].clone().requires_grad_()
    (layer(xl.unsqueeze(0)).squeeze(0) * coeff[sl]).sum().backward()
    plan = plans[-1]
    assert torch.equal(plan.retain_GGS, plan.assign_GGS)
    sel_I = plan.select_GGS.sum(0).flatten()
    assert (sel_I < plan.assign_GGS.sum(0).flatten()).any()  # some instances trimmed ...
    assert (sel_I == plan.assign_GGS.sum(0).flatten()).any()  # ... and some not

    # reference: block = home g's pairs of expert e (token order) split over e's instances
    # in global slot order (plan.interval_overlap); top-`select` by metric in each block
    W13 = ref.experts.gate_up_proj.detach().clone().requires_grad_()
    W2 = ref.experts.down_proj.detach().clone().requires_grad_()
    xr = x.clone().requires_grad_()
    gate = ref.router(xr).gate_TK
    gd = gate.detach()
    metric = gd * coeff.norm(dim=1, keepdim=True)

    def expert(e, xs):
        gu = xs @ W13[e].t()
        return (torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]) @ W2[e].t()

    ie = plan.inst_expert_GS.flatten()
    loss = 0
    for g in range(world):
        for e in range(NE):
            flat = torch.nonzero(idx[g * T:(g + 1) * T].flatten() == e).flatten()
            t, k = flat // K + g * T, flat % K
            if not t.numel():
                continue
            loss = loss + (gate[t, k, None] * expert(e, xr[t]).detach() * coeff[t]).sum()
            off = 0
            for i in (i for i in range(ie.numel()) if int(ie[i]) == e):
                a = int(plan.assign_GGS[g].flatten()[i])
                keep = int(plan.select_GGS[g].flatten()[i])
                tb, kb = t[off:off + a], k[off:off + a]
                off += a
                top = torch.argsort(metric[tb, kb], descending=True, stable=True)[:keep]
                ts, ks = tb[top], kb[top]
                loss = loss + (gd[ts, ks, None] * expert(e, xr[ts]) * coeff[ts]).sum()
            assert off == t.numel()
    loss.backward()
    per = NE // world
    own = slice(rank * per, (rank + 1) * per)
    for name, got, want in (("gate_up_proj", layer.experts.gate_up_proj.grad, W13.grad[own]),
                            ("down_proj", layer.experts.down_proj.grad, W2.grad[own]),
                            ("dx", xl.grad, xr.grad[sl])):
        rel = float((got - want).norm() / want.norm())
        assert rel < 1e-5, f"{case}, rank {rank}: {name} differs by {rel:.2e} (relative)"


@pytest.mark.parametrize("world", [2, 4])
def test_trimmed_backward_matches_masked_reference(world, tmp_path):
    from dist_util import run_world

    run_world(world, _trimmed_both, tmp_path=tmp_path)


def _trimmed_both(rank: int, world: int) -> None:
    for case in ("natives", "lrmoe"):
        _trimmed_worker(rank, world, case)


# ----------------------------------------------------------------------------- worker
def _worker_main(jobfile: str) -> int:
    """torchrun entry: one gloo group, then every job of ``jobfile`` in order."""
    import datetime

    import torch.distributed as dist

    from lrmoe.cli import main

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    jobs = json.loads(Path(jobfile).read_text())
    for argv in jobs:
        t0 = time.perf_counter()
        rc = main(argv)
        if rc != 0:
            print(f"job failed ({rc}): {argv}", file=sys.stderr, flush=True)
            os._exit(rc)  # the other ranks would wait in a collective: end now
        if dist.get_rank() == 0:
            print(f"job done in {time.perf_counter() - t0:.1f}s: {argv[:5]}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1]))
