#!/usr/bin/env bash
# Does the GLM-shaped workload's routing collapse? Short static runs at full width on the
# device machine, one per router setting, read with routing_concentration.py:
#   bash benchmarks/gpu_router_check.sh OUTDIR [STEPS] [SETTING ...]
# SETTING: "lr=1e-3,scale=0.1" style (the global lr and --router-lr-scale); default: the
# amendment-5 workload (lr 1e-3, scale 1) and router scales 0.1 and 0.05 at lr 1e-3.
# Static only, everything else as gpu_ttl_seeds.sh's glm_fastbias (EP 8 virtual ranks,
# batch 128 x 256, no budget). Writes OUTDIR/concentration.md and, as each setting ends,
# OUTDIR/routing_SETTING.tar.gz (its routing trace, ttl.md and log) and a row of
# OUTDIR/concentration_rows.md. Overrides for a CPU smoke run: PYTHON, MODEL_ARGS
# (default the GLM config), DEVICE, EP, BATCH, SEQ.
set -uo pipefail
OUT=${1:?outdir}; STEPS=${2:-40}; shift $(( $# >= 2 ? 2 : $# ))
[ $# -ge 1 ] || set -- "lr=1e-3,scale=1" "lr=1e-3,scale=0.1" "lr=1e-3,scale=0.05"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p "$OUT/runs"
traces=()
steps="5,10,20,$(( STEPS / 2 )),$(( STEPS - 1 ))"
for setting in "$@"; do
  lr=$(echo "$setting" | sed -n 's/.*lr=\([^,]*\).*/\1/p'); lr=${lr:-1e-3}
  sc=$(echo "$setting" | sed -n 's/.*scale=\([^,]*\).*/\1/p'); sc=${sc:-1}
  name="lr${lr}_scale${sc}"
  d="$OUT/runs/$name"
  echo "== $setting at ${SECONDS}s"
  # shellcheck disable=SC2086
  "${PYTHON:-python3}" -m lrmoe bench ttl ${MODEL_ARGS:---config benchmarks/configs/glm-4.5-air-layer-2L-fastbias.json} \
    --ep "${EP:-8}" --batch-size "${BATCH:-128}" --seq-len "${SEQ:-256}" --lr "$lr" \
    --router-lr-scale "$sc" --device "${DEVICE:-cuda}" \
    --steps "$STEPS" --eval-every "$STEPS" --eval-batches 2 --policies static --out "$d" \
    > "$d.log" 2>&1 || tail -5 "$d.log"
  if [ -f "$d/routing_trace_static.json" ]; then
    traces+=("$d/routing_trace_static.json")
    # each setting's trace and table are packed as soon as it ends (at the top of OUTDIR,
    # where the device tool fetches them), so a call cut short keeps what finished
    tar czf "$OUT/routing_$name.tar.gz" -C "$OUT/runs" "$name" "$name.log"
    "${PYTHON:-python3}" benchmarks/routing_concentration.py "$d/routing_trace_static.json" \
      --steps "$steps" | tail -1 | tee -a "$OUT/concentration_rows.md"
  fi
done
if [ ${#traces[@]} -gt 0 ]; then
  "${PYTHON:-python3}" benchmarks/routing_concentration.py "${traces[@]}" \
    --steps "$steps" | tee "$OUT/concentration.md"
fi
rm -rf "$OUT/runs"
