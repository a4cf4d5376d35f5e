"""The checkpoint's file writer: DCP's, with each rank's bytes in files of bounded size,
so that a save stages at most one file's tensors in host memory at a time.

Why: ``torch.distributed.checkpoint.FileSystemWriter`` keeps every tensor it has staged
for a file (the host copy of a CUDA tensor, the compact clone of a view such as one
expert's row) until that file is closed; it keeps them for its safetensors format and
does so under ``torch.save`` too. With one file per rank, as by default, a save holds a
second host copy of nearly all that the rank saves: every expert row of the weights and
of the AdamW state, and on CUDA every tensor copied off the GPU (into pinned memory,
which the caching host allocator rounds up to a power of two). Here a rank's items go,
in their order, into files of at most :data:`FILE_BYTES` each (a larger tensor alone in
its own), written one after another, so the staging held at once is one file's. The
files are plain DCP files: ``.metadata`` names, for every key, its file and offset, and
any DCP reader (any world or EP size) loads them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType

FILE_BYTES = 1 << 30  # a file's tensor bytes, at most (one larger tensor excepted)


def item_bytes(item) -> int:
    """A write item's tensor bytes (0 for a pickled object: small, written first)."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    return item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize


def files_of(items: list, limit: int) -> list[list]:
    """``items`` in order, cut into runs of at most ``limit`` bytes (a larger item alone)."""
    files: list[list] = []
    held = limit + 1  # the first item opens a file
    for item in items:
        size = item_bytes(item)
        if held + size > limit:
            files.append([])
            held = 0
        files[-1].append(item)
        held += size
    return files


class BoundedFileWriter(FileSystemWriter):
    """A ``FileSystemWriter`` (one thread, fsync'd files) whose rank ``r`` writes
    ``__r_K_0.distcp`` for K = 0, 1, ..., each of at most ``file_bytes`` of tensors
    (:data:`FILE_BYTES` when None), one file after another."""

    def __init__(self, path: str, file_bytes: int | None = None):
        super().__init__(path, single_file_per_rank=True, thread_count=1)
        self.file_bytes = FILE_BYTES if file_bytes is None else file_bytes

    def write_data(self, plan: SavePlan, planner: SavePlanner):
        prefix = plan.storage_data.prefix  # "__r_", set by prepare_global_plan
        results = []
        for k, items in enumerate(files_of(plan.items, self.file_bytes)):
            part = dataclasses.replace(plan, items=items, storage_data=dataclasses.replace(
                plan.storage_data, prefix=f"{prefix}{k}_"))
            results += super().write_data(part, planner).wait()
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(results)
        return done
