"""Modelled per-rank stats of one MoE layer's step, from a plan alone (no kernel runs).

Legend: G ranks, S slots per rank, E experts, H hidden, F expert (moe) intermediate
size; ``_GG`` is ``[src rank, dst rank]``, ``_GGS`` ``[home rank, rank, slot]``.

:func:`modelled_stats` builds the :class:`lrmoe.sim.virtual.VirtualStats` the virtual EP
emulator would record for the same plan, so :func:`lrmoe.sim.cost.step_times` turns it
into stage times unchanged. Bytes are the emulator's exactly (tested against
:class:`lrmoe.sim.virtual.VirtualEPLayer`); they follow the exchanges of
``VirtualExchange`` and ``VirtualEPLayer.forward``:

===============  ======================================  ===========================
exchange         rows ``[g, r]``                          bytes per row
===============  ======================================  ===========================
fwd_dispatch     ``assign_GGS[g, r, :].sum()``            ``H·bytes_act``
fwd_combine      fwd_dispatch transposed                  ``H·bytes_act``
bwd_dispatch     ``select_GGS[g, r, :].sum()``            ``H·bytes_act + 12`` (row
                                                          index int64, scale fp32)
bwd_combine      bwd_dispatch transposed                  ``H·bytes_act``
weight_scatter   instances owner ``g`` sends to ``r``     ``3HF·bytes_w``
grad_reduce      weight_scatter transposed                ``3HF·bytes_w``
===============  ======================================  ===========================

The one thing the emulator measures and this module models is the expert kernel time:
a SwiGLU expert is three ``H×F`` GEMMs, so a pair costs ``6HF`` flops in forward and
``12HF`` in backward (input and weight gradients), at a fixed ``rate_flops``. That
assumes every grouped GEMM runs at the same rate whatever its size; backward is charged
for the selected (compacted) rows only, as the runtime runs it.
"""

from __future__ import annotations

from lrmoe.config import ModelConfig
from lrmoe.errors import require
from lrmoe.policy.plan import Plan
from lrmoe.sim.cost import STAGES, StepTimes, step_times
from lrmoe.sim.links import Link
from lrmoe.sim.virtual import VirtualStats, replica_rows_GG

FWD_FLOPS_PER_HF = 6    # three H·F GEMMs, 2 flops per multiply-add
BWD_FLOPS_PER_HF = 12   # dX and dW of each of them
BWD_ROW_EXTRA_BYTES = 12  # per shipped backward row: its row index (int64) and scale (fp32)


def modelled_stats(plan: Plan, cfg: ModelConfig, rate_flops: float, bytes_act: int = 2,
                   bytes_w: int = 2, recompute_rows: list[int] | None = None) -> VirtualStats:
    """MODELLED stats of one layer's step under ``plan``: nothing runs, nothing is timed.

    Args:
        plan: one layer's plan.
        cfg: the model's shapes (``hidden_size``, ``moe_intermediate_size``,
            ``num_experts``).
        rate_flops: flop/s each rank's expert GEMMs achieve (e.g. 440e12).
        bytes_act: bytes per element of activations and exchanged rows.
        bytes_w: bytes per element of the instance weights and their gradients.
        recompute_rows: per rank, pairs whose gate_up output is recomputed in backward
            (exact policies under a budget); :mod:`lrmoe.sim.cost` charges them.
    Returns:
        A :class:`VirtualStats` with ``rows``, ``rows_GG``, ``bytes_GG``, ``expert_ms``
        (modelled) and ``saved_act_bytes``.
    """
    require(rate_flops > 0, f"GEMM rate {rate_flops} flop/s must be > 0")
    H, F, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    G = plan.G
    if recompute_rows is not None:
        require(len(recompute_rows) == G,
                f"recompute_rows has {len(recompute_rows)} entries, the plan has {G} ranks")
    stats = VirtualStats(plan, recompute_rows=None if recompute_rows is None
                         else [int(n) for n in recompute_rows])

    fwd_GG = plan.assign_GGS.sum(2)
    bwd_GG = plan.select_GGS.sum(2)
    rep_GG = replica_rows_GG(plan, E)
    per_inst = 3 * H * F * bytes_w
    for name, rows_GG, row_bytes in (
            ("fwd_dispatch", fwd_GG, H * bytes_act),
            ("fwd_combine", fwd_GG.t(), H * bytes_act),
            ("bwd_dispatch", bwd_GG, H * bytes_act + BWD_ROW_EXTRA_BYTES),
            ("bwd_combine", bwd_GG.t(), H * bytes_act),
            ("weight_scatter", rep_GG, per_inst),
            ("grad_reduce", rep_GG.t(), per_inst)):
        stats.rows_GG[name] = rows_GG.contiguous()
        stats.bytes_GG[name] = rows_GG * row_bytes

    fwd = plan.rank_load().tolist()
    selected = plan.rank_backward_load().tolist()
    retained = plan.retain_GGS.sum(dim=(0, 2)).tolist()
    stats.rows = {"fwd": fwd, "retained": retained, "bwd": list(selected),
                  "selected": selected}
    ms_per_flop = 1e3 / rate_flops
    stats.expert_ms = {
        "fwd": [n * FWD_FLOPS_PER_HF * H * F * ms_per_flop for n in fwd],
        "bwd": [n * BWD_FLOPS_PER_HF * H * F * ms_per_flop for n in selected],
    }
    stats.saved_act_bytes = [n * (H + 2 * F) * bytes_act for n in retained]
    return stats


def mean_step_times(stats: list[VirtualStats], link: Link) -> StepTimes:
    """Stage by stage, the mean over ``stats`` (each one layer's step, e.g. several sampled
    steps and layers) of :func:`lrmoe.sim.cost.step_times`, labelled ``modelled``."""
    require(len(stats) > 0, "no layer stats to average")
    runs = [step_times(s, link) for s in stats]
    out = StepTimes(link=link.name, label="modelled")
    for k in STAGES:
        setattr(out, k, sum(getattr(r, k) for r in runs) / len(runs))
    return out
