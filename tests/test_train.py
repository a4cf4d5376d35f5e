"""The trainer end to end on tiny models: loss falls, metrics, checkpoints, resume bit for
bit, eval, report, presets, NaN stop and corrupt-checkpoint detection (one process, CPU)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from lrmoe.cli import main
from lrmoe.errors import LrmoeError
from lrmoe.presets import PRESETS, get_preset
from lrmoe.train import TrainConfig, train
from lrmoe.train import checkpoint as ckpt
from lrmoe.train.metrics import read_metrics
from lrmoe.train.optim import build_optimizer, build_scheduler, lr_scale, param_groups

# Small and fast: 4 x 64 tokens per step, 200 kB of the stdlib corpus, one thread
# (steady timings when other processes share the two cores).
SMALL = ["--batch-size", "4", "--seq-len", "64", "--max-data-bytes", "200000",
         "--eval-batches", "2", "--threads", "1", "--warmup", "5"]
SMALL_API = dict(batch_size=4, seq_len=64, max_data_bytes=200_000, eval_batches=2, threads=1,
                 warmup=4)


def cli(argv, capsys) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def train_losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"]


def digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory):
    """tiny-qwen3, 36 steps, validation and checkpoints every 12, the last 2 kept."""
    out = tmp_path_factory.mktemp("runs") / "qwen"
    rc = main(["train", "--preset", "tiny-qwen3", "--out", str(out), "--steps", "36",
               "--eval-every", "12", "--ckpt-every", "12", "--keep-ckpts", "2", *SMALL])
    assert rc == 0
    return out


def test_train_qwen_loss_falls_and_prints_final(tmp_path, capsys):
    rc, out, err = cli(["train", "--preset", "tiny-qwen3", "--out", tmp_path / "r", "--steps",
                        "30", "--eval-every", "0", *SMALL], capsys)
    assert rc == 0, err
    losses = train_losses(tmp_path / "r")
    assert len(losses) == 30
    assert sum(losses[:5]) / 5 - sum(losses[-5:]) / 5 > 0.5
    finals = [ln for ln in out.splitlines() if ln.startswith("final val_loss=")]
    assert out.strip() == finals[0] and len(finals) == 1
    assert float(finals[0].split("=")[1]) < math.log(256)


def test_train_glm_loss_falls(tmp_path, capsys):
    rc, out, err = cli(["train", "--preset", "tiny-glm", "--out", tmp_path / "g", "--steps",
                        "30", "--eval-every", "0", *SMALL], capsys)
    assert rc == 0, err
    losses = train_losses(tmp_path / "g")
    assert sum(losses[:5]) / 5 - sum(losses[-5:]) / 5 > 0.5
    assert out.startswith("final val_loss=")


def test_metrics_rows(qwen_run):
    rows = read_metrics(qwen_run / "metrics.jsonl")
    tr = [r for r in rows if r["kind"] == "train"]
    val = [r for r in rows if r["kind"] == "val"]
    assert [r["step"] for r in tr] == list(range(1, 37))
    assert [r["step"] for r in val] == [12, 24, 36]
    assert all(math.isfinite(r["val_loss"]) and r["val_tokens"] > 0 for r in val)
    cfg = get_preset("tiny-qwen3")
    pairs = 4 * 64 * cfg.num_experts_per_tok
    for i, r in enumerate(tr):
        for k in ("step", "loss", "lr", "tokens", "elapsed_s", "grad_norm", "aux_loss",
                  "tokens_per_s", "expert_load_max_over_mean", "counts", "moe"):
            assert k in r, k
        assert r["tokens"] == (i + 1) * 4 * 64
        assert len(r["expert_load_max_over_mean"]) == len(cfg.moe_layers)
        assert all(x >= 1.0 for x in r["expert_load_max_over_mean"])
        assert all(len(c) == cfg.num_experts and sum(c) == pairs for c in r["counts"])
        for m in r["moe"]:
            assert m["pairs"] == m["retained"] == m["selected"] == pairs  # static: exact
            assert m["replicas"] == 0 and m["rank_load_max_over_mean"] == 1.0
            assert m["fwd_bytes"] > 0 and m["bwd_bytes"] > 0 and m["expert_fwd_ms"] >= 0
        assert "rank_load" not in r  # one process
        if sys.platform == "linux":  # the process's resident set, in bytes
            assert 2**20 < r["host_rss_bytes"] <= r["host_peak_rss_bytes"]
            assert ("host_rss_before_build_bytes" in r) == (i == 0)
    if sys.platform == "linux":
        assert 2**20 < tr[0]["host_rss_before_build_bytes"] <= tr[0]["host_peak_rss_bytes"]
    assert tr[0]["lr"] == pytest.approx(3e-3 / 5)  # warmup 5
    assert all(b["elapsed_s"] >= a["elapsed_s"] for a, b in zip(tr, tr[1:]))


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/status")
def test_host_memory_is_in_bytes():
    """64 MiB of fresh pages, written, raise the resident set by about 64 MiB, and the peak
    keeps it after they are unmapped. (A fresh anonymous mapping: a tensor could reuse
    pages an earlier test freed but the allocator kept resident.)"""
    import mmap

    from lrmoe.train.metrics import host_memory

    before = host_memory()["host_rss_bytes"]
    m = mmap.mmap(-1, 64 * 2**20)
    x = torch.frombuffer(m, dtype=torch.uint8)
    x.fill_(1)  # every page touched
    during = host_memory()["host_rss_bytes"]
    del x
    m.close()
    after = host_memory()
    assert 48 * 2**20 < during - before < 80 * 2**20
    assert after["host_peak_rss_bytes"] >= during - 2**20  # its counters lag a few pages


def test_run_config_and_checkpoints(qwen_run):
    cfg = json.loads((qwen_run / "config.json").read_text())
    assert cfg["model"]["model_type"] == "qwen3_moe" and cfg["model"]["vocab_size"] == 256
    assert cfg["train"]["steps"] == 36 and cfg["tokenizer"]["spec"] == "byte"
    assert [s for s, _ in ckpt.checkpoint_dirs(qwen_run)] == [24, 36]  # --keep-ckpts 2
    ck = ckpt.latest_checkpoint(qwen_run)
    assert ck.step == 36 and ck.world == 1 and ck.ep_size == 1 and ck.notes == []
    state, st = ckpt.merged_model_state(ck)
    assert {"scheduler", "data", "moe_prev_counts", "optim_groups", "progress"} <= set(st)
    assert st["data"]["seq_len"] == 64 and st["progress"]["val_loss"] is not None
    assert "layers.0.mlp.experts.gate_up_proj" in state


def test_resume_is_bit_exact(tmp_path):
    base = dict(preset="tiny-qwen3", steps=12, eval_every=4, ckpt_every=3, **SMALL_API)
    a = train(TrainConfig.from_flat(out=str(tmp_path / "a"), **base))
    train(TrainConfig.from_flat(out=str(tmp_path / "b"), stop_after=6, **base))
    b = train(TrainConfig.from_flat(out=str(tmp_path / "b"), resume=True, **base))
    assert a["final_val_loss"] == b["final_val_loss"]
    ra = [r for r in read_metrics(tmp_path / "a/metrics.jsonl") if r["kind"] == "train"]
    rb = [r for r in read_metrics(tmp_path / "b/metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rb] == list(range(1, 13))
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
    assert [r["grad_norm"] for r in ra] == [r["grad_norm"] for r in rb]
    assert [r["counts"] for r in ra] == [r["counts"] for r in rb]


def test_resume_bit_exact_glm_symi_via_cli(tmp_path, capsys):
    """GLM's router bias and SYMI's previous-step popularity must survive a resume."""
    args = ["--preset", "tiny-glm", "--policy", "symi", "--steps", "10", "--ckpt-every", "5",
            "--eval-every", "0", *SMALL]
    assert cli(["train", *args, "--out", tmp_path / "a"], capsys)[0] == 0
    assert cli(["train", *args, "--out", tmp_path / "b", "--stop-after", "4"], capsys)[0] == 0
    # flags not given on --resume come from the run's config.json
    rc, out, err = cli(["train", "--out", tmp_path / "b", "--resume", "--threads", "1"], capsys)
    assert rc == 0, err
    assert train_losses(tmp_path / "a") == train_losses(tmp_path / "b")


def test_resume_rejects_changed_trajectory(qwen_run, capsys):
    before = digest(qwen_run)
    rc, _, err = cli(["train", "--out", qwen_run, "--resume", "--lr", "0.01"], capsys)
    assert rc == 2 and "lr=0.01" in err and "--resume" in err
    assert digest(qwen_run) == before


def test_resume_at_end_only_validates(qwen_run, tmp_path, capsys):
    run = tmp_path / "copy"
    shutil.copytree(qwen_run, run)
    rc, out, err = cli(["train", "--out", run, "--resume", "--threads", "1"], capsys)
    assert rc == 0, err
    last = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "val"][-1]
    assert out.strip() == f"final val_loss={last['val_loss']:.6f}"


def test_resume_at_a_checkpoint_without_validation_evaluates_it(tmp_path, capsys):
    """A checkpoint saved between validations (val_loss None), resumed with ``--stop-after``
    at its step: nothing to train, so the run evaluates the checkpoint, as ``lrmoe eval``."""
    run = tmp_path / "r"
    args = ["train", "--preset", "tiny-qwen3", "--out", run, "--steps", "6", "--eval-every",
            "0", "--ckpt-every", "2", *SMALL]
    assert cli([*args, "--stop-after", "3"], capsys)[0] == 0
    shutil.rmtree(run / "checkpoints" / "ckpt-00000003")  # the latest is now step 2's
    rc, out, err = cli([*args, "--stop-after", "2", "--resume"], capsys)
    assert rc == 0, err
    rc, want, err = cli(["eval", run, "--threads", "1"], capsys)
    assert rc == 0, err
    assert out.strip() == "final " + want.strip()


def test_peak_rss_without_proc_is_ru_maxrss_in_bytes(monkeypatch):
    """Without ``/proc``'s ``VmHWM`` the peak comes from ``ru_maxrss``: in bytes, never below
    the resident set ``/proc`` reports now (less a few pages: the counters lag)."""
    from lrmoe.train import metrics

    now = metrics.host_rss_bytes()
    monkeypatch.setattr(metrics, "proc_kib", lambda path, key: None)
    assert now - 2**21 <= metrics.host_peak_rss_bytes() < 4 * now


def test_eval_matches_final_val_loss(qwen_run, capsys):
    last = [r for r in read_metrics(qwen_run / "metrics.jsonl") if r["kind"] == "val"][-1]
    rc, out, err = cli(["eval", qwen_run, "--threads", "1"], capsys)
    assert rc == 0, err
    assert out.strip() == f"val_loss={last['val_loss']:.6f}"


def test_report_writes_pngs(qwen_run, capsys):
    rc, out, err = cli(["report", qwen_run], capsys)
    assert rc == 0, err
    names = {Path(p).name for p in out.split()}
    assert {"loss.png", "expert_load.png", "load_balance.png"} <= names
    for n in names:
        assert (qwen_run / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_presets_lists_every_preset(capsys):
    rc, out, _ = cli(["presets"], capsys)
    assert rc == 0
    for name in PRESETS:
        assert name in out
    assert "30.5B" in out and "3.35B" in out  # qwen3-30b-a3b total / active
    # a rule of dashes under each column, as wide as its widest cell
    from lrmoe.commands.presets import human, table
    rows = table()
    rule = out.splitlines()[1]
    assert rule == "  ".join("-" * max(len(r[i]) for r in rows) for i in range(len(rows[0])))
    assert [human(n) for n in (999, 1_000, 99_940_000, 150e9, 2.5e12)] == [
        "999", "1K", "99.9M", "150B", "2.5T"]


def test_nan_loss_stops_and_keeps_last_checkpoint(tmp_path, capsys, monkeypatch):
    from lrmoe.model import MoEForCausalLM

    real = MoEForCausalLM.loss
    calls = {"n": 0}

    def loss(self, x, y):
        calls["n"] += 1
        lm, obj = real(self, x, y)
        if calls["n"] == 5:  # the 5th optimizer step's forward
            return lm * float("nan"), obj * float("nan")
        return lm, obj

    monkeypatch.setattr(MoEForCausalLM, "loss", loss)
    out = tmp_path / "nan"
    args = ["train", "--preset", "tiny-qwen3", "--out", out, "--steps", "10",
            "--ckpt-every", "2", "--eval-every", "0", *SMALL]
    snapshot = {}

    def hook(*a, **k):  # hash the checkpoints as they stood before the failure
        r = save(*a, **k)
        snapshot.update(digest(ckpt.ckpt_root(out)))
        return r

    save = ckpt.save_checkpoint
    monkeypatch.setattr(ckpt, "save_checkpoint", hook)
    rc, _, err = cli(args, capsys)
    assert rc == 2
    assert "step 5" in err and "nan" in err and "ckpt-00000004" in err
    assert [s for s, _ in ckpt.checkpoint_dirs(out)] == [2, 4]
    assert digest(ckpt.ckpt_root(out)) == snapshot
    assert max(r["step"] for r in read_metrics(out / "metrics.jsonl")) == 4


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_checkpoint_is_detected(qwen_run, tmp_path, capsys, damage):
    run = tmp_path / "bad"
    shutil.copytree(qwen_run, run)
    ck = ckpt.latest_checkpoint(run)
    shard = max((ck.path / n for n in ck.manifest["files"]), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = digest(run)
    for argv in (["train", "--out", run, "--resume"], ["eval", run]):
        rc, _, err = cli(argv, capsys)
        assert rc == 2
        assert str(shard) in err and ("corrupt" in err or "truncated" in err)
        assert len(err.strip().splitlines()) == 1
    assert digest(run) == before


def test_interrupted_save_is_ignored(qwen_run, tmp_path, capsys):
    """An unfinished save (a ``.tmp`` directory, or a directory without a manifest) is
    passed over, and the checkpoint used says so."""
    run = tmp_path / "partial"
    shutil.copytree(qwen_run, run)
    ckpt.partial_dir(run, 48).mkdir()
    (ckpt.partial_dir(run, 48) / "__0_0.distcp").write_bytes(b"partial")
    (ckpt.ckpt_dir(run, 40)).mkdir()
    ck = ckpt.latest_checkpoint(run)
    assert ck.step == 36
    line = ck.describe()
    assert "ckpt-00000036" in line and "ckpt-00000040" in line and "no manifest.json" in line
    assert ".ckpt-00000048.tmp" in line and "interrupted save" in line
    rc, _, err = cli(["eval", run], capsys)  # eval says so too
    assert rc == 0 and "ckpt-00000036: step 36" in err and "ckpt-00000040" in err


def _built(policy: str = "static", **model):
    """A one-process tiny-qwen3 run's model (``model``: config fields changed), optimizer,
    schedule and policy."""
    import dataclasses

    from lrmoe.model import MoEForCausalLM
    from lrmoe.policy.registry import PolicyConfig, make_policy

    cfg = dataclasses.replace(get_preset("tiny-qwen3"), **model)
    model = MoEForCausalLM(cfg)
    opt = build_optimizer(model, 1e-3, 0.1)
    return model, opt, build_scheduler(opt, 2, 10), make_policy(PolicyConfig(name=policy), cfg, 1)


def _save(run_dir: Path, step: int, built, gen: torch.Generator | None = None) -> None:
    """One process's checkpoint of ``built`` (``_built``'s four) and ``gen``'s state."""
    from lrmoe.train import ckpt_state

    model, opt, sched, policy = built
    ckpt.save_checkpoint(run_dir, step, model, opt,
                         trainer=ckpt.trainer_state(model, sched, policy, {}, {}),
                         rng=ckpt_state.rng_state(gen, torch.device("cpu")), rank=0, world=1,
                         ep_size=1)


