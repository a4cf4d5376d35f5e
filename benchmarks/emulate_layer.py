"""Emulated EP step time of one MoE layer under static, symi and lrmoe (virtual EP).

Runs G virtual ranks' real expert kernels on this device with each policy's real plan
(src/lrmoe/sim), models the all-to-alls from the exact bytes and a link preset, and
prints per-stage times (slowest rank per stage). EMULATED, not measured cluster time.

    python3 benchmarks/emulate_layer.py --preset qwen3-30b-a3b --ep 8 --tokens-per-rank 8192 \
        --skew 1 --budget 90GiB --out emulated.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lrmoe.memory import Ledger, parse_bytes  # noqa: E402
from lrmoe.policy.lrmoe import LrmoeConfig, LrmoePolicy  # noqa: E402
from lrmoe.policy.static import StaticPolicy  # noqa: E402
from lrmoe.policy.symi import SymiPolicy  # noqa: E402
from lrmoe.presets import get_preset  # noqa: E402
from lrmoe.sim.cost import emulate_step, step_times  # noqa: E402
from lrmoe.sim.links import get_link  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--skew", type=float, default=1.0)
    ap.add_argument("--budget", default="90GiB")
    ap.add_argument("--slots-per-rank", type=int, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="emulated_layer.json")
    a = ap.parse_args()
    cfg = get_preset(a.preset)
    G, E = a.ep, cfg.num_experts
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    dname = "bf16" if dtype == torch.bfloat16 else "fp32"
    budget = parse_bytes(a.budget)
    slots = a.slots_per_rank or E // G + 2
    runs = {
        "static": (StaticPolicy(), None),
        f"symi(s={slots})": (SymiPolicy(slots_per_rank=slots), None),
        f"lrmoe({a.budget})": (LrmoePolicy(LrmoeConfig()), Ledger.for_dtype(cfg, G, budget, dname)),
    }
    ledger_nb = Ledger.for_dtype(cfg, G, None, dname)
    out = dict(meta=dict(device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                         torch=torch.__version__, date=time.strftime("%Y-%m-%d"), argv=sys.argv,
                         label="emulated"), runs={})
    for name, (policy, ledger) in runs.items():
        st, vs = emulate_step(cfg, policy, G, a.tokens_per_rank, skew=a.skew, ledger=ledger,
                              link="nvlink", device=a.device, dtype=dtype, warmup=2,
                              repeats=a.repeats, seed=0)
        plan = vs.plan
        peak = max(t["total"] for t in ledger_nb.rank_terms(plan)) / 2**30
        row = dict(rank_load_max_over_mean=float(plan.rank_load().max() / plan.rank_load().float().mean()),
                   rank_bwd_load_max_over_mean=float(plan.rank_backward_load().max()
                                                     / plan.rank_backward_load().float().mean()),
                   keep=float(plan.select_GGS.sum() / plan.assign_GGS.sum()),
                   replicas=plan.num_replicas(), ledger_peak_gib=round(peak, 2))
        for link in ("nvlink", "ib"):
            row[link] = step_times([vs], get_link(link)).as_dict() if link != "nvlink" else st.as_dict()
        out["runs"][name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k not in ("nvlink", "ib")}), flush=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"{'policy':22} {'ledger GiB':>10} {'fwd m/m':>7} {'bwd m/m':>7} {'keep':>5} "
          f"{'nvlink ms':>9} {'ib ms':>8}   (one MoE layer, EMULATED)")
    for name, r in out["runs"].items():
        nv, ib = r["nvlink"], r["ib"]
        print(f"{name:22} {r['ledger_peak_gib']:>10.1f} {r['rank_load_max_over_mean']:>7.2f} "
              f"{r['rank_bwd_load_max_over_mean']:>7.2f} {r['keep']:>5.2f} "
              f"{1e3 * nv['total']:>9.2f} {1e3 * ib['total']:>8.2f}")


if __name__ == "__main__":
    main()
