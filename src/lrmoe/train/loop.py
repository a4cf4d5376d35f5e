"""The trainer: data -> model (EP-sharded) -> AdamW steps -> metrics, validation, checkpoints.

Every input is read and checked before the run directory is written; on one process no
``torch.distributed`` call is made. A checkpoint holds everything that evolves besides the
data order (a function of the global batch), so on the CPU a resumed run repeats the
uninterrupted one bit for bit (docs/design.md §7).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lrmoe.cli_flags import flag
from lrmoe.config import ModelConfig
from lrmoe.errors import LrmoeError, quiet_unless
from lrmoe.loss_mask import IGNORE, loss_args
from lrmoe.model import MoEForCausalLM
from lrmoe.model.moe import host_stats
from lrmoe.parallel.groups import all_reduce_sum, init_parallel, shard_experts
from lrmoe.policy.registry import make_policy
from lrmoe.tokenizer import check_vocab
from lrmoe.train import checkpoint as ckpt
from lrmoe.train import rundir
from lrmoe.train.accum import accumulate, update
from lrmoe.train.config import (
    RESUME_CHANGES,
    RUN_CONFIG,
    RUN_FORMAT,
    TrainConfig,
    build_ledger,
    build_runtime,
    check_args,
    check_join_flags,
    config_from_cli,
    data_reuse_warning,
    ignored_flags,
    read_run_config,
    resolve_model_config,
    resume_changes,
    trajectory_mismatch,
)
from lrmoe.train.divergence import DivergenceGuard
from lrmoe.train.faults import SignalStop, StopSignals, Watch, is_peer_failure
from lrmoe.train.metrics import (
    METRICS_FILE,
    MetricsWriter,
    host_memory,
    host_rss_bytes,
    rank_summary,
    train_row,
)
from lrmoe.train.optim import build_optimizer, build_scheduler
from lrmoe.train.ranks import agree, all_gather
from lrmoe.train.setup import (
    check_model_fits,
    check_same_flags,
    leave_process_group,
    open_run_dir,
    train_fields,
)
from lrmoe.train.step_oom import StepMemory, step_memory


# ----------------------------------------------------------------------------- collectives
def _sum_over_world(t: torch.Tensor, ctx) -> torch.Tensor:
    if not ctx.distributed:
        return t
    return all_reduce_sum(t.to(ctx.device)).cpu()


# ----------------------------------------------------------------------------- validation
def val_windows(num_tokens: int, seq_len: int, batch_size: int, eval_batches: int,
                world: int) -> int:
    """Validation windows used: ``eval_batches`` global batches, a multiple of ``world``
    (every EP rank must run the same number of forwards)."""
    avail = (num_tokens - 1) // seq_len
    k = min(avail, eval_batches * batch_size) // world * world
    if k < 1:
        raise LrmoeError(f"the validation split has {num_tokens} tokens: fewer than "
                         f"{world} window(s) of seq_len + 1 = {seq_len + 1} tokens; use more "
                         "data or a smaller --seq-len")
    return k


@torch.no_grad()
def evaluate(model, batches: list[torch.Tensor], ctx, autocast) -> tuple[float, int]:
    """Mean token cross entropy over ``batches`` (summed over ranks): ``(loss, tokens)``."""
    was = model.training
    model.eval()
    tot = torch.zeros(2, dtype=torch.float64)
    for b in batches:
        inputs, targets, _ = loss_args(b.to(ctx.device))  # masked targets: not counted
        with autocast():
            ce = model.loss_sum(inputs, targets)
        tot[0] += float(ce)
        tot[1] += int((targets != IGNORE).sum())
    model.train(was)
    tot = _sum_over_world(tot, ctx)
    return float(tot[0] / tot[1]), int(tot[1])


def make_autocast(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


# ----------------------------------------------------------------------------- setup
def _checkpoint_to_resume(cfg: TrainConfig, run_dir: Path, ctx):
    """The checkpoint ``--resume`` continues, verified, or ``None``; every rank reads its
    own ``--out``: they must find the same."""
    ck = agree(lambda: _find_checkpoint(cfg, run_dir, ctx.is_main), ctx)
    seen = all_gather(None if ck is None else (ck.step, ck.manifest["files"][".metadata"]),
                      ctx.world)
    other = next((r for r, x in enumerate(seen) if x != seen[0]), None)
    if other is not None:
        raise quiet_unless(LrmoeError(
            f"rank {other}'s --out holds another run than rank 0's (latest checkpoint "
            f"step {'none' if seen[other] is None else seen[other][0]} against "
            f"{'none' if seen[0] is None else seen[0][0]}): every rank must name the "
            "same run directory, on a file system all ranks share"), ctx.rank == 0)
    if ck is None:
        return None
    # any rank may read any file (resharding): each checks a share of them all
    agree(lambda: ckpt.verify_files(ck, ctx.rank, ctx.world), ctx)
    _log(ck.describe(), ctx)
    return ck


def _find_checkpoint(cfg: TrainConfig, run_dir: Path, main: bool):
    """The checkpoint to resume from, without collectives (:func:`_checkpoint_to_resume`)."""
    has_ck = bool(ckpt.checkpoint_dirs(run_dir))
    if main:
        rundir.check_out(run_dir, cfg.resume, has_ck)
    if not cfg.resume:
        if has_ck:
            raise LrmoeError(f"{run_dir} already holds checkpoints; use --resume to continue "
                             "that run or another --out")
        return None
    ck = ckpt.latest_checkpoint(run_dir)
    if not (run_dir / RUN_CONFIG).exists():  # read and checked by config_from_cli when there
        raise LrmoeError(f"--resume: {run_dir / RUN_CONFIG} is missing" if ck is not None else
                         f"--resume: {run_dir} holds no lrmoe run to continue (no {RUN_CONFIG}, "
                         "no checkpoint); drop --resume to start a new run there")
    if ck is None:
        return None  # a run that completed no checkpoint: it starts again
    for opt, value in (("--steps", cfg.steps), ("--stop-after", cfg.stop_after)):
        if value is not None and value < ck.step:
            raise LrmoeError(f"--resume {opt} {value}: the run in {run_dir} has already "
                             f"finished step {ck.step}; give {opt} >= {ck.step}")
    return ck


def _load_data(cfg: TrainConfig, run_dir: Path, ctx):
    from lrmoe.data import PackedBatches, build_streams, load_corpus
    from lrmoe.tokenizer_load import load_tokenizer

    corpus = load_corpus(cfg.data, max_bytes=cfg.max_data_bytes)
    # A new run trains its BPE in memory (the run dir is not created yet); a resumed
    # one reloads the tokenizer cached (a model's tokenizer: copied) in the run dir.
    tok = load_tokenizer(cfg.tokenizer, run_dir if cfg.resume else None, corpus.train_texts)
    streams = build_streams(corpus, tok)
    if cfg.batch_size % ctx.world:
        raise LrmoeError(f"--batch-size {cfg.batch_size} is not divisible by the world size "
                         f"{ctx.world}")
    batches = PackedBatches(streams.train_ids, cfg.seq_len, cfg.batch_size, cfg.seed,
                            target_mask=streams.train_mask, accum=cfg.grad_accum)
    return corpus, tok, batches, streams


def _sha256(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def _log(msg: str, ctx) -> None:
    if ctx.is_main:
        print(msg, file=sys.stderr, flush=True)


def _snapshot_stats(rt) -> dict[int, dict]:
    """The last step's per-layer stats, device counts and CUDA event timings resolved."""
    out = {}
    for layer, st in rt.stats.items():
        st = host_stats(st)
        events = st.pop("_events", None)
        if events:
            torch.cuda.synchronize()
            for key, a, b in events:
                st[key] = st.get(key, 0.0) + a.elapsed_time(b)
        out[layer] = st
    return out


