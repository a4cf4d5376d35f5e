"""Routing loads for planning without a model: synthetic Zipf, JSON files, routing traces.

Legend: G ranks (EP size), E experts, k experts per token, T tokens per home rank.
A loads file holds per-expert counts ``[..]``, ``{"counts": [..]}`` or a ``G x E``
matrix; a routing trace is what ``lrmoe bench ttl`` writes per policy
(``steps[step][moe_layer][expert]`` = global pairs routed).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lrmoe.errors import LrmoeError, require


def _water_fill(w_E: Tensor, pairs: int, cap: int) -> Tensor:
    """``pairs`` integer units over experts in proportion to ``w_E >= 0``, none above ``cap``.

    Experts whose share would pass ``cap`` get ``cap`` and the excess goes to the others
    in proportion to their weights; then largest-remainder rounding (ties to the lower
    expert id), so the sum is exact. Needs ``cap · (experts with weight > 0) >= pairs``.
    """
    w = w_E.double()
    E = w.numel()
    share = torch.zeros(E, dtype=torch.float64)
    free = w > 0
    left = float(pairs)
    for _ in range(E):
        share[free] = w[free] / w[free].sum() * left
        over = free & (share > cap)
        if not over.any():
            break
        share[over] = cap
        free &= ~over
        left = pairs - float(share[~free].sum())
    row = share.floor().long()
    order = torch.argsort(-(share - row), stable=True)
    row[order[: pairs - int(row.sum())]] += 1
    return row


def synthetic_counts(G: int, E: int, tokens_per_rank: int, top_k: int, skew: float,
                     seed: int = 0) -> Tensor:
    """``[G, E]`` Zipf loads: expert ``perm[j]`` gets weight ``1/(j+1)^skew``, every home
    rank spreading its ``tokens·top_k`` pairs alike, at most one per token and expert."""
    require(tokens_per_rank >= 1, f"--tokens-per-rank={tokens_per_rank} must be >= 1")
    require(skew >= 0, f"--skew={skew} must be >= 0")
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(E, generator=gen)
    w = torch.empty(E, dtype=torch.float64)
    w[perm] = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** skew
    row = _water_fill(w, tokens_per_rank * top_k, tokens_per_rank)
    return row[None, :].repeat(G, 1)


def spread_over_homes(total_E: Tensor, G: int) -> Tensor:
    """``[G, E]``: each expert's pairs split evenly over the G home ranks (the first ones +1)."""
    total_E = total_E.long()
    return total_E // G + (torch.arange(G)[:, None] < total_E % G).long()


def read_json(path: str):
    """``--loads``: JSON, gzipped where the name ends ``.gz`` (as benchmarks/results keeps
    routing traces)."""
    try:
        raw = Path(path).read_bytes()
        return json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw)
    except OSError as e:  # gzip.BadGzipFile too
        raise LrmoeError(f"cannot read --loads {path}: {e.strerror or e}") from None
    except EOFError:
        raise LrmoeError(f"cannot read --loads {path}: the gzip stream is cut off") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f": {e.msg} at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
        raise LrmoeError(f"--loads {path} is not valid JSON{where}") from None


def _counts(data, what: str, layout: str) -> Tensor:
    """``data`` as an int64 tensor, or one line naming ``what`` unless it holds
    non-negative integers laid out as ``layout`` says."""
    try:
        t = torch.tensor(data, dtype=torch.float64)
    except (TypeError, ValueError):
        raise LrmoeError(f"{what} must be {layout}") from None
    require(bool((t >= 0).all()) and bool((t == t.round()).all()),
            f"{what} must hold non-negative integers")
    return t.long()


def is_trace(data) -> bool:
    return isinstance(data, dict) and "steps" in data


def load_counts(path: str, G: int, E: int, data=None) -> Tensor:
    """Read ``--loads``: per-expert counts (spread evenly over homes) or a G x E matrix."""
    data = read_json(path) if data is None else data
    require(not is_trace(data), f"--loads {path} is a routing trace (many steps and layers); "
                                 "use it with --compare")
    if isinstance(data, dict):
        require("counts" in data, f"--loads {path} is an object without a \"counts\" field")
        data = data["counts"]
    t = _counts(data, f"--loads {path}", "a list of numbers or a list of equal-length lists")
    if t.dim() == 1:
        require(t.numel() == E, f"--loads {path} has {t.numel()} counts; the model has {E} "
                                "experts")
        return spread_over_homes(t, G)
    require(t.dim() == 2 and tuple(t.shape) == (G, E),
            f"--loads {path} matrix has shape {tuple(t.shape)}; want (--ep, experts) = "
            f"{(G, E)}")
    return t


@dataclass
class RoutingTrace:
    """Sampled ``(step, layer)`` global expert loads of a ``lrmoe bench ttl`` trace."""

    path: str
    n_steps: int  # steps in the trace
    steps: list[int]  # the sampled steps (0-based), evenly spaced, the last one included
    loads_E: list[Tensor]  # global pairs per expert, one per sampled (step, layer)
    skew: float  # mean over the samples of max/mean expert load (as observed)

    def counts(self, G: int, tokens_per_rank: int, top_k: int) -> list[Tensor]:
        """Per sample, ``[G, E]`` loads rescaled to ``G·T·k`` pairs (at most ``G·T`` per
        expert: one pair per token), each expert's pairs spread evenly over the homes."""
        pairs, cap = G * tokens_per_rank * top_k, G * tokens_per_rank
        return [spread_over_homes(_water_fill(c.double(), pairs, cap), G) for c in self.loads_E]


def read_trace(path: str, data: dict, E: int, top_k: int, n_samples: int) -> RoutingTrace:
    """Validate a routing trace (``steps[step][moe_layer][expert]`` = global pairs) and
    sample ``n_samples`` of its steps."""
    require(n_samples >= 1, f"--trace-steps={n_samples} must be >= 1")
    t = _counts(data["steps"], f"--loads {path}: routing trace \"steps\"", "a list (steps) "
                "of lists (MoE layers) of equal-length lists of numbers (experts)")
    require(t.dim() == 3 and t.shape[0] >= 1 and t.shape[1] >= 1,
            f"--loads {path}: routing trace \"steps\" has shape {tuple(t.shape)}; want "
            "(steps, MoE layers, experts) with at least one step and layer")
    require(t.shape[2] == E, f"--loads {path}: routing trace has {t.shape[2]} experts per layer; "
                             f"the model has {E}")
    n = t.shape[0]
    m = min(n_samples, n)
    steps = sorted({(i + 1) * n // m - 1 for i in range(m)})
    loads, ratios = [], []
    for s in steps:
        for layer in range(t.shape[1]):
            c = t[s, layer]
            used = int((c > 0).sum())
            require(used >= top_k, f"--loads {path}: step {s} layer {layer} routes to {used} "
                                   f"experts; top_k={top_k} needs at least {top_k}")
            loads.append(c)
            ratios.append(float(c.max()) / float(c.double().mean()))
    return RoutingTrace(path, n, steps, loads, sum(ratios) / len(ratios))
