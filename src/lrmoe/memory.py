"""The memory ledger: bytes each rank needs for the MoE layers' experts, against a budget.

Legend: G ranks, E experts, S slots per rank, H hidden size, F expert (moe) intermediate
size, k experts per token, L MoE layers. "Pairs" are token-expert pairs.

Every formula the planners and the runtime agree on lives here (SYSTEM.md §5):

===================  ===========================================  =========================
term                 bytes per rank                               counted
===================  ===========================================  =========================
owned_state          (E/G) · 3HF · (4 master + 4 grad + 8 Adam)   per layer × L
  (offload "host")   2 · (E/G) · 3HF · bytes_w (staging)          once
instance_weights     occupied_slots · 3HF · bytes_w               per layer × L
instance_grads       occupied_slots · 3HF · bytes_w               per layer × L
buffers              see :meth:`Ledger.buffer_bytes`              once (transient)
retained_acts        retained_pairs · (H + 2F) · bytes_act        per layer × L
combine_rows         P_home · H · bytes_act                       per layer × L
pair_index           P_home · 28                                  per layer × L
===================  ===========================================  =========================

* SwiGLU experts: ``gate_up_proj [2F, H]`` + ``down_proj [H, F]`` = 3HF parameters.
* Optimizer offload (``optimizer_offload="host"``, SYMI's memory design): the fp32
  masters, fp32 gradients and AdamW moments live in host memory (SYMI shards each
  expert's 1/G on every rank's host; static and lrmoe keep their owned experts'; the
  bytes per rank are the same), so the GPU keeps only its slots (the instance terms,
  natives included) plus one layer's staging: the E/G experts' worth of gradient going
  to the host and of updated weights coming back, in the compute dtype, counted once.
  The traffic this costs is modelled in :mod:`lrmoe.sim.offload`.
* Owned state: expert e's fp32 master weights, fp32 gradient and AdamW's two fp32
  moments live on its owner rank ``e // (E/G)``, for every policy, so the term is the
  same on every rank (SYSTEM.md's "equal totals"). AdamW's scalar ``step`` counters
  are ignored (4 bytes per tensor).
* Instances: every occupied slot materialises its expert's weights and a gradient
  buffer in the compute dtype (natives too), so ``P = 2 · 3HF · bytes_w`` per slot.
* Buffers (:meth:`Ledger.buffer_bytes`): the largest set of transients alive at once
  in one layer's forward or backward (``parallel/exchange.py``), on top of what is kept
  for backward. They are freed before the next layer runs, so they count once, not per
  layer. The backward frees the layer's kept rows as it goes, which
  :meth:`Ledger.plan_buffer_bytes` prices (net of them); ``buffer_bytes``, what the
  planners use, does not (a conservative bound).
* Retained activations: ``A = (H + 2F) · bytes_act`` per retained pair (the input row
  and the gate_up pre-activation the expert saves), on the rank that processes it.
* Combined rows: every home pair's expert output row comes back home (``y_send``) and
  is kept until backward, where it gives the exact router gradient
  ``<dy[t], y_e(x_t)>``: ``P_home · H · bytes_act`` per layer, whatever is retained.
  With ``router_grad_at_experts`` (the runtime's ``BackwardOptions(router_grad="experts")``)
  an exact plan keeps none: the expert backward computes ``<dy[t] @ w2, silu(g)·u>``
  for every pair instead, so the term is 0 for exact plans (LRMoE's trimmed plans still
  keep them: their unselected pairs never reach an expert in backward).
* Pair index: per home pair, what the exchange keeps for backward to find its rows:
  its gate weight (fp32, 4 bytes) and three int64 indices (its send-buffer row, the
  pair of each send row, each send row's index in its block): 28 bytes.
* Not in this ledger (policy-independent, checked in ``tests/test_ledger_truth.py``):
  the router's saved tensors and the layer input it saves, and the plan and counts,
  which live in host memory.
* Recompute (a plan's ``recompute_G`` rows): a pair whose gate_up output is recomputed
  in backward keeps only its input row, ``H · bytes_act``, and costs one more gate_up
  GEMM (2 of the expert's 3 GEMMs in the forward) in backward. An exact policy over
  budget recomputes the fewest pairs that make each rank fit (:meth:`Ledger.exact_fit`,
  mode ``"pairs"``). Where even recomputing every pair does not fit, the emulator models
  a whole-layer checkpoint (mode ``"layer"``): nothing is retained on the expert ranks
  (the layer's input is the residual stream, saved outside this ledger) and backward
  re-runs the layer's forward dispatch, experts and combine first.

Plans are per layer; the budget is for all MoE layers together, so the check assumes
every layer's plan looks like the one checked: per-layer terms × L, buffers once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from lrmoe.config import ModelConfig
from lrmoe.errors import LrmoeError, require

TERMS = ("owned_state", "instance_weights", "instance_grads", "buffers", "retained_acts",
         "combine_rows", "pair_index")
PAIR_INDEX_BYTES = 4 + 3 * 8  # per home pair: gate (fp32) and three int64 indices

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


def parse_bytes(text: str | int) -> int:
    """``"40GiB"``, ``"1.5GB"``, ``"123456"``, ``"512 MiB"`` -> bytes.

    KB/MB/GB/TB are powers of 1000; KiB/MiB/GiB/TiB and the bare K/M/G/T are powers
    of 1024. Case-insensitive. Fractions round to the nearest byte.
    """
    if isinstance(text, bool):
        raise LrmoeError(f"memory size {text!r} is not a size; write e.g. 40GiB or 123456")
    if isinstance(text, int):
        require(text > 0, f"memory size {text} must be a positive number of bytes")
        return text
    m = _BYTES_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise LrmoeError(
            f"memory size {text!r} is not understood; write a number with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 40GiB or 123456")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise LrmoeError(f"memory size {text!r} must be at least 1 byte")
    return int(round(value))


def fmt_bytes(n: float) -> str:
    """Bytes as a short human string in binary units: ``41.2 GiB``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.1f} {unit}"
    return f"{sign}{int(n)} B"


