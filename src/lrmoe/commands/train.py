"""``lrmoe train``: train (or --resume) a MoE LM; see :mod:`lrmoe.train.loop`."""

from __future__ import annotations

import argparse

from lrmoe.cli_flags import TRAIN, add_policy_flags, byte_size
from lrmoe.train.config import DIVERGENCE_WARMUP, TrainConfig
from lrmoe.train.loop import train

_D = TrainConfig()


def bytes_or_all(v: str) -> int | None:
    """argparse type: a byte size (``40GiB``), or ``all``/``none``/``0`` for no cap."""
    return None if v.lower() in ("all", "none", "0") else byte_size(v)


def register(sub) -> None:
    p = sub.add_parser(
        "train", help="train a MoE language model",
        description="Train a Qwen3-MoE / GLM-4.5-MoE model on a text corpus. Flags not "
                    "given take their defaults; with --resume they take the run's values. "
                    "--out must be new, empty or an lrmoe run directory. Exit codes: 2 bad "
                    "input or a refused --out, 3 a torchrun peer hung or died.",
        argument_default=argparse.SUPPRESS)
    _model_and_data(p.add_argument_group("model and data"))
    _optimisation(p.add_argument_group("optimisation"))
    _run(p.add_argument_group("run"))
    g = p.add_argument_group("parallelism")
    g.add_argument("--ep", type=int, help="expert-parallel size; launch with torchrun "
                   "--nproc-per-node N (a multiple of --ep) (default 1)")
    g.add_argument("--backend", help="gloo or nccl (default: nccl on cuda, else gloo)")
    g.add_argument("--timeout-s", type=float, help=f"collective timeout (default "
                   f"{_D.timeout_s:g})")
    g = p.add_argument_group("policy and memory (lrmoe.cli_flags: the same flags as plan "
                             "and bench)")
    add_policy_flags(g, TRAIN, defaults=False)
    g.add_argument("--activation-checkpoint", metavar="none|selective|full",
                   help="re-run in backward instead of keeping activations: selective = each "
                        "block's attention, full = each whole block, MoE forward and its "
                        "dispatch included (same gradients; default none)")
    g.add_argument("--loss-chunk", type=int, metavar="TOKENS",
                   help="run the output layer and the loss TOKENS tokens of a micro-batch at "
                        "a time, each chunk re-run in backward: one chunk's logits in memory "
                        "instead of the micro-batch's (same loss; 0 = off, the default)")
    p.set_defaults(func=run)


def _model_and_data(g) -> None:
    g.add_argument("--preset", help="model preset (see `lrmoe presets`)")
    g.add_argument("--config", help="HF config.json (or its directory) overriding the preset "
                   "(replacing it when model_type differs)")
    g.add_argument("--init-from", metavar="HF_DIR",
                   help="start from a HF model directory (config.json, safetensors, tokenizer "
                        "files): its config and weights, each rank reading only the tensors "
                        "it holds; its tokenizer unless --tokenizer is given")
    g.add_argument("--data", help="text file, .jsonl ('text' field, or 'prompt' and "
                   "'completion': trained on the completion only) or directory; default: "
                   "the Python stdlib's .py files")
    g.add_argument("--max-data-bytes", type=bytes_or_all, metavar="SIZE",
                   help=f"training bytes to read, e.g. 16MiB; 0 or all = all the data "
                        f"(default {_D.max_data_bytes // 2**20}MiB)")
    g.add_argument("--tokenizer", help="byte, bpe:N, or a directory holding a HF "
                   "tokenizer.json (default: the --init-from directory's, else byte)")


def _optimisation(g) -> None:
    g.add_argument("--steps", type=int, help=f"optimizer steps (default {_D.steps})")
    g.add_argument("--batch-size", type=int, help=f"global micro-batch, sequences: one "
                   f"forward and backward (default {_D.batch_size})")
    g.add_argument("--grad-accum", type=int, metavar="N",
                   help="micro-batches per optimizer step: each step sees N x --batch-size "
                        "sequences, its gradient the mean over all of them (default 1)")
    g.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {_D.seq_len})")
    g.add_argument("--lr", type=float, help=f"peak learning rate (default {_D.lr})")
    g.add_argument("--min-lr-ratio", type=float, help=f"cosine floor as a fraction of --lr "
                   f"(default {_D.min_lr_ratio})")
    g.add_argument("--warmup", type=int, help=f"linear warmup steps (default {_D.warmup})")
    g.add_argument("--weight-decay", type=float, help=f"AdamW weight decay on matrices "
                   f"(default {_D.weight_decay})")
    g.add_argument("--router-lr-scale", type=float, help="the MoE routers' lr as a multiple "
                   f"of --lr (default {_D.router_lr_scale})")
    g.add_argument("--clip", type=float, help=f"global grad-norm clip, 0 = off "
                   f"(default {_D.clip})")
    g.add_argument("--seed", type=int, help=f"model init and data order (default {_D.seed})")
    g.add_argument("--divergence-factor", type=float, metavar="F",
                   help=f"stop when the smoothed training loss exceeds F times its running "
                        f"minimum (checked from step {DIVERGENCE_WARMUP + 1}); 0 = never "
                        f"(default {_D.divergence_factor:g})")


def _run(g) -> None:
    g.add_argument("--device", help="cpu or cuda (bf16 autocast) (default cpu)")
    g.add_argument("--out", help="run directory (default runs/PRESET)")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint "
                   "in --out")
    g.add_argument("--eval-every", type=int, help=f"validate every N steps, 0 = at the end "
                   f"only (default {_D.eval_every})")
    g.add_argument("--eval-batches", type=int, help=f"validation size in global batches "
                   f"(default {_D.eval_batches})")
    g.add_argument("--ckpt-every", type=int, help=f"checkpoint every N steps, 0 = at the end "
                   f"only (default {_D.ckpt_every})")
    g.add_argument("--keep-ckpts", type=int, help=f"checkpoints kept, 0 = all "
                   f"(default {_D.keep_ckpts})")
    g.add_argument("--log-every", type=int, help="progress line every N steps when stderr "
                   "is not a terminal (default: about 10 lines per run)")
    g.add_argument("--log", metavar="tensorboard",
                   help="also write the metrics as TensorBoard events into OUT/tensorboard "
                        "(needs pip install 'lrmoe[tensorboard]')")
    g.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   help="torch.compile the model (attention, norms, routers, head and loss; "
                        "the MoE layers' plan and exchange stay eager: one graph break each); "
                        "--no-compile turns it off on --resume")
    g.add_argument("--stop-after", type=int, metavar="STEP", help="end this invocation after "
                   "STEP (validate + checkpoint); continue later with --resume")


def run(args: argparse.Namespace) -> int:
    train(vars(args))  # train() parses, so its errors print once under torchrun
    return 0
