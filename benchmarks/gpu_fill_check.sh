#!/usr/bin/env bash
# What torch's fill of uninitialized memory costs under --deterministic, and whether runs
# stay bitwise repeatable without it (device machine, one H200):
#   bash benchmarks/gpu_fill_check.sh OUTDIR [SECONDS]
# 1. benchmarks/select_cost.py: the select stage without deterministic kernels, with them
#    (--no-deterministic-fill) and with torch's fill on top (--deterministic as it comes)
# 2. the short GLM-shaped `lrmoe bench ttl` of gpu_checks.sh (static and
#    lrmoe:recompute+estimator=sampled, 12 steps) with --deterministic
#    --no-deterministic-fill twice and with the fill once; benchmarks/ttl_repeat.py
#    compares no-fill with no-fill (repeatable?) and no-fill with fill (same math?)
# Everything is packed into OUTDIR/fill_check.tar.gz (the device tool returns few files).
# Limits at TOTAL 420: select ~80 s, each 12-step run ~110 s (the first run on a cold
# machine took over 70 s before printing its first step).
set -uo pipefail
OUT=${1:?outdir}; TOTAL=${2:-420}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p "$OUT/fill_check/rep"
. benchmarks/gpu_steps.sh
TTL=("${REPEAT_TTL[@]}" --deterministic)
D=$OUT/fill_check
step select 340 python3 benchmarks/select_cost.py --out "$D/select"
step nofill_a 220 "${TTL[@]}" --no-deterministic-fill --out "$D/rep/nofill_a"
step nofill_b 110 "${TTL[@]}" --no-deterministic-fill --out "$D/rep/nofill_b"
step fill 10 "${TTL[@]}" --out "$D/rep/fill"
cp /tmp/select.log /tmp/nofill_a.log /tmp/nofill_b.log /tmp/fill.log "$D/" 2>/dev/null
[ -f "$D/rep/nofill_b/ttl.json" ] && python3 benchmarks/ttl_repeat.py "$D/rep/nofill_a/ttl.json" \
  "$D/rep/nofill_b/ttl.json" --out "$D/nofill_vs_nofill.md" && cat "$D/nofill_vs_nofill.md"
[ -f "$D/rep/fill/ttl.json" ] && python3 benchmarks/ttl_repeat.py "$D/rep/nofill_a/ttl.json" \
  "$D/rep/fill/ttl.json" --out "$D/nofill_vs_fill.md" && cat "$D/nofill_vs_fill.md"
tar czf "$OUT/fill_check.tar.gz" -C "$OUT" fill_check && rm -rf "$D"
