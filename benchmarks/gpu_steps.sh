# Sourced by the device scripts (gpu_issue16.sh, gpu_checks.sh): TOTAL seconds for the
# whole script; `step NAME RESERVE CMD...` runs CMD with the time left minus RESERVE
# (skipped below 30 s), logs to /tmp/NAME.log and shows its tail.
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
