"""``--log tensorboard``: the metrics rows mirrored as TensorBoard events in
``RUN/tensorboard/``: each number a scalar at the row's ``step`` (``train/KEY``,
``val/KEY``, ``moeK/KEY`` for MoE layer ``K``), each MoE layer's counts a histogram over
the expert ids. A resumed run purges the events after its checkpoint's step, as
``metrics.jsonl`` drops those rows.
"""

from __future__ import annotations

from pathlib import Path

TB_DIR = "tensorboard"


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class TensorBoardSink:
    """Writes each metrics row as events (rank 0 only, like :class:`MetricsWriter`)."""

    def __init__(self, log_dir: str | Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(str(log_dir), purge_step=first_step, flush_secs=10)

    def write(self, row: dict) -> None:
        kind, step = row.get("kind"), row.get("step")
        if kind not in ("train", "val"):
            return
        for key, v in row.items():
            if _number(v) and key != "step":
                self.w.add_scalar(f"{kind}/{key}", v, step)
        if kind != "train":
            return
        for k, v in enumerate(row.get("expert_load_max_over_mean", [])):
            if _number(v):
                self.w.add_scalar(f"moe{k}/expert_load_max_over_mean", v, step)
        for k, stats in enumerate(row.get("moe", [])):
            for key, v in stats.items():
                if _number(v):
                    self.w.add_scalar(f"moe{k}/{key}", v, step)
        for k, loads in enumerate(row.get("rank_load", [])):
            for r, v in enumerate(loads):
                self.w.add_scalar(f"moe{k}/rank_load/r{r}", v, step)
        for k, counts in enumerate(row.get("counts", [])):
            if counts:
                self.expert_load(f"moe{k}/expert_load", counts, step)

    def expert_load(self, tag: str, counts: list[int], step: int) -> None:
        """A histogram over expert ids: bucket ``e`` spans ``(e - 0.5, e + 0.5]`` and
        holds ``counts[e]`` pairs; its moments are those of the routed pairs' ids."""
        ids = range(len(counts))
        self.w.add_histogram_raw(
            tag, min=0, max=len(counts) - 1, num=sum(counts),
            sum=sum(e * c for e, c in zip(ids, counts)),
            sum_squares=sum(e * e * c for e, c in zip(ids, counts)),
            bucket_limits=[e + 0.5 for e in ids], bucket_counts=list(counts), global_step=step)

    def close(self) -> None:
        self.w.close()
