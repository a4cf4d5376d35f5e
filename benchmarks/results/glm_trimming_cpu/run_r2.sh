#!/bin/bash
cd /work/main
while pgrep -f run_ttl.sh > /dev/null; do sleep 5; done
for s in 0 1; do
  .venv/bin/python -m lrmoe bench ttl --config /tmp/glm/tiny-glm-slowbias.json --device cpu --ep 4 \
    --policies static,symi,lrmoe:max_slots=9,lrmoe:max_slots=9+estimator=sampled,lrmoe:max_slots=9+min_keep=0.9 --steps 150 \
    --batch-size 32 --seq-len 128 --eval-every 10 --eval-batches 4 --seed $s --threads 1 \
    --out /tmp/glm/r2_s$s > /tmp/glm/r2_s$s.log 2>&1
done
