#!/bin/bash
cd /work/main
for s in 2 3; do for m in static lrmoe dw_only dx_only; do
  .venv/bin/python /tmp/glm/fid.py --config /tmp/glm/tiny-glm-slowbias.json --mode $m --max-slots 9 --seed $s --out /tmp/glm/fid_${m}_s$s.json > /tmp/glm/fid_${m}_s$s.log 2>&1
done; done
