"""A hung or dead peer under torchrun, and stop signals: one readable line each. On a
failed collective the survivors agree through the job's key-value store on one reporter;
a stop signal is read by every rank in the step's loss all-reduce, so all stop after the
same step (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import datetime
import signal
import sys
import threading
import time
import traceback

import torch.distributed as dist

from lrmoe.errors import LrmoeError
from lrmoe.train.checkpoint import latest_checkpoint

_KEY = "lrmoe/fault"
_GRACE_S = 5.0  # how long the reporter waits for the other survivors to check in


class PeerFailure(LrmoeError):
    """The job lost a rank (hung or dead)."""

    exit_code = 3


def is_peer_failure(e: RuntimeError) -> bool:
    """A torch.distributed error that means a peer stopped answering."""
    msg = str(e).lower()
    return any(s in msg for s in ("timed out", "timeout", "connection closed", "connection reset",
                                  "broken pipe", "pair closure", "connection refused"))


def collective_of(e: BaseException) -> str:
    """The torch.distributed function the error came from (innermost), or "a collective"."""
    names = [f.name for f in traceback.extract_tb(e.__traceback__)
             if "torch/distributed/" in f.filename.replace("\\", "/")
             and not f.name.startswith("_") and f.name not in ("wrapper", "inner")]
    return names[-1] if names else "a collective"


class Watch:
    """What the trainer is doing, for the failure message: phase, step, last checkpoint."""

    def __init__(self, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.phase = "setup"
        self.step = 0
        self.last_ckpt: str | None = None
        self.run_dir = None  # where to look for a checkpoint completed on disk meanwhile

    def last_complete(self) -> str | None:
        """The newest complete checkpoint: a save whose directory is renamed into place
        counts even if a collective after it failed before this rank recorded it."""
        # a failure report must not fail: on any error, fall back to the record
        with contextlib.suppress(Exception):
            found = None if self.run_dir is None else latest_checkpoint(self.run_dir)
            if found is not None:
                return str(found.path)
        return self.last_ckpt

    def _store(self):
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set_timeout(datetime.timedelta(seconds=_GRACE_S + 5))
            return store
        except Exception:  # no store (already torn down): every survivor speaks for itself
            return None

    def claim(self) -> None:
        """This rank reports its own error (a failed write): the peers that then lose
        their connection to it stay quiet."""
        store = self._store() if self.world > 1 else None
        if store is not None:
            with contextlib.suppress(Exception):
                store.set(f"{_KEY}/rank{self.rank}", self.phase)
                store.add(f"{_KEY}/first", 1)
                store.set(f"{_KEY}/reported", "1")

    def failure(self, e: BaseException) -> PeerFailure:
        """The error to raise for ``e``; ``quiet`` on every survivor but the reporter."""
        kind = ("timed out after --timeout-s " f"{self.timeout_s:g}" if "time" in str(e).lower()
                else "lost its connection to a peer")
        where = f"in {collective_of(e)} during {self.phase}"
        if self.phase != "setup":
            where += f" of step {self.step + 1}"
        last = self.last_complete()
        ck = (f"the last complete checkpoint is {last}; continue with --resume"
              if last else "no checkpoint was written yet")
        store, silent = self._store(), []
        first = True
        if store is not None:
            try:
                store.set(f"{_KEY}/rank{self.rank}", self.phase)
                first = store.add(f"{_KEY}/first", 1) == 1
                if first:
                    deadline = time.monotonic() + _GRACE_S
                    others = [r for r in range(self.world) if r != self.rank]
                    while time.monotonic() < deadline:
                        silent = [r for r in others if not store.check([f"{_KEY}/rank{r}"])]
                        if not silent:
                            break
                        time.sleep(0.1)
                else:  # stay until the reporter has spoken (torchrun kills the job
                    store.wait([f"{_KEY}/reported"])  # when the first worker exits)
            except Exception:
                first = True
        who = (f"rank(s) {', '.join(map(str, silent))} stopped responding" if silent
               else "a peer stopped responding")
        err = PeerFailure(f"rank {self.rank} {kind} {where}: {who}; {ck}")
        err.quiet = True  # printed here, once: the CLI must not print it again per rank
        if first:
            print(f"lrmoe: error: {err}", file=sys.stderr, flush=True)
            if store is not None:
                with contextlib.suppress(Exception):
                    store.set(f"{_KEY}/reported", "1")
        return err


class SignalStop(LrmoeError):
    """A requested stop (SIGTERM / SIGUSR1) after a checkpoint: exit 128 + signal."""

    def __init__(self, signum: int, msg: str):
        super().__init__(msg)
        self.exit_code = 128 + signum
        self.quiet = True  # rank 0 has printed the line


class StopSignals:
    """Once installed (main thread only), SIGTERM and SIGUSR1 set a flag in ``seen``."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.seen = [0.0, 0.0]
        self._old: dict = {}

    def install(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for i, s in enumerate(self.SIGNALS):
                self._old[s] = signal.signal(s, lambda *_, i=i: self._set(i))
        return self

    def _set(self, i: int) -> None:
        self.seen[i] = 1.0

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    @staticmethod
    def which(totals: list[float]) -> int | None:
        """The signal to stop for, from the flags summed over the ranks (None: go on)."""
        for s, n in zip(StopSignals.SIGNALS, totals):
            if n > 0:
                return int(s)
        return None
