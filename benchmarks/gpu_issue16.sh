#!/usr/bin/env bash
# Issue-16 measurements on the device machine (one H200), in priority order, each with
# its own time limit so one that hangs cannot take the others' time:
#   bash benchmarks/gpu_issue16.sh OUTDIR [SECONDS]
# 1. benchmarks/moe_layer.py   the layer table: ours (one-process local path), x-only,
#                              rg@e, HF eager and compiled; 16k and 64k, skew 0 and 1;
#                              LRMoE keep 1.0 vs 0.5 (the speed and memory goals)
# 2. benchmarks/ledger_peak.py the ledger against the measured peak (±5%), EP 8 emulated
# 3. benchmarks/moe_profile.py GLM at 16k (Qwen3 was profiled on 2026-12-01)
# Writes OUTDIR/{layer,ledger,prof}/*.{json,md}: six files, within the device tool's
# eight. SECONDS (default 540) is the whole script's allowance; each step gets what is
# left, minus a margin for the next ones.
set -uo pipefail
OUT=${1:?outdir}; TOTAL=${2:-540}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p "$OUT/layer" "$OUT/ledger" "$OUT/prof"
. benchmarks/gpu_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
step layer 200 python3 benchmarks/moe_layer.py --out "$OUT/layer" --budget-s $(( TOTAL / 2 ))
step ledger 90 python3 benchmarks/ledger_peak.py --out "$OUT/ledger"
step prof 0 python3 benchmarks/moe_profile.py --out "$OUT/prof" --shapes glm --iters 3
