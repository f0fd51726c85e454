HERE=$(cd "$(dirname "$0")" && pwd)  # the checkpoints: runs/ray/ of the idle demo pair at 6834f0a (run 2)
cd "$(git rev-parse --show-toplevel)" || exit 1
for i in 1 2 3 4; do
 for ck in runs/ray/demo-ft-M32-lam0.001-tome-94eee2cf11/local_checkpoints/epoch_00001 runs/ray/demo-ft-M64-lam0.0001-powerbert-994af53cb8/local_checkpoints/epoch_00001; do
  for mode in mallopt late; do
  echo "$mode $(basename $(dirname $(dirname $ck))) $(.venv/bin/python "$HERE/one2.py" $ck $mode 2>&1 | tail -1)"
  done
 done
done
