"""Re-price a finished ``lrmoe bench ttl`` run for another EP link: MODELLED times.

    python3 benchmarks/reprice_links.py --link ib OUT/ttl/qwen3/s{0,1,2}

A RUN folder holds ``ttl.json`` or ``ttl.json.gz``. Every step row of a run records its
link-priced stages (:data:`lrmoe.sim.cost.LINK_STAGES`: the dispatches and combines,
weight scatter, gradient reduce, count exchange, and ``bwd_recompute`` with its re-sent
exchanges) as link-free terms (``link_terms``: per charge, each rank's bytes and fixed
seconds; :func:`lrmoe.sim.cost.price_terms`). Each such stage is priced again on
``--link``; every other stage (the measured kernels, the host offload on its own PCIe
link) and the non-MoE time stay as recorded, so one step costs
``non_moe + other stages + re-priced stages``. Each policy's cumulative time is rebuilt,
and steps and time to target are read as ``bench ttl`` reads them
(:mod:`lrmoe.sim.target`: the run's recorded fraction and smoothing window).

Assumes: the same routing, loss curve, kernels and plans as the run (only the link
changes); static and lrmoe do not plan by link cost, but symi's slots per rank were
chosen by least modelled time on the run's link (``lrmoe.sim.ttl_symi``): on a slower
link it would choose again (likely fewer replicas), so its re-priced time likely
overstates it. A flat link, or a two-level one whose node holds all the ranks (the
recorded bytes are not split into intra- and inter-node).

Guard: before printing anything, the run is re-priced on its own link and must give its
recorded per-step totals, times to target and ratios to 1e-9; else (or for a run
recorded without ``link_terms``) one line, exit 2.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpu_common import cli, read_json, reading  # noqa: E402

from lrmoe.errors import LrmoeError, require  # noqa: E402
from lrmoe.sim.cost import LINK_STAGES, price_terms  # noqa: E402
from lrmoe.sim.links import Link, get_link  # noqa: E402
from lrmoe.sim.target import crossing, target_at  # noqa: E402
from lrmoe.sim.ttl import ratio_over  # noqa: E402

TOL = 1e-9


def load(run: Path) -> dict:
    """The run folder's ``bench ttl`` record."""
    for name in ("ttl.json", "ttl.json.gz"):
        f = run / name
        if f.is_file():
            return read_json(f)
    raise LrmoeError(f"{run}: holds neither ttl.json nor ttl.json.gz")


def own_link(rep: dict) -> Link:
    """The link the run was priced with, from its record."""
    lk = dict(rep["link"])
    inter = lk.pop("inter", None)
    return Link(**lk, inter=Link(**inter) if inter else None)


def close(a, b) -> bool:
    if a is None or b is None or isinstance(a, str) or isinstance(b, str):
        return a == b
    return math.isclose(a, b, rel_tol=TOL, abs_tol=TOL * 1e-3)


def reprice(rep: dict, link: Link, run: Path) -> dict:
    """Per policy: rebuilt per-step seconds, steps and time to target; and the ratios."""
    cfg, pols = rep["config"], rep["policies"]
    w = rep["target"]["smooth_window"]
    tgt = target_at(pols["static"]["evals"], math.ceil(rep["target"]["fraction"]
                                                        * cfg["steps"]), w)
    require(close(tgt, rep["target"]["val_loss"]),
            f"{run}: target {tgt!r} read again differs from the recorded "
            f"{rep['target']['val_loss']!r}")
    out = {}
    for name, r in pols.items():
        step_s = []
        for row in r["steps"]:
            lt, st = row["link_terms"], row["stages_emulated_s"]
            priced = {k: sum(price_terms(c, link, lt["G"]) for c in lt["stages"].get(k, []))
                      for k in LINK_STAGES}
            step_s.append(row["non_moe_s"] + sum(priced.get(k, v) for k, v in st.items()))
        cum = [0.0]
        for t in step_s:
            cum.append(cum[-1] + t)
        evals = [dict(e, cum_emulated_s=cum[e["step"]]) for e in r["evals"]]
        s, t = crossing(evals, tgt, w)
        if r.get("out_of_memory"):
            s = t = None
        out[name] = {"step_s": step_s, "cum": cum[1:], "steps_to_target": s,
                     "time_to_target_emulated_s": t, "out_of_memory": r.get("out_of_memory")}
    for p in out.values():
        p["ratio"] = ratio_over(p, out.get("symi"))
    return out


