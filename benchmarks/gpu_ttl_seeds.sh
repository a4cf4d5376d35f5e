#!/usr/bin/env bash
# Issue-14 time-to-target runs on the device machine (one H200), EP 8 virtual ranks, one
# `lrmoe bench ttl` per seed with every pre-registered policy (benchmarks/RESULTS.md):
#   bash benchmarks/gpu_ttl_seeds.sh OUTDIR WORKLOAD STEPS SEED [SEED ...]
# WORKLOAD: qwen3 (Qwen3-30B-A3B-shaped MoE layers), glm_fastbias (GLM-4.5-Air-shaped,
# loss-free bias rate 0.01 for every policy) or glm_bias03 (the same at rate 0.03).
# Every policy keeps its experts' optimizer state in host memory (--optimizer-offload
# host, SYMI's design); budget
# --budget-retain-fraction 0.8. Each seed's outputs are packed into OUTDIR/WORKLOAD_sSEED.tar.gz
# (the device tool returns at most 8 files: 2 a seed, so at most 4 seeds a call) beside its
# ttl.md. Times are emulated.
# MEM_BUDGET=8GiB: a fixed per-rank budget instead of --budget-retain-fraction 0.8 (the
# GLM amendment in RESULTS.md's pre-registration).
# ROUTER_GRAD=experts: static and symi take the router gradient at the experts (no combined
# rows kept; `bench ttl --router-grad`); default home.
# DETERMINISTIC=1: `bench ttl --deterministic` (torch's deterministic kernels, repeatable runs).
# ROUTER_LR_SCALE=s: `bench ttl --router-lr-scale s` (the routers' AdamW groups at s x lr)
# for every policy; default 1.
# REUSE=DIR: where DIR/WORKLOAD_sSEED/ttl.json or DIR/sSEED/ttl.json (the layout of
# benchmarks/results/ttl_gpu_*; or ttl_partial.json) exists, the policies it
# finished are taken from it (`bench ttl --reuse`, checked against this run) and not re-run.
# REUSE_ONLY=static,symi: take only those policies from the REUSE file (the others run
# again; without it every policy the file holds is reused, lrmoe's old run included).
set -euo pipefail
OUT=${1:?outdir}; W=${2:?workload}; STEPS=${3:?steps}; shift 3
[ $# -ge 1 ] || { echo "give at least one seed" >&2; exit 2; }
[ $# -le 4 ] || echo "warning: $# seeds write $(( 2 * $# )) files; the device tool returns 8" >&2
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
case $W in
  qwen3) CFG=benchmarks/configs/qwen3-30b-a3b-layer-2L.json ;;
  glm_fastbias) CFG=benchmarks/configs/glm-4.5-air-layer-2L-fastbias.json ;;
  glm_bias03) CFG=benchmarks/configs/glm-4.5-air-layer-2L-bias03.json ;;
  *) echo "unknown workload $W" >&2; exit 2 ;;
esac
POLICIES=${POLICIES:-static,symi,lrmoe:recompute,lrmoe,lrmoe:min_keep=0.8}
REUSE=${REUSE:-}
if [ -n "${MEM_BUDGET:-}" ]; then BUDGET=(--mem-budget "$MEM_BUDGET"); else BUDGET=(--budget-retain-fraction 0.8); fi
SEED_TIMEOUT=${SEED_TIMEOUT:-3000}  # seconds per seed; a cut-short seed keeps ttl_partial.json
EVERY=$(( STEPS / 20 > 0 ? STEPS / 20 : 1 ))
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
for SEED in "$@"; do
  D="$OUT/${W}_s$SEED"
  mkdir -p "$D"  # so a seed that fails before writing anything still packs its log
  R=()
  for f in "$REUSE/${W}_s$SEED/ttl.json" "$REUSE/${W}_s$SEED/ttl_partial.json" \
           "$REUSE/s$SEED/ttl.json" "$REUSE/s$SEED/ttl_partial.json"; do
    if [ -n "$REUSE" ] && [ -f "$f" ]; then R=(--reuse "$f"); break; fi
  done
  if [ ${#R[@]} -gt 0 ] && [ -n "${REUSE_ONLY:-}" ]; then  # a copy with those policies only
    mkdir -p /tmp/lrmoe_reuse  # not under OUT: the device tool returns few files
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); keep=sys.argv[2].split(','); \
r['policies']={k: v for k, v in r['policies'].items() if k in keep}; \
json.dump(r, open(sys.argv[3], 'w'))" "${R[1]}" "$REUSE_ONLY" /tmp/lrmoe_reuse/s$SEED.json
    R=(--reuse /tmp/lrmoe_reuse/s$SEED.json)
  fi
  echo "== $W seed $SEED: $STEPS steps, eval every $EVERY, policies $POLICIES ${R[*]}"
  timeout "$SEED_TIMEOUT" python3 -m lrmoe bench ttl --config "$CFG" --ep 8 --batch-size 128 --seq-len 256 --lr 1e-3 \
    --device cuda --eval-batches 8 --eval-every "$EVERY" --steps "$STEPS" --seed "$SEED" \
    "${BUDGET[@]}" --router-grad "${ROUTER_GRAD:-home}" --router-lr-scale "${ROUTER_LR_SCALE:-1}" --optimizer-offload host --link nvlink \
    --policies "$POLICIES" ${R[@]+"${R[@]}"} ${DETERMINISTIC:+--deterministic} --out "$D" \
    > "$D.log" 2>&1 || { tail -30 "$D.log"; }
  [ -f "$D/ttl.md" ] && cp "$D/ttl.md" "$OUT/${W}_s$SEED.md" && cat "$D/ttl.md" | head -30
  tar czf "$OUT/${W}_s$SEED.tar.gz" -C "$OUT" "${W}_s$SEED" "${W}_s$SEED.log"
  rm -rf "$D" "$D.log"  # the log is in the tarball: two files a seed come back, not three
done
