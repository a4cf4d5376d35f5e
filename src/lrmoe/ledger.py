"""The memory ledger: bytes each rank needs for the MoE layers' experts, against a budget.

Legend: G ranks, E experts, H hidden size, F expert (moe) intermediate size, k experts per
token, L MoE layers; "pairs" are token-expert pairs. The terms, their derivation from the
code and how each is checked: docs/design.md §5. Plans are per layer and the budget is for
all MoE layers together: per-layer terms × L, buffers once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from lrmoe.config import ModelConfig
from lrmoe.errors import OutOfMemory, require
from lrmoe.units import fmt_bytes

TERMS = ("owned_state", "instance_weights", "instance_grads", "buffers", "retained_acts",
         "combine_rows", "pair_index")
PAIR_INDEX_BYTES = 4 + 3 * 8  # per home pair: gate (fp32) and three int64 indices

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


# (R, k, rec) = a·(1,0,0) + b·(1,1,0) + c·(1,1,1) with a, b, c >= 0 spans 0 <= rec <= k <= R
_CONE = np.array([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=np.int64)


def _undominated(pieces: np.ndarray) -> list[int]:
    """Rows of ``pieces`` no other row bounds wherever ``0 <= rec <= k <= R``."""
    keep = []
    idx = np.arange(len(pieces))
    for i, r in enumerate(pieces):
        d = pieces - r  # [P, 4]: another piece minus this one
        at = d[:, 1:] @ _CONE.T  # its excess along each edge of the counts' cone
        ge = (d[:, 0] >= 0) & (at >= 0).all(1)
        gt = (d[:, 0] > 0) | (at > 0).any(1)
        if not (ge & (gt | (idx < i)) & (idx != i)).any():
            keep.append(i)
    return keep


def recompute_bounds(B: int, a: np.ndarray, d: np.ndarray, k: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """For retained counts ``k`` (any shape), from the ``rec >= 1`` pieces' value ``a`` at ``rec
    = 0`` and slope ``d`` (``[..., P]``): whether some ``1 <= rec <= k`` keeps every piece
    within budget ``B``, and the fewest."""
    neg, pos, zero = d < 0, d > 0, d == 0
    lo = np.maximum(1, np.where(neg, -((B - a) // np.where(neg, -d, 1)), 1).max(-1))
    hi = np.minimum(k, np.where(pos, (B - a) // np.where(pos, d, 1), np.int64(1 << 62)).min(-1))
    ok = (lo <= hi) & np.where(zero, a <= B, True).all(-1)
    return ok, lo


def plan_counts(plan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per rank of ``plan``, int64 ``[G]``: occupied slots, received pairs, home pairs
    (what it routed, dropped pairs included) and retained pairs."""
    a = plan.assign_GGS.numpy()
    home = a.sum((1, 2))
    if plan.dropped_GE is not None:
        home = home + plan.dropped_GE.numpy().sum(1)
    n = (plan.inst_expert_GS.numpy() >= 0).sum(1)
    return n, a.sum((0, 2)), home, plan.retain_GGS.numpy().sum((0, 2))


@dataclass(frozen=True)
class BackwardRows:
    """One rank's backward rows for a known plan (:meth:`Ledger.backward_rows`)."""

    rows_in: int    # output-gradient rows received (the selected rows on this rank)
    rows_out: int   # rows this rank sends from home (its selected home pairs)
    gathered: bool  # the saved rows are gathered (selection != retention into this rank)


