"""Out of memory inside a training step (the ledger's verdict or the allocator's), as one
line that says how to go on (docs/design.md §7).
"""

from __future__ import annotations

import contextlib
import math
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from lrmoe.errors import LrmoeError, OutOfMemory
from lrmoe.train.config import TrainConfig
from lrmoe.units import fmt_bytes

_HOST_OOM = "DefaultCPUAllocator: can't allocate memory"
LARGE_VOCAB = 32768  # from here a micro-batch's logits are worth computing in chunks


def verdict(e: OutOfMemory, step: int) -> str:
    """``out of memory at step S (needs X GiB, budget Y GiB)``."""
    return (f"out of memory at step {step} (needs {fmt_bytes(e.needs_bytes)}, budget "
            f"{fmt_bytes(e.budget_bytes)})")


def budget_arg(n: int) -> str:
    """``--mem-budget`` text for at least ``n`` bytes: rounded up to 0.1 of a binary
    unit (``23.3MiB``), so the value given is never below the need."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{math.ceil(n * 10 / size) / 10:g}{unit}"
    return str(int(n))


def allocator_words(e: BaseException) -> tuple[str, str] | None:
    """``(where, the allocator's own first sentences)``: ``where`` is ``GPU`` or
    ``host``; None when ``e`` is no allocation failure."""
    text = str(e).strip()
    if isinstance(e, torch.OutOfMemoryError):
        return "GPU", text.split(" Of the allocated memory")[0].split(" If reserved")[0] \
            .rstrip(".")
    if isinstance(e, RuntimeError) and _HOST_OOM in text:
        return "host", text[text.index(_HOST_OOM):].split(" Error code")[0].rstrip(".")
    return None


@dataclass
class StepMemory:
    """What the out-of-memory lines of one step of run ``cfg`` on ``world`` ranks name."""

    cfg: TrainConfig
    world: int
    step: int  # 1-based
    continue_with: list[str]  # the lrmoe train arguments that continue this run
    plan_args: list[str]  # lrmoe plan's model and layout flags for this run
    intact: str  # where the last complete checkpoint is
    micro: int = 0  # 0-based: the micro-batch running
    vocab: int = 0  # the model's vocabulary: a large one's logits are worth chunking

    def batch_of(self, get: Callable[[int], torch.Tensor]) -> Callable[[int], torch.Tensor]:
        """``get``, noting which micro-batch is running."""
        def fetch(m: int) -> torch.Tensor:
            self.micro = m
            return get(m)
        return fetch

    def _continued(self, *flags: str) -> str:
        """The ``lrmoe train`` command that continues this run with ``flags`` added."""
        return shlex.join(["lrmoe", "train", *self.continue_with, *flags])

    def ledger_line(self, e: OutOfMemory) -> str:
        cmd = self._continued("--mem-budget", budget_arg(e.needs_bytes))
        policy = self.cfg.policy  # static and symi: --recompute is a fallback
        more = "; --recompute instead, if recomputing fits" \
            if policy.name in ("static", "symi") and not policy.recompute else ""
        return (f"{verdict(e, self.step)}: {e.detail}; stopped ({self.intact}); continue "
                f"with `{cmd}` (this step's need{more})")

    def allocator_line(self, where: str, words: str) -> str:
        cfg, fixes = self.cfg, []
        if cfg.activation_checkpoint != "full":  # the checkpoint runs eager only
            eager = ("--no-compile",) if cfg.compile else ()
            fixes.append(f"`{self._continued(*eager, '--activation-checkpoint', 'full')}`")
        if cfg.loss_chunk == 0 and not cfg.compile and self.vocab >= LARGE_VOCAB:
            # compiled, chunks lowered no measured peak (benchmarks/RESULTS.md)
            fixes.append(f"`{self._continued('--loss-chunk', '1024')}`")
        half = cfg.batch_size // 2
        if cfg.batch_size % 2 == 0 and half % self.world == 0:
            fixes.append(f"a new run with --batch-size {half} and --grad-accum "
                         f"{2 * cfg.grad_accum} (the same sequences a step)")
        else:
            fixes.append("a new run with a smaller --batch-size (a multiple of the world "
                         "size) and a larger --grad-accum")
        return (f"{where} out of memory at step {self.step} in micro-batch {self.micro + 1} "
                f"of {cfg.grad_accum} ({cfg.batch_size // self.world} sequences x {cfg.seq_len} tokens "
                f"on this rank): {words}; stopped ({self.intact}). A micro-batch must fit: "
                f"{' or '.join(fixes)}; `{shlex.join(['lrmoe', 'plan', *self.plan_args])}` "
                "prices the experts' share")


@contextlib.contextmanager
def step_memory(mem: StepMemory, claim: Callable[[], None]) -> Iterator[StepMemory]:
    """Turn an out-of-memory stop inside the block into one line; ``claim()`` is called
    before an error only this rank hit (its peers stay quiet)."""
    try:
        yield mem
    except OutOfMemory as e:  # every rank plans alike: every rank raises it
        raise LrmoeError(mem.ledger_line(e)) from None
    except (torch.OutOfMemoryError, RuntimeError) as e:
        found = allocator_words(e)
        if found is None:
            raise
        claim()
        raise LrmoeError(mem.allocator_line(*found), local=True) from None  # this rank's allocation
