"""Training: the loop (:mod:`.loop`), checkpoints (:mod:`.checkpoint`), metrics
(:mod:`.metrics`) and the optimizer/schedule (:mod:`.optim`)."""

from lrmoe.train.config import TrainConfig
from lrmoe.train.loop import train

__all__ = ["TrainConfig", "train"]