def _load(run_dir: Path, built, gen: torch.Generator | None = None) -> None:
    """``run_dir``'s latest checkpoint into ``built`` on one process."""
    from lrmoe.parallel.groups import ParallelContext

    ckpt.load_checkpoint(ckpt.latest_checkpoint(run_dir), *built, gen, ctx=ParallelContext(), seed=0)


def test_a_finished_save_removes_interrupted_saves(tmp_path):
    """Once a checkpoint is renamed into place, the ``.tmp`` directories that killed saves
    left behind (of any step) are removed."""
    for step in (3, 9):
        ckpt.partial_dir(tmp_path, step).mkdir(parents=True)
        (ckpt.partial_dir(tmp_path, step) / "__0_0.distcp").write_bytes(b"partial")
    _save(tmp_path, 5, _built())
    assert ckpt.partial_dirs(tmp_path) == []
    assert [s for s, _ in ckpt.checkpoint_dirs(tmp_path)] == [5]
    ck = ckpt.latest_checkpoint(tmp_path)
    assert ck.step == 5 and ck.notes == []


def test_resume_at_the_same_size_restores_rng_streams_and_policy_state(tmp_path):
    """Loading a checkpoint at the world and EP size that wrote it puts the global and the
    runtime generators back where the save left them (not a reseeded stream), and the
    policy's adaptive state (lrmoe's per-layer keep floor) back as saved."""
    built = _built("lrmoe")
    built[3].min_keep_by_layer = {0: 0.375, 1: 0.5}
    gen = torch.Generator().manual_seed(11)
    torch.rand(5), torch.rand(5, generator=gen)
    _save(tmp_path, 4, built, gen)
    want = torch.rand(4), torch.rand(4, generator=gen)
    built = _built("lrmoe")
    gen = torch.Generator().manual_seed(99)
    _load(tmp_path, built, gen)
    assert torch.equal(torch.rand(4), want[0])
    assert torch.equal(torch.rand(4, generator=gen), want[1])
    assert built[3].min_keep_by_layer == {0: 0.375, 1: 0.5}


