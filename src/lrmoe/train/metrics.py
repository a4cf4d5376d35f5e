"""``metrics.jsonl``: one JSON object per line (train, validation and init rows), written by
rank 0 and flushed every row; the rows' fields: docs/design.md §7.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Iterable

from lrmoe.train.checkpoint import atomic_write_text

METRICS_FILE = "metrics.jsonl"

# Per-rank counters (rank_summary's name -> the layer row's), by how ranks combine
_SUM_KEYS = {
    "fwd_rows": "fwd_rows", "retained_rows": "retained", "bwd_rows": "bwd_rows",
    "selected_rows": "selected", "saved_act_bytes": "saved_act_bytes",
    "recomputed_rows": "recomputed", "fwd_bytes": "fwd_bytes", "bwd_bytes": "bwd_bytes",
    "bwd_exact_bytes": "bwd_exact_bytes",
}
_MAX_KEYS = {k: k for k in ("expert_fwd_ms", "expert_bwd_ms", "count_exchange_ms", "plan_ms",
                            "weight_scatter_bytes", "ledger_total_bytes")}
_MEAN_KEYS = {k: k for k in ("fidelity_cosine", "fidelity_rel_err")}
_BALANCE_KEYS = {"load": "rank_load_max_over_mean", "bwd_load": "rank_bwd_load_max_over_mean"}


def proc_kib(path: str, key: str) -> int | None:
    """``key``'s value in a ``/proc`` file of ``key: N kB`` lines, in bytes (or None)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None


def host_rss_bytes() -> int | None:
    """This process's resident set size now, in bytes (None without ``/proc``)."""
    return proc_kib("/proc/self/status", "VmRSS")


def host_peak_rss_bytes() -> int | None:
    """This process's largest resident set so far, in bytes: ``VmHWM`` where Linux has it
    (its ``ru_maxrss`` keeps the mark of the image before ``exec``), else ``ru_maxrss``."""
    peak = proc_kib("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def host_memory() -> dict[str, int | None]:
    """A row's ``host_rss_bytes`` and ``host_peak_rss_bytes`` (the peak at least the resident
    set: the kernel sums its counters lazily)."""
    rss, peak = host_rss_bytes(), host_peak_rss_bytes()
    if peak is not None and rss is not None:
        peak = max(peak, rss)
    return {"host_rss_bytes": rss, "host_peak_rss_bytes": peak}


def _r(x: float, nd: int = 4) -> float:
    """Round to ``nd`` significant digits, never into the integer digits (rows stay short)."""
    if not math.isfinite(x) or x == 0:
        return x
    return round(x, max(0, nd - 1 - int(math.floor(math.log10(abs(x))))))


def max_over_mean(xs: Iterable[float]) -> float:
    xs = [float(x) for x in xs]
    if not xs:
        return 1.0
    mean = sum(xs) / len(xs)
    return _r(max(xs) / mean) if mean > 0 else 1.0


_COMBINE = ((_BALANCE_KEYS, max_over_mean), (_SUM_KEYS, lambda v: int(sum(v))),
            (_MAX_KEYS, lambda v: _r(max(v))), (_MEAN_KEYS, lambda v: _r(sum(v) / len(v), 6)))


def rank_summary(stats: dict, ep_rank: int = 0) -> dict:
    """One rank's stats of one layer as numbers: its pairs in forward and backward, its counters."""
    out: dict[str, float] = {}
    for src, dst in (("rank_load", "load"), ("rank_backward_load", "bwd_load")):
        if src in stats and ep_rank < len(stats[src]):
            out[dst] = float(stats[src][ep_rank])
    for k in list(_SUM_KEYS) + list(_MAX_KEYS) + list(_MEAN_KEYS):
        if k in stats:
            out[k] = float(stats[k])
    out["fwd_bytes"] = float(sum(stats.get(k, 0) for k in (
        "fwd_dispatch_bytes_sent", "fwd_combine_bytes_sent")))
    out["bwd_bytes"] = float(sum(stats.get(k, 0) for k in (  # + a layer checkpoint's re-run
        "bwd_dispatch_bytes_sent", "bwd_combine_bytes_sent",
        "recompute_dispatch_bytes_sent", "recompute_combine_bytes_sent")))
    return out


def layer_row(plan_stats: dict, per_rank: list[dict], pairs: int | None = None) -> dict:
    """One MoE layer's compact row from rank 0's plan stats and every rank's summary."""
    row: dict[str, Any] = {}
    if "plan_replicas" in plan_stats:
        row["replicas"] = int(plan_stats["plan_replicas"])
    if pairs is not None:
        row["pairs"] = int(pairs)
    elif "counts_E" in plan_stats:
        row["pairs"] = int(sum(plan_stats["counts_E"]))
    for keys, combine in _COMBINE:
        for src, dst in keys.items():
            vals = [r[src] for r in per_rank if src in r]
            if vals:
                row[dst] = combine(vals)
    return row


class MetricsWriter:
    """Appends rows to ``metrics.jsonl`` (rank 0 only) and hands them to ``sink`` (TensorBoard's,
    or None); a row is written whole or not at all, the error naming the file."""

    def __init__(self, path: str | os.PathLike, enabled: bool = True, sink=None):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666) \
            if enabled else None
        self.sink = sink if enabled else None

    def write(self, row: dict) -> None:
        if self._fd is None:
            return
        data = (json.dumps(row, separators=(",", ":")) + "\n").encode()
        end = os.fstat(self._fd).st_size
        try:
            done = 0
            while done < len(data):
                done += os.write(self._fd, data[done:])
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, end)
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        if self.sink is not None:
            self.sink.write(row)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.sink is not None:
            self.sink.close()
            self.sink = None


