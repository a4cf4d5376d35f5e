#!/bin/bash
cd /work/main
while pgrep -f run_fid.sh > /dev/null; do sleep 5; done
.venv/bin/python /tmp/glm/fid.py --config /tmp/glm/tiny-glm-slowbias.json --mode lrmoe --estimator sampled --max-slots 9 --seed 0 --out /tmp/glm/fid_sampled_s0.json > /tmp/glm/fid_sampled_s0.log 2>&1
.venv/bin/python /tmp/glm/fid.py --config /tmp/glm/tiny-glm-slowbias.json --mode lrmoe --min-keep 0.9 --max-slots 9 --seed 0 --out /tmp/glm/fid_mk09_s0.json > /tmp/glm/fid_mk09_s0.log 2>&1
.venv/bin/python /tmp/glm/fid.py --config /tmp/glm/tiny-glm.json --mode lrmoe --seed 0 --out /tmp/glm/fid_r1_s0.json > /tmp/glm/fid_r1_s0.log 2>&1
