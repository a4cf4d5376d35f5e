#!/usr/bin/env bash
# One-GPU training runs of small-qwen3 under static, symi and lrmoe (issue 5), run on the
# device machine: bash benchmarks/gpu_train_runs.sh OUTDIR [STEPS]
set -euo pipefail
OUT=${1:?outdir}; STEPS=${2:-200}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
COMMON="--preset small-qwen3 --device cuda --steps $STEPS --batch-size 32 --seq-len 512 --lr 2e-3 --eval-every 50 --ckpt-every 100000 --seed 0"
run() { name=$1; shift; python3 -m lrmoe train $COMMON --out "$OUT/$name" "$@" 2>&1 | grep -E "final|error|Error" | sed "s/^/[$name] /"; }
run static --policy static
run symi --policy symi --slots-per-rank 72
run lrmoe --policy lrmoe --mem-budget 4.3GiB --lrmoe-fidelity-every 20
run lrmoe_nocompact --policy lrmoe --mem-budget 4.3GiB --lrmoe-compaction off --lrmoe-fidelity-every 20
