"""What the benchmarks share: CUDA-event timing, peak memory of one call, the dense bf16
ceiling, run metadata, argument checks (one ``lrmoe: error:`` line, exit code 2),
comma lists, markdown table heads, reading (gzipped) JSON and ending a file of the wrong
shape in one line, and writing JSON + markdown into ``--out DIR``.

On the CPU (``--smoke``) the same code runs once per call, for the script's logic only:
its times are not results and its memory columns are ``None``.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

GiB = 2**30
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from lrmoe.errors import LrmoeError  # noqa: E402
from lrmoe.train.checkpoint import atomic_write_text  # noqa: E402


def cli(main: Callable[..., int | None]) -> Callable[..., int]:
    """``main`` returning 0, or 2 after one ``lrmoe: error:`` line where it raises
    :class:`LrmoeError` (bad input: raised before any output is written)."""
    def run(argv: list[str] | None = None) -> int:
        try:
            return main(argv) or 0
        except LrmoeError as e:
            print(f"lrmoe: error: {e}", file=sys.stderr)
            return 2
    return run


def check_device(device: str, cpu: str = "--device cpu") -> None:
    """``device`` is cuda or cpu and there if cuda; ``cpu``: the flag of the CPU logic check."""
    if device not in ("cuda", "cpu"):
        raise LrmoeError(f"--device {device!r}: use cuda or cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise LrmoeError(f"no GPU is visible: run on the GPU, or {cpu} for the logic check")


def csv(text: str, kind: type = str, name: str = "") -> list:
    """A comma list (``kind`` each; empty items skipped)."""
    try:
        return [kind(v) for v in text.split(",") if v]
    except ValueError:
        raise LrmoeError(f"{name or 'list'} {text!r}: want a comma list of {kind.__name__}") from None


def md_head(*cols: str) -> list[str]:
    """A markdown table's header and rule."""
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def bench(fn: Callable[[], object], dev: str, warmup: int = 3, iters: int = 15) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs (CUDA events); on the CPU one
    untimed and one timed call (a smoke run of the script, not a result)."""
    if dev != "cuda":
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def peak_of(fn: Callable[[], object], dev: str) -> tuple[int | None, int | None]:
    """``(peak, kept)`` in bytes above what was allocated before ``fn``: the highest point
    during the call and what is still allocated after it (e.g. gradients).
    ``(None, None)`` off CUDA."""
    if dev != "cuda":
        fn()
        return None, None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start, torch.cuda.memory_allocated() - start


def count_syncs(fn: Callable[[], object]) -> tuple[object, int]:
    """``(fn(), host syncs inside it)``, from CUDA's sync debug mode warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            r = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return r, sum("synchroniz" in str(w.message) for w in caught)


def dense_tflops(dev: str) -> float:
    """bf16 ``n x n x n`` matmul rate (TFLOP/s): the ceiling the expert GEMMs are held to."""
    n = 8192 if dev == "cuda" else 256
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    ms = bench(lambda: a @ b, dev, 3, 10)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def run_meta(dev: str, dense: float | None = None, argv: list[str] | None = None, **more) -> dict:
    """Device, versions, date and the command (``argv``: as given to ``main``); ``more``
    added or overriding."""
    try:
        import transformers
        tf = transformers.__version__
    except ImportError:
        tf = None
    return {**dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (logic check: not results)",
                   torch=torch.__version__, transformers=tf, python=platform.python_version(),
                   dense_bf16_tflops=dense, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   command=" ".join([Path(sys.argv[0]).name] + (sys.argv[1:] if argv is None else argv))),
            **more}


# what reading a file of the wrong shape raises: a missing key, a list for a dict, a
# string for a number, an empty list, a zero where a count was due
SHAPE_ERRORS = (KeyError, TypeError, IndexError, AttributeError, ValueError, ZeroDivisionError)


@contextlib.contextmanager
def reading(what: str, *paths: Path):
    """Inside the block the content of ``paths`` is read: an error its shape causes (a
    key missing, a value of another type) becomes one :class:`LrmoeError` naming the
    file(s) and ``what`` they should be."""
    names = ", ".join(str(p) for p in paths)
    try:
        yield
    except LrmoeError as e:
        if all(str(p) not in str(e) for p in paths):
            raise LrmoeError(f"{names}: {e}") from None
        raise
    except SHAPE_ERRORS as e:
        raise LrmoeError(f"{names}: not {what} ({type(e).__name__}: {e})") from None


def read_json(f: Path):
    """The JSON in ``f`` (gzipped where its name ends ``.gz``); unreadable: one
    :class:`LrmoeError` naming the file."""
    try:
        raw = f.read_bytes()
        return json.loads(gzip.decompress(raw) if f.name.endswith(".gz") else raw)
    except (OSError, ValueError, EOFError) as e:
        raise LrmoeError(f"{f}: not readable JSON ({type(e).__name__}: {e})") from None


def out_dir(path: str) -> Path:
    """``--out DIR``: created if missing; an existing file there is a usage error."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise LrmoeError(f"--out {path} is a file; give a directory")
    p.mkdir(parents=True, exist_ok=True)
    return p


def write_outputs(d: Path, stem: str, meta: dict, rows: list[dict], markdown: str) -> None:
    """``d/stem.json`` (every number) and ``d/stem.md`` (the tables), each written whole
    (temporary file, then rename: an interrupted run leaves the previous files)."""
    atomic_write_text(d / f"{stem}.json", json.dumps(dict(meta=meta, results=rows), indent=1))
    atomic_write_text(d / f"{stem}.md", markdown)


def fmt(v, spec: str = ".2f") -> str:
    return "—" if v is None else format(v, spec)


def gib(b: int | None) -> float | None:
    return None if b is None else b / GiB