@dataclass
class Ledger:
    """Per-rank bytes of the MoE layers' experts; ``budget_bytes=None`` is unbounded and
    ``num_moe_layers=None`` takes the model's."""

    model_cfg: ModelConfig
    G: int
    budget_bytes: int | None = None
    bytes_w: int = 4
    bytes_act: int = 4
    num_moe_layers: int | None = None
    optimizer_offload: str = "device"
    router_grad_at_experts: bool = False
    _pieces_memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

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
                  dtype: str = "bf16", **fields) -> Ledger:
        """A ledger whose weights and activations are both in ``dtype`` (``fields``: the rest)."""
        require(dtype in DTYPE_BYTES,
                f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPE_BYTES)}")
        b = DTYPE_BYTES[dtype]
        return cls(model_cfg, G, budget_bytes, b, b, **fields)

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

    def owner_bytes(self) -> int:
        """fp32 master, grad and AdamW's two moments of the E/G owned experts × L; with host
        offload, one layer's staging (gradient out, weights in)."""
        if self.optimizer_offload == "host":
            return 2 * (self.E // self.G) * self.P_params * self.bytes_w
        return self.L * (self.E // self.G) * self.P_params * (4 + 4 + 8)

    def _index_bytes(self, n: int, gathered: bool) -> int:
        """Per backward row, the expert backward's indices and scales (more when gathered)."""
        return n * (20 + 16 * bool(gathered))

    def _memo_key(self, *what) -> tuple:
        """``what`` and every field the pieces depend on (the memo outlives none of them)."""
        return what + (self.L, self.bytes_w, self.bytes_act, self.optimizer_offload,
                       self.router_grad_at_experts, self.G, self.E, self.H,
                       self.F, self.top_k)

    def rows_buffer_bytes(self, received_pairs: int, home_pairs: int,
                          retained_pairs: int | None = None, recomputed_pairs: int = 0,
                          bwd: BackwardRows | None = None, exact: bool = False) -> int:
        """The buffers term of a plan whose backward rows ``bwd`` are known (default: an exact
        plan's; docs/design.md §5)."""
        R, h = int(received_pairs), int(home_pairs)
        k = R if retained_pairs is None else int(retained_pairs)
        rec = int(recomputed_pairs)
        T = -(-h // self.top_k)
        bwd = BackwardRows(R, h, False) if bwd is None else bwd
        y = 0 if exact and self.router_grad_at_experts else h
        return max(self._point_bytes(T, R, h, k, rec, y, bwd.rows_in, bwd.rows_out,
                                     bwd.gathered).values())

    def _point_bytes(self, T: int, R: int, h: int, k: int, rec: int, y: int, n: int, ps: int,
                     gathered: bool, rebuild=None, copy_x=None, copy_gu=None) -> dict[str, int]:
        """Bytes alive at each candidate peak, the backward's (``bwd_*``) and the forward's (``fwd_*``)."""
        b, idx = self.bytes_act, self._index_bytes(n, gathered)
        out = {"bwd_" + name: v * b + idx for name, v in
               self.backward_points(T, n, ps, k, rec, y, gathered, rebuild).items()}
        out.update({"fwd_" + name: v * b for name, v in
                    self.forward_points(T, R, h, k, rec, y, copy_x, copy_gu).items()})
        return out

    def buffer_pieces(self, home_pairs: int, exact: bool, rec_branch: bool) -> np.ndarray:
        """:meth:`counts_buffer_bytes` for ``h`` home pairs as undominated affine pieces, int64
        ``[P, 4]`` rows ``(const, per R, per k, per rec)`` whose largest value is the term."""
        h = int(home_pairs)
        key = self._memo_key("buffer", h, bool(exact), bool(rec_branch))
        hit = self._pieces_memo.get(key)
        if hit is not None:
            return hit
        T = -(-h // self.top_k)
        y = 0 if exact and self.router_grad_at_experts else h

        def at(R: int, k: int, rec: int) -> dict[str, int]:  # {point: bytes}, affine in each
            if exact:  # every received row in backward, none gathered, no input copy
                n, gth, cx = R, False, False
            else:  # a trimmed plan: at most every retained row selected (n <= k), every
                # home row sent, the saved rows gathered, the retained rows copied
                n, gth, cx = k, True, True
            return self._point_bytes(T, R, h, k, rec, y, n, h, gth, rebuild=rec_branch,
                                     copy_x=cx, copy_gu=cx or rec_branch)
        p0, *rest = (at(*v) for v in ((0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1)))
        out = np.array([[v0] + [p[name] - v0 for p in rest] for name, v0 in p0.items()],
                       dtype=np.int64)
        x = np.array([1, 1013, 701, 307], dtype=np.int64)  # affine check, generic point
        if not np.array_equal(out @ x, np.array(list(at(*x[1:].tolist()).values()))):
            raise AssertionError("a ledger point is not affine in (R, k, rec)")
        out = out[_undominated(out)]
        if len(self._pieces_memo) > 256:
            self._pieces_memo.clear()
        self._pieces_memo[key] = out
        return out

    def counts_buffer_bytes(self, received_pairs: int, home_pairs: int, retained_pairs: int,
                            recomputed_pairs: int = 0, exact: bool = False) -> int:
        """The buffers term the planners price from counts alone: an exact plan's own account, or a
        bound over every selection a trimmed plan can make (docs/design.md §5)."""
        pieces = self.buffer_pieces(home_pairs, exact, int(recomputed_pairs) > 0)
        x = np.array([1, int(received_pairs), int(retained_pairs), int(recomputed_pairs)],
                     dtype=np.int64)
        return int((pieces @ x).max())

    def forward_points(self, T: int, R: int, h: int, k: int, rec: int, y: int,
                       copy_x: bool | None = None, copy_gu: bool | None = None
                       ) -> dict[str, int]:
        """Elements alive at each candidate peak of one rank's forward, net of the layer's kept
        rows (docs/design.md §5)."""
        H, F = self.H, self.F
        kept = k * H + (k - rec) * 2 * F + y * H
        p = {
            "dispatch": T * H + h * H + R * H - kept,       # rows sent and received
            "y_gemm": T * H + R * (2 * H + 3 * F) - kept,   # x, gu, act, y
            "y_unpermute": T * H + 2 * R * H - y * H,       # y in instance and arrival order
            "y_ship": T * H + (R + h) * H - y * H,          # y sent home and arrived
            "combine": 2 * T * H + h * H - y * H,           # y home and the layer output
        }
        cx = (k < R) if copy_x is None else copy_x
        cg = (k < R or rec > 0) if copy_gu is None else copy_gu
        if cx or cg:  # x, gu, y beside the copies that will be kept
            copied = cx * k * H + cg * (k - rec) * 2 * F
            p["keep_copy"] = T * H + R * (2 * H + 2 * F) + copied - kept
        return p

    def backward_points(self, T: int, n: int, ps: int, k: int, rec: int, y: int,
                        gathered: bool, rebuild: bool | None = None) -> dict[str, int]:
        """Elements alive at each candidate peak of one rank's backward, net of the layer's kept
        rows (docs/design.md §5)."""
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
        if (rec > 0) if rebuild is None else rebuild:
            # the saved gate_up rows are copied into one buffer, then the head recomputed
            p["rebuild_copy"] = T * H + n * H + k * 2 * F - y * H
            p["rebuild_gemm"] = T * H + n * H + 2 * rec * 2 * F - y * H
        if gathered:  # x gathered (saved x dropped), then gu gathered beside the saved gu
            p["gather_gu"] = T * H + 2 * n * H + n * 2 * F + rec * 2 * F - k * H - y * H
        return p

    @staticmethod
    def backward_rows(plan, me: int) -> BackwardRows:
        """Rank ``me``'s backward rows for ``plan``."""
        sel_in, ret_in = plan.select_GGS[:, me, :], plan.retain_GGS[:, me, :]
        return BackwardRows(int(sel_in.sum()), int(plan.select_GGS[me].sum()),
                            not torch.equal(sel_in, ret_in))

    def kept_bytes(self, home_pairs: int, exact: bool = False) -> dict[str, int]:
        """Per layer, the ``combine_rows`` and ``pair_index`` a rank keeps for its home pairs."""
        Ph = int(home_pairs)
        rows = 0 if exact and self.router_grad_at_experts else Ph * self.H * self.bytes_act
        return {"combine_rows": rows, "pair_index": Ph * PAIR_INDEX_BYTES}

    @property
    def A_recompute(self) -> int:
        """Bytes per recomputed pair per layer: only the saved input row."""
        return self.H * self.bytes_act

    def terms(self, n_instances: int, received_pairs: int, home_pairs: int,
              retained_pairs: int, recomputed_pairs: int = 0, exact: bool = False) -> dict[str, int]:
        """All ledger terms of one rank from its per-layer counts (``exact=False``: a bound)."""
        inst = self.L * int(n_instances) * self.P_params * self.bytes_w
        rec = int(recomputed_pairs)
        require(0 <= rec <= int(retained_pairs),
                f"recomputed_pairs={rec} must be in [0, retained_pairs={retained_pairs}]")
        t = {
            "owned_state": self.owner_bytes(),
            "instance_weights": inst,
            "instance_grads": inst,
            "buffers": self.counts_buffer_bytes(received_pairs, home_pairs, retained_pairs,
                                                rec, exact),
            "retained_acts": self.L * ((int(retained_pairs) - rec) * self.A
                                       + rec * self.A_recompute),
        }
        t.update({k: self.L * v for k, v in self.kept_bytes(home_pairs, exact).items()})
        t["total"] = sum(t[k] for k in TERMS)
        return t

    def total_pieces(self, home_pairs: int, exact: bool, rec_branch: bool
                     ) -> tuple[int, np.ndarray]:
        """``(per_slot, pieces)``: a rank's total at ``(n, R, k, rec)`` is ``per_slot·n +
        max(pieces @ (1, R, k, rec))`` (``rec_branch``: for ``rec >= 1``)."""
        h = int(home_pairs)
        per_slot = 2 * self.L * self.P_params * self.bytes_w
        lin = np.array([self.owner_bytes() + self.L * sum(self.kept_bytes(h, exact).values()),
                        0, self.L * self.A, -self.L * (self.A - self.A_recompute)],
                       dtype=np.int64)
        return per_slot, self.buffer_pieces(h, exact, rec_branch) + lin

    def retain_capacity(self, n_instances: int, received_pairs: int, home_pairs: int,
                        exact: bool = False) -> int:
        """Most retained pairs per layer that fit with nothing recomputed (callers clip to
        ``received_pairs``); -1 if none fits."""
        if self.budget_bytes is None:
            return int(received_pairs)
        per_slot, P = self.total_pieces(home_pairs, exact, False)
        room = self.budget_bytes - per_slot * int(n_instances) - P[:, 0] - P[:, 1] * int(received_pairs)
        if (room < 0).any():
            return -1
        up = P[:, 2] > 0
        if not up.any():
            return int(received_pairs)
        return int((room[up] // P[up, 2]).min())

    def recompute_needed(self, n_instances: int, received_pairs: int, home_pairs: int,
                         retained_pairs: int, exact: bool = False) -> int:
        """Fewest pairs per layer to recompute so the rank fits (0 without a budget, -1: none)."""
        if self.budget_bytes is None:
            return 0
        n, R, h, k = int(n_instances), int(received_pairs), int(home_pairs), int(retained_pairs)
        if self.terms(n, R, h, k, 0, exact)["total"] <= self.budget_bytes:
            return 0
        ok, need = self._recompute_bounds(n, R, h, np.array([k], dtype=np.int64), exact)
        return int(need[0]) if ok[0] else -1

    def retain_capacity_recompute(self, n_instances: int, received_pairs: int,
                                  home_pairs: int, exact: bool = False) -> tuple[int, int]:
        """``(k, rec)``: the most pairs a rank can retain when it may recompute some, and the
        fewest recomputed for that (``(-1, 0)`` if none fits)."""
        n, R, h = int(n_instances), int(received_pairs), int(home_pairs)
        k0 = self.retain_capacity(n, R, h, exact)
        if k0 < 0:
            return -1, 0
        if k0 >= R:  # without a budget too
            return R, 0
        lo, hi, rec = k0, R, 0  # lo fits (with rec; none recomputed at k0), hi unknown
        while hi > lo:
            span = hi - lo  # candidates lo+1 .. hi
            m = min(64, span)
            ks = lo + 1 + (np.arange(m, dtype=np.int64) * (span - 1)) // max(m - 1, 1)
            ok, need = self._recompute_bounds(n, R, h, ks, exact)
            j = np.flatnonzero(ok)
            if j.size == 0:
                hi = int(ks[0]) - 1
                continue
            j = int(j[-1])
            lo, rec = int(ks[j]), int(need[j])
            if j < m - 1:
                hi = int(ks[j + 1]) - 1
        return lo, rec

    def _recompute_bounds(self, n: int, R: int, h: int, ks: np.ndarray, exact: bool
                          ) -> tuple[np.ndarray, np.ndarray]:
        """For each retained count in ``ks``: whether some ``1 <= rec <= k`` fits, and the fewest."""
        per_slot, P = self.total_pieces(h, exact, True)
        a = (per_slot * n + P[:, 0] + P[:, 1] * R)[None, :] + ks[:, None] * P[:, 2][None, :]
        return recompute_bounds(self.budget_bytes, a, np.broadcast_to(P[:, 3], a.shape), ks)

    def _rank_counts(self, plan) -> list[tuple[int, int, int, int]]:
        """Per rank ``(instances, received, home, retained)`` of ``plan`` (:func:`plan_counts`)."""
        return list(zip(*(x.tolist() for x in plan_counts(plan))))

    def rank_terms(self, plan, plan_buffers: bool = False) -> list[dict[str, int]]:
        """Ledger terms of every rank for one layer's ``plan``; ``plan_buffers`` prices the
        buffers on the plan's selected rows."""
        counts = self._rank_counts(plan)
        if plan.layer_checkpoint:
            return [self.layer_terms(n, R, h) for n, R, h, _ in counts]
        rec = [0] * plan.G if plan.recompute_G is None else plan.recompute_G.tolist()
        out = [self.terms(*c, n, exact=plan.exact) for c, n in zip(counts, rec)]
        if plan_buffers:  # the buffers derived from the code, for this plan (docs/design.md §5)
            for r, (t, (_, R, h, k), n) in enumerate(zip(out, counts, rec)):
                buf = self.rows_buffer_bytes(R, h, k, n, self.backward_rows(plan, r), plan.exact)
                t["total"] += buf - t["buffers"]
                t["buffers"] = buf
        return out

    def layer_checkpoint_buffer_bytes(self, received_pairs: int, home_pairs: int) -> int:
        """The buffers term of a whole-layer checkpoint (docs/design.md §5)."""
        R, h = int(received_pairs), int(home_pairs)
        T = -(-h // self.top_k)
        H, F = self.H, self.F
        y = 0 if self.router_grad_at_experts else h
        kept = R * H + R * 2 * F + y * H
        fwd = max(self.forward_points(T, R, h, R, 0, y).values()) + kept
        back = max(self.backward_points(T, R, h, R, 0, y, False).values()) + kept + T * H
        idx = h * (PAIR_INDEX_BYTES - 4)
        # the re-run in backward, the backward (forward without a graph: below the re-run)
        return max((T * H + fwd) * self.bytes_act + idx,
                   back * self.bytes_act + self._index_bytes(R, False) + idx)

    def layer_terms(self, n_instances: int, received_pairs: int, home_pairs: int
                    ) -> dict[str, int]:
        """One rank's terms under a whole-layer checkpoint: only the gates kept."""
        t = self.terms(n_instances, received_pairs, home_pairs, 0, exact=True)
        t.update(retained_acts=0, combine_rows=0,
                 pair_index=self.L * int(home_pairs) * 4,
                 buffers=self.layer_checkpoint_buffer_bytes(received_pairs, home_pairs))
        t["total"] = sum(t[k] for k in TERMS)
        return t

    def exact_fit(self, plan) -> tuple[str, list[int], list[dict[str, int]]]:
        """How an exact plan meets the budget, cheapest first: ``(mode, recomputed rows per rank,
        terms per rank)``, mode ``fits``, ``pairs``, ``layer`` or ``over``."""
        counts = self._rank_counts(plan)
        rec = [self.recompute_needed(*c, exact=plan.exact) for c in counts]
        if min(rec) >= 0:
            terms = [self.terms(*c, n, exact=plan.exact) for c, n in zip(counts, rec)]
            return ("fits" if max(rec) == 0 else "pairs"), rec, terms
        terms = [self.layer_terms(n, R, h) for n, R, h, _ in counts]
        mode = "layer" if max(t["total"] for t in terms) <= self.budget_bytes else "over"
        return mode, [R for _, R, _, _ in counts], terms

    def check(self, plan) -> list[dict[str, int]]:
        """Raise :class:`OutOfMemory` if a rank exceeds the budget; return the terms."""
        terms = self.rank_terms(plan)
        self.raise_if_over(terms, "the plan")
        return terms

    def feasible_minimum(self, tokens_per_rank_home: int | None = None) -> list[dict[str, int]]:
        """Terms per rank of the smallest memory-aware plan before any pair is routed: the
        natives, each home routing ``tokens_per_rank_home`` tokens (None: none)."""
        h = 0 if tokens_per_rank_home is None else int(tokens_per_rank_home * self.top_k)
        return [self.terms(self.E // self.G, 0, h, 0) for _ in range(self.G)]

    def raise_if_over(self, terms: list[dict[str, int]], what: str) -> None:
        """Raise :class:`OutOfMemory` naming the worst rank, its largest terms and the shortfall."""
        if self.budget_bytes is None:
            return
        over = [(t["total"] - self.budget_bytes, r) for r, t in enumerate(terms)]
        short, r = max(over)
        if short <= 0:
            return
        detail = self.describe(r, terms[r])
        raise OutOfMemory(f"{what} does not fit mem_budget: {detail}", terms[r]["total"],
                          self.budget_bytes, detail)

    def describe(self, r: int, t: dict[str, int]) -> str:
        """``rank 3 needs 41.2 GiB > budget 40.0 GiB: retained_acts 12.1 GiB, ...; short by
        1.2 GiB`` (a budget is set: only a rank over it is described)."""
        parts = ", ".join(f"{k} {fmt_bytes(t[k])}" for k in sorted(TERMS, key=lambda k: -t[k]))
        return (f"rank {r} needs {fmt_bytes(t['total'])} > budget {fmt_bytes(self.budget_bytes)}: "
                f"{parts}; short by {fmt_bytes(t['total'] - self.budget_bytes)}")
