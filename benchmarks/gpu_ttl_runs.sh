#!/usr/bin/env bash
# Time-to-target workloads of issue 7 on the device machine (one H200), EP 8 virtual ranks:
#   bash benchmarks/gpu_ttl_runs.sh OUTDIR WORKLOAD [SECONDS] [FRACTION] [LR] [bench ttl flags...]
# WORKLOAD: qwen3 (Qwen3-30B-A3B-shaped MoE layers), glm (GLM-4.5-Air-shaped) or
# glm_fastbias (the same with loss-free bias rate 0.01: routing collapsed at 0.001).
# A 4-step static calibration measures the step wall time; the run's step count is then
# sized so all three policies fit in about SECONDS. Budget: --budget-retain-fraction
# FRACTION (a balanced static rank keeping FRACTION of its pairs). Times are emulated.
set -euo pipefail
OUT=${1:?outdir}; W=${2:?workload}; SECS=${3:-420}; F=${4:-0.8}; LR=${5:-1e-3}
shift $(( $# < 5 ? $# : 5 )); EXTRA=("$@")  # more bench ttl flags, e.g. --lrmoe-max-slots 24
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
case $W in
  qwen3) CFG=benchmarks/configs/qwen3-30b-a3b-layer-2L.json ;;
  glm) CFG=benchmarks/configs/glm-4.5-air-layer-2L.json ;;
  glm_fastbias) CFG=benchmarks/configs/glm-4.5-air-layer-2L-fastbias.json ;;  # bias rate 0.01
  *) echo "unknown workload $W" >&2; exit 2 ;;
esac
COMMON="--config $CFG --ep 8 --batch-size 128 --seq-len 256 --lr $LR --device cuda --eval-batches 6 --seed 0"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m lrmoe bench ttl $COMMON --policies static --steps 4 --eval-every 0 \
  --out "$OUT/${W}_calib" > "$OUT/${W}_calib.log" 2>&1 || { cat "$OUT/${W}_calib.log"; exit 1; }
STEPS=$(python3 - "$OUT/${W}_calib/ttl.json" "$SECS" <<'PY'
import json, sys
rep = json.load(open(sys.argv[1]))
w = [s["wall_s"] for s in rep["policies"]["static"]["steps"][1:]]
per = sum(w) / len(w)
steps = int(float(sys.argv[2]) / (3 * per * 1.35)) // 20 * 20
print(max(40, min(400, steps)))
print(f"calibration: {per:.3f} s/step wall (static) -> {max(40, min(400, steps))} steps",
      file=sys.stderr)
PY
)
EVERY=$((STEPS / 20))
echo "workload $W: $STEPS steps, eval every $EVERY, budget fraction $F, lr $LR"
python3 -m lrmoe bench ttl $COMMON --steps "$STEPS" --eval-every "$EVERY" \
  --budget-retain-fraction "$F" --link nvlink "${EXTRA[@]}" --out "$OUT/$W" 2>&1 | tee "$OUT/$W.log"
