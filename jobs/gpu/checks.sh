#!/usr/bin/env bash
# The project's GPU checks, as run for docs/benchmarks.md on a lent single-GPU machine.
#
# On a bare CUDA image (no network, no ray/mlflow/ffcv) carry the pure-Python wheels first
# (jobs/gpu/README.md), then:  OUT=DIR bash jobs/gpu/checks.sh PART...
# Parts (each under its own time limit, so one slow part cannot take the others' results):
#   doctor    pipeline doctor: every fused kernel against the torch path on the device (first: a wrong kernel
#             makes every figure after it meaningless), with its errors and times
#   tests     tests/test_gpu.py (TESTS selects with pytest -k)
#   kernels   bench kernels: K-Medoids' Triton kernels against the torch iterations, K-Means' iterations, patch embedding
#   eager     bench throughput, bf16, batch 256, DeiT-S level 3, every method + ceiling, eager
#   compiled  the same with torch.compile (COMPILE: default mode unless set) on both models
#   train     training step, bf16, batch 128, compiled (COMPILE), every method (TRAIN_METHODS)
#   fp32      inference, fp32, batch 256, eager
#   loop      bench loop: the training loop against its bare step (loop efficiency), bf16 (fp32 on the CPU),
#             batch 128, compiled (COMPILE), LOOP_STEPS (100) steps an epoch, the unmodified model and WK-Medoids
#   pooling   the fused clustering kernels against the kernels they replace: their GPU tests, bench kernels, the
#             compiled throughput of every method (METHODS), the same with the previous kernels
#             (KERNELS="kmedoids=tiled kmeans=torch"; PREVIOUS_METHODS, in OUT/previous),
#             and the training step of TRAIN_METHODS (wkmedoids); each under its own limit, in that order
#   latency   bench blocks: a latency table of DeiT-S (bf16, batch BATCH, compiled in COMPILE mode, the current
#             kernels) for each of LATENCY_METHODS (wkmedoids) on a coarse grid (LATENCY_STEP 48, --no-fine: 23
#             cells, each compiled shape costs seconds; the model and the halves at N to a +-1% interval, at
#             most LATENCY_ANCHOR_CAP_S 20 s each; LATENCY_ANCHOR_TOLERANCE 0.01), then bench latency-check of it on
#             the paper's levels (LATENCY_LISTS 8 lists: levels 0-7; LATENCY_CHECK_TOLERANCE 0.02, LATENCY_CHECK_CAP_S
#             30 s a list);
#             OUT/latency-METHOD.{json,md,log} and OUT/latency-check-METHOD.{md,log}; LATENCY_ARGS replaces the
#             model flags of bench blocks (the CPU test gives a tiny model and one thread; the check takes the table's)
#   speed     benchmarks/paired_speed.py: DeiT-S level 3 (SPEED_METHODS: powerbert,wkmedoids) against the unmodified
#             model, bf16, batch BATCH, compiled (COMPILE), with the evaluate stage's paired primitive (CUDA events,
#             ABBA blocks, a 95% interval to SPEED_TOLERANCE 0.02; SPEED_CAP_S 40 s a method)
#   pack      every output so far in one archive (below)
# SPLIT=1 runs eager, compiled, train and fp32 once per method (OUT/PART-METHOD.*), each under the
# part's limit, so that one method's slow compilation cannot take the later methods' results; each
# run times the unmodified model again (inductor's cache makes its second compilation short) and
# leaves out the ceiling row.
# Outputs: OUT/card.txt, OUT/PART.md (stdout), OUT/PART.log (stderr, progress) and, for the bench parts,
# OUT/PART.json (`--record`: the record pipeline/bench/measured/ keeps and the cluster budget reads).
# KERNELS="NAME=VALUE ...": the config's kernel choices for every part (`--set kernels.NAME=VALUE`).
# DEVICE (default cuda), BATCH (256) and TRAIN_BATCH (128) change the bench parts' setting: the tests run the
# script on the CPU with DEVICE=cpu BATCH=2, so that a broken line shows here, not on the lent machine.
# The lent machines return at most 8 files (the first H200 run of 2026-11-27 lost its test log and
# kernel tables so): write the parts to a local OUT and finish with the part `pack`, which puts the
# whole OUT folder in one archive, PACK (default OUT.tgz). DEADLINE (seconds since the epoch) skips
# every part, or SPLIT run, whose time limit would end after it, so that `pack` still runs in time.
set -uo pipefail
case ${DEADLINE:-0} in
  ''|*[!0-9]*) echo "DEADLINE must be seconds since the epoch, e.g. DEADLINE=\$(( \$(date +%s) + 540 )); got '$DEADLINE'" >&2
               exit 2 ;;
