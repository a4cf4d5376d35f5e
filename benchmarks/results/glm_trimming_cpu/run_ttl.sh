#!/bin/bash
cd /work/main
for s in 0 1; do
  .venv/bin/python -m lrmoe bench ttl --config /tmp/glm/tiny-glm.json --device cpu --ep 4 \
    --policies static,lrmoe,lrmoe:estimator=sampled,lrmoe:min_keep=0.9 --steps 150 \
    --batch-size 32 --seq-len 128 --eval-every 10 --eval-batches 4 --seed $s --threads 1 \
    --out /tmp/glm/ttl_s$s > /tmp/glm/ttl_s$s.log 2>&1
done