@pytest.mark.parametrize("experts", [8, 32])
def test_resume_refuses_a_checkpoint_with_another_number_of_experts(tmp_path, experts):
    """A checkpoint of 16 experts loads into no model of 8 (whose expert ids are all in it)
    or of 32: the refusal names the first tensor that differs (the router) and both shapes."""
    _save(tmp_path, 1, _built())
    with pytest.raises(LrmoeError, match=rf"does not match this model: .*mlp.router.weight has "
                                         rf"shape \(16, 128\), the model \({experts}, 128\)"):
        _load(tmp_path, _built(num_experts=experts))


def test_resume_keeps_each_parameters_optimizer_state_when_one_has_none(tmp_path):
    """A parameter that never had a gradient has no AdamW state; the others' moments still
    load onto their own parameters, and it stays without state."""
    built = _built()
    model, opt = built[:2]
    params = list(model.named_parameters())
    skipped = opt.param_groups[0]["params"][0]
    for _, p in params:
        p.grad = None if p is skipped else torch.randn_like(p)
    opt.step()
    want = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in params}
    _save(tmp_path, 1, built)
    built = _built()
    _load(tmp_path, built)
    model, opt = built[:2]
    got = {n: opt.state.get(p, {}) for n, p in model.named_parameters()}
    assert sum(not s for s in want.values()) == 1
    for n, st in want.items():
        assert set(got[n]) == set(st), n
        for k, v in st.items():
            assert torch.equal(got[n][k], v), (n, k)


