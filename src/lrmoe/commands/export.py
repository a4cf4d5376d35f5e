"""``lrmoe export RUN OUT``: a run's checkpoint as a HF model directory
(:mod:`lrmoe.hf_export`), which ``AutoModelForCausalLM.from_pretrained(OUT)`` loads."""

from __future__ import annotations

import argparse
import sys

from lrmoe.cli_flags import byte_size


def register(sub) -> None:
    p = sub.add_parser("export", help="write a run's checkpoint as a HF model directory",
                       description="Write the latest (or --step) checkpoint of RUN_DIR into "
                                   "OUT: sharded safetensors with an index, config.json and "
                                   "the run's tokenizer files; one shard in memory at a time. "
                                   "OUT must be new, empty or an earlier export of this model.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: "
                   "the latest)")
    p.add_argument("--max-shard-size", type=byte_size, default=None, metavar="SIZE",
                   help="largest safetensors file, e.g. 5GB (the default) or 500MiB")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="cast the weights (default: as the checkpoint holds them, fp32; "
                        "GLM's router stays fp32, as in HF)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lrmoe.hf_export import export_run

    r = export_run(args.run_dir, args.out, args.step, args.max_shard_size, args.dtype)
    print(f"{r.checkpoint}: step {r.step}, {r.tensors} tensors "
          f"({r.bytes_written / 2**20:,.1f} MiB) in {len(r.files)} files", file=sys.stderr)
    print(r.out)
    return 0
