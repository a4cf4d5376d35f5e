"""The backward's options, a leaf record: the trainer, the emulator and the policy config
(:class:`lrmoe.policy.registry.PolicyConfig`) build it; :mod:`lrmoe.parallel.stages` and
:mod:`lrmoe.parallel.exchange` read it."""

from __future__ import annotations

from dataclasses import dataclass

from lrmoe.errors import require
from lrmoe.ops.selection import METRICS

ESTIMATORS = ("topk", "sampled")


@dataclass
class BackwardOptions:
    """How the backward selects and ships pairs (LRMoE's runtime knobs; inert for exact
    plans). ``metric``: the recalibration metric (:data:`METRICS`); ``estimator``: ``topk``
    keeps a quota's highest-metric pairs, ``sampled`` samples ``p ∝ metric`` and
    reweights; ``compaction``: False (an ablation) zeroes unselected rows instead of
    removing them."""

    metric: str = "grad_norm"
    estimator: str = "topk"
    compaction: bool = True
    fidelity: bool = False  # also compute the exact weight gradient and compare
    # "experts": on an exact plan the expert backward computes each pair's router gradient
    # and ships it home beside dx, so the combined outputs are not kept (docs/design.md §2)
    router_grad: str = "home"
    # under an activation checkpoint of the whole block: the kept rows are saved through
    # save_for_backward (so the checkpoint drops them and its re-run restores them), not
    # held by the Function until their last use in backward
    checkpointed: bool = False

    def __post_init__(self) -> None:
        require(self.metric in METRICS, f"lrmoe metric={self.metric!r} is not one of "
                                        f"{tuple(METRICS)}")
        require(self.estimator in ESTIMATORS,
                f"lrmoe estimator={self.estimator!r} is not one of {ESTIMATORS}")
        require(self.router_grad in ("home", "experts"),
                f"router_grad={self.router_grad!r} is not one of ('home', 'experts')")
