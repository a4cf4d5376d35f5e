#!/bin/bash
cd /work/main
for s in 0 1; do for m in lrmoe dw_only dx_only static; do
  .venv/bin/python /tmp/glm/fid.py --config /tmp/glm/tiny-glm-slowbias.json --mode $m --max-slots 9 --seed $s --out /tmp/glm/fid_${m}_s$s.json > /tmp/glm/fid_${m}_s$s.log 2>&1
done; done
