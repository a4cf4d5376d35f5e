"""What the ranks exchange to agree: an object from each (:func:`all_gather`), the
first rank's error, raised on all (:func:`raise_first`), and a step run on every rank
whose error on any is raised on all (:func:`agree`)."""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from lrmoe.errors import LrmoeError, quiet_unless


def all_gather(obj: Any, world: int) -> list:
    """One ``obj`` per rank (``[obj]`` on one process); also the ranks' barrier."""
    if world == 1:
        return [obj]
    out: list = [None] * world
    dist.all_gather_object(out, obj)
    return out


def raise_first(errs: list[str | None], kind: type = LrmoeError, rank: int | None = None) -> None:
    """Raise the lowest failing rank's error (``errs``: one per rank) on every rank. Given
    this ``rank``, it is prefixed with the failing rank when others did not fail, and
    printed by rank 0 alone."""
    failed = [r for r, e in enumerate(errs) if e]
    if not failed:
        return
    msg = errs[failed[0]]
    if rank is None:
        raise kind(msg)
    if len(failed) < len(errs):
        msg = f"rank {failed[0]}: {msg}"
    raise quiet_unless(kind(msg), rank == 0)


def agree(fn: Callable[[], Any], ctx) -> Any:
    """Run ``fn`` on every rank of ``ctx`` (its ``rank`` and ``world``); an
    :class:`LrmoeError` on any is raised on all."""
    out, err = None, None
    try:
        out = fn()
    except LrmoeError as e:
        err = str(e)
    raise_first(all_gather(err, ctx.world), rank=ctx.rank)
    return out
