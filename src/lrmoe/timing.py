"""Timing a region of device work without adding a host sync.

On CUDA the region is bracketed by events that the caller resolves later (after a sync
it does anyway); elsewhere a monotonic clock gives milliseconds at once.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

import torch


@contextmanager
def timed(device: torch.device, on_ms: Callable[[float], None],
          on_events: Callable[[object, object], None]):
    """Time the ``with`` block: ``on_events(start, end)`` on CUDA, ``on_ms(ms)`` elsewhere.

    Nothing is timed while the current CUDA stream is being captured into a graph: a
    timing event cannot be recorded there, and a replay would not refresh it anyway."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        yield
    elif device.type == "cuda":
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        yield
        b.record()
        on_events(a, b)
    else:
        t = time.perf_counter()
        yield
        on_ms((time.perf_counter() - t) * 1e3)