def _observe_fidelity(policy, stats: dict[int, dict], per_rank: list[dict]) -> None:
    """Hand the fidelity cosine, averaged over the EP ranks (so every rank plans alike), to a
    policy that adapts to it (``--lrmoe-keep auto``)."""
    for layer, st in stats.items():
        if "fidelity_cosine" in st:
            vals = [float(r[layer]["fidelity_cosine"]) for r in per_rank
                    if layer in r and "fidelity_cosine" in r[layer]]
            if vals:
                policy.observe_fidelity(layer, sum(vals) / len(vals))


# ----------------------------------------------------------------------------- train
def train(cfg: TrainConfig | Any) -> dict:
    """Train (or resume) a run. Under torchrun an error every rank raises alike is printed
    by rank 0 only; one a rank hit alone (``local``) by that rank."""
    try:
        return _run(cfg)
    except LrmoeError as e:
        if os.environ.get("RANK", "0") != "0" and not e.local:
            e.quiet = True
        raise


def _intact(watch: Watch) -> str:
    return (f"the last complete checkpoint, {watch.last_ckpt}, is intact" if watch.last_ckpt
            else "no checkpoint was written")


def _stopped(msg: str, local: bool, ctx, watch: Watch) -> LrmoeError:
    """``msg`` (a failed write) with where the last complete checkpoint is; an error this
    rank alone hit (``local``) is claimed, so the peers that lose it stay quiet."""
    if local:
        watch.claim()
    who = f"rank {ctx.rank}: " if local and ctx.distributed else ""
    return LrmoeError(f"{who}{msg}; stopped ({_intact(watch)})", local=local)


