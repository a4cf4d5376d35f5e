"""Summarize `lrmoe bench ttl` runs (ttl.json) as markdown, re-applying the link model.

    python benchmarks/summarize_ttl.py benchmarks/results/ttl_gpu_qwen3_v1 [...]

Per policy: steps and emulated time to the target, final validation loss, mean emulated
step and MoE time, routing skew, keep / recompute ratios, budget status; then the same
emulated times with the exchanges re-priced for InfiniBand from the per-step critical
bytes the run recorded (``exchange_critical_bytes``). Everything here is EMULATED.

``--sensitivity``: the lrmoe/symi ratio for other target fractions of the same run.

``--layer-checkpoint`` (for runs made before exact policies could fall back to a
whole-layer checkpoint): static's and symi's plans are rebuilt from the recorded routing
trace (symi with the run's ``s`` and the previous step's popularity; homes split
evenly, which leaves every rank's received pairs unchanged), each (step, layer) is
classified by :meth:`lrmoe.memory.Ledger.exact_fit`, and every step with a layer that
needed the checkpoint is re-charged its forward dispatch + experts + combine stages in
place of the run's per-pair recompute (all layers of that step: an upper estimate).
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

from lrmoe.commands.bench import fmt
from lrmoe.memory import fmt_bytes
from lrmoe.sim.links import Link, get_link
from lrmoe.sim.ttl import time_to_target


def repriced(step: dict, old, new, G: int) -> float:
    """``step_emulated_s`` with every exchange re-priced from ``old`` to ``new`` link."""
    t = step["step_emulated_s"]
    for crit, n in step["exchange_critical_bytes"].values():
        if n:
            t += (crit / new.effective_Bps + n * new.latency_s * (G - 1)
                  - crit / old.effective_Bps - n * old.latency_s * (G - 1))
    return t


def layer_checkpoint_modes(run: Path, rep: dict, name: str) -> list[list[str]]:
    """Per step and MoE layer, ``Ledger.exact_fit``'s mode for static or symi."""
    import torch

    from lrmoe.config import ModelConfig
    from lrmoe.loads import spread_over_homes
    from lrmoe.memory import Ledger
    from lrmoe.policy.plan import full_plan
    from lrmoe.policy.static import native_placement
    from lrmoe.policy.symi import plan_symi

    cfg = ModelConfig.from_hf_dict(rep["model"])
    G, E = rep["config"]["ep"], cfg.num_experts
    led = Ledger.for_dtype(cfg, G, rep["budget_bytes"], "bf16")
    trace = json.loads((run / f"routing_trace_{name}.json").read_text())["steps"]
    s = int(re.match(r"s=(\d+)", rep["policies"][name]["config"]).group(1))
    modes = []
    for t, layers in enumerate(trace):
        row = []
        for li, c in enumerate(layers):
            counts = spread_over_homes(torch.tensor(c), G)
            if name == "static":
                plan = full_plan(counts, native_placement(G, E))
            else:
                prev = torch.tensor(trace[t - 1][li]) if t else None
                plan = plan_symi(counts, s, prev)
            row.append(led.exact_fit(plan)[0])
        modes.append(row)
    return modes


def with_layer_checkpoint(run: Path, rep: dict, name: str) -> tuple[list[float], int, int]:
    """``(step times, steps re-charged, steps over budget even so)`` (see module doc)."""
    modes = layer_checkpoint_modes(run, rep, name)
    times, n_layer, n_over = [], 0, 0
    for st, m in zip(rep["policies"][name]["steps"], modes):
        t = st["step_emulated_s"]
        if "over" in m:
            n_over += 1
        if "layer" in m or "over" in m:
            n_layer += 1
            g = st["stages_emulated_s"]
            t += g["fwd_dispatch"] + g["fwd_experts"] + g["fwd_combine"] - g["bwd_recompute"]
        times.append(t)
    return times, n_layer, n_over


def checkpoint_section(run: Path) -> str:
    rep = json.loads((run / "ttl.json").read_text())
    tg, out, tt = rep["target"], [], {}
    for name in ("static", "symi"):
        times, n_layer, n_over = with_layer_checkpoint(run, rep, name)
        step, _ = time_to_target(rep["policies"][name], tg["val_loss"], tg["rtol"])
        tt[name] = None if step is None else sum(times[:step])
        out.append(f"- {name}: whole-layer checkpoint at {n_layer}/{len(times)} steps, over "
                   f"budget even so at {n_over}; mean step {sum(times) / len(times) * 1e3:.2f} ms; "
                   f"time to target {fmt(tt[name], '.3f')} s (NVLink)")
    lr = rep["policies"]["lrmoe"]
    ls, _ = time_to_target(lr, tg["val_loss"], tg["rtol"])
    lt = None if ls is None else sum(s["step_emulated_s"] for s in lr["steps"][:ls])
    ratio = None if None in (lt, tt["symi"]) else lt / tt["symi"]
    out.append(f"- lrmoe/symi time to target with symi's layer checkpoint: {fmt(ratio, '.3f', 'n/a')}")
    return "\n".join(out)