def actual_param_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes held by the given tensors (each counted once), for checking the ledger."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


@dataclass(frozen=True)
class BackwardRows:
    """One rank's backward rows for a known plan (:meth:`Ledger.backward_rows`)."""

    rows_in: int    # output-gradient rows received (the selected rows on this rank)
    rows_out: int   # rows this rank sends from home (its selected home pairs)
    gathered: bool  # the saved rows are gathered (selection != retention into this rank)


@dataclass
class Ledger:
    """Per-rank bytes of the MoE layers' experts (see the module docstring).

    Attributes:
        model_cfg: the model's shapes.
        G: ranks in the EP group.
        budget_bytes: bytes per rank for all MoE layers' expert memory; ``None`` means
            unbounded (every check passes).
        bytes_w: bytes per element of the compute-dtype instance weights and grads.
        bytes_act: bytes per element of activations and dispatch buffers.
        num_moe_layers: L; ``None`` takes ``len(model_cfg.moe_layers)``.
    """

    model_cfg: ModelConfig
    G: int
    budget_bytes: int | None = None
    bytes_w: int = 4
    bytes_act: int = 4
    num_moe_layers: int | None = None
    optimizer_offload: str = "device"
    router_grad_at_experts: bool = False

    def __post_init__(self) -> None:
        E = self.model_cfg.num_experts
        require(isinstance(self.G, int) and self.G > 0, f"EP size G={self.G!r} must be >= 1")
        require(E % self.G == 0,
                f"number of experts {E} is not divisible by the EP size {self.G}; "
                f"use an EP size that divides {E}")
        if self.num_moe_layers is None:
            self.num_moe_layers = len(self.model_cfg.moe_layers)
        require(self.num_moe_layers >= 1, f"num_moe_layers={self.num_moe_layers} must be >= 1")
        require(self.optimizer_offload in ("device", "host"),
                f"optimizer offload {self.optimizer_offload!r}: use device or host")
        for name in ("bytes_w", "bytes_act"):
            v = getattr(self, name)
            require(v in (1, 2, 4, 8), f"{name}={v!r} must be 1, 2, 4 or 8")
        if self.budget_bytes is not None:
            require(self.budget_bytes > 0, f"mem_budget={self.budget_bytes} must be > 0 bytes")

    @classmethod
    def for_dtype(cls, model_cfg: ModelConfig, G: int, budget_bytes: int | None = None,
                  dtype: str = "bf16", num_moe_layers: int | None = None,
                  optimizer_offload: str = "device", router_grad_at_experts: bool = False) -> Ledger:
        """A ledger whose weights and activations are both in ``dtype``."""
        if dtype not in DTYPE_BYTES:
            raise LrmoeError(f"dtype={dtype!r} is not supported; use one of "
                             f"{', '.join(DTYPE_BYTES)}")
        b = DTYPE_BYTES[dtype]
        return cls(model_cfg, G, budget_bytes, b, b, num_moe_layers, optimizer_offload,
                   router_grad_at_experts)

    # ------------------------------------------------------------------ sizes
    @property
    def L(self) -> int:
        return int(self.num_moe_layers)

    @property
    def H(self) -> int:
        return self.model_cfg.hidden_size

    @property
    def F(self) -> int:
        return self.model_cfg.moe_intermediate_size

    @property
    def E(self) -> int:
        return self.model_cfg.num_experts

    @property
    def top_k(self) -> int:
        return self.model_cfg.num_experts_per_tok

    @property
    def P_params(self) -> int:
        """Parameters per expert: ``gate_up_proj [2F, H]`` + ``down_proj [H, F]``."""
        return 3 * self.H * self.F

    @property
    def P(self) -> int:
        """Bytes per occupied slot per layer: compute-dtype weights + gradient buffer."""
        return 2 * self.P_params * self.bytes_w

    @property
    def A(self) -> int:
        """Bytes per retained pair per layer: the saved input row and gate_up output."""
        return (self.H + 2 * self.F) * self.bytes_act

    def owner_bytes_per_layer(self) -> int:
        """fp32 master + fp32 grad + AdamW's 2 fp32 moments of the E/G owned experts
        (0 with ``optimizer_offload="host"``: they live in host memory)."""
        if self.optimizer_offload == "host":
            return 0
        return (self.E // self.G) * self.P_params * (4 + 4 + 8)

    def owner_bytes(self) -> int:
        """:meth:`owner_bytes_per_layer` × L: the same on every rank, for every policy.
        With host offload: one layer's staging (gradient out, weights in), counted once."""
        if self.optimizer_offload == "host":
            return 2 * (self.E // self.G) * self.P_params * self.bytes_w
        return self.L * self.owner_bytes_per_layer()

    def buffer_bytes(self, received_pairs: int, home_pairs: int) -> int:
        """Transients of one layer on one rank (counted once), the larger of its forward
        and its backward, each at its largest point in ``parallel/exchange.py``:

        * forward, inside the experts: the layer input in the compute dtype ``T·H``
          (``T = home_pairs / top_k``), the received rows ``R·H``, the gate_up output
          ``R·2F``, the activation ``R·F`` and the expert output ``R·H``; or, during the
          dispatch, ``T·H`` + the send buffer ``P_home·H`` + the received rows ``R·H``;
        * backward, at the input-gradient GEMM: the output gradient ``T·H``, the rows
          sent ``P_home·H``, the rows received and put in instance order ``2·R·H``, the
          gathered saved rows ``R·(H + 2F)`` (a compacted backward), and inside the
          expert backward the activation ``R·F``, its gradient ``R·F``, the gate_up
          gradient ``R·2F`` and ``dx`` ``R·H``.

        ``R`` bounds the backward's rows (select <= assign). Weight gradients are the
        ``instance_grads`` term; the tensors kept for backward are their own terms.
        """
        R, Ph, H, F = int(received_pairs), int(home_pairs), self.H, self.F
        T = -(-Ph // self.top_k)
        fwd = T * H + max(R * (2 * H + 3 * F), Ph * H + R * H)
        bwd = T * H + Ph * H + R * (2 * H) + R * (H + 2 * F) + R * (4 * F + H)
        return max(fwd, bwd) * self.bytes_act

    def plan_buffer_bytes(self, received_pairs: int, home_pairs: int,
                          retained_pairs: int | None = None, recomputed_pairs: int = 0,
                          bwd: BackwardRows | None = None, exact: bool = False) -> int:
        """The buffers term derived from the code and checked against it (CPU: the row
        tensors alive at every point of the backward, ``tests/test_ledger_truth.py``;
        H200: the measured peak, ``benchmarks/ledger_peak.py``): one layer's transients
        on one rank, at the largest point of its forward or backward
        (``parallel/exchange.py``, ``ops/experts.py``), on top of the layer's kept terms.
        Derivation: ``docs/design.md`` §5. Not yet what the planners price
        (:meth:`buffer_bytes`); ``rank_terms(plan, plan_buffers=True)`` uses it.

        The backward drops each kept row tensor at its last use (the combined rows after
        the router gradient, the saved rows inside the expert backward), so the term is
        the largest, over the points of :meth:`backward_points`, of the rows alive minus
        this layer's kept rows (it can be smaller than the transients alone), plus the
        per-row indices of the expert backward. With ``bwd`` (a known plan,
        :meth:`backward_rows`) the rows are the plan's *selected* rows, and the points of
        :meth:`forward_points` (beyond what the layer then keeps) are included. Without
        it (planning time) the counts are priced as the exact plan of ``R`` received and
        ``h`` home pairs (every row in backward, none gathered), independent of the
        retention (a trimmed plan, whose kept rows are copies and whose selection may be
        gathered, can need more than that). ``exact``: the plan
        is exact, so with ``router_grad_at_experts`` no combined rows are kept (as in
        :meth:`kept_bytes`).
        """
        R, h = int(received_pairs), int(home_pairs)
        k = R if retained_pairs is None else int(retained_pairs)
        rec = int(recomputed_pairs)
        T = -(-h // self.top_k)
        b = self.bytes_act
        n, ps, gth = (R, h, False) if bwd is None else (bwd.rows_in, bwd.rows_out, bwd.gathered)
        y = 0 if (exact or bwd is None) and self.router_grad_at_experts else h
        back = max(self.backward_points(T, n, ps, k, rec, y, gth).values()) * b
        back += n * (20 + 16 * bool(gth))
        if bwd is None:
            return back
        return max(back, max(self.forward_points(T, R, h, k, rec, y).values()) * b)

    def forward_points(self, T: int, R: int, h: int, k: int, rec: int, y: int) -> dict[str, int]:
        """Elements in row tensors alive at each candidate peak of one rank's forward,
        minus this layer's kept rows (as :meth:`backward_points`; they are being made
        here), for ``T`` home tokens, ``h`` home pairs, ``R`` received pairs, ``k`` of
        them retained (``rec`` recomputed) and ``y`` combined rows kept. The layer input
        ``T·H`` (compute dtype) is alive throughout. The kept rows are copied out of the
        experts' ``x`` and ``gu`` while those and the expert output ``y`` are still alive
        (``parallel/exchange.py``): the retained rows of a trimmed plan (``k < R``), the
        saved part of ``gu`` when ``rec`` rows are recomputed; an exact plan without
        recompute keeps the experts' tensors themselves (no copy). After that every kept
        row but ``y`` is alive, so the points that follow are net of ``y·H`` only (for an
        exact plan the first two equal the backward's permute and ship points)."""
        H, F = self.H, self.F
        kept = k * H + (k - rec) * 2 * F + y * H
        p = {
            "dispatch": T * H + h * H + R * H - kept,       # rows sent and received
            "y_gemm": T * H + R * (2 * H + 3 * F) - kept,   # x, gu, act, y
            "y_unpermute": T * H + 2 * R * H - y * H,       # y in instance and arrival order
            "y_ship": T * H + (R + h) * H - y * H,          # y sent home and arrived
            "combine": 2 * T * H + h * H - y * H,           # y home and the layer output
        }
        copied = (k < R) * k * H + (k < R or rec > 0) * (k - rec) * 2 * F
        if copied:  # x, gu, y beside the copies that will be kept
            p["keep_copy"] = T * H + R * (2 * H + 2 * F) + copied - kept
        return p

    def backward_points(self, T: int, n: int, ps: int, k: int, rec: int, y: int,
                        gathered: bool) -> dict[str, int]:
        """Elements in row tensors alive at each candidate peak of one rank's backward,
        minus this layer's kept rows (``k·H + (k - rec)·2F + y·H``: ``k`` retained rows,
        ``rec`` of them recomputed, ``y`` combined rows), for ``T`` home tokens, ``n``
        rows received (selected) and ``ps`` sent; ``gathered``: the saved rows are
        gathered (selection != retention). The output gradient ``T·H`` is alive
        throughout. Points dominated by these (the dx GEMM, dx's way home) are left out;
        the code's order is walked in ``docs/design.md`` §5."""
        H, F = self.H, self.F
        kept = k * H + (k - rec) * 2 * F + y * H
        p = {
            "router_grad": T * H,                          # every kept row, dout
            "ship": T * H + (ps + n) * H - y * H,          # rows sent and arrived; y dropped
            "permute": T * H + 2 * n * H + rec * 2 * F - y * H,  # arrived + instance order
            "act": T * H + n * (2 * H + 3 * F) - kept,     # x, gu, dy, act: the dw2 GEMM
            "dgu": T * H + n * (H + 5 * F) - kept,         # x, gu, dact, dgu
            "dx_home": 2 * T * H + ps * H - kept,          # dx back home and combined
        }
        if rec:  # the saved gate_up rows are copied into one buffer, then the head recomputed
            p["rebuild_copy"] = T * H + n * H + k * 2 * F - y * H
            p["rebuild_gemm"] = T * H + n * H + 2 * rec * 2 * F - y * H
        if gathered:  # x gathered (saved x dropped), then gu gathered beside the saved gu
            p["gather_gu"] = T * H + 2 * n * H + n * 2 * F + rec * 2 * F - k * H - y * H
        return p

    @staticmethod
    def backward_rows(plan, me: int) -> BackwardRows:
        """What rank ``me``'s backward works on for ``plan`` (top-k selection, compaction
        on): rows received (``select`` into ``me``), rows sent (``select`` from ``me``),
        and whether the saved rows are gathered (the selection differs from the retention
        on some block into ``me``)."""
        sel_in, ret_in = plan.select_GGS[:, me, :], plan.retain_GGS[:, me, :]
        return BackwardRows(int(sel_in.sum()), int(plan.select_GGS[me].sum()),
                            not torch.equal(sel_in, ret_in))

    def kept_bytes(self, home_pairs: int, exact: bool = False) -> dict[str, int]:
        """Per layer, what a rank keeps for backward for its home pairs whatever the plan:
        ``combine_rows`` (the combined expert outputs, for the router gradient; none for an
        ``exact`` plan with ``router_grad_at_experts``) and ``pair_index`` (see the module
        docstring)."""
        Ph = int(home_pairs)
        rows = 0 if exact and self.router_grad_at_experts else Ph * self.H * self.bytes_act
        return {"combine_rows": rows, "pair_index": Ph * PAIR_INDEX_BYTES}

    # ------------------------------------------------------------------ per rank
    @property
    def A_recompute(self) -> int:
        """Bytes per recomputed pair per layer: only the saved input row."""
        return self.H * self.bytes_act

    def terms(self, n_instances: int, received_pairs: int, home_pairs: int,
              retained_pairs: int, recomputed_pairs: int = 0, exact: bool = False) -> dict[str, int]:
        """All ledger terms of one rank from its per-layer counts (see module docstring).

        ``recomputed_pairs`` (<= ``retained_pairs``) of the retained pairs keep only
        their input row (:attr:`A_recompute`) instead of :attr:`A`. ``exact``: the plan
        is exact (:attr:`lrmoe.policy.plan.Plan.exact`); callers that do not know count
        the combined rows (an upper bound).
        """
        inst = self.L * int(n_instances) * self.P_params * self.bytes_w
        rec = int(recomputed_pairs)
        require(0 <= rec <= int(retained_pairs),
                f"recomputed_pairs={rec} must be in [0, retained_pairs={retained_pairs}]")
        t = {
            "owned_state": self.owner_bytes(),
            "instance_weights": inst,
            "instance_grads": inst,
            "buffers": self.buffer_bytes(received_pairs, home_pairs),
            "retained_acts": self.L * ((int(retained_pairs) - rec) * self.A
                                       + rec * self.A_recompute),
        }
        t.update({k: self.L * v for k, v in self.kept_bytes(home_pairs, exact).items()})
        t["total"] = sum(t[k] for k in TERMS)
        return t

    def retain_capacity(self, n_instances: int, received_pairs: int, home_pairs: int) -> int:
        """Most retained pairs per layer a rank can afford; negative if even 0 does not fit.

        Unbounded ledgers return ``received_pairs`` (everything fits).
        """
        if self.budget_bytes is None:
            return int(received_pairs)
        fixed = self.terms(n_instances, received_pairs, home_pairs, 0)["total"]
        room = self.budget_bytes - fixed
        if room < 0:
            return -1
        return room // (self.L * self.A)

    @staticmethod
    def _home_pairs(plan, home_pairs: int | None) -> Tensor:
        if home_pairs is not None:
            return torch.full((plan.G,), int(home_pairs), dtype=torch.long)
        home = plan.assign_GGS.sum(dim=(1, 2))
        if plan.dropped_GE is not None:
            home = home + plan.dropped_GE.long().sum(1)
        return home

    def _rank_counts(self, plan, tokens_per_rank_home: int | None
                     ) -> list[tuple[int, int, int, int]]:
        """Per rank ``(instances, received, home, retained)`` pairs of ``plan``."""
        home = self._home_pairs(
            plan, None if tokens_per_rank_home is None else tokens_per_rank_home * self.top_k)
        n_inst = (plan.inst_expert_GS >= 0).sum(1)
        recv = plan.assign_GGS.sum(dim=(0, 2))
        kept = plan.retain_GGS.sum(dim=(0, 2))
        return [(int(n_inst[r]), int(recv[r]), int(home[r]), int(kept[r]))
                for r in range(plan.G)]

    def rank_terms(self, plan, tokens_per_rank_home: int | None = None,
                   plan_buffers: bool = False) -> list[dict[str, int]]:
        """Ledger terms of every rank for ``plan`` (one layer's plan, repeated over L).

        Args:
            plan: a :class:`lrmoe.policy.plan.Plan` (its ``recompute_G`` rows count at
                :attr:`A_recompute`).
            tokens_per_rank_home: tokens per home rank; its pairs ``tokens · top_k`` size
                the send/combine buffers. ``None`` takes each home's routed pairs from
                the plan (assigned + dropped).
            plan_buffers: price the buffers with :meth:`plan_buffer_bytes` (the plan's
                selected rows) instead of :meth:`buffer_bytes` (what the planners use).
        """
        rec = [0] * plan.G if plan.recompute_G is None else plan.recompute_G.tolist()
        out = [self.terms(*c, n, exact=plan.exact)
               for c, n in zip(self._rank_counts(plan, tokens_per_rank_home), rec)]
        if plan_buffers:  # the buffers derived from the code, for this plan (§5)
            counts = self._rank_counts(plan, tokens_per_rank_home)
            for r, (t, (_, R, h, k), n) in enumerate(zip(out, counts, rec)):
                buf = self.plan_buffer_bytes(R, h, k, n, self.backward_rows(plan, r), plan.exact)
                t["total"] += buf - t["buffers"]
                t["buffers"] = buf
        return out

    def recompute_needed(self, n_instances: int, received_pairs: int, home_pairs: int,
                         retained_pairs: int, exact: bool = False) -> int:
        """Fewest pairs per layer to recompute so the rank fits; -1 if even recomputing
        every retained pair does not fit. 0 when there is no budget. ``exact``: as in
        :meth:`terms`."""
        if self.budget_bytes is None:
            return 0
        full = self.terms(n_instances, received_pairs, home_pairs, retained_pairs,
                          exact=exact)["total"]
        over = full - self.budget_bytes
        if over <= 0:
            return 0
        per_pair = self.L * (self.A - self.A_recompute)
        need = -(-over // per_pair)
        return int(need) if need <= retained_pairs else -1

    def exact_fit(self, plan, tokens_per_rank_home: int | None = None
                  ) -> tuple[str, list[int], list[dict[str, int]]]:
        """How an exact (every pair in backward) plan meets the budget, cheapest first.

        Returns ``(mode, recomputed rows per rank, terms per rank)``, mode one of:
        ``"fits"`` (nothing recomputed), ``"pairs"`` (the fewest pairs' gate_up outputs
        recomputed per rank, :meth:`recompute_needed`), ``"layer"`` (whole-layer
        checkpoint: no retained activations, every received row re-run forward in
        backward), ``"over"`` (even that does not fit; terms of the layer checkpoint).
        With ``router_grad_at_experts`` an exact plan keeps no combined rows (as
        :meth:`rank_terms`).
        """
        counts = self._rank_counts(plan, tokens_per_rank_home)
        rec = [self.recompute_needed(*c, exact=plan.exact) for c in counts]
        if min(rec) >= 0:
            terms = [self.terms(*c, n, exact=plan.exact) for c, n in zip(counts, rec)]
            return ("fits" if max(rec) == 0 else "pairs"), rec, terms
        terms = [self.terms(n, R, h, 0, exact=plan.exact) for n, R, h, _ in counts]
        mode = "layer" if max(t["total"] for t in terms) <= self.budget_bytes else "over"
        return mode, [R for _, R, _, _ in counts], terms

    def check(self, plan, tokens_per_rank_home: int | None = None) -> list[dict[str, int]]:
        """Raise :class:`LrmoeError` if a rank exceeds the budget; return the terms."""
        terms = self.rank_terms(plan, tokens_per_rank_home)
        self.raise_if_over(terms, "the plan")
        return terms

    def feasible_minimum(self, counts_GE: Tensor | None = None,
                         tokens_per_rank_home: int | None = None) -> list[dict[str, int]]:
        """Terms of the smallest plan a memory-aware planner could make, per rank.

        The native experts only (E/G slots) with one retained pair per instance; the
        buffers carry the native placement's received pairs for ``counts_GE`` (zero when
        no counts are given).
        """
        n = self.E // self.G
        if counts_GE is None:
            recv = home = torch.zeros(self.G, dtype=torch.long)
        else:
            c = counts_GE.long()
            require(tuple(c.shape) == (self.G, self.E),
                    f"counts have shape {tuple(c.shape)}, the ledger wants {(self.G, self.E)}")
            recv = c.sum(0).reshape(self.G, n).sum(1)
            home = c.sum(1)
        if tokens_per_rank_home is not None:
            home = torch.full((self.G,), tokens_per_rank_home * self.top_k, dtype=torch.long)
        return [self.terms(n, int(recv[r]), int(home[r]), min(n, int(recv[r])))
                for r in range(self.G)]

    def raise_if_over(self, terms: list[dict[str, int]], what: str) -> None:
        """Raise naming the worst rank, its largest terms and the shortfall."""
        if self.budget_bytes is None:
            return
        over = [(t["total"] - self.budget_bytes, r) for r, t in enumerate(terms)]
        short, r = max(over)
        if short <= 0:
            return
        raise LrmoeError(f"{what} does not fit mem_budget: {self.describe(r, terms[r])}")

    def describe(self, r: int, t: dict[str, int]) -> str:
        """``rank 3 needs 41.2 GiB > budget 40.0 GiB: retained_acts 12.1 GiB, ...``."""
        parts = ", ".join(f"{k} {fmt_bytes(t[k])}"
                          for k in sorted(TERMS, key=lambda k: -t[k]))
        budget = "unbounded" if self.budget_bytes is None else fmt_bytes(self.budget_bytes)
        msg = f"rank {r} needs {fmt_bytes(t['total'])} > budget {budget}: {parts}"
        if self.budget_bytes is not None:
            msg += f"; short by {fmt_bytes(t['total'] - self.budget_bytes)}"
        return msg