def test_atomic_write_leaves_no_temp(tmp_path):
    p = tmp_path / "x.json"
    ckpt.atomic_write_text(p, "one")
    ckpt.atomic_write_text(p, "two")
    assert p.read_text() == "two" and [q.name for q in tmp_path.iterdir()] == ["x.json"]


def test_atomic_write_flushes_the_file_before_renaming_it(tmp_path, monkeypatch):
    """The new file's bytes reach the disk before its name replaces the old file's."""
    events, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(
        f"/proc/self/fd/{fd}"))), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a))),
                                                     real_replace(a, b)))
    p = tmp_path / "x.json"
    ckpt.atomic_write_text(p, "one")
    tmp = next(a for e, a in events if e == "replace")
    assert events.index(("fsync", tmp)) < events.index(("replace", tmp))
    assert p.read_text() == "one"


def test_optimizer_groups_and_schedule():
    from lrmoe.model import MoEForCausalLM

    model = MoEForCausalLM(get_preset("tiny-glm"))
    groups = {g["name"]: g for g in param_groups(model, 0.1)}
    names = {id(p): n for n, p in model.named_parameters()}
    plain = {names[id(p)] for p in groups["no_decay"]["params"]}
    decay = {names[id(p)] for p in groups["decay"]["params"]}
    assert all("norm" in n or n.endswith("bias") for n in plain)
    assert any(n.endswith("q_proj.bias") for n in plain)  # GLM attention bias
    assert any(n.endswith("experts.gate_up_proj") for n in decay)
    assert groups["no_decay"]["weight_decay"] == 0.0
    assert lr_scale(0, 10, 100) == pytest.approx(0.1)
    assert lr_scale(9, 10, 100) == pytest.approx(1.0)
    assert lr_scale(100, 10, 100) == pytest.approx(0.1)
    assert lr_scale(55, 10, 100) == pytest.approx(0.55)


