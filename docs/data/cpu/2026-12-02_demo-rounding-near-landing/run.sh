#!/bin/bash
# Two idle `make demo` runs from empty stores: the betons, runs/ and every numba disk cache (FFCV's pipelines,
# this package's, and numba.typed's dict functions) deleted before each. Run from anywhere in the checkout;
# outputs go to $OUT (default /tmp/r51). The load average is logged every 30 s into load.txt.
cd "$(git rev-parse --show-toplevel)" || exit 1
OUT=${OUT:-/tmp/r51}
mkdir -p "$OUT"
git rev-parse HEAD > "$OUT/commit.txt"
( while true; do echo "$(date -u +%T) $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/load.txt"; sleep 30; done ) &
LOADER=$!
SITE=$(.venv/bin/python -c "import importlib.util as u; print(u.find_spec('ffcv').submodule_search_locations[0])")
NUMBA=$(.venv/bin/python -c "import importlib.util as u; print(u.find_spec('numba').submodule_search_locations[0])")
for i in 1 2; do
  rm -rf runs data/fmnist_train_10k.beton* data/fmnist_test_2k.beton*
  find pipeline "$SITE" "$NUMBA/typed" \( -name '*.nbi' -o -name '*.nbc' \) -delete
  echo "run $i start $(date -u +%FT%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/log.txt"
  s=$(date +%s)
  make demo > "$OUT/demo-$i.log" 2>&1; rc=$?
  echo "run $i end $(date -u +%FT%T) rc $rc wall $(( $(date +%s) - s )) s load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/log.txt"
  mkdir -p "$OUT/demo-$i" && cp runs/experiments/demo/*.csv "$OUT/demo-$i/"
done
kill $LOADER
.venv/bin/python benchmarks/speed_repeat.py "$OUT/demo-1" "$OUT/demo-2" > "$OUT/speed_repeat.md" 2>&1
echo "all done $(date -u +%FT%T)" >> "$OUT/log.txt"
