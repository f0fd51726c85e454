HERE=$(cd "$(dirname "$0")" && pwd)  # the checkpoints: runs/ray/ of the idle demo pair at 6834f0a (run 2)
cd "$(git rev-parse --show-toplevel)" || exit 1
for i in 1 2 3 4 5 6; do
 for ck in runs/ray/demo-ft-M32-lam0.001-tome-94eee2cf11/local_checkpoints/epoch_00001 runs/ray/demo-ft-M64-lam0.0001-powerbert-994af53cb8/local_checkpoints/epoch_00001; do
  echo "default $(basename $(dirname $(dirname $ck))) $(.venv/bin/python "$HERE/one.py" $ck 2>/dev/null | tail -1)"
  echo "malloc $(basename $(dirname $(dirname $ck))) $(MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=67108864 .venv/bin/python "$HERE/one.py" $ck 2>/dev/null | tail -1)"
 done
done
