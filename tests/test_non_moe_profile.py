"""benchmarks/non_moe_profile.py: splitting a step's non-MoE wall by category, on a
synthetic CUDA-like trace (every number known), and the ranges ``bench ttl`` emits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import non_moe_profile as nm  # noqa: E402

MAIN, BWD = 1, 2  # host threads: main and autograd


class _Trace:
    def __init__(self):
        self.ev, self.corr = [], 0

    def rng(self, name, ts, dur, tid=MAIN):
        self.ev.append({"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur,
                        "tid": tid})

    def op(self, name, ts, dur, tid=MAIN, seq=None):
        args = {} if seq is None else {"Sequence number": seq}
        self.ev.append({"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur,
                        "tid": tid, "args": args})

    def kernel(self, name, launch_ts, ts, dur, tid=MAIN):
        """A kernel launched at ``launch_ts`` (inside the op there) running [ts, ts+dur)."""
        self.corr += 1
        self.ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                        "ts": launch_ts, "dur": 0.5, "tid": tid, "args": {"correlation": self.corr}})
        self.ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                        "tid": "stream 7", "args": {"correlation": self.corr}})

    def sync(self, ts, dur, tid=MAIN):
        self.ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize",
                        "ts": ts, "dur": dur, "tid": tid, "args": {}})

    def dump(self):
        return {"traceEvents": self.ev}


def _step(t: _Trace, t0: float) -> None:
    """One step of 1000 us: forward 0-300 (attention 0-100 with a projection and SDPA;
    MoE 100-250 whose router part is 100-120), backward 300-700 (SDPA's backward 320-360
    on the autograd thread; the MoE backward 400-600), clip 700-800, optimizer 800-1000
    (host step 900-1000)."""
    t.rng("ttl:step", t0, 1000)
    t.rng("step:forward", t0, 300)
    t.rng("mod:Attention", t0, 100)
    t.rng("mod:Linear", t0 + 5, 20)
    t.op("aten::linear", t0 + 6, 10, seq=1)
    t.kernel("nvjet_gemm", t0 + 8, t0 + 10, 30)  # projection 10-40
    t.op("aten::scaled_dot_product_attention", t0 + 30, 10, seq=2)
    t.kernel("flash_fwd_kernel", t0 + 32, t0 + 40, 20)  # SDPA 40-60; idle 60-100
    t.rng("mod:MoELayer", t0 + 100, 150)
    t.rng("ttl:moe_forward", t0 + 100, 150)
    t.rng("stage:route", t0 + 100, 10)
    t.op("aten::linear", t0 + 101, 5, seq=3)
    t.kernel("router_gemm", t0 + 102, t0 + 105, 15)  # runs past its range: 105-120
    t.op("aten::mm", t0 + 130, 5, seq=4)
    t.kernel("expert_gemm", t0 + 131, t0 + 130, 100)  # MoE: excluded
    t.rng("step:backward", t0 + 300, 400)
    t.op("autograd::engine::evaluate_function: ScaledDotProductFlashAttentionBackward0",
         t0 + 310, 20, tid=BWD, seq=2)
    t.kernel("flash_bwd_kernel", t0 + 312, t0 + 320, 40, tid=BWD)  # 320-360
    t.op("autograd::engine::evaluate_function: ExpertExchangeBackward", t0 + 400, 200,
         tid=BWD, seq=9)
    t.kernel("expert_bwd", t0 + 401, t0 + 400, 190, tid=BWD)
    t.op("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", t0 + 610,
         5, tid=BWD)
    t.kernel("copy_kernel", t0 + 611, t0 + 620, 10, tid=BWD)  # 620-630
    t.rng("step:clip", t0 + 700, 100)
    t.op("aten::_foreach_norm", t0 + 701, 5)
    t.kernel("multi_tensor_apply", t0 + 702, t0 + 710, 80)  # 710-790
    t.kernel("multi_tensor_apply", t0 + 703, t0 + 780, 15)  # overlaps: only 790-795 counts
    t.rng("step:optimizer", t0 + 800, 200)
    t.op("aten::_foreach_add_", t0 + 801, 5)
    t.kernel("multi_tensor_apply", t0 + 802, t0 + 810, 40)  # 810-850; idle 850-900
    t.rng(nm.HOST_STEP, t0 + 900, 100)
    t.op("aten::_fused_adamw_", t0 + 901, 5)
    t.kernel("fused_adamw", t0 + 902, t0 + 910, 50)  # 910-960, idle 960-1000
    t.sync(t0 + 955, 10)


@pytest.fixture
def steps():
    t = _Trace()
    _step(t, 0.0)
    _step(t, 5000.0)
    return nm.analyse(t.dump(), skip=1)["steps"]


def test_one_step_split(steps):
    assert len(steps) == 1
    s = steps[0]
    # MoE wall: forward 100-250 less the router (100-120), backward 400-600
    assert s["moe_wall_ms"] == pytest.approx((130 + 200) / 1e3)
    assert s["non_moe_ms"] == pytest.approx((1000 - 330) / 1e3)
    assert s["host_step_ms"] == pytest.approx(0.1)
    c = {k: v * 1e3 for k, v in s["categories"].items()}
    assert c["attention projections (fwd)"] == pytest.approx(30)
    assert c["attention SDPA (fwd)"] == pytest.approx(20)
    assert c["attention SDPA (bwd)"] == pytest.approx(40)  # by the forward op's ranges
    assert c["routers, aux loss, shared experts (fwd)"] == pytest.approx(15)
    assert c["gradient accumulation (AccumulateGrad)"] == pytest.approx(10)
    assert c["gradient clipping"] == pytest.approx(80 + 5)
    assert c["optimizer: AdamW on the device"] == pytest.approx(40)
    assert c["optimizer: experts' host step (excluded: host_s)"] == pytest.approx(100)
    # idle: backward 300-320, 360-400, 600-620, 630-700; clip, optimizer; the host
    # step's idle 900-910 and 960-1000 is the host step's
    # idle: forward 0-10, 60-105 (the router kernel starts at 105), 250-300
    assert c["host gap (device idle): forward"] == pytest.approx(10 + 45 + 50)
    assert c["host gap (device idle): backward"] == pytest.approx(20 + 40 + 20 + 70)
    assert c["host gap (device idle): clip"] == pytest.approx(10 + 5)
    assert c["host gap (device idle): optimizer"] == pytest.approx(10 + 50)
    assert sum(c.values()) == pytest.approx(s["non_moe_ms"] * 1e3)
    assert s["busy_ms"] + s["idle_ms"] == pytest.approx(s["non_moe_ms"])
    assert s["syncs"] == 1


def test_mean_table_and_markdown(steps):
    cats = nm.mean_table(steps + steps)
    assert list(cats)[0] == "host gap (device idle): backward"  # largest first
    md = nm.markdown_table(cats, 4, dense_share=0.2, offload="host")
    # clipping: the dense fifth in full, the experts' 4/5 over 4 ranks
    assert "| gradient clipping | 0.09 | 0.021 | 0.034 |" in md[2 + list(cats).index(
        "gradient clipping")]
    row = md[2 + list(cats).index("optimizer: AdamW on the device")]
    assert "| 0.04 | 0.010 | 0.040 |" in row  # with offload the device step is dense only
    # the host step is charged apart (host_s), neither as non-MoE nor to a real rank here
    assert "| 0.10 | 0.000 | 0.000 |" in md[2 + list(cats).index(
        "optimizer: experts' host step (excluded: host_s)")]
    assert md[-1].startswith("| **total (non-MoE time of the trace)** | **0.67** | **0.143** |")
    real = sum(nm.real_rank_share(k, 4, 0.2, "host")[0] * v for k, v in cats.items())
    assert md[-1].endswith(f"| **{real:.3f}** | |")
    assert nm.real_rank_share("optimizer: AdamW on the device", 4, 0.2, "device")[0] == \
        pytest.approx(0.2 + 0.8 / 4)


def test_cpu_trace_uses_leaf_operators():
    """Without device events each leaf operator stands in for a kernel."""
    t = _Trace()
    t.rng("ttl:step", 0, 100)
    t.rng("step:forward", 0, 100)
    t.rng("mod:RMSNorm", 10, 30)
    t.op("aten::mul", 10, 30)
    t.op("aten::empty", 12, 3)  # a leaf inside mul: mul is not a leaf
    out = nm.analyse(t.dump())
    assert out["cpu_only"]
    c = out["steps"][0]["categories"]
    assert c["norms (fwd)"] == pytest.approx(0.003)
    assert c["host gap (device idle): forward"] == pytest.approx(0.097)


def test_bench_ttl_emits_the_ranges_it_times(tmp_path):
    """The step and MoE ranges come from bench ttl's own loop (not copied here): a tiny
    run under the profiler has one ttl:step per step and one ttl:moe_forward per MoE
    layer and step, and the analysed non-MoE time is close to the recorded one."""
    from lrmoe.sim.ttl import TTLConfig

    cfg = TTLConfig.from_flat(preset="tiny-qwen3", ep=2, policies=("static",), steps=2,
                              batch_size=4, seq_len=16, eval_every=0, eval_batches=1, max_data_bytes=2**16)
    rep, trace = nm.run(cfg, True, lambda m: None)
    tr = nm.Trace(trace)
    steps = tr.named("ttl:step")
    assert len(steps) == 2
    from lrmoe.presets import get_preset
    n_moe = len(get_preset("tiny-qwen3").moe_layers)
    inside = [m for m in tr.named("ttl:moe_forward")
              if any(s.ts <= m.ts and m.end <= s.end for s in steps)]
    assert len(inside) == 2 * n_moe  # (the untimed warm-up step has its own, outside)
    assert {r.name for r in tr.ranges if r.name.startswith("mod:")} >= {
        "mod:Attention", "mod:RMSNorm", "mod:Linear", "mod:MoELayer"}
    an = nm.analyse(trace)
    rec = [r["non_moe_measured_s"] * 1e3 for r in rep["policies"]["static"]["steps"]]
    for s, r in zip(an["steps"], rec):
        assert s["non_moe_ms"] == pytest.approx(r, rel=0.25)
    # module hooks are gone after the run
    assert not torch.nn.modules.module._global_forward_pre_hooks


def test_the_emulators_gradient_assembly_is_inside_the_moe_wall(monkeypatch):
    """The exchange's backward ends (``bwd_end_s``, where bench ttl stops the MoE clock)
    after it has concatenated the G virtual ranks' gradients: that is emulator work no
    real rank does, and must not be charged as non-MoE time."""
    from emulated import EmulatedLayer
    from lrmoe.model.moe import MoELayer
    from lrmoe.policy.static import StaticPolicy
    from lrmoe.presets import get_preset
    from lrmoe.sim import virtual

    cfg = get_preset("tiny-qwen3")
    torch.manual_seed(0)
    v = EmulatedLayer(MoELayer(cfg, 0), 4, StaticPolicy())
    x = torch.randn(4 * 8, cfg.hidden_size, requires_grad=True)
    out = v(x)
    cats: list[float] = []
    real_cat = torch.cat

    def cat(*a, **k):
        r = real_cat(*a, **k)
        cats.append(virtual.time.perf_counter())
        return r
    monkeypatch.setattr(torch, "cat", cat)
    out.sum().backward()
    monkeypatch.setattr(torch, "cat", real_cat)
    assert cats and v.stats.bwd_end_s >= cats[-1]


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert nm.main(["--out", str(tmp_path), "--offload", "gpu", "--device", "cpu"]) == 2
    assert "lrmoe: error: --offload 'gpu'" in capsys.readouterr().err
    assert nm.main(["--out", str(tmp_path), "--steps", "2", "--skip", "2", "--device",
                    "cpu"]) == 2
    assert not (tmp_path / "non_moe_profile.json").exists()


def test_flop_floor_counts_the_non_moe_matmuls():
    """The floor's matmul FLOPs, forward and backward, against torch's FLOP counter on a
    real step of tiny-glm (a dense layer, MoE layers with a shared expert): attention
    projections, routers with shared experts and dense MLPs, and the head alike
    (the experts' grouped GEMMs are not counted by either; the counter does not count
    the CPU's SDPA, whose causal term the floor adds as 2·T·Dq a token forward)."""
    from torch.utils.flop_counter import FlopCounterMode

    from lrmoe.model import MoEForCausalLM
    from lrmoe.presets import get_preset

    cfg = get_preset("tiny-glm")
    B, T = 2, 32
    fl = nm.flop_floor(cfg, B, T, 2.0)
    m = MoEForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1))
    with FlopCounterMode(display=False) as fc:
        m.loss(ids[:, :-1], ids[:, 1:])[1].backward()
    c = {k: sum(v.values()) for k, v in fc.get_flop_counts().items()}
    layers = range(cfg.num_hidden_layers)
    f = fl["flops"]
    assert f["attention projections"] == sum(c[f"MoEForCausalLM.layers.{i}.self_attn"] for i in layers)
    assert f["routers"] + f["dense MLPs and shared experts"] == sum(
        c[f"MoEForCausalLM.layers.{i}.mlp"] for i in layers)
    assert f["head"] == c["MoEForCausalLM.lm_head"]
    Dq = cfg.num_attention_heads * cfg.head_dim
    assert f["attention SDPA"] == 3 * 2 * T * Dq * B * T * cfg.num_hidden_layers
    assert fl["floor_ms"] == pytest.approx(fl["total_flops"] / 2e12 * 1e3)
