"""``lrmoe eval RUN_DIR``: validation loss of a run's latest checkpoint.

Works on one process for any run: an expert-parallel checkpoint's expert shards are
concatenated back into the whole model (see :func:`lrmoe.train.checkpoint.merged_model_state`).
The validation windows are the ones the run used (same data, seq_len, batch size,
``--eval-batches``), so on one process the result equals the run's final ``val_loss``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lrmoe.cli_flags import check_int
from lrmoe.errors import LrmoeError, require


def register(sub) -> None:
    p = sub.add_parser("eval", help="validation loss of a run's latest checkpoint",
                       description="Load the latest checkpoint of RUN_DIR and print val_loss=.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--eval-batches", type=int, default=None,
                   help="validation size in global batches (default: the run's)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(func=run)


def evaluate_run(run_dir: str | Path, eval_batches: int | None = None, device: str = "cpu"
                 ) -> dict:
    """``{"val_loss", "val_tokens", "step", "checkpoint"}`` of the latest checkpoint."""
    import torch

    from lrmoe.config import ModelConfig
    from lrmoe.data import build_streams, load_corpus, validation_batches
    from lrmoe.model import MoEForCausalLM
    from lrmoe.parallel.groups import ParallelContext
    from lrmoe.tokenizer_load import load_tokenizer
    from lrmoe.train import checkpoint as ckpt
    from lrmoe.train.config import FLAT_NAMES, TrainConfig, read_run_config
    from lrmoe.train.loop import evaluate, make_autocast, val_windows

    run_dir = Path(run_dir)
    require(run_dir.exists(), f"run directory {run_dir} does not exist")
    require(run_dir.is_dir(), f"{run_dir} is a file; eval takes a run directory (the --out of "
                              "lrmoe train)")
    saved = read_run_config(run_dir)
    require(saved is not None, f"{run_dir} is not an lrmoe run directory (no config.json)")
    ck = ckpt.latest_checkpoint(run_dir)
    require(ck is not None, f"{run_dir} has no checkpoint to evaluate")
    cfg = TrainConfig.from_flat({k: v for k, v in saved.get("train", {}).items()
                                 if k in FLAT_NAMES})
    if eval_batches is not None:
        cfg.eval_batches = eval_batches
    mcfg = ModelConfig.from_hf_dict(saved["model"])
    require(device != "cuda" or torch.cuda.is_available(),
            "--device cuda was asked for but no CUDA device is available")
    dev = torch.device(device)
    state, _ = ckpt.merged_model_state(ck)
    corpus = load_corpus(cfg.data, max_bytes=cfg.max_data_bytes)
    tok = load_tokenizer(cfg.tokenizer, run_dir, corpus.train_texts)
    streams = build_streams(corpus, tok)
    val_ids = streams.val_ids
    k = val_windows(val_ids.numel(), cfg.seq_len, cfg.batch_size, cfg.eval_batches, ck.world)
    batches = validation_batches(val_ids, cfg.seq_len, cfg.batch_size, num_windows=k,
                                 target_mask=streams.val_mask)
    model = MoEForCausalLM(mcfg)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise LrmoeError(f"checkpoint {ck.path} does not match the run's model: {e}") from None
    model.to(dev)
    model.set_loss_chunk(cfg.loss_chunk)  # the run's: its logits a chunk at a time
    loss, n = evaluate(model, batches, ParallelContext(device=dev), make_autocast(dev))
    return {"val_loss": loss, "val_tokens": n, "step": ck.step, "checkpoint": str(ck.path),
            "skipped": list(ck.notes)}


def run(args: argparse.Namespace) -> int:
    check_int("threads", args.threads, 1, allow_none=True)
    check_int("eval_batches", args.eval_batches, 1, allow_none=True)
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
    r = evaluate_run(args.run_dir, args.eval_batches, args.device)
    skipped = "".join(f"; {note}" for note in r["skipped"])
    print(f"{r['checkpoint']}: step {r['step']}, {r['val_tokens']} validation tokens"
          f"{skipped}", file=sys.stderr)
    print(f"val_loss={r['val_loss']:.6f}")
    return 0
