"""The checkpoint's file writer: DCP's, with each rank's items cut, in order, into files of
at most :data:`FILE_BYTES`, so that a save stages one file's tensors in host memory at a
time (DCP's writer keeps what it staged for a file until the file closes).
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


def files_of(items: list, limit: int, nbytes=item_bytes) -> list[list]:
    """``items`` in order, cut into runs of at most ``limit`` bytes (a larger item alone)."""
    files: list[list] = []
    held = limit + 1  # the first item opens a file
    for item in items:
        size = nbytes(item)
        if held + size > limit:
            files.append([])
            held = 0
        files[-1].append(item)
        held += size
    return files


class BoundedFileWriter(FileSystemWriter):
    """A ``FileSystemWriter`` whose rank ``r`` writes ``__r_K_0.distcp`` for K = 0, 1, ...,
    one after another, each of at most :data:`FILE_BYTES` of tensors."""

    def __init__(self, path: str):
        super().__init__(path, single_file_per_rank=True, thread_count=1)

    def write_data(self, plan: SavePlan, planner: SavePlanner):
        prefix = plan.storage_data.prefix  # "__r_", set by prepare_global_plan
        results = []
        for k, items in enumerate(files_of(plan.items, FILE_BYTES)):
            part = dataclasses.replace(plan, items=items, storage_data=dataclasses.replace(
                plan.storage_data, prefix=f"{prefix}{k}_"))
            results += super().write_data(part, planner).wait()
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(results)
        return done
