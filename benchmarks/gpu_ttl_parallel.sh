#!/usr/bin/env bash
# Issue-14 time-to-target runs spread over every GPU of the device machine, one
# `gpu_ttl_seeds.sh` seed per GPU at a time (a job queue), then one archive:
#   bash benchmarks/gpu_ttl_parallel.sh OUTDIR STEPS JOB [JOB ...]
# JOB: WORKLOAD:SEED, e.g. glm_fastbias:0 qwen3:2. Per-workload settings come from the
# environment as in gpu_ttl_seeds.sh, with the workload's name as prefix:
# GLM_FASTBIAS_MEM_BUDGET=8GiB GLM_FASTBIAS_ROUTER_GRAD=experts; POLICIES, DETERMINISTIC,
# SEED_TIMEOUT apply to all. Writes OUTDIR/all.tar.gz (every seed's files) and
# OUTDIR/WORKLOAD_sSEED.md (each seed's ttl.md, for a first look). Each process sees
# one GPU (CUDA_VISIBLE_DEVICES); the measured kernel times are per process as in the
# sequential script, with other processes on other GPUs of the same host.
set -uo pipefail
OUT=${1:?outdir}; STEPS=${2:?steps}; shift 2
NG=$(nvidia-smi -L | wc -l)
mkdir -p "$OUT/work"
echo "$NG GPUs; jobs: $*"
run_job() {  # gpu workload seed
  local gpu=$1 w=$2 seed=$3 up; up=$(echo "$w" | tr a-z A-Z)
  local mb="${up}_MEM_BUDGET" rg="${up}_ROUTER_GRAD"
  CUDA_VISIBLE_DEVICES=$gpu MEM_BUDGET=${!mb:-} ROUTER_GRAD=${!rg:-home} \
    bash benchmarks/gpu_ttl_seeds.sh "$OUT/work" "$w" "$STEPS" "$seed" > "$OUT/work/${w}_s$seed.out" 2>&1
}
declare -A busy
for job in "$@"; do
  while :; do  # the first free GPU
    for g in $(seq 0 $((NG - 1))); do
      p=${busy[$g]:-}
      if [ -z "$p" ] || ! kill -0 "$p" 2>/dev/null; then free=$g; break 2; fi
    done
    sleep 2
  done
  w=${job%%:*}; s=${job##*:}
  echo "== $job on GPU $free at ${SECONDS}s"
  run_job "$free" "$w" "$s" &
  busy[$free]=$!
done
wait
echo "== all done at ${SECONDS}s"
for f in "$OUT"/work/*.md; do [ -f "$f" ] && cp "$f" "$OUT/"; done
tar czf "$OUT/all.tar.gz" -C "$OUT" work
rm -rf "$OUT/work"
