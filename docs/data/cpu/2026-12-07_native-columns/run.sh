#!/bin/bash
# Issue 78's measurements at 7c1322a against db5a098, one at a time on the idle 2-core AMD EPYC VM (AVX-512).
# OLD is a checkout of db5a098, NEW one of 7c1322a (git clone, then git checkout); outputs under /tmp/b78d/ (this folder).
# The first_* files are the same script's run at 1e02cf9 (before the OpenMP split), its throughput runs stopped after one.
# native_kmedoids_*.md: `python benchmarks/native_kmedoids.py` twice, 09:27 UTC, after this script.
set -x
cd /tmp
OLD=/tmp/base78; NEW=/tmp/new78; PY=/work/main/.venv/bin/python; OUT=/tmp/b78d
mkdir -p $OUT
git -C $NEW log --oneline -1; date -u; uptime; grep -m1 "model name" /proc/cpuinfo
ops=(configs/bench_ops.yaml --set "bench.keep=[98]" --set "bench.methods=[wkmedoids, kmedoids, wkmeans, kmeans, powerbert]")
for i in 1 2 3; do
  (cd $OLD && PYTHONPATH=$OLD $PY -m pipeline bench ops "${ops[@]}") > $OUT/ops_db5a098_$i.md 2>&1
  (cd $NEW && PYTHONPATH=$NEW $PY -m pipeline bench ops "${ops[@]}") > $OUT/ops_new_$i.md 2>&1
done
for i in 1 2; do
  (cd $NEW && PIPELINE_NATIVE_CLONES=0 PYTHONPATH=$NEW $PY -m pipeline bench ops "${ops[@]}") > $OUT/ops_new_baseline_$i.md 2>&1
  (cd $OLD && PYTHONPATH=$OLD $PY -m pipeline bench ops "${ops[@]}") > $OUT/ops_db5a098_vs_baseline_$i.md 2>&1
done
(cd $NEW && PYTHONPATH=$NEW $PY benchmarks/native_clones.py --old-source docs/data/cpu/2026-12-07_native-clones/clustering_cpu_db5a098.c --threads 1,2) > $OUT/native_clones.md 2>&1
for t in 1 2; do
  (cd $NEW && PYTHONPATH=$NEW $PY benchmarks/clustering_parts.py --threads $t --repeats 9) > $OUT/parts_new_t$t.md 2>&1
done
for i in 1 2 3 4 5; do
  (cd $NEW && PYTHONPATH=$NEW $PY -m pipeline bench throughput --methods wkmedoids,powerbert --level 3 --batch 32 --set bench_throughput.ceiling=false) > $OUT/throughput_new_$i.md 2>&1
done
date -u; uptime