def _cell(reach) -> str:
    return "never" if reach[0] is None else f"{reach[0]} / {reach[1]:.2f}"


def sensitivity(run: Path, fractions=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)) -> str:
    """lrmoe/symi time to target for other target fractions of the same run (post hoc:
    the run's own rule fixes one fraction; this shows how much the ratio depends on it)."""
    rep = json.loads((run / "ttl.json").read_text())
    pol, steps, rtol = rep["policies"], rep["config"]["steps"], rep["target"]["rtol"]
    out = ["| target fraction | static step | target val | symi steps / time (s) | "
           "lrmoe steps / time (s) | lrmoe/symi |", "|---|---|---|---|---|---|"]
    for f in fractions:
        e = next(e for e in pol["static"]["evals"] if e["step"] >= math.ceil(f * steps))
        sy, lr = (time_to_target(pol[p], e["val_loss"], rtol) for p in ("symi", "lrmoe"))
        both = None not in (sy[1], lr[1])
        out.append(f"| {f} | {e['step']} | {e['val_loss']:.4f} | {_cell(sy)} | {_cell(lr)} | "
                   f"{fmt(lr[1] / sy[1] if both else None, '.3f', 'n/a')} |")
    return "\n".join(out)


def summarize(run: Path) -> str:
    rep = json.loads((run / "ttl.json").read_text())
    G, tg = rep["config"]["ep"], rep["target"]
    # re-priced from the link the run was priced with (its recorded figures: a run made
    # before the presets carried their all-to-all efficiencies was priced at peak)
    nv = Link(**{k: v for k, v in rep["link"].items() if k != "inter"})
    ib = get_link(rep["link"]["name"] == "ib" and "nvlink" or "ib")
    out = [f"### {run.name}", "",
           f"target val {tg['val_loss']:.4f} (static at step {tg['static_step']}); budget "
           f"{fmt_bytes(rep['budget_bytes'])} per rank; {rep['config']['steps']} steps; "
           f"EP {G} virtual ranks", "",
           "| policy | status | steps→target | time→target NVLink (s) | time→target IB (s) | "
           "final val | mean step NVLink (ms) | mean MoE NVLink (ms) | mean step IB (ms) | "
           "expert max/mean | rank max/mean (fwd) | keep | recompute |",
           "|" + "---|" * 13]
    tt = {}
    for name, r in rep["policies"].items():
        st = r["steps"]
        n = max(len(st), 1)
        t_nv = [s["step_emulated_s"] for s in st]
        t_ib = [repriced(s, nv, ib, G) for s in st]
        s_nv, _ = time_to_target(r, tg["val_loss"], tg["rtol"])
        tt_nv, tt_ib = (None, None) if s_nv is None else (sum(t_nv[:s_nv]), sum(t_ib[:s_nv]))
        tt[name] = (tt_nv, tt_ib)
        out.append("| " + " | ".join([
            name, r["budget_status"][:60], fmt(s_nv, "d"), fmt(tt_nv, ".3f"), fmt(tt_ib, ".3f"),
            f"{r['final_val_loss']:.4f}", f"{sum(t_nv) / n * 1e3:.2f}",
            f"{sum(s['moe_emulated_s'] for s in st) / n * 1e3:.2f}",
            f"{sum(t_ib) / n * 1e3:.2f}",
            f"{sum(s['expert_load_max_over_mean'] for s in st) / n:.2f}",
            f"{sum(s['fwd_load_max_over_mean'] for s in st) / n:.3f}",
            f"{sum(s['keep_ratio'] for s in st) / n:.3f}",
            f"{sum(s.get('recompute_ratio', 0) for s in st) / n:.3f}"]) + " |")
    if "lrmoe" in tt and "symi" in tt:
        for i, link in enumerate(("NVLink", "IB")):
            a, b = tt["lrmoe"][i], tt["symi"][i]
            out.append(f"\nlrmoe/symi time to target ({link}): "
                       + ("n/a (a policy never reached it)" if None in (a, b) else f"{a / b:.3f}"))
        lr, sy = rep["policies"]["lrmoe"], rep["policies"]["symi"]
        common = {e["step"]: e["val_loss"] for e in sy["evals"]}
        gaps = [(e["step"], e["val_loss"] / common[e["step"]] - 1) for e in lr["evals"]
                if e["step"] in common and e["step"] > 0]
        if gaps:
            s_, g_ = gaps[-1]
            out.append(f"lrmoe val vs symi at step {s_}: {g_ * 100:+.2f}%")
    return "\n".join(out)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    for p in args:
        print(summarize(Path(p)))
        if "--layer-checkpoint" in sys.argv:
            print("\nexact policies with a whole-layer checkpoint where per-pair recompute "
                  "does not fit (modelled, see --help):")
            print(checkpoint_section(Path(p)))
        if "--sensitivity" in sys.argv:
            print("\nlrmoe/symi time to target at other target fractions (post hoc):\n")
            print(sensitivity(Path(p)))
        print()