esac
out=${OUT:-runs/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
methods=${METHODS:-powerbert,kmedoids,wkmedoids,kmeans,tome}
mode=${COMPILE:-default}  # the compile mode of the compiled and train parts
device=${DEVICE:-cuda} batch=${BATCH:-256} train_batch=${TRAIN_BATCH:-128}
extra="${PROFILE:+--profile} ${PATCH_EMBED:+--patch-embed $PATCH_EMBED} ${CALLS:+--calls $CALLS}"
if [ -n "${SIGNIFICANCE:-}" ]; then  # every method that reads scores (pipeline methods: its significance option)
  for method in powerbert importance kmeans wkmeans kmedoids wkmedoids; do
    extra+=" --set pooling.options.$method.significance=$SIGNIFICANCE"
  done
fi
sets=""
for choice in ${KERNELS:-}; do sets+=" --set kernels.$choice"; done
extra+="$sets"
# PROFILE=1: a profile of one call of each model in PART.log (device time by kernel group, the longest
# kernels, torch.profiler's table); OUTPUT_CODE=1: inductor's generated code in PART.log as well (which aten
# ops each fused kernel of the profile holds); PATCH_EMBED=matmul: every model's patch embedding as one
# matmul; SIGNIFICANCE=cls: the class token's scores (give it its own OUT); CALLS=N: N calls a timed sample
# (bench throughput's default is 10 on CUDA; CALLS=1 times each call from an idle GPU, as runs 1-6 did), and
# the bench parts' outputs are named PART-callsN
if [ -n "${OUTPUT_CODE:-}" ]; then export TORCH_LOGS=output_code; fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$out/card.txt" 2>&1

fits() {  # fits LIMIT_S NAME: whether a part of that limit ends before DEADLINE
  [ -z "${DEADLINE:-}" ] || [ $(( DEADLINE - $(date +%s) )) -ge "$1" ] && return 0
  echo "== $2 skipped: $(( DEADLINE - $(date +%s) )) s left before DEADLINE, its limit is $1 s"; return 1
}

bench_one() {  # bench_one NAME LIMIT_S ARGS...
  local name=$1 limit=$2; shift 2
  fits "$limit" "$name" || return 0
  echo "== $name ($(date +%T))"
  timeout "$limit" python3 -m pipeline bench throughput --device "$device" --model deit_small_patch16_224 --level 3 \
    $extra "$@" --record "$out/$name.json" > "$out/$name.md" 2> "$out/$name.log"
  echo "   exit $? ($(date +%T))"; cat "$out/$name.md"
}

bench() {  # bench NAME LIMIT_S METHODS ARGS...: one run for all methods, or one a method with SPLIT=1
  local name=$1${CALLS:+-calls$CALLS} limit=$2 list=$3; shift 3
  if [ -n "${SPLIT:-}" ]; then
    for m in ${list//,/ }; do
      bench_one "$name-$m" "$limit" --methods "$m" "$@" --set bench_throughput.ceiling=false
    done
  else
    bench_one "$name" "$limit" --methods "$list" "$@"
  fi
}

for part in "$@"; do
  case $part in
    doctor) fits "${DOCTOR_S:-120}" doctor || continue
           echo "== doctor ($(date +%T))"
           timeout "${DOCTOR_S:-120}" python3 -m pipeline doctor --device "$device" $sets > "$out/doctor.md" \
             2> "$out/doctor.log"
           echo "   exit $?"; cat "$out/doctor.md" "$out/doctor.log" ;;
    tests) fits "${TESTS_S:-150}" tests || continue
           echo "== tests ($(date +%T))"
           timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py ${TESTS:+-k "$TESTS"} \
             > "$out/tests.log" 2>&1
           echo "   exit $?"; tail -3 "$out/tests.log" ;;
    kernels) fits "${KERNELS_S:-90}" kernels || continue
           echo "== kernels ($(date +%T))"
           timeout "${KERNELS_S:-90}" python3 -m pipeline bench kernels --device "$device" > "$out/kernels.md" \
             2> "$out/kernels.log"
           echo "   exit $?"; cat "$out/kernels.md" ;;
    eager) bench eager "${EAGER_S:-180}" "$methods" --dtype bf16 --batch "$batch" ;;
    compiled) bench "compiled-$mode" "${COMPILED_S:-330}" "$methods" --dtype bf16 --batch "$batch" --compile "$mode" ;;
    train) bench "train-$mode" "${TRAIN_S:-330}" "${TRAIN_METHODS:-$methods}" --dtype bf16 --batch "$train_batch" \
             --compile "$mode" --train --set bench_throughput.ceiling=false ;;
    fp32) bench fp32 "${FP32_S:-120}" "$methods" --dtype fp32 --batch "$batch" ;;
    loop) fits "${LOOP_S:-300}" loop || continue
          echo "== loop-$mode ($(date +%T))"
          loop_dtype=bf16; [ "$device" = cpu ] && loop_dtype=fp32  # training autocasts to bf16 on CUDA only
          timeout "${LOOP_S:-300}" python3 -m pipeline bench loop --device "$device" --model deit_small_patch16_224 \
            --level 3 --methods "${LOOP_METHODS:-none,wkmedoids}" --dtype "$loop_dtype" --batch "$train_batch" \
            --compile "$mode" --steps "${LOOP_STEPS:-100}" ${PATCH_EMBED:+--patch-embed $PATCH_EMBED} $sets \
            --record "$out/loop-$mode.json" > "$out/loop-$mode.md" 2> "$out/loop-$mode.log"
          echo "   exit $? ($(date +%T))"; cat "$out/loop-$mode.md" ;;
    pooling) TESTS=${TESTS:-"gram_matrix or cluster_means or kmedoids"} TESTS_S=${TESTS_S:-60} bash "$0" tests
             COMPILED_S=${COMPILED_S:-200} bash "$0" compiled
             TRAIN_METHODS=${TRAIN_METHODS:-wkmedoids} TRAIN_S=${TRAIN_S:-100} bash "$0" train
             KERNELS_S=${KERNELS_S:-60} bash "$0" kernels
             OUT="$out/previous" KERNELS="kmedoids=tiled kmeans=torch" \
               METHODS=${PREVIOUS_METHODS:-wkmedoids,kmeans} COMPILED_S=${PREVIOUS_S:-120} bash "$0" compiled ;;
    latency) for m in ${LATENCY_METHODS:-wkmedoids}; do
               fits "${LATENCY_S:-420}" "latency-$m" || continue
               echo "== latency-$m ($(date +%T))"
               timeout "${LATENCY_S:-420}" python3 -m pipeline bench blocks --device "$device" --method "$m" \
                 --batch "$batch" --dtype bf16 --compile "$mode" --step "${LATENCY_STEP:-48}" --no-fine --repeats 7 \
                 --anchor-tolerance "${LATENCY_ANCHOR_TOLERANCE:-0.01}" --anchor-cap-s "${LATENCY_ANCHOR_CAP_S:-20}" \
                 ${LATENCY_ARGS:---model deit_small_patch16_224} --out "$out/latency-$m.json" \
                 > "$out/latency-$m.md" 2> "$out/latency-$m.log"
               echo "   exit $? ($(date +%T))"; cat "$out/latency-$m.md"
               fits "${LATENCY_CHECK_S:-300}" "latency-check-$m" || continue
               timeout "${LATENCY_CHECK_S:-300}" python3 -m pipeline bench latency-check "$out/latency-$m.json" \
                 --lists "${LATENCY_LISTS:-8}" --tolerance "${LATENCY_CHECK_TOLERANCE:-0.02}" \
                 --cap-s "${LATENCY_CHECK_CAP_S:-30}" > "$out/latency-check-$m.md" \
                 2> "$out/latency-check-$m.log"
               echo "   exit $? ($(date +%T))"; cat "$out/latency-check-$m.md"
             done ;;
    speed) fits "${SPEED_S:-240}" "speed-$mode" || continue
           echo "== speed-$mode ($(date +%T))"
           timeout "${SPEED_S:-240}" python3 benchmarks/paired_speed.py --device "$device" --level 3 \
             --model "${SPEED_MODEL:-deit_small_patch16_224}" \
             --methods "${SPEED_METHODS:-powerbert,wkmedoids}" --batch "$batch" --dtype bf16 --compile "$mode" \
             --tolerance "${SPEED_TOLERANCE:-0.02}" --cap-s "${SPEED_CAP_S:-40}" \
             > "$out/speed-$mode.md" 2> "$out/speed-$mode.log"
           echo "   exit $? ($(date +%T))"; cat "$out/speed-$mode.md" ;;
    pack) tar czf "${PACK:-$out.tgz}" -C "$out" . && echo "== packed $out into ${PACK:-$out.tgz}" ;;
    *) echo "unknown part $part (doctor tests kernels eager compiled train fp32 loop pooling latency speed pack)"
       exit 2 ;;
  esac
done
