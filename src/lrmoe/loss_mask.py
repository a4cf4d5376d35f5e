"""Prompt/completion rows: the mask of the targets trained on, and exact loss averaging
(docs/design.md §7, "Prompt/completion rows").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lrmoe.tokenizer import Tokenizer


@dataclass
class Streams:
    """Both splits' token streams (int64 ``[N]``) and, for prompt/completion rows, the
    mask of the targets trained on (bool ``[N]``; None: every target)."""

    train_ids: torch.Tensor
    val_ids: torch.Tensor
    train_mask: torch.Tensor | None = None
    val_mask: torch.Tensor | None = None


def prompt_rows(tokenizer: Tokenizer, prompts: list[str], texts: list[str]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``prompt + completion + eos`` packed end to end, and their trained mask."""
    ps, cs = tokenizer.encode_each(prompts), tokenizer.encode_each(texts)
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    ids, mask = [], []
    for p, c in zip(ps, cs):
        ids += [p, c, eos]
        mask += [np.zeros(len(p), dtype=bool), np.ones(len(c) + 1, dtype=bool)]
    if not ids:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool)
    return torch.from_numpy(np.concatenate(ids)), torch.from_numpy(np.concatenate(mask))


IGNORE = -100  # a target not trained on (``cross_entropy``'s ignore_index, HF's label)


@dataclass
class MaskedBatch:
    """Packed windows with their loss mask: ``ids [b, L + 1]``, ``targets [b, L]`` (:data:`IGNORE`
    where not trained) and ``num_targets``, the step's trained targets divided by ``world x
    accumulation``."""

    ids: torch.Tensor
    targets: torch.Tensor
    num_targets: float

    def to(self, device) -> MaskedBatch:
        return MaskedBatch(self.ids.to(device), self.targets.to(device), self.num_targets)


def loss_args(batch: torch.Tensor | MaskedBatch
              ) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """``model.loss``'s arguments for a micro-batch: inputs, targets and the loss's
    denominator (None for a plain window batch: the mean over its targets)."""
    if isinstance(batch, MaskedBatch):
        return batch.ids[:, :-1], batch.targets, batch.num_targets
    return batch[:, :-1], batch[:, 1:], None


def masked_targets(rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return rows[:, 1:].masked_fill(~keep, IGNORE)