def _run(cfg: TrainConfig | Any) -> dict:
    if not isinstance(cfg, TrainConfig):
        cfg = config_from_cli(cfg if isinstance(cfg, dict) else vars(cfg))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    early = _checked(cfg, world)  # under torchrun: said once every rank has joined
    threads = torch.get_num_threads()
    if cfg.threads and early is None:
        torch.set_num_threads(cfg.threads)

    we_init = not (dist.is_available() and dist.is_initialized())
    stops = StopSignals().install()  # SIGTERM/SIGUSR1: stop at a step boundary
    ctx, agreed = None, False
    try:
        ctx = init_parallel(cfg.ep, cfg.device, cfg.backend, cfg.timeout_s,
                            check=lambda rank, world, refused: check_same_flags(
                                cfg, rank, world, early or refused))
        watch = Watch(ctx.rank, ctx.world, cfg.timeout_s)
        try:
            inputs = _check(cfg, ctx)
            return _open(cfg, ctx, inputs, _build(cfg, ctx, inputs), watch, stops).loop()
        except RuntimeError as e:  # a gloo/NCCL timeout or a closed connection
            if ctx.distributed and is_peer_failure(e):
                raise watch.failure(e) from None
            raise
        except OSError as e:  # a full disk, a directory gone read-only...
            raise _stopped(f"{rundir.os_error_line(e, 'cannot write')} (during {watch.phase}, "
                           f"step {watch.step + 1})", True, ctx, watch) from None
    except LrmoeError as e:
        agreed = e.agreed
        raise
    finally:
        if ctx is not None and ctx.is_main:
            rundir.release_lock(Path(cfg.out))
        if we_init:
            leave_process_group(agreed)
        stops.restore()
        torch.set_num_threads(threads)  # in-process callers get their setting back


def _checked(cfg: TrainConfig, world: int) -> LrmoeError | None:
    """Check every flag and warn of those the run ignores. On one process an error is raised;
    under torchrun it is returned, to be said once every rank has joined (a rank leaving
    before joining would leave the others waiting); what joining needs is checked first."""
    check_join_flags(cfg)  # alike on every rank, or joining itself would fail
    try:
        check_args(cfg)
    except LrmoeError as e:
        if world == 1:
            raise
        return e
    if os.environ.get("RANK", "0") == "0":
        for warning in ignored_flags(cfg, world):
            print(f"lrmoe: warning: {warning}", file=sys.stderr, flush=True)
    if cfg.resume and world % cfg.ep:  # --ep came from the run's config.json
        raise LrmoeError(f"--resume: the run used --ep {cfg.ep}, which does not divide this "
                         f"world size {world}; pass --ep N (N divides {world}) to resume on "
                         "a different layout")
    if world == 1 and cfg.ep > 1:
        raise LrmoeError(f"--ep {cfg.ep} needs {cfg.ep} processes (or a multiple); launch with "
                         f"torchrun --nproc-per-node {cfg.ep} -m lrmoe train ...")
    return None


@dataclass
class _Inputs:
    """What the checks read: the run, the model, the data (:func:`_check`)."""

    run_dir: Path
    mcfg: Any
    ck: Any  # the checkpoint to resume from, or None
    hf: Any  # the checked --init-from checkpoint of a new run (lrmoe.hf_load), or None
    saved: dict | None  # the run's config.json on a resume
    policy: Any
    ledger: Any
    corpus: Any
    tok: Any
    batches: Any
    val_ids: torch.Tensor
    val_b: list[torch.Tensor]
    data_fp: dict


