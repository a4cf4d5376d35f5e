"""The argument checks of ``lrmoe bench ttl`` that need no file (:func:`check_ttl_config`):
one line naming the flag, before anything is read or trained."""

from __future__ import annotations

from lrmoe.cli_flags import check_int, check_tokens_read
from lrmoe.errors import require
from lrmoe.sim.ttl_budget import check_fraction


def check_ttl_config(cfg) -> None:
    """Every integer within its range (int64 at most: ``--seed`` any unsigned 64-bit
    value, as torch's generators take), the run's tokens within int64, and the other
    ranges ``bench ttl`` needs (``cfg``: a :class:`lrmoe.sim.ttl.TTLConfig`)."""
    t = cfg.train
    require(t.preset or t.config, "give a model: --preset NAME or --config FILE")
    for k in ("ep", "steps", "batch_size", "seq_len", "eval_batches", "grad_accum"):
        check_int(k, getattr(t, k), 1)
    for k in ("eval_every", "warmup"):
        check_int(k, getattr(t, k), 0)
    check_int("seed", t.seed, 0, high=2**64 - 1)
    check_int("max_data_bytes", t.max_data_bytes, 1, allow_none=True)
    check_tokens_read(t.steps, t.grad_accum, t.batch_size, t.seq_len)
    require(0 < cfg.target_fraction <= 1, "--target-fraction must be in (0, 1]")
    require(t.mem_budget is None or cfg.budget_floor_fraction is None,
            "give --mem-budget or --budget-floor-fraction, not both")
    check_fraction(cfg.budget_floor_fraction)
    require(t.batch_size % t.ep == 0, f"--batch-size {t.batch_size} must be divisible by "
                                      f"--ep {t.ep} (one home rank per share of the batch)")
    require(t.device in ("cpu", "cuda"), f"--device {t.device!r}: use cpu or cuda")
    require(t.optimizer_offload in ("device", "host"),
            f"--optimizer-offload {t.optimizer_offload!r}: use device or host")
    from lrmoe.model.checkpoint import check_mode
    check_mode(t.activation_checkpoint)
    require(t.router_grad in ("home", "experts"),
            f"--router-grad {t.router_grad!r}: use home or experts")
    require(isinstance(cfg.smooth_window, int) and 1 <= cfg.smooth_window <= 2**31
            and cfg.smooth_window % 2 == 1,
            f"--smooth-window {cfg.smooth_window!r} must be an odd integer >= 1")
