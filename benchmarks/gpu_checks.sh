#!/usr/bin/env bash
# Short GPU checks on the device machine (one H200), each with its own time limit:
#   bash benchmarks/gpu_checks.sh OUTDIR [SECONDS]
# 1. benchmarks/ledger_peak.py   the ledger against the measured peak, EP 8 emulated
# 2. benchmarks/moe_layer.py     Qwen3 16k, uniform routing only: the `ours graphed`
#                                diagnostic (host overhead) beside ours and HF compiled
# 3. repeatability: the same short `lrmoe bench ttl` (GLM-shaped, 8 GiB, static and
#    lrmoe:recompute+estimator=sampled, 12 steps) twice with --deterministic and twice
#    without; benchmarks/ttl_repeat.py compares each pair bitwise
# Writes OUTDIR/{ledger,layer}/*.{json,md} and OUTDIR/repeat/{det,nondet}.md.
set -uo pipefail
OUT=${1:?outdir}; TOTAL=${2:-420}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p "$OUT/layer" "$OUT/ledger" "$OUT/repeat"
. benchmarks/gpu_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
[ -n "${SKIP_LEDGER:-}" ] || step ledger 260 python3 benchmarks/ledger_peak.py --out "$OUT/ledger"
[ -n "${SKIP_LAYER:-}" ] || step layer 170 python3 benchmarks/moe_layer.py --out "$OUT/layer" --shapes qwen3 \
  --tokens 16384 --skews 0 --keeps 1.0 --budget-s 100
for mode in det nondet; do
  flag=(); [ $mode = det ] && flag=(--deterministic)
  step "${mode}_a" 0 "${REPEAT_TTL[@]}" ${flag[@]+"${flag[@]}"} --out "/tmp/rep/${mode}_a"
  step "${mode}_b" 0 "${REPEAT_TTL[@]}" ${flag[@]+"${flag[@]}"} --out "/tmp/rep/${mode}_b"
  [ -f "/tmp/rep/${mode}_b/ttl.json" ] && python3 benchmarks/ttl_repeat.py \
    "/tmp/rep/${mode}_a/ttl.json" "/tmp/rep/${mode}_b/ttl.json" --out "$OUT/repeat/$mode.md"
done
