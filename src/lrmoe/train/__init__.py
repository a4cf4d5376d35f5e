"""Training: the loop (:mod:`.loop`), checkpoints (:mod:`.checkpoint`), metrics
(:mod:`.metrics`) and the optimizer/schedule (:mod:`.optim`)."""

from lrmoe.train.loop import TrainConfig, train

__all__ = ["TrainConfig", "train"]
