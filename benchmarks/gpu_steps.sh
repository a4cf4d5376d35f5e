# Sourced by the device scripts (gpu_issue16.sh, gpu_checks.sh, gpu_fill_check.sh): TOTAL
# seconds for the whole script; `step NAME RESERVE CMD...` runs CMD with the time left
# minus RESERVE (skipped below 30 s), logs to /tmp/NAME.log and shows its tail.
# REPEAT_TTL: the short GLM-shaped `lrmoe bench ttl` the repeatability checks run twice
# (8 GiB, static and lrmoe:recompute+estimator=sampled, 12 steps).
REPEAT_TTL=(python3 -m lrmoe bench ttl --config benchmarks/configs/glm-4.5-air-layer-2L-fastbias.json \
    --ep 8 --batch-size 128 --seq-len 256 --lr 1e-3 --device cuda --eval-batches 8 \
    --eval-every 4 --steps 12 --seed 0 --mem-budget 8GiB --router-grad experts \
    --optimizer-offload host --link nvlink \
    --policies static,lrmoe:recompute+estimator=sampled)
START=$SECONDS
left() { echo $(( TOTAL - (SECONDS - START) - $1 )); }
step() {
  local name=$1 reserve=$2; shift 2
  local t; t=$(left "$reserve")
  if [ "$t" -lt 30 ]; then echo "== $name: skipped (${t}s left)"; return; fi
  echo "== $name (limit ${t}s)"
  timeout "$t" "$@" > "/tmp/$name.log" 2>&1
  echo "== $name rc=$? after $((SECONDS - START))s"; tail -25 "/tmp/$name.log"
}
