"""Static's memory floor over a run's recorded routing, and budgets as fractions of it: MODELLED (ledger).

    python3 benchmarks/floor_budget.py RUN_OR_TRACE [...] [--fractions 1.10] [--mem-budget 2GiB]

A ``bench ttl`` run folder (its ``routing_trace_static.json(.gz)``) or a trace file; the
run's ``ttl.json(.gz)`` beside it gives the settings (ep, dtype, optimizer offload, router
gradient), else the flags. Each step's counts of each MoE layer become a count matrix
whose home rows hold ``tokens_per_rank · top_k`` pairs (the ledger prices a rank by its
received and home pairs, so any such split prices alike); static's native plan is priced
with the ledger ``bench ttl`` prices static's floor with
(:func:`lrmoe.sim.ttl.static_floor_ledger`). Maxima over steps and layers of the worst rank:

- ``as_is``: nothing recomputed;
- ``row_floor``: the least budget where :func:`lrmoe.policy.plan.fit_exact` fits every
  plan as is or by per-row recompute (mode ``fits``/``pairs``; bisection);
- ``F``: the whole-layer-checkpointed plan's total (the regime study's floor);
- ``fit_floor``: the least budget where ``fit_exact`` raises for no plan (per plan the
  lesser of its per-row floor and its checkpoint): below it static runs out of memory.
  It is ``F`` where the checkpoint is the cheaper fallback; where it is not (the
  checkpoint's transients outweigh what it frees), ``F`` is above static's need.

``--config FILE``: the counts priced on another model of the same experts and top-k (its
MoE layer count; the ledger prices one layer's plan repeated over the MoE layers).
Out: F, each ``--fractions`` x·F, each ``--mem-budget`` and the run's budget as x of F;
``--out DIR``: ``floor_budget.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_common as gc  # noqa: E402

from lrmoe.config import ModelConfig  # noqa: E402
from lrmoe.errors import require  # noqa: E402
from lrmoe.policy.ledger_view import plan_exact_fit  # noqa: E402
from lrmoe.policy.plan import layer_checkpoint_plan, native_plan  # noqa: E402
from lrmoe.sim.ttl import TTLConfig, static_floor_ledger  # noqa: E402
from lrmoe.sim.ttl_budget import counts_matrix  # noqa: E402
from lrmoe.train.config import TrainConfig, resolve_model_config  # noqa: E402
from lrmoe.units import parse_bytes  # noqa: E402


def find(folder: Path, stem: str) -> Path | None:
    return next((f for f in (folder / stem, folder / f"{stem}.gz") if f.is_file()), None)


def load(path: str, a) -> tuple[dict, TTLConfig, int | None]:
    """``(trace, settings, the run's budget)``."""
    p = Path(path)
    f = find(p, "routing_trace_static.json") if p.is_dir() else p
    require(f is not None and f.is_file(), f"{path}: no routing_trace_static.json(.gz) there")
    trace = gc.read_json(f)
    require(isinstance(trace, dict) and {"model", "ep", "tokens_per_rank", "steps"} <= trace.keys(),
            f"{f}: not a bench ttl routing trace (wants model, ep, tokens_per_rank, steps)")
    require(isinstance(trace["ep"], int) and not isinstance(trace["ep"], bool) and trace["ep"] >= 1,
            f"{f}: its ep {trace['ep']!r} is not a positive integer")
    run = find(f.parent, "ttl.json")
    if run is not None:
        with gc.reading("a bench ttl ttl.json", run):
            rep = gc.read_json(run)
            c = rep.get("config", {})
            require(c.get("grad_accum", 1) == 1, f"{run}: {c.get('grad_accum')} micro-batches a "
                    "step: the trace sums them, the ledger prices one")
            cfg = TTLConfig.from_flat(ep=trace["ep"], device=c.get("device", "cpu"),
                                      optimizer_offload=c.get("optimizer_offload", "device"),
                                      router_grad=c.get("router_grad", "home"))
            return trace, cfg, rep.get("budget_bytes")
    return trace, TTLConfig.from_flat(ep=trace["ep"], device=a.device,
                                      optimizer_offload=a.optimizer_offload,
                                      router_grad=a.router_grad), None


def rows_fit(ledger, plan, budget: int) -> bool:
    """:func:`lrmoe.policy.plan.fit_exact`'s mode at ``budget`` is ``fits`` or ``pairs``."""
    ledger.budget_bytes = budget
    return plan_exact_fit(ledger, plan)[0] in ("fits", "pairs")


def least(ledger, plan, lo: int, hi: int) -> int:
    """Smallest budget in ``(lo, hi]`` where ``plan`` fits by per-row recompute, else ``hi``
    (feasibility grows with the budget; the caller knows ``lo`` is not enough)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if rows_fit(ledger, plan, mid) else (mid, hi)
    return hi


def floors(trace: dict, cfg: TTLConfig, mcfg: ModelConfig) -> dict:
    led = static_floor_ledger(cfg, mcfg)
    G, home = cfg.train.ep, trace["tokens_per_rank"] * mcfg.num_experts_per_tok
    plans = [native_plan(counts_matrix(cE, G, home)) for step in trace["steps"] for cE in step]
    require(plans, "the trace has no steps")
    peak = [max(t["total"] for t in led.rank_terms(p)) for p in plans]
    lay = [max(t["total"] for t in led.rank_terms(layer_checkpoint_plan(p))) for p in plans]
    row = fit = 0  # a plan's floor is at most its peak as is (and, any fallback, its checkpoint)
    for p, pk, _ in sorted(zip(plans, peak, lay), key=lambda x: -x[1]):
        if pk > row and not rows_fit(led, p, row):
            row = least(led, p, row, pk)
    for p, pk, lc in sorted(zip(plans, peak, lay), key=lambda x: -min(x[1], x[2])):
        if min(pk, lc) > fit and not rows_fit(led, p, fit):
            fit = least(led, p, fit, min(pk, lc))
    led.budget_bytes = None
    return dict(steps=len(trace["steps"]), moe_layers_traced=len(trace["steps"][0]),
                moe_layers_priced=led.L, ep=G, dtype="bf16" if cfg.train.device == "cuda" else "fp32",
                optimizer_offload=cfg.train.optimizer_offload, router_grad=cfg.train.router_grad,
                as_is=max(peak), row_floor=row, F=max(lay), fit_floor=fit)


def model_of(trace: dict, config: str | None) -> ModelConfig:
    """The trace's model, or ``--config``'s (same experts and top-k: the counts must fit it)."""
    mcfg = ModelConfig.from_hf_dict(trace["model"])
    if config is None:
        return mcfg
    other = resolve_model_config(TrainConfig(config=config), vocab_size=mcfg.vocab_size)
    require((other.num_experts, other.num_experts_per_tok) == (mcfg.num_experts, mcfg.num_experts_per_tok),
            f"--config {config}: {other.num_experts} experts top-{other.num_experts_per_tok}, the "
            f"trace's model has {mcfg.num_experts} top-{mcfg.num_experts_per_tok}")
    return other


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", help="bench ttl run folders or routing trace files")
    ap.add_argument("--fractions", default="1.10,1.25,1.5,2.0", help="budgets as x·F")
    ap.add_argument("--mem-budget", default="", help="comma list of budgets to express as x·F")
    ap.add_argument("--config", default=None,
                    help="price the counts on this model instead (its MoE layer count: each traced "
                         "layer's plan repeated over them, as the ledger prices one plan)")
    ap.add_argument("--device", default="cuda", help="without ttl.json: cuda prices bf16, cpu fp32")
    ap.add_argument("--optimizer-offload", default="device", help="without ttl.json")
    ap.add_argument("--router-grad", default="home", help="without ttl.json")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    fracs = gc.csv(a.fractions, float, "--fractions")
    given = [(b, parse_bytes(b)) for b in gc.csv(a.mem_budget, str, "--mem-budget")]
    rows = []
    for path, (trace, cfg, run_budget) in [(p, load(p, a)) for p in a.traces]:
        with gc.reading("a bench ttl routing trace", Path(path)):
            r = dict(trace=path, **floors(trace, cfg, model_of(trace, a.config)),
                     run_budget=run_budget)
        r["run_budget_over_F"] = None if run_budget is None else run_budget / r["F"]
        r["budgets"] = {f"{x:g}": {"bytes": int(x * r["F"]), "GiB": x * r["F"] / gc.GiB} for x in fracs}
        r["given_over_F"] = {b: v / r["F"] for b, v in given}
        rows.append(r)
    md = ["# static's floor F and budgets as x·F: MODELLED (ledger)", "",
          *gc.md_head("trace", "MoE layers traced/priced", "as is GiB", "per-row floor GiB",
                      "any-fallback floor GiB", "F GiB", "run budget / F",
                      *[f"{x:g}·F GiB" for x in fracs], *[f"{b} / F" for b, _ in given])]
    for r in rows:
        cells = [r["trace"], f"{r['moe_layers_traced']}/{r['moe_layers_priced']}",
                 *(gc.fmt(gc.gib(r[k]), ".3f") for k in ("as_is", "row_floor", "fit_floor", "F")),
                 gc.fmt(r["run_budget_over_F"], ".3f"), *(f"{v['GiB']:.3f}" for v in r["budgets"].values()),
                 *(f"{v:.3f}" for v in r["given_over_F"].values())]
        md.append("| " + " | ".join(cells) + " |")
    md += ["", "F: the largest rank total of static's whole-layer-checkpointed native plan over "
           "every recorded step and MoE layer; per-row floor: the least budget where fit_exact "
           "fits every step by per-row recompute; any-fallback floor: the least budget where "
           "fit_exact fits every step (recompute, else the checkpoint: below it, out of memory); "
           "as is: nothing recomputed."]
    print("\n".join(md))
    if a.out:
        meta = gc.run_meta("cpu", argv=argv, label="MODELLED (ledger)")
        gc.write_outputs(gc.out_dir(a.out), "floor_budget", meta, rows, "\n".join(md) + "\n")
    return 0


run = gc.cli(main)

if __name__ == "__main__":
    sys.exit(run())
