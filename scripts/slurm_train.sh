#!/bin/bash
# Multi-node lrmoe training under SLURM: one torchrun per node, rendezvous on the first.
#
#   sbatch --nodes 2 scripts/slurm_train.sh --preset small-qwen3 --ep 8 --out /shared/runs/x
#   sbatch --nodes 2 scripts/slurm_train.sh --out /shared/runs/x --resume     # continue
#
# Every argument goes to `lrmoe train`. --out must be on a file system all nodes share.
# LRMOE_GPUS_PER_NODE (default: SLURM's GPUs on the node, else 8), LRMOE_RDZV_PORT
# (default 29500) and LRMOE_PYTHON_BIN (default .venv/bin) override the defaults.
#SBATCH --job-name=lrmoe
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

if [ -z "${SLURM_JOB_NODELIST:-}" ]; then
    echo "slurm_train.sh: not inside a SLURM allocation; submit it with sbatch" >&2
    exit 2
fi
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=${LRMOE_RDZV_PORT:-29500}
gpus=${LRMOE_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
bin=${LRMOE_PYTHON_BIN:-$(pwd)/.venv/bin}

# --kill-on-bad-exit: when one node's torchrun fails, SLURM ends the others at once.
srun --kill-on-bad-exit=1 "$bin/torchrun" \
    --nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node "$gpus" \
    --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$head_node:$port" \
    -m lrmoe train --device cuda "$@"
