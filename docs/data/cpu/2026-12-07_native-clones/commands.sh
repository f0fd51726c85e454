#!/bin/bash
# Issue 78's measurements at the final code, one at a time on an idle machine. Outputs under /tmp/b78b/.
set -x
while pgrep -f "rehearse-dir /tmp/paper-rehearsal-qk" > /dev/null; do sleep 5; done
mkdir -p /tmp/b78b; cd /tmp
OLD=/tmp/base78; NEW=/tmp/new78; PY=/work/main/.venv/bin/python
git -C $NEW log --oneline -1; date -u; uptime
for t in 1 2; do
  (cd $NEW && PYTHONPATH=$NEW $PY benchmarks/clustering_parts.py --threads $t --repeats 9) > /tmp/b78b/parts_new_t$t.md 2>&1
done
(cd $NEW && PYTHONPATH=$NEW $PY benchmarks/native_clones.py --old-source docs/data/cpu/2026-12-07_native-clones/clustering_cpu_db5a098.c --threads 1,2) > /tmp/b78b/native_clones.md 2>&1
ops=(configs/bench_ops.yaml --set "bench.keep=[98]" --set "bench.methods=[wkmedoids, kmedoids, wkmeans, kmeans, powerbert]")
for i in 1 2 3; do
  (cd $OLD && PYTHONPATH=$OLD $PY -m pipeline bench ops "${ops[@]}") > /tmp/b78b/ops_db5a098_$i.md 2>&1
  (cd $NEW && PYTHONPATH=$NEW $PY -m pipeline bench ops "${ops[@]}") > /tmp/b78b/ops_new_$i.md 2>&1
done
for i in 1 2 3; do
  (cd $NEW && PYTHONPATH=$NEW $PY -m pipeline bench throughput --methods wkmedoids,powerbert --level 3 --batch 32 --set bench_throughput.ceiling=false) > /tmp/b78b/throughput_new_$i.md 2>&1
done
date -u; uptime
#!/bin/bash
# WK-Means' step with the clones and with the baseline build alone, interleaved (bench ops, wkmeans and kmeans rows).
set -x
while pgrep -f bench78b.sh > /dev/null; do sleep 3; done
cd /tmp/new78; export PYTHONPATH=/tmp/new78; PY=/work/main/.venv/bin/python
ops=(configs/bench_ops.yaml --set "bench.keep=[98]" --set "bench.methods=[wkmeans, kmeans]")
for i in 1 2; do
  $PY -m pipeline bench ops "${ops[@]}" > /tmp/b78b/wk_clones_$i.md 2>&1
  PIPELINE_NATIVE_CLONES=0 $PY -m pipeline bench ops "${ops[@]}" > /tmp/b78b/wk_baseline_$i.md 2>&1
  (cd /tmp/base78 && PYTHONPATH=/tmp/base78 $PY -m pipeline bench ops "${ops[@]}") > /tmp/b78b/wk_db5a098_$i.md 2>&1
done
date -u
