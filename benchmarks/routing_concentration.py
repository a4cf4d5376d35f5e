"""How concentrated a recorded routing is: does it collapse onto a few experts?

    python3 benchmarks/routing_concentration.py TRACE.json [TRACE.json ...] [--steps 5,10,20,40,80,119]

For ``bench ttl``'s routing traces (``steps[step][moe_layer][expert]`` = global pairs),
per listed step (last MoE layer): how many experts carry 90% of the pairs (uniform
top-k routing over E experts needs about 0.9·E; a collapsed router about k), how many
receive every token (a pair from each token: ``pairs / top_k``), and over the whole
run how often the most loaded expert is the previous step's (what a router whose hot
set rotates does to SYMI, which places replicas by the previous step's popularity).
With ``--whole-run FROM``, a second table over every step of each trace: the fewest
and the median experts carrying 90% from step FROM on, how many steps have an expert
receiving every token (and the first and last of them), at how many steps the most
loaded expert receives at least half of the tokens, and its largest share.
Prints markdown tables; reads files only (a measured trace, nothing modelled); a trace
may be gzipped (``.json.gz``, as kept under ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys


def concentration(data: dict, steps: list[int], top_k: int) -> dict:
    """The table's numbers for one trace (see the module docstring)."""
    st = data["steps"]
    rows = []
    for i in [s for s in steps if s < len(st)]:
        c = st[i][-1]
        tot = sum(c)
        full = sum(1 for x in c if tot and x * top_k >= tot * 0.999)
        cum, n90 = 0, 0
        for x in sorted(c, reverse=True):
            if cum >= 0.9 * tot:
                break
            cum += x
            n90 += 1
        rows.append({"step": i, "experts_for_90pct": n90, "experts_every_token": full,
                     "experts": len(c)})
    tops = [max(range(len(s[-1])), key=s[-1].__getitem__) for s in st]
    same = sum(a == b for a, b in zip(tops, tops[1:]))
    return {"rows": rows, "top_repeats": same, "transitions": len(tops) - 1}


def whole_run(data: dict, top_k: int, from_step: int) -> dict:
    """``--whole-run``'s numbers for one trace (see the module docstring)."""
    n = len(data["steps"])
    r = concentration(data, list(range(n)), top_k)["rows"]
    late = sorted(x["experts_for_90pct"] for x in r if x["step"] >= from_step)
    sinks = [x["step"] for x in r if x["experts_every_token"] > 0]
    share = []  # the most loaded expert's pairs over the tokens (a pair from each token)
    for st in data["steps"]:
        c = st[-1]
        tot = sum(c)
        share.append(max(c) * top_k / tot if tot else 0.0)
    return {"steps": n, "from": from_step,
            "min_90pct": late[0] if late else None,
            "median_90pct": late[(len(late) - 1) // 2] if late else None,
            "sink_steps": len(sinks), "first_sink": sinks[0] if sinks else None,
            "last_sink": sinks[-1] if sinks else None,
            "half_steps": sum(x >= 0.5 for x in share), "max_share": max(share, default=0.0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--steps", default="5,10,20,40,80,119")
    ap.add_argument("--whole-run", type=int, default=None, metavar="FROM",
                    help="also the whole-run table, 90%% counts from step FROM on")
    ap.add_argument("--top-k", type=int, default=None,
                    help="experts per token (default: the trace's model config, else 8)")
    a = ap.parse_args(argv)
    try:
        steps = [int(x) for x in a.steps.split(",") if x]
    except ValueError:
        print(f"routing_concentration: --steps {a.steps!r} is not a comma list of ints",
              file=sys.stderr)
        return 2
    loaded = []
    for path in a.traces:  # every trace read before anything is printed
        try:
            with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as f:
                data = json.loads(f.read())
            k = a.top_k or int((data.get("model") or {}).get("num_experts_per_tok", 8))
            r = concentration(data, steps, k)
            w = None if a.whole_run is None else whole_run(data, k, a.whole_run)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            print(f"routing_concentration: {path}: not a routing trace ({e})", file=sys.stderr)
            return 2
        loaded.append((path, r, w))
    print("| trace | " + " | ".join(f"step {s}: 90% / every token" for s in steps)
          + " | top expert = previous step's |")
    print("|---|" + "---|" * (len(steps) + 1))
    for path, r, _ in loaded:
        cells = {x["step"]: f"{x['experts_for_90pct']} / {x['experts_every_token']}"
                 for x in r["rows"]}
        print(f"| {path} | " + " | ".join(cells.get(s, "—") for s in steps)
              + f" | {r['top_repeats']} of {r['transitions']} |")
    if a.whole_run is not None:
        print(f"\n| trace | experts for 90% from step {a.whole_run}: fewest / median | steps "
              "with an expert receiving every token (first–last) | steps where one expert "
              "receives ≥ half of the tokens | largest share |")
        print("|---|---|---|---|---|")
        for path, _, w in loaded:
            sink = (f"{w['sink_steps']} ({w['first_sink']}–{w['last_sink']})"
                    if w["sink_steps"] else "0")
            print(f"| {path} | {w['min_90pct']} / {w['median_90pct']} | {sink} | "
                  f"{w['half_steps']} of {w['steps']} | {w['max_share']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
