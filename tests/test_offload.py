"""``--optimizer-offload host``: the host AdamW of the experts (same update as on the
device), the ledger's GPU-only accounting, and the emulator's offload traffic model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor

from lrmoe.model import MoEForCausalLM
from lrmoe.presets import get_preset
from lrmoe.train.offload import HostOffloadAdamW, offloaded_params
from lrmoe.train.optim import build_optimizer, build_scheduler

VOCAB = get_preset("tiny-qwen3").vocab_size


def _model(seed=0):
    torch.manual_seed(seed)
    return MoEForCausalLM(get_preset("tiny-qwen3"))


def _train(model, opt, steps=4, seed=1):
    sched = build_scheduler(opt, 2, steps)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 17), generator=gen)
        _, obj = model.loss(ids[:, :-1], ids[:, 1:])
        opt.zero_grad(set_to_none=True)
        obj.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()


@pytest.mark.slow
def test_host_adamw_equals_device_adamw():
    """A few training steps with the experts stepped by the offload path (host = CPU here)
    give the same parameters as the plain on-device AdamW, to fp32 tolerance."""
    ref, off = _model(), _model()
    _train(ref, build_optimizer(ref, 3e-3, 0.1))
    opt = build_optimizer(off, 3e-3, 0.1, offload="host")
    assert isinstance(opt, HostOffloadAdamW)
    _train(off, opt)
    experts = {id(p) for p in offloaded_params(off)}
    assert experts, "the tiny model has expert parameters to offload"
    moved = 0
    for (n, a), b in zip(ref.named_parameters(), off.parameters()):
        # the host update is torch's fused CPU AdamW, the reference its single-tensor
        # loop: they differ in the last bits, which Adam amplifies a little over steps
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=n)
        moved += int(id(b) in experts and not torch.equal(b, _model().state_dict()[n]))
    assert moved == len(experts)  # every expert weight was updated (through the host)
    for p in offloaded_params(off):  # their state lives on the host, keyed by the parameter
        st = opt.state[p]
        assert st["exp_avg"].device.type == "cpu" and float(st["step"]) == 4
        torch.testing.assert_close(st["master"], p.detach())


def test_host_adamw_resume_from_state_dict():
    """State dict round trip: a fresh model + optimizer loaded from step 2 continue like
    the uninterrupted run."""
    a = _model()
    opt_a = build_optimizer(a, 3e-3, 0.1, offload="host")
    _train(a, opt_a, steps=2)
    b = _model(seed=7)
    b.load_state_dict(a.state_dict())
    opt_b = build_optimizer(b, 3e-3, 0.1, offload="host")
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for p in offloaded_params(b):
        assert opt_b.state[p]["exp_avg"].device.type == "cpu"
    _train(a, opt_a, steps=2, seed=5)
    _train(b, opt_b, steps=2, seed=5)
    for x, y in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(y, x, rtol=0, atol=0)


def test_build_optimizer_rejects_unknown_offload():
    from lrmoe.errors import LrmoeError
    with pytest.raises(LrmoeError, match="optimizer offload 'gpu'"):
        build_optimizer(_model(), 1e-3, 0.0, offload="gpu")


def test_host_adamw_step_refuses_a_closure():
    from lrmoe.errors import LrmoeError
    opt = build_optimizer(_model(), 1e-3, 0.0, offload="host")
    with pytest.raises(LrmoeError, match="takes no closure"):
        opt.step(lambda: torch.tensor(0.0))


# ----------------------------------------------------------------------------- ledger
def test_ledger_with_offload_counts_only_the_gpu():
    from lrmoe.ledger import Ledger

    cfg = get_preset("qwen3-30b-a3b")
    dev = Ledger.for_dtype(cfg, 8, None, "bf16")
    host = Ledger.for_dtype(cfg, 8, None, "bf16", optimizer_offload="host")
    P, L, own = 3 * cfg.hidden_size * cfg.moe_intermediate_size, dev.L, cfg.num_experts // 8
    a, b = dev.terms(20, 1000, 1000, 500), host.terms(20, 1000, 1000, 500)
    assert a["owned_state"] == L * own * P * 16  # fp32 master, grad, two moments
    assert b["owned_state"] == 2 * own * P * 2   # one layer's bf16 staging, once
    for k in a:  # the slots (bf16 weights and grads, natives included) stay as they are
        if k not in ("owned_state", "total"):
            assert a[k] == b[k], k
    assert a["total"] - b["total"] == a["owned_state"] - b["owned_state"]
    from lrmoe.errors import LrmoeError
    with pytest.raises(LrmoeError, match="optimizer offload 'disk'"):
        Ledger.for_dtype(cfg, 8, None, optimizer_offload="disk")


# ----------------------------------------------------------------------------- traffic model
def _symi_plan(G=4, E=8, s=3):
    from lrmoe.policy.symi import plan_symi

    counts = torch.tensor([[40, 5, 5, 5, 5, 5, 5, 10]] * G)
    return plan_symi(counts, s, counts.sum(0))


def test_sharded_offload_bytes_follow_the_paper():
    """SYMI's layout: every rank's host holds 1/G of every expert, so each rank moves the
    same E/G experts' worth over PCIe, and each slot gathers (G-1)/G of its weights."""
    from lrmoe.sim.offload import HOST_UPDATE_FP32_BYTES, OffloadModel

    G, E, P, bw = 4, 8, 1000, 2
    plan = _symi_plan(G, E, s=3)
    m = OffloadModel(E, G, P, bw, "sharded")
    b = m.rank_bytes()
    assert b["opt_d2h"] == b["opt_h2d"] == [E // G * P * bw] * G
    assert b["opt_host_update"] == [E // G * P * (HOST_UPDATE_FP32_BYTES + 2 * bw)] * G
    terms = m.link_terms(plan.inst_expert_GS)  # (messages, max(sent, received), fixed)
    assert terms["weight_scatter"][1] == [3 * P * bw * (G - 1) / G] * G  # 3 slots each
    assert terms["grad_reduce"] == terms["weight_scatter"]  # the same bytes the other way
    owner = OffloadModel(E, G, P, bw, "owner")
    assert owner.rank_bytes() == b
    assert owner.link_terms(plan.inst_expert_GS) == {}


def test_step_times_charge_the_offload_stages():
    from lrmoe.sim.analytic import modelled_stats
    from lrmoe.sim.cost import step_times
    from lrmoe.sim.links import LINKS
    from lrmoe.sim.offload import HOST_MEM_BPS, PCIE5_X16, OffloadModel

    cfg = get_preset("tiny-qwen3")
    G, E = 4, cfg.num_experts
    from lrmoe.policy.symi import plan_symi
    counts = torch.arange(1, E + 1).repeat(G, 1) * 3
    plan = plan_symi(counts, E // G + 2, counts.sum(0))
    st = modelled_stats(plan, cfg, 1e12, 4, 4, [0] * G)
    link = LINKS["ib"]
    P = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    m = OffloadModel(E, G, P, 4, "sharded")
    base, off = step_times(st, link), step_times(st, link, offload=m)
    assert base.opt_d2h == base.opt_host_update == base.opt_h2d == 0.0
    pcie = E // G * P * 4 / PCIE5_X16.bandwidth_Bps + PCIE5_X16.latency_s
    assert off.opt_d2h == pytest.approx(pcie) and off.opt_h2d == pytest.approx(pcie)
    assert off.opt_host_update == pytest.approx(E // G * P * 32 / HOST_MEM_BPS)
    # the sharded scatter: each rank gathers (G-1)/G of its E/G + 2 slots' weights
    want = (E // G + 2) * P * 4 * (G - 1) / G / link.effective_Bps + link.latency_s * (G - 1)
    assert off.weight_scatter == pytest.approx(want)
    same = [k for k in ("fwd_dispatch", "fwd_experts", "bwd_experts", "bwd_combine")]
    assert all(getattr(off, k) == getattr(base, k) for k in same)
    assert off.moe > base.moe


def test_plan_compare_prices_symi_with_offload():
    """With offload SYMI's E/G slots still pay the sharded weight scatter; a budget the
    on-device optimizer state alone exceeds fits SYMI with replicas on the host design,
    its s the least modelled time among those that fit."""
    from lrmoe.ledger import Ledger
    from lrmoe.routing_loads import synthetic_counts
    from lrmoe.sim.analytic import project_policy
    from lrmoe.sim.links import LINKS

    cfg = get_preset("qwen3-30b-a3b")
    G, E, T, k = 16, cfg.num_experts, 4096, cfg.num_experts_per_tok
    samples = [synthetic_counts(G, E, T, k, 1.0, 0)]
    link = LINKS["nvlink"]
    for off in ("device", "host"):
        led = Ledger.for_dtype(cfg, G, 2**40, "bf16", optimizer_offload=off)
        fixed = project_policy("symi", cfg, led, samples, link, 440e12, slots_per_rank=E // G)
        st = fixed["modelled_stages_ms"]
        assert (st["weight_scatter"] > 0) == (off == "host")  # sharded: natives gathered too
        assert (st["opt_host_update"] > 0) == (off == "host")
    rows = {off: project_policy("symi", cfg, Ledger.for_dtype(cfg, G, 20 * 2**30, "bf16",
                                                              optimizer_offload=off),
                                samples, link, 440e12) for off in ("device", "host")}
    assert not rows["device"]["fits"] and "owned state" in rows["device"]["reason"]
    assert rows["host"]["fits"]
    assert rows["host"]["slots_per_rank"] > E // G and rows["host"]["replicas"] > 0


# ----------------------------------------------------------------------------- bench ttl
def test_bench_ttl_with_offload(tmp_path, capsys):
    """Every policy is charged the offload stages, the budget is priced on the host
    design, symi's s is the least modelled time, and the table shows replicas per step
    (and says so when SYMI had none)."""
    import json

    from lrmoe.cli import main
    from lrmoe.commands.bench import table

    out = tmp_path / "o"
    rc = main(["bench", "ttl", "--preset", "tiny-qwen3", "--ep", "2", "--steps", "4",
               "--batch-size", "4", "--seq-len", "32", "--eval-every", "2",
               "--max-data-bytes", "200000", "--threads", "1", "--budget-floor-fraction",
               "1.1", "--optimizer-offload", "host", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "ttl.json").read_text())
    md = (out / "ttl.md").read_text()
    assert "replicas per step" in md and "opt_host_update" in md and "host memory" in md
    for name, r in rep["policies"].items():
        assert "optimizer offload to host" in r["config"]
        for s in r["steps"]:
            assert all(s["stages_emulated_s"][k] > 0
                       for k in ("opt_d2h", "opt_host_update", "opt_h2d")), name
    assert "least modelled MoE time" in rep["policies"]["symi"]["config"]
    assert "offload traffic" in rep["policies"]["symi"]["config"]
    # the budget is 1.1 x static's whole-layer floor on the host design (no optimizer
    # state in it), read off static's routing, which the trace records
    from lrmoe.sim.ttl import TTLConfig, static_floor_ledger
    from lrmoe.sim.ttl_budget import floor_of_run
    mcfg = get_preset("tiny-qwen3")
    trace = json.loads((out / "routing_trace_static.json").read_text())["steps"]
    counts = [[torch.tensor(c) for c in step] for step in trace]
    cfg = TTLConfig.from_flat(ep=2, batch_size=4, seq_len=32, optimizer_offload="host")
    F = floor_of_run(static_floor_ledger(cfg, mcfg), cfg, mcfg, counts)
    assert rep["budget_rule"]["floor_bytes"] == F and rep["budget_bytes"] == int(1.1 * F)
    dev_cfg = TTLConfig.from_flat(ep=2, batch_size=4, seq_len=32)
    assert F < floor_of_run(static_floor_ledger(dev_cfg, mcfg), dev_cfg, mcfg, counts)
    a = [s["train_loss"] for s in rep["policies"]["static"]["steps"]]
    b = [s["train_loss"] for s in rep["policies"]["symi"]["steps"]]
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-5)
    none = "SYMI ran with no replicas"
    had = any(s["replicas"] for s in rep["policies"]["symi"]["steps"])
    assert (none in md) != had
    for s in rep["policies"]["symi"]["steps"]:
        s["replicas"] = 0
    assert none in table(rep) and "s = E/G = 8" in table(rep)
    # GLM's HF config names the experts n_routed_experts (the table read num_experts)
    from lrmoe.config import ModelConfig
    glm = ModelConfig.from_hf_dict(rep["model"] | {"model_type": "glm4_moe"}).to_hf_dict()
    assert "num_experts" not in glm and glm["n_routed_experts"] == 16
    rep["model"] = glm
    assert "s = E/G = 8" in table(rep)


# ----------------------------------------------------------------------------- lrmoe train
def test_train_with_offload_resumes_and_matches_device(tmp_path, capsys):
    """``lrmoe train --optimizer-offload host``: same losses as the on-device optimizer
    (fp32 tolerance), and a resumed run repeats the uninterrupted one exactly."""
    from lrmoe.cli import main
    from lrmoe.train.metrics import read_metrics

    base = ["train", "--preset", "tiny-qwen3", "--steps", "6", "--batch-size", "4",
            "--seq-len", "32", "--max-data-bytes", "200000", "--eval-batches", "1",
            "--threads", "1", "--warmup", "2", "--eval-every", "0", "--ckpt-every", "3"]

    def losses(run):
        return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"]
    runs = {k: tmp_path / k for k in ("dev", "host", "resumed")}
    assert main(base + ["--out", str(runs["dev"])]) == 0
    assert main(base + ["--out", str(runs["host"]), "--optimizer-offload", "host"]) == 0
    assert main(base + ["--out", str(runs["resumed"]), "--optimizer-offload", "host",
                        "--stop-after", "3"]) == 0
    assert main(["train", "--out", str(runs["resumed"]), "--resume", "--threads", "1"]) == 0
    torch.testing.assert_close(torch.tensor(losses(runs["host"])),
                               torch.tensor(losses(runs["dev"])), rtol=1e-4, atol=1e-5)
    assert losses(runs["resumed"]) == losses(runs["host"])
    capsys.readouterr()
    assert main(base + ["--out", str(tmp_path / "bad"), "--optimizer-offload", "gpu"]) == 2
    assert "--optimizer-offload 'gpu'" in capsys.readouterr().err


def test_symi_slots_are_the_least_modelled_time_with_offload_charged():
    """symi_slot_choice (plan --compare and bench ttl) is the argmin over s of the
    modelled MoE time *with* the offload traffic; on InfiniBand that differs from the
    choice priced without it (the sharded layout gathers even SYMI's natives)."""
    from lrmoe.config import ModelConfig
    from lrmoe.ledger import Ledger
    from lrmoe.routing_loads import synthetic_counts
    from lrmoe.sim.analytic import project_policy, symi_slot_choice
    from lrmoe.sim.links import LINKS
    cfg = ModelConfig.from_hf_dict({**get_preset("qwen3-30b-a3b").to_hf_dict(),
                                    "num_experts": 32, "num_hidden_layers": 4})
    G, E = 8, cfg.num_experts
    samples = [synthetic_counts(G, E, 2048, cfg.num_experts_per_tok, 1.0, 0)]
    pops = [c.sum(0) for c in samples]
    link = LINKS["ib"]
    best = {}
    for off in ("device", "host"):
        led = Ledger.for_dtype(cfg, G, 2**40, "bf16", optimizer_offload=off)
        rows = {s: project_policy("symi", cfg, led, samples, link, 440e12, slots_per_rank=s)
                for s in range(E // G, E + 1)}
        # the choice prices the plan, not the (measured, noisy) planning time
        ms = {s: r["modelled_layer_ms"] - r["modelled_stages_ms"]["plan"]
              for s, r in rows.items()}
        best[off] = min(ms, key=lambda s: (ms[s], -s))
        assert symi_slot_choice(cfg, led, samples, pops, link, 440e12)[0] == best[off]
    assert best["host"] != best["device"]


def test_offload_check_benchmark_logic(tmp_path):
    """tests/gpu/offload_check.py (the GPU check) on the CPU at tiny shapes."""
    import json

    from dist_util import load_benchmark

    mod = load_benchmark("offload_check", "tests/gpu")
    out = tmp_path / "oc"
    assert mod.main(["--out", str(out), "--preset", "tiny-qwen3", "--device", "cpu",
                     "--steps", "4", "--batch-size", "4", "--seq-len", "32",
                     "--max-data-bytes", "200000", "--threads", "1", "--repeats", "2"]) == 0
    res = json.loads((out / "offload_check.json").read_text())
    assert set(res["modes"]) == {"device_0", "host_0", "device_1", "host_1"}
    sm = res["summary"]
    assert 0 <= sm["max_rel_train_loss_diff_device_vs_host"] < 1e-4
    assert sm["max_rel_train_loss_diff_within_mode"] == 0  # CPU fp32 is deterministic
    assert sm["mean_rel_train_loss_diff_within_mode"] == 0
    assert 0 <= sm["mean_rel_train_loss_diff_device_vs_host"] < 1e-4
    assert sm["device"]["final_val_min"] == sm["device"]["final_val_max"]
    assert sorted(p.name for p in out.iterdir()) == ["offload_check.json", "offload_check.md"]
    assert "host" in (out / "offload_check.md").read_text()
    # the verdict: host's mean against the device runs' range
    modes = {"d0": {"mode": "device", "final_val_loss": 2.0},
             "d1": {"mode": "device", "final_val_loss": 2.1},
             "h0": {"mode": "host", "final_val_loss": 2.3}}
    losses = {"d0": [1.0], "d1": [1.0], "h0": [1.1]}
    assert mod.summarize(modes, losses)["host_mean_outside_device_range"]
    modes["h0"]["final_val_loss"] = 2.05
    assert not mod.summarize(modes, losses)["host_mean_outside_device_range"]
    assert mod.main(["--out", str(out), "--device", "cpu"]) == 2  # never overwrites
    assert mod.main(["--out", str(tmp_path / "new"), "--seeds", "0,x"]) == 2
    assert not (tmp_path / "new").exists()


def test_offload_check_pairs_the_modes_by_seed(tmp_path):
    """The paired verdict: host − device per seed over each mode's repeats, its mean and
    the t interval; a run at two seeds names and seeds its runs."""
    import json
    import math

    from dist_util import load_benchmark

    mod = load_benchmark("offload_check", "tests/gpu")
    modes = {}
    for s, (dev, host) in enumerate([((2.0, 2.2), 2.2), ((3.0, 3.0), 3.2), ((1.0, 1.0), 1.3)]):
        for r, v in enumerate(dev):
            modes[f"device_s{s}_{r}"] = {"mode": "device", "seed": s, "final_val_loss": v}
        modes[f"host_s{s}_0"] = {"mode": "host", "seed": s, "final_val_loss": host}
    pr = mod.paired(modes)
    diffs = pr["host_minus_device_by_seed"]
    assert list(diffs) == [0, 1, 2]
    assert [round(d, 12) for d in diffs.values()] == [0.1, 0.2, 0.3]
    assert math.isclose(pr["mean"], 0.2)
    half = 4.303 * 0.1 / math.sqrt(3)
    assert math.isclose(pr["ci95"][0], 0.2 - half) and math.isclose(pr["ci95"][1], 0.2 + half)
    one = mod.paired({k: v for k, v in modes.items() if v["seed"] == 0})
    assert one["ci95"] is None and math.isclose(one["mean"], 0.1)

    out = tmp_path / "oc"
    assert mod.main(["--out", str(out), "--preset", "tiny-qwen3", "--device", "cpu",
                     "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                     "--max-data-bytes", "200000", "--threads", "1", "--repeats", "1",
                     "--seeds", "0,1"]) == 0
    res = json.loads((out / "offload_check.json").read_text())
    assert {k: v["seed"] for k, v in res["modes"].items()} == {
        "device_s0_0": 0, "host_s0_0": 0, "device_s1_0": 1, "host_s1_0": 1}
    v = {k: m["final_val_loss"] for k, m in res["modes"].items()}
    assert v["device_s0_0"] != v["device_s1_0"]  # the seed reached the run
    sm = res["summary"]
    assert sorted(sm["paired"]["host_minus_device_by_seed"]) == ["0", "1"]
    # runs are compared within a seed only: no two runs of one mode share one here, and
    # host against device at the same seed agrees as on one seed
    assert sm["max_rel_train_loss_diff_within_mode"] is None
    assert 0 <= sm["max_rel_train_loss_diff_device_vs_host"] < 1e-4
    assert "per seed" in (out / "offload_check.md").read_text()


# ----------------------------------------------------------------------------- bf16 on device
def _bf16_grads(model, seed: int) -> None:
    """Give every parameter a gradient that bf16 holds exactly (its own dtype)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16).to(p.dtype)


def test_host_offload_keeps_only_bf16_expert_weights_and_grads_on_the_device():
    """compute_dtype=bf16: the device holds the experts in bf16 (weights and gradients);
    the fp32 masters and moments are host state, updated as fp32 AdamW on the same
    gradients would update fp32 weights; the device weight is the master rounded."""
    ref, off = _model(), _model()
    ropt = build_optimizer(ref, 3e-3, 0.1)
    opt = build_optimizer(off, 3e-3, 0.1, offload="host", compute_dtype=torch.bfloat16)
    experts = offloaded_params(off)
    assert experts and all(p.dtype == torch.bfloat16 for p in experts)
    assert all(p.dtype == torch.float32 for p in off.parameters() if id(p) not in
               {id(e) for e in experts})
    for step in range(3):
        _bf16_grads(ref, step)
        _bf16_grads(off, step)
        assert all(p.grad.dtype == torch.bfloat16 for p in experts)
        ropt.step()
        opt.step()
    for (n, a), b in zip(ref.named_parameters(), off.parameters()):
        if id(b) in {id(e) for e in experts}:
            st = opt.state[b]
            assert {st[k].dtype for k in ("master", "exp_avg", "exp_avg_sq")} == {torch.float32}
            assert st["master"].device.type == "cpu"
            torch.testing.assert_close(st["master"], a.detach(), rtol=1e-5, atol=1e-6, msg=n)
            assert torch.equal(b.detach(), st["master"].to(torch.bfloat16)), n
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=n)


def test_bf16_offload_state_reloads_exactly():
    """The fp32 master travels in the optimizer state (checkpoints carry it): a reload
    restores it and the moments bit for bit, not from the bf16 device weight."""
    model = _model()
    opt = build_optimizer(model, 3e-3, 0.1, offload="host", compute_dtype=torch.bfloat16)
    for step in range(2):
        _bf16_grads(model, step)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    fresh = _model()
    fopt = build_optimizer(fresh, 3e-3, 0.1, offload="host", compute_dtype=torch.bfloat16)
    fresh.load_state_dict(model.state_dict())
    fopt.load_state_dict(saved)
    for p, q in zip(offloaded_params(model), offloaded_params(fresh)):
        for k in ("master", "exp_avg", "exp_avg_sq", "step"):
            assert fopt.state[q][k].dtype == torch.float32 and fopt.state[q][k].device.type == "cpu"
            assert torch.equal(fopt.state[q][k], opt.state[p][k]), k
        assert not torch.equal(fopt.state[q]["master"], q.detach().float())  # not re-read
    _bf16_grads(model, 9)
    _bf16_grads(fresh, 9)
    opt.step()
    fopt.step()
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


def test_loaded_host_state_is_allocated_as_a_fresh_runs(monkeypatch):
    """A reload puts the masters in memory from the allocation a fresh run's masters and
    gradient buffers come from (pinned when the parameters are on CUDA:
    ``tests/gpu/test_gpu_offload.py``), the moments in a fresh run's pageable memory,
    and continues bit for bit."""
    made = []  # kept alive, so no other tensor can reuse an address

    def recorded(self, like, dtype=torch.float32):
        made.append(real(self, like, dtype))
        return made[-1]
    real = HostOffloadAdamW._host_empty
    monkeypatch.setattr(HostOffloadAdamW, "_host_empty", recorded)
    model = _model()
    opt = build_optimizer(model, 3e-3, 0.1, offload="host", compute_dtype=torch.bfloat16)
    for step in range(2):
        _bf16_grads(model, step)
        opt.step()
    fresh = _model(seed=7)
    fopt = build_optimizer(fresh, 3e-3, 0.1, offload="host", compute_dtype=torch.bfloat16)
    fresh.load_state_dict(model.state_dict())
    fopt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for m in (model, fresh):
        _bf16_grads(m, 9)
    opt.step()
    fopt.step()
    pinnable = {t.untyped_storage().data_ptr() for t in made}
    for o, m in ((opt, model), (fopt, fresh)):
        for p in offloaded_params(m):
            st = o.state[p]
            assert st["master"].untyped_storage().data_ptr() in pinnable
            assert o._grad_buf[id(p)].untyped_storage().data_ptr() in pinnable
            for k in ("exp_avg", "exp_avg_sq"):
                assert st[k].untyped_storage().data_ptr() not in pinnable, k
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


def test_train_with_bf16_device_experts_resumes_bit_exact(tmp_path, monkeypatch):
    """The trainer's CUDA setting (bf16 expert weights on the device, fp32 masters on
    the host) forced on the CPU: a resumed run repeats the uninterrupted one bit for bit
    (the masters come back from the checkpoint, not from the bf16 weights), and its
    checkpoint evaluates on a fresh model."""
    from pathlib import Path

    import lrmoe.train.loop as loop
    from lrmoe.commands.eval import evaluate_run
    from lrmoe.train import TrainConfig, train
    from lrmoe.train.metrics import read_metrics

    real = loop.build_optimizer

    def bf16(*a, **k):
        return real(*a, **{**k, "compute_dtype": torch.bfloat16})
    monkeypatch.setattr(loop, "build_optimizer", bf16)
    base = dict(preset="tiny-qwen3", steps=4, batch_size=2, seq_len=32, max_data_bytes=100_000,
                eval_batches=1, eval_every=0, ckpt_every=2, threads=1, warmup=1,
                optimizer_offload="host")
    a = train(TrainConfig.from_flat(out=str(tmp_path / "a"), **base))
    train(TrainConfig.from_flat(out=str(tmp_path / "b"), stop_after=2, **base))
    b = train(TrainConfig.from_flat(out=str(tmp_path / "b"), resume=True, **base))
    losses = [[r["loss"] for r in read_metrics(tmp_path / x / "metrics.jsonl")
               if r["kind"] == "train"] for x in ("a", "b")]
    assert losses[0] == losses[1] and a["final_val_loss"] == b["final_val_loss"]
    assert evaluate_run(Path(a["run_dir"]))["val_loss"] == pytest.approx(a["final_val_loss"],
                                                                         rel=1e-6)


def _autocast_step(model, opt, ids, clip: float) -> Tensor:
    """The trainer's step under CUDA's numerics, on the CPU: bf16 autocast, backward, the
    trainer's clip (with the optimizer's ``scale_grads`` where it has one), AdamW."""
    from lrmoe.parallel.groups import ParallelContext, clip_grad_norm

    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, obj = model.loss(ids[:, :-1], ids[:, 1:])
    obj.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    assert clip_grad_norm(model, clip, ParallelContext(), getattr(opt, "scale_grads", None)) > clip
    opt.step()
    return grads


def test_bf16_host_offload_follows_the_device_path_under_autocast():
    """The trainer's CUDA setting on the CPU, several clipped steps on fresh inputs. Under
    bf16 autocast the device path (fp32 expert weights) computes its experts in bf16
    too, so both paths get the same bf16 expert gradients; the device path widens them
    to fp32 and clips there, and the host path must clip the same fp32 values (a clip
    multiplied into the bf16 gradient in place rounds every product to bf16). Then the
    masters are the device path's fp32 weights bit for bit, and the device weights their
    rounding. The reference steps its fp32 experts with the host path's AdamW kernel
    (``offload="host"`` on fp32 weights; it equals torch's AdamW, as tested above): one
    rounding apart, the bf16 forward of the next step would differ and the trajectories
    part."""
    ref, off = _model(), _model()
    ropt = build_optimizer(ref, 3e-3, 0.1, offload="host")
    opt = build_optimizer(off, 3e-3, 0.1, offload="host", compute_dtype=torch.bfloat16)
    experts = {id(p) for p in offloaded_params(off)}
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (4, 33), generator=gen)
        # clip at a tenth of the norm: every gradient is scaled, by a coefficient far from 1
        g_ref = _autocast_step(ref, ropt, ids, 0.1)
        g_off = _autocast_step(off, opt, ids, 0.1)
        for (n, a), b in zip(ref.named_parameters(), off.parameters()):
            assert torch.equal(g_off[n], g_ref[n]), n  # the same bf16 expert compute
            if id(b) in experts:
                assert torch.equal(opt.state[b]["master"], a.detach()), n
                assert torch.equal(b.detach(), a.detach().to(torch.bfloat16)), n
            else:
                assert torch.equal(b, a), n


def test_trainer_clips_bf16_offloaded_gradients_on_the_host(tmp_path, monkeypatch):
    """The trainer under CUDA's numerics on the CPU (bf16 autocast; host offload with bf16
    device experts against fp32 experts stepped by the same AdamW kernel): its clip hands
    the bf16 gradients' coefficient to the host, so the clipped runs train alike, loss
    for loss."""
    import lrmoe.train.loop as loop
    from lrmoe.train import TrainConfig, train
    from lrmoe.train.metrics import read_metrics

    real, bf16 = loop.build_optimizer, [False]

    def build(*a, **k):
        return real(*a, **{**k, "compute_dtype": torch.bfloat16 if bf16[0] else None})
    monkeypatch.setattr(loop, "build_optimizer", build)
    monkeypatch.setattr(loop, "make_autocast",
                        lambda device: lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    base = dict(preset="tiny-qwen3", steps=3, batch_size=2, seq_len=32, max_data_bytes=100_000,
                eval_batches=1, eval_every=0, ckpt_every=0, threads=1, warmup=1,
                optimizer_offload="host")
    rows = {}
    for name in ("fp32", "bf16"):
        bf16[0] = name == "bf16"
        train(TrainConfig.from_flat(out=str(tmp_path / name), **base))
        rows[name] = [r for r in read_metrics(tmp_path / name / "metrics.jsonl")
                      if r["kind"] == "train"]
    assert all(r["grad_norm"] > 1.0 for r in rows["fp32"])  # every step clipped
    assert [r["loss"] for r in rows["bf16"]] == [r["loss"] for r in rows["fp32"]]


@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_clip_is_torchs_global_norm_clip(max_norm):
    """One process: the trainer's clip against ``torch.nn.utils.clip_grad_norm_`` (the
    returned norm and every clipped gradient), a parameter without a gradient left out."""
    from lrmoe.parallel.groups import ParallelContext, clip_grad_norm

    torch.manual_seed(0)
    model = MoEForCausalLM(get_preset("tiny-qwen3"))
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    model.loss(ids[:, :-1], ids[:, 1:])[1].backward()
    model.embed_tokens.weight.grad = None
    ref = {}  # copies for torch's clip: each parameter with a gradient, and its gradient
    for n, p in model.named_parameters():
        if p.grad is not None:
            ref[n] = torch.nn.Parameter(p.detach().clone())
            ref[n].grad = p.grad.clone()
    norm = clip_grad_norm(model, max_norm, ParallelContext())
    want = torch.nn.utils.clip_grad_norm_(list(ref.values()), max_norm)
    assert norm == pytest.approx(float(want), rel=1e-6) and norm > 0.05
    assert model.embed_tokens.weight.grad is None
    for n, p in model.named_parameters():
        if n in ref:
            torch.testing.assert_close(p.grad, ref[n].grad, rtol=1e-5, atol=1e-8)