def _check(cfg: TrainConfig, ctx) -> _Inputs:
    """Step 1: read and check everything; nothing is written yet."""
    from lrmoe.data import validation_batches

    run_dir = Path(cfg.out)
    mcfg = resolve_model_config(cfg, vocab_size=None)  # structure errors before slow work
    ck = _checkpoint_to_resume(cfg, run_dir, ctx)
    hf = None  # headers and names checked here; a resume never reads the HF weights
    if cfg.init_from is not None and ck is None:
        from lrmoe.hf_load import open_checkpoint
        hf = agree(lambda: open_checkpoint(cfg.init_from), ctx)
    saved = None
    if cfg.resume:
        saved = read_run_config(run_dir)  # there: checked with the checkpoint
        if ck is None:
            gone = "".join(f" ({p.name}: an interrupted save)" for p in ckpt.partial_dirs(run_dir))
            _log(f"lrmoe train: note: {run_dir} holds no complete checkpoint{gone}: --resume "
                 "starts the run again from step 0 and rewrites its metrics", ctx)
        bad = trajectory_mismatch(cfg, saved.get("train", {}))
        if bad:
            raise LrmoeError(f"--resume: {bad} differ from the run in {run_dir} "
                             f"({RUN_CONFIG}); drop those flags or use another --out (a "
                             f"resume may change {', '.join(flag(k) for k in RESUME_CHANGES)})")
        if mcfg is None:
            mcfg = ModelConfig.from_hf_dict(saved["model"])
    policy = make_policy(cfg.policy, mcfg, ctx.ep_size)
    ledger = build_ledger(cfg, mcfg, ctx)
    corpus, tok, batches, streams = agree(lambda: _load_data(cfg, run_dir, ctx), ctx)
    val_ids = streams.val_ids
    reuse = data_reuse_warning(cfg, batches.num_windows)
    if reuse:
        _log(f"lrmoe: warning: {reuse}", ctx)
    if cfg.preset is not None or cfg.config is not None or cfg.init_from is not None:
        if cfg.init_from is None:
            mcfg = resolve_model_config(cfg, vocab_size=tok.vocab_size)
        if saved is not None and mcfg.to_hf_dict() != saved["model"]:
            raise LrmoeError(f"--resume: the model config differs from the run's "
                             f"{run_dir / RUN_CONFIG}; drop --preset/--config/--init-from or "
                             "use another --out")
    check_vocab(tok, mcfg.vocab_size, cfg.init_from)
    k = val_windows(val_ids.numel(), cfg.seq_len, cfg.batch_size, cfg.eval_batches, ctx.world)
    val_b = validation_batches(val_ids, cfg.seq_len, max(1, cfg.batch_size // ctx.world),
                               num_windows=k, rank=ctx.rank, world=ctx.world,
                               target_mask=streams.val_mask)
    data_fp = {"num_windows": batches.num_windows, "train_tokens": int(batches.ids.numel()),
               "seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "seed": cfg.seed,
               "tokenizer": tok.spec, "train_sha256": _sha256(batches.ids),
               "val_sha256": _sha256(val_ids)}
    if streams.train_mask is not None:  # prompt/completion rows: which targets train
        data_fp["mask_sha256"] = _sha256(torch.cat([streams.train_mask, streams.val_mask]))
    if ctx.distributed and any(f != data_fp for f in all_gather(data_fp, ctx.world)):
        raise LrmoeError("the ranks loaded different training data or tokenizers (token "
                         "stream hashes differ); give every rank the same --data")
    if ledger is not None:
        home_tokens = cfg.batch_size // ctx.world * cfg.seq_len
        ledger.raise_if_over(ledger.feasible_minimum(tokens_per_rank_home=home_tokens),
                             "even the native experts with one retained pair per instance")
    return _Inputs(run_dir, mcfg, ck, hf, saved, policy, ledger, corpus, tok, batches, val_ids,
                   val_b, data_fp)


@dataclass
class _State:
    """The model, optimizer and progress (:func:`_build`)."""

    model: Any
    rt: Any
    opt: Any
    sched: Any
    gen: torch.Generator
    guard: DivergenceGuard
    start: int = 0
    tokens: int = 0
    elapsed: float = 0.0
    last_val: float | None = None
    rss_before_build: int | None = None  # the process's resident set before the model
    loaded: dict | None = None  # what --init-from read on this rank (metrics' init row)
    batches: int = 0  # global batches read before ``start``


def _new_model(cfg: TrainConfig, ctx, inp: _Inputs):
    """This rank's model (experts sharded) and, with ``--init-from``, what it read; weights a
    checkpoint fills are never initialised, and no rank builds the whole model then."""
    from lrmoe.hf_load import empty_model, load_owned

    if inp.hf is None and inp.ck is None:
        model = MoEForCausalLM(inp.mcfg)
        if ctx.ep_size > 1:
            shard_experts(model, ctx)
        return model.to(ctx.device), None
    model = empty_model(inp.mcfg, ctx, ctx.device)
    if inp.hf is None:
        return model, None
    report = agree(lambda: load_owned(model, inp.hf), ctx)
    _log(f"lrmoe train: initialized from {inp.hf.path}: rank {ctx.rank} read "
         f"{report.tensors} tensors, {report.bytes_read / 2**20:,.1f} MiB in "
         f"{report.seconds:.1f}s", ctx)
    return model, {**dataclasses.asdict(report), **host_memory()}


def _build(cfg: TrainConfig, ctx, inp: _Inputs) -> _State:
    """Step 2: build (and restore) in memory; a checkpoint that does not fit fails here."""
    agree(lambda: check_model_fits(inp.mcfg, cfg, ctx), ctx)  # before a byte is allocated
    rss = host_rss_bytes()
    torch.manual_seed(cfg.seed)
    model, loaded = _new_model(cfg, ctx, inp)
    gen = torch.Generator(device=ctx.device).manual_seed(  # any 64-bit --seed
        (cfg.seed * 1_000_003 + ctx.rank + 1) % 2**64)
    rt = build_runtime(cfg, ctx, inp.policy, inp.ledger, gen)
    model.set_runtime(rt)
    model.set_activation_checkpoint(cfg.activation_checkpoint)
    model.set_loss_chunk(cfg.loss_chunk)
    opt = build_optimizer(model, cfg.lr, cfg.weight_decay, offload=cfg.optimizer_offload,
                          router_lr_scale=cfg.router_lr_scale,
                          compute_dtype=torch.bfloat16 if ctx.device.type == "cuda" else None)
    sched = build_scheduler(opt, cfg.warmup, cfg.steps, cfg.min_lr_ratio)
    ck, prog, batches = inp.ck, {"tokens": 0, "elapsed_s": 0.0}, 0
    if ck is not None:
        st = ckpt.load_checkpoint(  # verified above; any world and EP size
            ck, model, opt, sched, inp.policy, gen, ctx=ctx, seed=cfg.seed)
        if st.get("data") != inp.data_fp:
            raise LrmoeError(f"--resume: the training data differ from the checkpoint's "
                             f"({st.get('data')} vs now {inp.data_fp}); resume on the same data")
        prog = st["progress"]
        was = int(inp.saved["train"].get("grad_accum", 1))  # checkpoints before "batches"
        batches = int(prog.get("batches", ck.step * was))
    return _State(model, rt, opt, sched, gen,
                  DivergenceGuard(cfg.divergence_factor, prog.get("divergence")),
                  start=0 if ck is None else ck.step, tokens=int(prog["tokens"]),
                  elapsed=float(prog["elapsed_s"]), last_val=prog.get("val_loss"),
                  rss_before_build=rss, loaded=loaded, batches=batches)


def _open(cfg: TrainConfig, ctx, inp: _Inputs, state: _State, watch: Watch,
          stops: StopSignals) -> _Run:
    """Step 3: every input is valid: from here on the run directory is written."""
    from lrmoe.presets import param_counts

    total, active = param_counts(inp.mcfg)
    run_cfg = {"format": RUN_FORMAT, "model": inp.mcfg.to_hf_dict(),
               "train": train_fields(cfg, inp.saved),
               "tokenizer": {"spec": inp.tok.spec, "vocab_size": inp.tok.vocab_size},
               "data": {"source": inp.corpus.source,
                        "train_tokens": int(inp.batches.ids.numel()),
                        "val_tokens": int(inp.val_ids.numel())},
               "parallel": {"world": ctx.world, "ep_size": ctx.ep_size},
               "params": {"total": total, "active": active}}
    open_run_dir(cfg, inp.run_dir, inp.ck, run_cfg, inp.tok, state.model, ctx)  # lock: _run
    sink = None
    if cfg.log == "tensorboard" and ctx.is_main:
        from lrmoe.train.tensorboard import TB_DIR, TensorBoardSink
        sink = TensorBoardSink(inp.run_dir / TB_DIR, first_step=state.start + 1)
    writer = MetricsWriter(inp.run_dir / METRICS_FILE, enabled=ctx.is_main, sink=sink)
    if inp.hf is not None:  # what each rank read, gathered on every rank alike
        ranks = all_gather(state.loaded, ctx.world)
        writer.write({"kind": "init", "step": 0, "source": str(inp.hf.path), "ranks": ranks})
    run = _Run(cfg, ctx, inp, state, watch, stops, writer)
    changes = {} if inp.saved is None else resume_changes(cfg, inp.saved.get("train", {}))
    if changes:  # what a resume changed, at the step it continues from
        run.writer.write({"kind": "change", "step": state.start, "changes": changes})
        _log("lrmoe train: resuming with " + ", ".join(
            f"{flag(k)} {new!r} (was {old!r})" for k, (old, new) in changes.items()), ctx)
    watch.last_ckpt = None if inp.ck is None else str(ckpt.ckpt_dir(inp.run_dir, state.start))
    watch.run_dir = inp.run_dir
    if cfg.compile:  # in place: checkpoints keep their parameter names
        from lrmoe.model.compile import compile_model
        compile_model(state.model)
    m, origin = inp.mcfg, run_cfg["train"]
    name = next((origin[k] for k in ("preset", "config", "init_from") if origin[k]), "model")
    _log(f"lrmoe train: {name} ({m.model_type}, {m.num_hidden_layers} layers, "
         f"{m.num_experts} experts top-{m.num_experts_per_tok}, {total / 1e6:.2f}M "
         f"params, {active / 1e6:.2f}M active) | {inp.corpus.source} | tokenizer "
         f"{inp.tok.spec} ({inp.tok.vocab_size}) | steps {state.start}->{run.end} of "
         f"{cfg.steps}, {cfg.batch_size}x{cfg.seq_len} tokens x {cfg.grad_accum} "
         f"micro-batch(es) each | policy {cfg.policy.name} | world {ctx.world}, ep "
         f"{ctx.ep_size}, {ctx.device} | out {inp.run_dir}", ctx)
    for note in inp.corpus.notes:
        _log(f"lrmoe train: note: {note}", ctx)
    return run


class _Run:
    """Step 4: the steps of an opened run, with its validation, checkpoints and log."""

    def __init__(self, cfg: TrainConfig, ctx, inp: _Inputs, state: _State, watch: Watch,
                 stops: StopSignals, writer: MetricsWriter):
        self.cfg, self.ctx, self.inp, self.s = cfg, ctx, inp, state
        self.watch, self.stops, self.writer = watch, stops, writer
        self.end = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
        self.autocast = make_autocast(ctx.device)
        self.base_bwd = state.rt.backward
        self.bar = None
        self.step_tokens = cfg.batch_size * cfg.seq_len * cfg.grad_accum
        # micro-batch m of step s reads global batch batch0 + s * N + m: the batches read
        # before this invocation continue in order whatever N was then
        self.batch0 = state.batches - state.start * cfg.grad_accum

    def memory(self, step: int) -> StepMemory:
        """What an out-of-memory line of ``step`` (0-based) names (:mod:`.step_oom`)."""
        cfg, ctx, fields = self.cfg, self.ctx, train_fields(self.cfg, self.inp.saved)
        name = next(([f"--{k}", str(fields[k])] for k in ("preset", "config") if fields[k]), [])
        plan = name and [*name, "--ep", str(ctx.ep_size), "--tokens-per-rank",
                         str(cfg.batch_size // ctx.world * cfg.seq_len), "--policy",
                         cfg.policy.name, "--dtype",
                         "bf16" if ctx.device.type == "cuda" else "fp32"]
        return StepMemory(cfg, ctx.world, step + 1, ["--out", str(self.inp.run_dir), "--resume"],
                          plan, _intact(self.watch), vocab=self.s.model.config.vocab_size)

    def save(self, step: int) -> None:
        s, ctx = self.s, self.ctx
        self.watch.phase = "checkpoint save"
        progress = {"tokens": s.tokens, "elapsed_s": s.elapsed, "val_loss": s.last_val,
                    "divergence": s.guard.state(),
                    "batches": self.batch0 + step * self.cfg.grad_accum}
        try:
            ckpt.save_checkpoint(
                self.inp.run_dir, step, s.model, s.opt,
                rng=ckpt.ckpt_state.rng_state(s.gen, ctx.device),
                trainer=ckpt.trainer_state(s.model, s.sched, self.inp.policy, progress,
                                           self.inp.data_fp),
                rank=ctx.rank, world=ctx.world, ep_size=ctx.ep_size, keep=self.cfg.keep_ckpts)
        except ckpt.CheckpointWriteError as e:
            raise _stopped(str(e), e.local, ctx, self.watch) from None
        self.watch.last_ckpt = str(ckpt.ckpt_dir(self.inp.run_dir, step))

    def validate(self, step: int) -> float:
        self.watch.phase = "validation"
        self.s.last_val, n = evaluate(self.s.model, self.inp.val_b, self.ctx, self.autocast)
        self.writer.write({"kind": "val", "step": step, "val_loss": self.s.last_val,
                           "val_tokens": n, "elapsed_s": round(self.s.elapsed, 3)})
        return self.s.last_val

    def say(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            _log(msg, self.ctx)

    def loop(self) -> dict:
        cfg, ctx, s, start, end = self.cfg, self.ctx, self.s, self.s.start, self.end
        interactive = cfg.progress if cfg.progress is not None else sys.stderr.isatty()
        if ctx.is_main and interactive and start < end:
            from tqdm import tqdm
            self.bar = tqdm(total=end, initial=start, unit="step", dynamic_ncols=True,
                            file=sys.stderr)
        self.log_every = cfg.log_every or max(1, min(50, cfg.steps // 10))
        self.t_run = time.perf_counter()
        s.model.train()
        try:
            for step in range(start, end):
                row, stop_sig = self.step(step)
                self.record(step + 1, row)
                self.after(step + 1, stop_sig)
            if start >= end and s.last_val is None:  # resumed at the end: the checkpoint's
                s.last_val = evaluate(s.model, self.inp.val_b, ctx, self.autocast)[0]  # loss
        finally:
            if self.bar is not None:
                self.bar.close()
            self.writer.close()
        if ctx.is_main:
            print(f"final val_loss={s.last_val:.6f}", flush=True)
        return {"final_val_loss": s.last_val, "run_dir": str(self.inp.run_dir), "steps": end,
                "tokens": s.tokens, "elapsed_s": s.elapsed}

    def step(self, step: int) -> tuple[dict, int | None]:
        """One optimizer step: each micro-batch's forward and backward, the loss and gradient-norm
        checks, the update; returns the metrics row's inputs and the stop signal a rank got."""
        from lrmoe.train.offload import last_backward_hook

        cfg, ctx, s, watch, accum = self.cfg, self.ctx, self.s, self.watch, self.cfg.grad_accum
        s.rt.step = watch.step = step
        watch.phase = "forward and backward"
        every = cfg.policy.fidelity.every
        fid = every > 0 and (step + 1) % every == 0
        s.rt.backward = dataclasses.replace(self.base_bwd, fidelity=fid)
        if ctx.device.type == "cuda":  # cuda_max_mem_bytes is this step's peak
            torch.cuda.reset_peak_memory_stats(ctx.device)
        t0 = time.perf_counter()
        s.opt.zero_grad(set_to_none=True)
        with step_memory(self.memory(step), watch.claim) as mem:
            sums = accumulate(
                s.model, mem.batch_of(lambda m: self.inp.batches.batch(
                    self.batch0 + step * accum + m, ctx.rank, ctx.world).to(ctx.device)),
                accum, self.autocast, before_last_backward=last_backward_hook(s.opt, ctx))
        watch.phase = "loss all-reduce"  # with every rank's SIGTERM/SIGUSR1 flags
        red = _sum_over_world(torch.cat([sums.float().cpu(), torch.tensor(self.stops.seen)]),
                              ctx)
        losses, stop_sig = red[:2] / (ctx.world * accum), StopSignals.which(red[2:].tolist())
        loss, aux = float(losses[0]), float(losses[1] - losses[0])
        intact = _intact(watch)
        if not math.isfinite(loss) or not math.isfinite(float(losses[1])):
            raise LrmoeError(f"training loss is {loss} at step {step + 1}; stopped "
                             f"({intact}). Lower --lr or raise --warmup")
        blowup = s.guard.check(loss)
        if blowup:
            raise LrmoeError(f"training diverged at step {step + 1}: {blowup}; stopped "
                             f"before updating the weights ({intact}). Lower --lr or raise "
                             "--warmup; --divergence-factor 0 disables this check")
        watch.phase = "gradient sync, clipping, optimizer step and router counts"

        def check_norm(gnorm: float) -> None:
            if not math.isfinite(gnorm):
                raise LrmoeError(f"gradient norm is {gnorm} at step {step + 1}; stopped "
                                 f"({intact}). Lower --lr or raise --warmup")
        lr = s.opt.param_groups[0]["lr"]
        gnorm, counts = update(s.model, s.opt, s.sched, cfg.clip, ctx, check_norm)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        dt = time.perf_counter() - t0
        s.elapsed += dt
        s.tokens += self.step_tokens
        return {"loss": loss, "aux": aux, "lr": lr, "dt": dt, "grad_norm": gnorm,
                "counts": counts, "fidelity_step": fid}, stop_sig

    def record(self, done: int, row: dict) -> None:
        """The step's metrics row (per-layer stats gathered from every rank) and log."""
        ctx, s = self.ctx, self.s
        self.watch.phase = "stats all-gather"
        stats = _snapshot_stats(s.rt)
        mine = {k: rank_summary(v, ctx.ep_rank) for k, v in stats.items()}
        mem = (int(torch.cuda.max_memory_allocated(ctx.device)) if ctx.device.type == "cuda"
               else None)
        host = host_memory()
        if done == s.start + 1:  # this process's first row
            host["host_rss_before_build_bytes"] = s.rss_before_build
        got = all_gather((mine, mem, host), ctx.world)
        per_rank = [g[0] for g in got]
        _observe_fidelity(self.inp.policy, stats, per_rank)
        mem = None if mem is None else max(g[1] for g in got)
        host = {k: max((g[2][k] for g in got if g[2][k] is not None), default=None)
                for k in host}
        ledger = self.inp.ledger
        self.watch.phase = "the metrics row"
        self.writer.write(train_row(
            step=done, tokens=s.tokens, elapsed=s.elapsed, step_tokens=self.step_tokens,
            stats=stats, per_rank=per_rank, world=ctx.world, cuda_mem=mem,
            micro_batches=self.cfg.grad_accum, host_mem=host,
            budget=None if ledger is None else ledger.budget_bytes, **row))
        loss, dt = row["loss"], row["dt"]
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{self.step_tokens / dt:,.0f}")
            self.bar.update(1)
        elif done % self.log_every == 0 or done == self.end:
            eta = (time.perf_counter() - self.t_run) / (done - s.start) * (self.end - done)
            _log(f"step {done}/{self.end} | loss {loss:.4f} | lr {row['lr']:.2e} | "
                 f"{self.step_tokens / dt:,.0f} tok/s | {s.elapsed:.0f}s | eta {eta:.0f}s",
                 ctx)

    def after(self, done: int, stop_sig: int | None) -> None:
        """Validation and checkpoints due after step ``done``; a stop signal ends here."""
        cfg, end = self.cfg, self.end
        if cfg.eval_every and done % cfg.eval_every == 0 and done < end:
            self.say(f"step {done}: val_loss {self.validate(done):.4f}")
        if done == end or (cfg.ckpt_every and done % cfg.ckpt_every == 0):
            if done == end:
                self.validate(done)
            self.save(done)
        if stop_sig is not None and done < end:
            if self.watch.last_ckpt != str(ckpt.ckpt_dir(self.inp.run_dir, done)):
                self.save(done)
            msg = (f"lrmoe: {signal.Signals(stop_sig).name} received: stopped after step "
                   f"{done} of {end}; saved {ckpt.ckpt_dir(self.inp.run_dir, done)}; "
                   "continue with --resume")
            self.say(msg)
            raise SignalStop(stop_sig, msg)
