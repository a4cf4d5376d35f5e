#!/usr/bin/env bash
# Run benchmarks on a GPU machine, one after another; each writes under OUTDIR:
#   bash benchmarks/gpu_run.sh OUTDIR BENCH [BENCH ...]
# BENCH:
#   layer             benchmarks/moe_layer.py    the MoE layer against HF, eager and compiled
#   step              benchmarks/train_step.py   the whole training step against HF
#   ledger            benchmarks/ledger_peak.py  the memory ledger against the measured peak
#   plan              benchmarks/plan_speed.py   planning time per MoE layer
#   NAME              any other benchmarks/NAME.py that takes --out DIR
#   checks            the GPU correctness tests: pytest -m gpu tests/gpu
#   ttl:WORKLOAD:SEED one `lrmoe bench ttl` time-to-target run (EMULATED times), EP 8
#                     virtual ranks; WORKLOAD: qwen3, glm_fastbias, glm_bias03, or the
#                     two-MoE-layer GLM twin glm_moe / glm_moe_bias03
# Results: OUTDIR/NAME/ (checks: OUTDIR/checks/; ttl: OUTDIR/ttl/WORKLOAD/sSEED/) and the
# log OUTDIR/NAME.log. More flags for a python benchmark: ARGS_NAME, e.g.
# ARGS_layer="--shapes glm --tokens 16384".
# ttl settings (environment, default in brackets): STEPS [120]; POLICIES
# [static,symi,lrmoe:recompute+estimator=sampled]; MEM_BUDGET, a size or none for no
# budget [--budget-floor-fraction 1.1 when unset: 1.1 x static's whole-layer floor over the
# run's routing, read off a first static run without a budget]; ROUTER_GRAD, static's and symi's
# router gradient [home]; ROUTER_LR_SCALE [1]; LINK [nvlink]; DETERMINISTIC=1 for
# --deterministic; REUSE=DIR to take the finished policies of DIR/sSEED/ttl.json
# (checked by `bench ttl --reuse`), REUSE_ONLY=static,symi to take only those; TTL_ARGS,
# more `bench ttl` flags. MODEL_ARGS, DEVICE [cuda], EP [8], BATCH [128], SEQ [256]
# override the workload (for a CPU smoke run).
# TIMEOUT: seconds per benchmark [3000]. PYTHON: the interpreter [.venv/bin/python where
# `make` made one, else python3]. Exit code: the number of benchmarks that failed.
set -uo pipefail
OUT=${1:?usage: gpu_run.sh OUTDIR BENCH [BENCH ...]}; shift
[ $# -ge 1 ] || { echo "gpu_run.sh: error: name at least one benchmark" >&2; exit 2; }
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -x .venv/bin/python ]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi
mkdir -p "$OUT"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

ttl() {  # WORKLOAD SEED LOG
  local w=$1 seed=$2 log=$3 cfg d budget reuse=()
  case $w in
    qwen3) cfg=qwen3-30b-a3b-layer-2L.json ;;
    glm_fastbias) cfg=glm-4.5-air-layer-2L-fastbias.json ;;
    glm_bias03) cfg=glm-4.5-air-layer-2L-bias03.json ;;
    glm_moe) cfg=glm-4.5-air-moe-2L.json ;;
    glm_moe_bias03) cfg=glm-4.5-air-moe-2L-bias03.json ;;
    *) echo "gpu_run.sh: error: workload '$w' (qwen3, glm_fastbias, glm_bias03, glm_moe," \
            "glm_moe_bias03)" >&2; return 2 ;;
  esac
  d=$OUT/ttl/$w/s$seed
  mkdir -p "$d"
  local steps=${STEPS:-120}
  if [ "${MEM_BUDGET:-}" = none ]; then budget=()
  elif [ -n "${MEM_BUDGET:-}" ]; then budget=(--mem-budget "$MEM_BUDGET")
  else budget=(--budget-floor-fraction 1.1); fi
  if [ -n "${REUSE:-}" ] && [ -f "$REUSE/s$seed/ttl.json" ]; then
    reuse=(--reuse "$REUSE/s$seed/ttl.json")
    if [ -n "${REUSE_ONLY:-}" ]; then  # a copy holding only those policies
      "$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); k=sys.argv[2].split(','); \
r['policies']={n: v for n, v in r['policies'].items() if n in k}; \
json.dump(r, open(sys.argv[3], 'w'))" "${reuse[1]}" "$REUSE_ONLY" "$d.reuse.json"
      reuse=(--reuse "$d.reuse.json")
    fi
  fi
  # shellcheck disable=SC2086
  timeout "${TIMEOUT:-3000}" "$PY" -m lrmoe bench ttl ${MODEL_ARGS:---config benchmarks/configs/$cfg} \
    --ep "${EP:-8}" --batch-size "${BATCH:-128}" --seq-len "${SEQ:-256}" --lr 1e-3 \
    --device "${DEVICE:-cuda}" --eval-batches 8 --eval-every $(( steps / 20 > 0 ? steps / 20 : 1 )) \
    --steps "$steps" --seed "$seed" ${budget[@]+"${budget[@]}"} --router-grad "${ROUTER_GRAD:-home}" \
    --router-lr-scale "${ROUTER_LR_SCALE:-1}" --optimizer-offload host --link "${LINK:-nvlink}" \
    --policies "${POLICIES:-static,symi,lrmoe:recompute+estimator=sampled}" \
    ${reuse[@]+"${reuse[@]}"} ${DETERMINISTIC:+--deterministic} ${TTL_ARGS:-} --out "$d" > "$log" 2>&1
}

failed=0
for b in "$@"; do
  name=${b//:/_}
  log=$OUT/$name.log
  echo "== $b at ${SECONDS}s"
  case $b in
    ttl:*:*) IFS=: read -r _ w seed <<< "$b"; ttl "$w" "$seed" "$log" ;;
    checks) LRMOE_GPU_OUT=$OUT/checks timeout "${TIMEOUT:-3000}" "$PY" -m pytest -p no:cacheprovider \
              -m gpu -rs tests/gpu > "$log" 2>&1 ;;
    *)
      case $b in layer) s=moe_layer ;; step) s=train_step ;; ledger) s=ledger_peak ;;
                 plan) s=plan_speed ;; *) s=$b ;; esac
      if [ ! -f "benchmarks/$s.py" ]; then
        echo "gpu_run.sh: error: no benchmark '$b' (layer, step, ledger, plan, checks," \
             "ttl:WORKLOAD:SEED or a benchmarks/NAME.py)" | tee "$log" >&2
        false
      else
        args=ARGS_$b
        # shellcheck disable=SC2086
        timeout "${TIMEOUT:-3000}" "$PY" "benchmarks/$s.py" --out "$OUT/$name" ${!args:-} > "$log" 2>&1
      fi ;;
  esac
  rc=$?
  echo "== $b rc=$rc after ${SECONDS}s"; tail -20 "$log"
  [ $rc -eq 0 ] || failed=$((failed + 1))
done
exit $failed