def test_schedule_peaks_at_the_end_of_warmup_and_stays_at_its_floor():
    """The first cosine step is the peak; past ``total`` the lr stays at ``min_ratio``, and
    the scheduler passes its ``min_ratio`` on."""
    assert lr_scale(10, 10, 100) == pytest.approx(1.0)
    assert lr_scale(150, 10, 100) == pytest.approx(0.1)
    assert lr_scale(1000, 0, 100, 0.25) == pytest.approx(0.25)
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = build_scheduler(opt, 2, 10, 0.3)
    for _ in range(10):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.6)


def test_adamw_two_steps_match_hand_arithmetic():
    """Two AdamW steps of a matrix (decayed) and a 1-D gain (not) against the update
    written out: betas (0.9, 0.95), eps 1e-8 (gradients of 1e-7 make eps count)."""
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Parameter(torch.full((1, 1), 0.5, dtype=torch.float64))
            self.gain = nn.Parameter(torch.full((1,), 0.5, dtype=torch.float64))

    m = Tiny()
    lr, wd, b1, b2, eps = 1e-2, 0.1, 0.9, 0.95, 1e-8
    opt = build_optimizer(m, lr, wd)
    grads = [3e-7, -1e-7]
    for g in grads:
        m.proj.grad = torch.full_like(m.proj, g)
        m.gain.grad = torch.full_like(m.gain, g)
        opt.step()

    def by_hand(decay: float) -> float:
        x, mom, var = 0.5, 0.0, 0.0
        for t, g in enumerate(grads, start=1):
            x *= 1 - lr * decay
            mom = b1 * mom + (1 - b1) * g
            var = b2 * var + (1 - b2) * g * g
            x -= lr * (mom / (1 - b1**t)) / ((var / (1 - b2**t)) ** 0.5 + eps)
        return x

    assert m.proj.item() == pytest.approx(by_hand(wd), rel=0, abs=1e-12)
    assert m.gain.item() == pytest.approx(by_hand(0.0), rel=0, abs=1e-12)