def guard(rep: dict, run: Path) -> None:
    """Re-priced on its own link, the run must give its recorded figures (exit 2 if not)."""
    for name, r in rep["policies"].items():
        for row in r["steps"]:
            require("link_terms" in row,
                    f"{run}: policy {name} step {row['step']} lacks link_terms (a run made "
                    "before bench ttl recorded them cannot be re-priced exactly); re-run it")
    got = reprice(rep, own_link(rep), run)
    for name, r in rep["policies"].items():
        g = got[name]
        for i, row in enumerate(r["steps"]):
            for k, mine in (("step_emulated_s", g["step_s"][i]), ("cum_emulated_s", g["cum"][i])):
                require(close(mine, row[k]), f"{run}: {name} step {row['step']} {k} "
                        f"re-priced on its own link {mine!r} != recorded {row[k]!r}")
        for k in ("steps_to_target", "time_to_target_emulated_s"):
            require(close(g[k], r[k]), f"{run}: {name} {k} re-read {g[k]!r} != recorded "
                    f"{r[k]!r}")
    for name, v in rep["ratios_over_symi_time_to_target_emulated"].items():
        require(close(got[name]["ratio"], v), f"{run}: {name} ratio over symi re-read "
                f"{got[name]['ratio']!r} != recorded {v!r}")


def fmt(v, spec: str) -> str:
    return "n/a" if v is None else v if isinstance(v, str) else format(v, spec)


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--link", required=True, help="link preset (lrmoe.sim.links.LINKS)")
    a = ap.parse_args(argv)
    link = get_link(a.link)
    reps = [(run, load(run)) for run in a.runs]
    results = []
    for run, rep in reps:
        with reading("a bench ttl ttl.json with link_terms", run):
            guard(rep, run)
            results.append((run, rep, reprice(rep, link, run)))
    lines = [f"MODELLED (re-priced): each run's exchanges priced again on --link {link.name} "
             f"({link.effective_Bps / 1e9:g} GB/s effective, {link.latency_s * 1e6:g} us); "
             "everything else as the run recorded (EMULATED); symi keeps the slots it chose "
             "for the run's link", ""]
    ratios: dict[str, list[float]] = {}
    for run, rep, res in results:
        lines += [f"### {run} (ran on {rep['link']['name']})", "",
                  "| policy | steps→target | time→target as run (s) | time→target "
                  f"{link.name} (s) | ratio over symi as run | ratio over symi {link.name} |",
                  "|---|---|---|---|---|---|"]
        for name, p in res.items():
            r = rep["policies"][name]
            was = ratio_over(r, rep["policies"].get("symi"))
            lines.append(f"| {name} | {fmt(p['steps_to_target'], '.1f')} | "
                         f"{fmt(r['time_to_target_emulated_s'], '.3f')} | "
                         f"{fmt(p['time_to_target_emulated_s'], '.3f')} | {fmt(was, '.3f')} | "
                         f"{fmt(p['ratio'], '.3f')} |")
            if isinstance(p["ratio"], float):
                ratios.setdefault(name, []).append(p["ratio"])
        lines.append("")
    lines += [f"Over {len(results)} run(s), ratio over symi on {link.name} (MODELLED): "
              "mean, min–max (runs with a ratio)", ""]
    for name, v in ratios.items():
        lines.append(f"- {name}: {statistics.mean(v):.3f}, {min(v):.3f}–{max(v):.3f} "
                     f"({len(v)} of {len(results)})")
    print("\n".join(lines))
    return 0


main = cli(run)  # exit 2 after one line on bad input

if __name__ == "__main__":
    raise SystemExit(main())
