"""Operations one MoE layer step issues on one rank, stage by stage, counted on the CPU.

The control plane around the expert kernels is host-bound on a GPU machine: each op on a
small tensor costs ~25-30 us of host time there, whatever its size. This counts them
without a GPU. One rank of a G-rank group (the plan's busiest, synthetic peers:
``tests/onerank.py``, as ``benchmarks/control_plane.py`` runs it) does one forward and
one backward of one MoE layer; a ``TorchDispatchMode`` counts every ATen op it
dispatches, attributed to the stage region it runs in (the runtime's own ``local``,
``select``, ``gather`` and expert regions; ``other``: counting, planning, the instance
weights, the exchanges, one op each; the router and shared experts are left out) and
classed by lineage (``tests/host_waits.py``):
a **device** op touches data computed from the layer's input or weights, or makes a
tensor on an explicit device (a kernel launch on a GPU); a **host** op works on plan
data the host holds (small CPU tensors). A fused elementwise helper
(:mod:`lrmoe.ops.fused`, one compiled kernel on CUDA) counts as one device op, whatever
its eager version runs on the CPU; with ``--triton-interpret`` the row kernels
(:mod:`lrmoe.ops.rowops`, :mod:`lrmoe.ops.selection`) run as Triton kernels under Triton's
interpreter and each launch counts as one device op, as on a GPU (without it they run
their torch references, several ops each). numpy and pure-Python work is not counted
(it is in ``plan_ms``).

    python3 benchmarks/op_count.py --out DIR                 # Qwen3 routing shapes, ~1 min
    python3 benchmarks/op_count.py --out DIR --tokens 64 --eps 4 --preset tiny-qwen3

Shapes: the preset's experts, top-k and EP size with a narrow hidden and expert width
(the counts do not depend on them), ``--tokens`` per rank. Writes ``op_count.json`` and
``op_count.md``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import sys
from pathlib import Path

if "--triton-interpret" in sys.argv:  # read when Triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))

import control_plane as cp  # noqa: E402
from gpu_common import cli, md_head, out_dir, run_meta, write_outputs  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from host_waits import HostWaits  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interp import patch_interpreter

    patch_interpreter()

POLICIES = ("static", "symi", "lrmoe", "lrmoe:estimator=sampled")
STAGE_KEYS = ("other", "local", "select", "gather", "expert")  # "dense" is left out


class OpCount(HostWaits):
    """Counts dispatched ops by (stage, host/device) inside the ``with`` block."""

    def __init__(self):
        super().__init__()
        self.stage: list[str] = ["dense"]
        self.counts: collections.Counter = collections.Counter()
        self.by_op: collections.Counter = collections.Counter()
        self.muted = 0
        self.factory = 0

    def region(self, key: str):
        @contextlib.contextmanager
        def ctx():
            self.stage.append("expert" if key.startswith("expert") else key.removesuffix("_ms"))
            try:
                yield
            finally:
                self.stage.pop()
        return ctx()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.muted:
            out = func(*args, **kwargs)
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    self._dev[o] = True
            return out
        flat, _ = tree_flatten((args, kwargs))
        dev = self.factory or any(self.is_device(a) for a in flat)
        self.counts[(self.stage[-1], "device" if dev else "host")] += 1
        self.by_op[(self.stage[-1], "device" if dev else "host", str(func))] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def counting(layer):
    """An :class:`OpCount` over the layer's step, with its stage regions, fused helpers
    and exchanges hooked: ops outside the routed experts' code (the router, the shared
    experts, the loss) are ``dense`` and left out; each all-to-all of the synthetic
    peers counts as one device op (a collective launch), whatever its stand-in copies."""
    import lrmoe.model.moe as moe
    import lrmoe.ops.fused as fused_mod
    import lrmoe.parallel.exchange as exchange
    import lrmoe.parallel.instances as instances
    from onerank import OneRankComm

    oc = OpCount()
    oc.stage = ["dense"]
    saved = {}

    def timed(stats, key, device):
        return oc.region(key)

    def once(name, fn):
        def call(*a, **kw):
            oc.counts[(oc.stage[-1], "device")] += 1
            oc.by_op[(oc.stage[-1], "device", name)] += 1
            oc.muted += 1
            try:
                return fn(*a, **kw)
            finally:
                oc.muted -= 1
        return call

    def fused(name, fn, x):
        return once(f"fused:{name}", fn)

    def routed(fn):
        def call(*a, **kw):
            oc.stage.append("other")
            try:
                return fn(*a, **kw)
            finally:
                oc.stage.pop()
        return call
    patches = [(m, "_timed", timed) for m in (exchange, moe) if hasattr(m, "_timed")]
    patches += [(m, "fused", fused) for m in list(sys.modules.values())
                if getattr(m, "__name__", "").startswith("lrmoe")
                and getattr(m, "fused", None) is fused_mod.fused]
    patches += [(OneRankComm, "all_to_all", once("all_to_all", OneRankComm.all_to_all)),
                (OneRankComm, "exchange_counts", once("all_to_all", OneRankComm.exchange_counts))]
    patches += [(moe.MoELayer, "routed", routed(moe.MoELayer.routed))]
    for fn in (exchange.ExpertExchange, instances.GatherInstances):
        patches.append((fn, "backward", staticmethod(routed(fn.backward))))
    for mod, name, new in patches:
        saved[(mod, name)] = mod.__dict__[name] if isinstance(mod, type) else getattr(mod, name)
        setattr(mod, name, new)
    try:
        with oc:
            yield oc
    finally:
        for (mod, name), old in saved.items():
            setattr(mod, name, old)


def count_step(cfg, G: int, T: int, spec: str, seed: int) -> dict:
    """One forward + backward of the busiest rank: ops by stage and kind."""
    import lrmoe.parallel.instances as instances
    from lrmoe.ledger import Ledger
    from lrmoe.policy.base import PlanInputs

    idx, counts = cp.routing(G, T, cfg.num_experts, cfg.num_experts_per_tok, cp.DEFAULT_SKEW, seed)
    policy, opts = cp.make_policy(spec, cfg, G, False)
    ledger = Ledger.for_dtype(cfg, G, None, "fp32", num_moe_layers=1)
    plan = policy.plan(counts, PlanInputs(0, 0, counts.sum(0), ledger))
    me = cp.busiest_rank(plan)
    layer = cp.build_rank(cfg, me, counts, idx[me * T:(me + 1) * T], policy, ledger, opts,
                          torch.device("cpu"), plan)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, cfg.hidden_size, generator=g).requires_grad_()
    dy = torch.randn(1, T, cfg.hidden_size, generator=g)
    cp.run_once(layer, x, dy, False)  # warm caches (the policy's, the layouts')
    if hasattr(instances, "_route"):  # a new placement's route is copied in this step
        instances._route.cache_clear()
    out_counts = {}
    for phase in ("forward", "backward"):
        with counting(layer) as oc:
            oc.device(x, dy, *layer.parameters())
            if phase == "forward":
                layer.runtime.stats.clear()
                out = layer(x)
            else:
                out.backward(dy)
        out_counts[phase] = oc
    row = {"policy": spec, "rank": me, "replicas": plan.num_replicas(),
           "keep_ratio": float(plan.select_GGS.sum() / plan.assign_GGS.sum().clamp(min=1))}
    for phase, oc in out_counts.items():
        row[phase] = {f"{s}_{k}": oc.counts[(s, k)] for s in STAGE_KEYS for k in ("host", "device")}
        row[phase]["host_waits"] = len(oc.waits)
        row[phase]["top_host_ops"] = [f"{s}:{op} x{n}" for (s, k, op), n in
                                      oc.by_op.most_common() if k == "host"][:12]
    return row


def _tot(d: dict, kind: str | None = None) -> int:
    return sum(v for k, v in d.items() if k.endswith(("_host", "_device"))
               and (kind is None or k.endswith("_" + kind)))


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = ["# Ops of one MoE layer step, one rank (counted on the CPU)", "",
             f"Command: `{meta['command']}`; date {meta['date']}; torch {meta['torch']}. "
             f"Preset {meta['preset']} routing shapes (E, k), EP {meta['ep']}, "
             f"{meta['tokens']} tokens a rank, Zipf skew {cp.DEFAULT_SKEW}; the busiest rank. "
             "Counts of dispatched ATen ops (forward + backward); device = on data of the "
             "layer (a kernel launch on a GPU), host = on plan data; a fused helper counts "
             f"once; row kernels: {meta['row_kernels']}. Expert kernels (GEMMs, activations) "
             "are in `expert`.", ""]
    lines += md_head("policy", "replicas", "keep", "**total**", "host", "device",
                     *[f"{s} h/d" for s in STAGE_KEYS], "host waits f/b")
    for r in rows:
        f, b = r["forward"], r["backward"]
        both = {k: f.get(k, 0) + b.get(k, 0) for k in f if k.endswith(("_host", "_device"))}
        lines.append(f"| {r['policy']} | {r['replicas']} | {r['keep_ratio']:.3f} | "
                     f"**{_tot(both)}** | {_tot(both, 'host')} | {_tot(both, 'device')} | "
                     + " | ".join(f"{both[s + '_host']}/{both[s + '_device']}" for s in STAGE_KEYS)
                     + f" | {f['host_waits']}/{b['host_waits']} |")
    lines += ["", "Most frequent host ops (stage:op x count), forward then backward:", ""]
    for r in rows:
        lines.append(f"- {r['policy']}: " + "; ".join(r["forward"]["top_host_ops"][:6]) + " || "
                     + "; ".join(r["backward"]["top_host_ops"][:6]))
    return "\n".join(lines) + "\n"


@cli
def main(argv=None) -> int:
    from lrmoe.presets import get_preset

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--eps", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--triton-interpret", action="store_true",
                   help="run the row kernels under Triton's interpreter (see module doc)")
    args = p.parse_args(argv)
    out = out_dir(args.out)
    cfg = dataclasses.replace(get_preset(args.preset), hidden_size=64, moe_intermediate_size=32)
    torch.manual_seed(args.seed)
    rows = [count_step(cfg, args.eps, args.tokens, spec, args.seed)
            for spec in args.policies.split(",")]
    meta = run_meta("cpu", argv=argv, preset=args.preset, ep=args.eps, tokens=args.tokens,
                    row_kernels="triton (interpreted)" if args.triton_interpret else "torch references")
    md = markdown(meta, rows)
    write_outputs(out, "op_count", meta, rows, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