def test_api_accepts_a_namespace_and_validates(tmp_path):
    import argparse

    with pytest.raises(LrmoeError, match="--steps"):
        train(argparse.Namespace(preset="tiny-qwen3", out=str(tmp_path / "n"), steps=0))
    assert not (tmp_path / "n").exists()
    torch.set_num_threads(torch.get_num_threads())  # unchanged by a failed call


def test_accumulated_loss_and_the_fidelity_steps(tmp_path, capsys):
    """With --grad-accum 2 the logged loss is the mean over the step's micro-batches: step 1
    logs the loss of one micro-batch of twice the sequences (the same data). lrmoe with
    --lrmoe-fidelity-every 2, trimming under a budget, measures the fidelity at steps 2
    and 4 only."""
    from lrmoe.ledger import Ledger

    cfg = get_preset("tiny-qwen3")
    led = Ledger.for_dtype(cfg, 1, None, "fp32")
    E, P = cfg.num_experts, 2 * 64 * cfg.num_experts_per_tok  # a micro-batch's pairs
    budget = sum(led.terms(E, P, P, P, n)["total"] for n in (0, P)) // 2
    common = ["train", "--preset", "tiny-qwen3", "--steps", "4", "--eval-every", "0", *SMALL]
    assert cli(common + ["--out", tmp_path / "one", "--steps", "1"], capsys)[0] == 0
    assert cli(common + ["--out", tmp_path / "acc", "--batch-size", "2", "--grad-accum", "2",
                         "--policy", "lrmoe", "--mem-budget", budget,
                         "--lrmoe-fidelity-every", "2"], capsys)[0] == 0
    one, acc = train_losses(tmp_path / "one"), train_losses(tmp_path / "acc")
    assert acc[0] == pytest.approx(one[0], rel=1e-6)
    rows = [r for r in read_metrics(tmp_path / "acc" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["fidelity_step"] for r in rows] == [False, True, False, True]
    measured = [all("fidelity_cosine" in layer for layer in r["moe"]) for r in rows]
    assert measured == [False, True, False, True]


def test_recompute_fits_a_budget_without_changing_the_math(tmp_path, capsys):
    """static over --mem-budget stops; with --recompute it recomputes just enough rows'
    gate_up outputs to fit, and trains like the unbudgeted run (fp32 tolerance)."""
    from lrmoe.ledger import Ledger

    cfg = get_preset("tiny-qwen3")
    led = Ledger.for_dtype(cfg, 1, None, "fp32")
    E, P = cfg.num_experts, 4 * 64 * cfg.num_experts_per_tok  # one rank receives every pair
    full, every = (led.terms(E, P, P, P, n)["total"] for n in (0, P))
    budget = (full + every) // 2
    common = ["train", "--preset", "tiny-qwen3", "--steps", "4", "--eval-every", "0", *SMALL]
    rc, _, _ = cli(common + ["--out", tmp_path / "free"], capsys)
    assert rc == 0
    rc, _, err = cli(common + ["--out", tmp_path / "tight", "--mem-budget", budget], capsys)
    assert rc == 2 and "out of memory at step 1 (needs " in err
    rc, _, _ = cli(common + ["--out", tmp_path / "rec", "--mem-budget", budget, "--recompute"],
                   capsys)
    assert rc == 0
    # same math; the recomputed GEMM may round differently from the forward's (~1e-7)
    torch.testing.assert_close(torch.tensor(train_losses(tmp_path / "rec")),
                               torch.tensor(train_losses(tmp_path / "free")), rtol=1e-5, atol=0)
    for row in (r for r in read_metrics(tmp_path / "rec" / "metrics.jsonl") if r["kind"] == "train"):
        for layer in row["moe"]:
            assert 0 < layer["recomputed"] < P and layer["ledger_total_bytes"] <= budget
    rc, _, err = cli(common + ["--out", tmp_path / "x", "--policy", "lrmoe", "--recompute"], capsys)
    assert rc == 2 and "recompute applies to the exact policies" in err
    # lrmoe under the same budget: trims retention; with --lrmoe-recompute it retains more
    kept = {}
    for name, extra in (("lr", []), ("lrrec", ["--lrmoe-recompute"])):
        rc, _, _ = cli(common + ["--out", tmp_path / name, "--policy", "lrmoe",
                                 "--mem-budget", budget, *extra], capsys)
        assert rc == 0
        rows = [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if r["kind"] == "train"]
        kept[name] = sum(layer["retained"] for r in rows for layer in r["moe"])
        assert all(layer["ledger_total_bytes"] <= budget for r in rows for layer in r["moe"])
        rec = sum(layer.get("recomputed", 0) for r in rows for layer in r["moe"])
        assert (rec > 0) == bool(extra)
    assert kept["lrrec"] > kept["lr"]


def test_router_lr_scale_gives_the_routers_their_own_lr():
    """--router-lr-scale: the routers' parameters (and only they) step at lr × scale;
    the schedule scales both alike; scale 1 keeps the two usual groups (old checkpoints
    resume); 0 or less is refused."""
    from lrmoe.errors import LrmoeError
    from lrmoe.model import MoEForCausalLM
    from lrmoe.train.optim import build_optimizer, build_scheduler

    model = MoEForCausalLM(get_preset("tiny-qwen3"))
    names = {id(p): n for n, p in model.named_parameters()}
    assert [g["name"] for g in build_optimizer(model, 1e-3, 0.1).param_groups] == [
        "decay", "no_decay"]
    opt = build_optimizer(model, 1e-3, 0.1, router_lr_scale=0.25)
    by = {g["name"]: g for g in opt.param_groups}
    routers = {names[id(p)] for g in opt.param_groups if g["name"].startswith("router")
               for p in g["params"]}
    assert routers == {n for n in names.values() if ".router." in f".{n}"} and routers
    assert by["router_decay"]["lr"] == pytest.approx(2.5e-4)
    assert by["decay"]["lr"] == pytest.approx(1e-3)
    build_scheduler(opt, 10, 100)  # warmup: both at a tenth of their peak, same ratio
    assert by["decay"]["lr"] == pytest.approx(1e-4)
    assert by["router_decay"]["lr"] / by["decay"]["lr"] == pytest.approx(0.25)
    # one AdamW step moves a router weight by about its lr, the others by theirs
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    for n, p in model.named_parameters():
        if p.ndim == 2:
            step = (before[n] - p.detach()).abs().max().item()
            lr = by["router_decay" if n in routers else "decay"]["lr"]
            assert step == pytest.approx(lr * (1 + 0.1 * before[n].abs().max().item()), rel=0.2)
    with pytest.raises(LrmoeError, match="router lr scale"):
        build_optimizer(model, 1e-3, 0.1, router_lr_scale=0.0)


def test_layer_row_sums_counters_takes_the_slowest_rank_and_averages_fidelity():
    from lrmoe.train.metrics import layer_row

    ranks = [{"load": 6.0, "retained_rows": 3.0, "fwd_bytes": 100.0, "expert_fwd_ms": 1.5,
              "expert_bwd_ms": 12345.678, "weight_scatter_bytes": 123456789.0,
              "fidelity_cosine": 0.5},
             {"load": 2.0, "retained_rows": 5.0, "fwd_bytes": 40.0, "expert_fwd_ms": 2.54321,
              "weight_scatter_bytes": 5.0, "fidelity_cosine": 1.0}]
    row = layer_row({"plan_replicas": 1}, ranks, pairs=8)
    # maxima to 4 significant digits, but never into the integer digits
    assert row == {"rank_load_max_over_mean": 1.5, "replicas": 1, "pairs": 8, "retained": 8,
                   "fwd_bytes": 140, "expert_fwd_ms": 2.543, "expert_bwd_ms": 12346.0,
                   "weight_scatter_bytes": 123456789.0, "fidelity_cosine": 0.75}


def test_layer_row_combines_every_rank_counter():
    """A layer's metrics row: byte and row counters summed over the ranks, timings at the
    slowest rank (random counters, the sums written out by hand)."""
    from lrmoe.train.metrics import layer_row, rank_summary

    g = torch.Generator().manual_seed(7)
    keys = ("fwd_dispatch_bytes_sent", "fwd_combine_bytes_sent", "bwd_dispatch_bytes_sent",
            "bwd_combine_bytes_sent", "bwd_exact_bytes", "fwd_rows", "selected_rows")
    stats = [dict(zip(keys, torch.randint(0, 1000, (len(keys),), generator=g).tolist()),
                  expert_fwd_ms=float(torch.rand((), generator=g))) for _ in range(3)]
    row = layer_row({}, [rank_summary(s) for s in stats])

    def total(*names):
        return sum(s[n] for s in stats for n in names)
    assert row["fwd_bytes"] == total("fwd_dispatch_bytes_sent", "fwd_combine_bytes_sent")
    assert row["bwd_bytes"] == total("bwd_dispatch_bytes_sent", "bwd_combine_bytes_sent")
    assert row["bwd_exact_bytes"] == total("bwd_exact_bytes")
    assert (row["fwd_rows"], row["selected"]) == (total("fwd_rows"), total("selected_rows"))
    assert row["expert_fwd_ms"] == pytest.approx(max(s["expert_fwd_ms"] for s in stats), rel=1e-3)


def test_a_step_reading_more_than_the_data_is_warned(tmp_path, capsys):
    """One step of 16 x 4 sequences over a text of ~30 windows: one warning line naming the
    flags; a step of 1 x 4: none. The boundary (a step reading the data exactly once) is
    not warned."""
    from lrmoe.train.config import TrainConfig, data_reuse_warning

    data = tmp_path / "small.txt"
    data.write_text("".join(f"line {i} of a small text\n" for i in range(60)))
    base = ["train", "--preset", "tiny-qwen3", "--data", data, "--steps", "1", "--batch-size",
            "4", "--seq-len", "32", "--eval-batches", "1", "--threads", "1"]
    rc, _, err = cli([*base, "--out", tmp_path / "a", "--grad-accum", "16"], capsys)
    assert rc == 0, err
    warned = [ln for ln in err.splitlines() if ln.startswith("lrmoe: warning:")]
    assert len(warned) == 1 and "--grad-accum 16 x --batch-size 4 = 64 sequences a step" \
        in warned[0] and "more than once" in warned[0], err
    rc, _, err = cli([*base, "--out", tmp_path / "b"], capsys)
    assert rc == 0 and "lrmoe: warning:" not in err, err
    cfg = TrainConfig(grad_accum=4, batch_size=8, seq_len=32)
    assert data_reuse_warning(cfg, 32) is None and data_reuse_warning(cfg, 31) is not None