def read_metrics(path: str | os.PathLike, torn: list[int] | None = None) -> list[dict]:
    """All well-formed rows; a torn line (a killed run) is skipped, its line number
    appended to ``torn`` when given."""
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                obj = None
            if isinstance(obj, dict):
                rows.append(obj)
            elif torn is not None:
                torn.append(lineno)
    return rows


def truncate_metrics(path: str | os.PathLike, step: int) -> list[int]:
    """Drop rows after ``step`` (a resumed run rewrites them) and torn rows, atomically;
    returns the line numbers of the torn rows dropped."""
    p = Path(path)
    if not p.exists():
        return []
    torn: list[int] = []
    rows = [r for r in read_metrics(p, torn) if int(r.get("step", 0)) <= step]
    atomic_write_text(p, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
    return torn


def train_row(*, step: int, loss: float, aux: float, lr: float, tokens: int, elapsed: float,
              dt: float, step_tokens: int, grad_norm: float, counts: list, stats: dict,
              per_rank: list[dict], world: int, cuda_mem: int | None, budget: int | None,
              fidelity_step: bool, micro_batches: int, host_mem: dict) -> dict:
    """The train row of one optimizer step; under accumulation the ``moe`` rows are the
    last micro-batch's."""
    layers = sorted(stats)
    row: dict[str, Any] = {
        "kind": "train", "step": step, "loss": loss, "aux_loss": round(aux, 7), "lr": lr,
        "fidelity_step": fidelity_step,
        "tokens": tokens, "elapsed_s": round(elapsed, 4), "step_s": round(dt, 4),
        "tokens_per_s": round(step_tokens / dt, 1), "grad_norm": round(grad_norm, 6),
        "micro_batches": micro_batches,
    }
    cl = [None if c is None else [int(x) for x in c.tolist()] for c in counts]
    row["expert_load_max_over_mean"] = [None if c is None else max_over_mean(c) for c in cl]
    row["counts"] = cl
    row["moe"] = [layer_row(stats[k], [r.get(k, {}) for r in per_rank],
                            None if c is None or micro_batches > 1 else sum(c))
                  for k, c in zip(layers, cl)]
    if world > 1:
        row["rank_load"] = [[int(r.get(k, {}).get("load", 0)) for r in per_rank] for k in layers]
    if cuda_mem is not None:
        row["cuda_max_mem_bytes"] = cuda_mem
        if budget is not None:
            row["ledger_budget_bytes"] = int(budget)
    row.update({k: int(v) for k, v in host_mem.items() if v is not None})
    return row
