#!/bin/bash
# Every finetuned M32 model of `make demo`, exported and checked on the first 2,000 Fashion-MNIST test images:
echo "command: pipeline export --checkpoint CHECKPOINT --check-images 2000 --out FILE, for each M32 row of runs/experiments/demo/results.csv; $(grep -m1 "model name" /proc/cpuinfo); $(date -u +%F); $(git rev-parse --short HEAD)"
cd /work/main
.venv/bin/python -c "
import csv
for r in csv.DictReader(open('runs/experiments/demo/results.csv')):
    if r['arch'] == 'M32': print(r['method'], r['level'], r['checkpoint'])
" | while read method level ckpt; do
  echo "## $method $level"
  start=$(date +%s.%N)
  .venv/bin/python -m pipeline export --checkpoint "$ckpt" --check-images 2000 --out "/tmp/onx/demo/$method-$level.onnx" 2>&1 | grep -v "^exporting\|^wrote"
  echo "seconds: $(echo "$(date +%s.%N) - $start" | bc)"
done
