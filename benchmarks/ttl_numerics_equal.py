"""Are two ``lrmoe bench ttl`` runs the same training, bit for bit? Compares every number
of their ``ttl.json`` that is not a time: per policy and step the training loss, the
plans' keep, retain and recompute ratios, replicas, loads, ledger peaks, rungs and
exchanged bytes; per evaluation the validation losses; the final validation loss.
Wall times, emulated times and the link terms (which carry times) are left out: they
differ between any two runs.

    python3 benchmarks/ttl_numerics_equal.py A/ttl.json B/ttl.json   # exit 0: equal

Used to show that a setting which should change no number (``--no-deterministic-fill``:
torch's deterministic mode without its fill of uninitialised memory) changes none, by
two runs with it against each other and against one without it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_common import LrmoeError, read_json  # noqa: E402

TIMED = ("_s", "_ms", "link_terms", "emulated_s", "emulator_device_peak_bytes")


def numerics(report: dict) -> dict:
    """Every number of a ``ttl.json`` that is not a time (module doc)."""
    out = {}
    for name, p in sorted(report["policies"].items()):
        out[name] = {
            "final_val_loss": p.get("final_val_loss"),
            "evals": [{k: v for k, v in e.items() if not k.endswith(TIMED)}
                      for e in p.get("evals", [])],
            "steps": [{k: v for k, v in s.items() if not k.endswith(TIMED)}
                      for s in p.get("steps", [])]}
    return out


def differences(a: dict, b: dict, limit: int = 5) -> list[str]:
    """The first ``limit`` places where two :func:`numerics` differ."""
    out = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            out.append(f"policy {name} in one run only")
            continue
        x, y = a[name], b[name]
        if x["final_val_loss"] != y["final_val_loss"]:
            out.append(f"{name}: final_val_loss {x['final_val_loss']} vs {y['final_val_loss']}")
        for part in ("steps", "evals"):
            if len(x[part]) != len(y[part]):
                out.append(f"{name}: {len(x[part])} vs {len(y[part])} {part}")
            for i, (u, v) in enumerate(zip(x[part], y[part])):
                out += [f"{name} {part}[{i}].{k}: {u.get(k)} vs {v.get(k)}"
                        for k in sorted(set(u) | set(v)) if u.get(k) != v.get(k)]
    return out[:limit]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: ttl_numerics_equal.py A/ttl.json B/ttl.json", file=sys.stderr)
        return 2
    try:
        a, b = (numerics(read_json(Path(f))) for f in args)
    except (LrmoeError, KeyError) as e:  # a missing, unreadable or foreign report
        print(f"lrmoe: error: {e if isinstance(e, LrmoeError) else f'no {e} in the report'}",
              file=sys.stderr)
        return 2
    diff = differences(a, b)
    steps = sum(len(p["steps"]) for p in a.values())
    print(f"{'EQUAL' if not diff else 'DIFFERENT'}: {args[0]} vs {args[1]} "
          f"({', '.join(a)}; {steps} steps)")
    for d in diff:
        print("  " + d)
    return 0 if not diff else 1


if __name__ == "__main__":
    sys.exit(main())
