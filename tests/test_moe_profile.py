"""The stage profile of issue 16 (``benchmarks/moe_profile.py`` + ``profile_parse.py``):
the kernel-name classifier, the per-iteration time summary of a Chrome trace, the memory
peak found in an allocator trace and its attribution, all on synthetic data; and the
script end to end on the CPU (``--smoke``) with bad input answered by exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dist_util import load_benchmark

pp = load_benchmark("profile_parse")

# real kernel names (abridged where long) as H200 traces of torch 2.11 show them
NAMES = {
    "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel": "gemm",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816_128x64_32x6_tn_align8>": "gemm",
    "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm",
    "triton_tem_fused_mm_0": "gemm",
    "aten::_grouped_mm": "gemm",
    "triton_poi_fused_mul_silu_slice_0": "activation",
    "triton_poi_fused__to_copy_add_cat_mul_rsub_sigmoid_silu_backward_0": "activation",
    "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(...)>": "activation",
    "void at_cuda_detail::cub::detail::radix_sort::DeviceRadixSortOnesweepKernel<...>": "routing",
    "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>": "routing",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>": "routing",
    "void at::native::elementwise_kernel_with_index<int, at::native::arange_cuda_out>": "routing",
    "void compute_cuda_kernel<long>(long const*, long const*, long*, long, long)": "routing",
    "triton_red_fused__to_copy_index_mul_sum_unsqueeze_0": "gather_scatter_copy",
    "triton_poi_fused__to_copy_index_mul_unsqueeze_0": "gather_scatter_copy",
    "void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int)": "gather_scatter_copy",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel>": "gather_scatter_copy",
    "void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>": "gather_scatter_copy",
    "Memcpy DtoH (Device -> Pinned)": "gather_scatter_copy",
    "triton_poi_fused__to_copy_0": "gather_scatter_copy",
    "triton_poi_fused_clone_permute_1": "gather_scatter_copy",
    "aten::index_add_": "gather_scatter_copy",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, sum_functor>>": "reduction",
    "triton_red_fused__to_copy_sum_0": "reduction",
    "triton_per_fused_mul_sum_2": "reduction",
    "aten::sum": "reduction",
    "Memset (Device)": "memset_fill",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "memset_fill",
    "void at::native::vectorized_elementwise_kernel<8, BinaryFunctor<MulFunctor<float>>>": "elementwise",
    "triton_poi_fused_add_mul_3": "elementwise",
    "aten::mul": "elementwise",
    "aten::view": "other",
    "ExpertExchangeBackward": "other",
}


def test_classifier_on_real_kernel_names():
    got = {n: pp.classify(n) for n in NAMES}
    assert got == NAMES
    # every category is exercised, so a broken regex shows up as a mismatch above
    assert set(NAMES.values()) == {*pp.CATEGORIES, pp.OTHER}


def _trace(iters=2):
    """Two iterations; each launches a GEMM and a SiLU in forward, a gather and a GEMM in
    backward (one inside a ``stage:experts`` range); kernels run ``lag`` µs after launch,
    so two start outside the range that launched them (placed by launch, not start)."""
    ev, corr, t = [], 0, 1000.0

    def ann(name, a, b):
        ev.append(dict(ph="X", cat="user_annotation", name=name, pid=1, tid=1, ts=a, dur=b - a))

    def kern(name, launch, dur, with_corr=True, lag=5):
        nonlocal corr
        corr += 1
        ev.append(dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", pid=1, tid=1, ts=launch,
                       dur=2, args=dict(correlation=corr)))
        ev.append(dict(ph="X", cat="kernel", name=name, pid=0, tid=7, ts=launch + lag, dur=dur,
                       args=dict(correlation=corr) if with_corr else {}))

    kern("sm90_xmma_gemm_warmup", 900, 50)  # before the first iteration: not counted
    for _ in range(iters):
        ann(pp.ITER, t, t + 400)
        ann(pp.FWD, t, t + 150)
        kern("nvjet_gemm_fwd", t + 10, 100)
        kern("triton_poi_fused_mul_silu_0", t + 20, 20)   # overlaps the GEMM on the device
        kern("triton_per_fused_sum_0", t + 140, 10, lag=25)  # runs after the forward range
        ann(pp.BWD, t + 160, t + 390)
        ann("stage:experts", t + 165, t + 200)
        kern("vectorized_gather_kernel", t + 170, 30, lag=40)  # runs after the stage range
        kern("cutlass_gemm_bwd", t + 250, 60, with_corr=False)  # placed by its own start
        t += 1000
    ev.append(dict(ph="X", cat="cpu_op", name="aten::mm", pid=1, tid=1, ts=t, dur=5))
    return ev


def test_summarize_per_iteration_categories_phases_and_busy():
    s = pp.summarize(_trace(2), 2)
    c = s["categories"]
    assert s["source"] == "device kernels"
    assert c["gemm"]["ms"] == pytest.approx(0.160)          # 100 + 60 µs per iteration, not the warm-up
    assert c["gemm"]["fwd_ms"] == pytest.approx(0.100)
    assert c["gemm"]["bwd_ms"] == pytest.approx(0.060)
    assert c["activation"]["fwd_ms"] == pytest.approx(0.020)
    assert c["gather_scatter_copy"]["bwd_ms"] == pytest.approx(0.030)
    assert c["reduction"]["fwd_ms"] == pytest.approx(0.010)
    assert c["gemm"]["calls"] == pytest.approx(2)
    assert s["total_ms"] == pytest.approx(0.220)
    assert s["stages"] == {"stage:experts": pytest.approx(0.030)}
    # busy = union: GEMM [15,115] holds the SiLU [25,45]; sum [165,175]; gather [210,240];
    # GEMM [255,315]
    assert s["busy_ms"] == pytest.approx(0.200)
    assert s["span_ms"] == pytest.approx(0.300)
    assert list(s["kernels"])[0] == "nvjet_gemm_fwd"
    with pytest.raises(ValueError, match="expected 3"):
        pp.summarize(_trace(2), 3)


def test_cpu_ops_counted_by_self_time():
    ev = [dict(ph="X", cat="user_annotation", name=n, pid=1, tid=1, ts=0, dur=100)
          for n in (pp.ITER, pp.FWD)]
    ev += [dict(ph="X", cat="cpu_op", name="aten::linear", pid=1, tid=1, ts=10, dur=50),
           dict(ph="X", cat="cpu_op", name="aten::mm", pid=1, tid=1, ts=12, dur=30),
           dict(ph="X", cat="cpu_op", name="aten::empty", pid=1, tid=1, ts=13, dur=4),
           dict(ph="X", cat="cpu_op", name="aten::silu", pid=1, tid=1, ts=61, dur=7)]
    s = pp.summarize(ev, 1)
    assert s["source"].startswith("CPU")
    k = s["kernels"]
    assert k["aten::linear"]["ms"] == pytest.approx(0.020)
    assert k["aten::mm"]["ms"] == pytest.approx(0.026)
    assert s["categories"]["activation"]["fwd_ms"] == pytest.approx(0.007)
    assert s["busy_ms"] is None


def _frame(name, filename="/x/lrmoe/ops/experts.py", line=1):
    return dict(name=name, filename=filename, line=line)


def _alloc(addr, size, where, phase_frames=()):
    return dict(action="alloc", addr=addr, size=size, frames=[_frame(where), *phase_frames])


def _free(addr, size):
    return [dict(action="free_requested", addr=addr, size=size),
            dict(action="free_completed", addr=addr, size=size)]


def _mem_trace():
    """Forward keeps A (100) and B (50); backward allocates C (300) then frees B and C,
    allocates D (20, a gradient that stays) at B's old address; an older block (addr 9)
    is freed. Peak = 450 just after C; a later moment has more blocks but fewer bytes."""
    t = [_alloc(1, 999, "before"), _alloc(90, 512, pp.MARK_START)]
    t += [_alloc(10, 100, "fwd_a"), _alloc(20, 50, "fwd_b"), _alloc(91, 512, pp.MARK_FWD)]
    t += [_alloc(30, 300, "bwd_c")]
    t += _free(20, 50) + _free(30, 300)
    t += [_alloc(20, 20, "grad_d"), _alloc(40, 10, "t1"), _alloc(50, 10, "t2")]
    t += _free(9, 40) + _free(40, 10) + _free(50, 10)
    t += [_alloc(92, 512, pp.MARK_END), _alloc(60, 7000, "after")]
    return t


def test_replay_finds_the_peak_and_who_holds_it():
    rep = pp.replay(_mem_trace())
    assert rep["peak_bytes"] == 450
    assert rep["free_action"] == "free_completed"
    held = {b["frames"][0]["name"]: (b["size"], b["phase"], b["left_after"]) for b in rep["blocks"]}
    assert held == {"fwd_a": (100, "forward", True), "fwd_b": (50, "forward", False),
                    "bwd_c": (300, "backward", False)}
    att = pp.attribute(rep, ("/lrmoe/",))
    assert att["split"] == dict(forward_kept=150, backward=300, left_after=100)
    assert [s["bytes"] for s in att["sites"].values()] == [300, 100, 50]
    assert next(iter(att["sites"])).startswith("ops/experts.py:1 bwd_c")


def test_replay_uses_the_last_markers_and_requested_frees_when_no_completions():
    old = _mem_trace()
    t = [e for e in old if e["action"] != "free_completed"]
    rep = pp.replay(old[:4] + t)  # an earlier recording's start marker is still in the history
    assert rep["free_action"] == "free_requested"
    assert rep["peak_bytes"] == 450
    with pytest.raises(ValueError, match="markers"):
        pp.replay([e for e in old if pp.MARK_FWD not in str(e.get("frames"))])


def test_peak_counts_frees_of_older_blocks():
    """A block allocated before the call and freed during it lowers the total: the true
    peak is the forward transient X (start + 360), not C (start + 450 - 200)."""
    t = [_alloc(90, 512, pp.MARK_START), _alloc(10, 100, "a"), _alloc(11, 260, "x"), *_free(11, 260),
         _alloc(12, 50, "b"), *_free(9, 200), _alloc(91, 512, pp.MARK_FWD), _alloc(13, 300, "c"),
         _alloc(92, 512, pp.MARK_END)]
    rep = pp.replay(t)
    assert rep["peak_bytes"] == 360
    assert sorted(b["frames"][0]["name"] for b in rep["blocks"]) == ["a", "x"]


def test_site_of_prefers_our_frames_with_callers():
    frames = [_frame("empty", "/t/torch/_tensor.py", 3), _frame("_gmm", "/x/lrmoe/ops/experts.py", 47),
              _frame("swiglu_forward", "/x/lrmoe/ops/experts.py", 90),
              _frame("apply", "/t/torch/autograd.py", 5),
              _frame("forward", "/x/lrmoe/parallel/exchange.py", 300),
              _frame("fwd", "/x/lrmoe/model/moe.py", 1)]
    s = pp.site_of(frames, ("/lrmoe/",))
    assert s == ("ops/experts.py:47 _gmm <- ops/experts.py:90 swiglu_forward"
                 " <- parallel/exchange.py:300 forward")
    assert pp.site_of(frames[:1] + [_frame("f", "libc.so", 0)], ("/lrmoe/",)).startswith("torch/_tensor.py:3")
    assert pp.site_of([], ("/lrmoe/",)).startswith("<no Python frame")


BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(*args):
    return subprocess.run([sys.executable, str(BENCH / "moe_profile.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=600)


def test_smoke_run_writes_profile(tmp_path):
    pytest.importorskip("transformers")
    p = _run("--smoke", "--out", tmp_path, "--shapes", "qwen3", "--tokens", "32", "--iters", "1",
             "--warmup", "0", "--compile-backend", "eager")
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads((tmp_path / "moe_profile.json").read_text())["results"]
    assert len(rows) == 1
    r = rows[0]
    for v in ("ours", "ours_rg_experts", "hf_compiled"):
        assert "error" not in r[v], r[v]
        assert r[v]["time"]["categories"]["gemm"]["ms"] > 0
        assert r[v]["time"]["categories"]["gemm"]["bwd_ms"] > 0
        assert "CUDA" in r[v]["memory"]["error"]
    assert r["hf_compiled"]["rel_err_vs_ours"] < 2e-2
    md = (tmp_path / "moe_profile.md").read_text()
    assert "| gemm |" in md and "top unclassified" in md and "memory not measured" in md
    assert "Ours minus HF compiled, largest first: " in md
    assert all("needs CUDA" in r[v]["syncs"]["error"] for v in ("ours", "hf_compiled"))
    assert "Host synchronizations in one forward+backward" in md


def test_sync_sites_name_the_innermost_repository_frame():
    """Each sync is charged to the innermost frame in lrmoe / this repo (not torch's own
    frames below it), most frequent first."""
    import os

    import lrmoe
    mp = load_benchmark("moe_profile")
    pkg = os.path.dirname(lrmoe.__file__)
    torch_frame = "/usr/lib/python3/site-packages/torch/_tensor.py:100 __bool__"
    gather = [f"{pkg}/model/moe.py:95 _routed", f"{pkg}/parallel/comm.py:25 all_gather_counts"]
    recs = [["/x/runpy.py:1 main", *gather, torch_frame]] * 3
    recs += [["/x/runpy.py:1 main", f"{pkg}/parallel/layout.py:43 ranges"], [torch_frame]]
    got = mp.sync_sites(recs)
    assert got["count"] == 5
    assert got["sites"][0] == (f"{pkg}/parallel/comm.py:25 all_gather_counts", 3)
    assert (f"{pkg}/parallel/layout.py:43 ranges", 1) in got["sites"]
    assert (torch_frame, 1) in got["sites"]  # no repository frame: the innermost one
    assert len(mp.sync_sites(recs, top=1)["sites"]) == 1


@pytest.mark.parametrize("bad", [("--shapes", "qwen4"), ("--tokens", "x"), ("--iters", "0")])
def test_bad_input_exit_2_and_no_output(tmp_path, monkeypatch, capsys, bad):
    mp = load_benchmark("moe_profile")
    monkeypatch.setattr(sys, "argv", ["moe_profile.py", "--smoke", "--out", str(tmp_path / "o"), *bad])
    with pytest.raises(SystemExit) as e:
        mp.main()
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("moe_profile.py: error:") and bad[0] in last
    assert not (tmp_path / "o").exists()


def test_memory_pass_glue_with_a_fake_allocator(monkeypatch):
    """The CUDA-only memory pass, its snapshot reading and its markdown, driven by a fake
    allocator history on the CPU (the real one is exercised on the GPU run)."""
    import torch
    mp = load_benchmark("moe_profile")
    calls = []
    monkeypatch.setattr(mp.ml, "DEV", "cuda")
    for f, v in dict(synchronize=None, reset_peak_memory_stats=None, memory_allocated=1000,
                     max_memory_allocated=1450, current_device=0).items():
        monkeypatch.setattr(torch.cuda, f, lambda *a, _v=v, **k: _v)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **k: calls.append(k))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: dict(device_traces=[_mem_trace()]))
    for m in ("_mark_start", "_mark_forward_end", "_mark_end"):
        monkeypatch.setattr(mp, m, lambda: None)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    a = type("A", (), dict(stacks="python", max_entries=10))()
    m = mp.profile_memory(lin, x, torch.ones(2, 4), a, lambda: None)
    assert calls[0]["clear_history"] and calls[-1] == dict(enabled=None)
    assert m["peak_bytes"] == 450 and m["allocator_peak_bytes"] == 450
    assert m["split"] == dict(forward_kept=150, backward=300, left_after=100)
    row = {v: dict(memory=m) for v in mp.VARIANTS}
    md = "\n".join(mp.memory_lines(row))
    assert "bwd_c" in md and "| peak (max_memory_allocated) |" in md
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: dict(device_traces=[_mem_trace()[3:]]))
    m = mp.profile_memory(lin, x, torch.ones(2, 4), a, lambda: None)
    assert "could not be read" in m["error"] and m["allocator_peak_bytes"] == 450
    monkeypatch.delattr(torch.cuda.memory, "_record_memory_history")
    assert "lacks" in mp.profile_memory(lin, x, torch.ones(2, 4), a, lambda: None)["error"]
