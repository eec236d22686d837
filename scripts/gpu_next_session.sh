#!/bin/sh
# One GPU lease for a kernel change: correctness first, then where the new configs stand, then
# a fresh tuning DB and the side-by-side benchmark. Every stage is time-boxed and writes under
# $OUT; run it in two calls (STAGE=1, then STAGE=2) to stay inside a 10-minute call limit.
#   STAGE=1: GPU tests (4 parallel pytest processes) + decode sweep at M = 1, 16 (~5 min);
#   SWEEP=gemm: the GEMM sweep at M = 16, 64, 128, 512 instead (with the decode default at 16)
#   SWEEP=swizzle: the GEMM's CTA order at M = 512, 2048, 8192 (SWEEP_MS, SWEEP_SHAPES)
#   SWEEP=pdl: the benchmark's default configs with and without dependent launch (SWEEP_MS)
#   (SWEEP=none: tests only)
#   STAGE=2: tune each TUNES entry (model:fmt:seconds; none by default) into $DB (first imported
#            from .devsite/db/nvidia-h200.json when carried; FORCE=1 re-tunes the buckets it
#            already holds, starting from the stored winners), export it (and copy the SQLite
#            file with its trials); with BENCH=1 (default)
#            the benchmark (ROUNDS interleaved rounds, default 3) and host overhead (TUNE_MS: the M buckets)
OUT=${OUT:-out}; mkdir -p "$OUT"
DB=${DB:-/tmp/autofp4-h200.db}
# kernels compiled ahead of time on a CPU host (autofp4 cache --warm ... --arch sm_90a), carried along
if [ -d .devsite/kcache ]; then export AUTOFP4_KERNEL_CACHE="$(pwd)/.devsite/kcache"; fi
if [ "${STAGE:-1}" = 1 ]; then
  T="timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -m gpu -p no:cacheprovider"
  $T tests/test_decode_gpu.py tests/test_kernel_cache.py > "$OUT/ta.txt" 2>&1 &
  $T tests/test_sm90_gemm_gpu.py > "$OUT/tb.txt" 2>&1 &
  $T tests/test_gpu_api.py tests/test_tuner.py tests/test_pdl.py > "$OUT/tc.txt" 2>&1 &
  $T tests/test_formats.py tests/test_weights.py tests/test_timing.py tests/test_dispatch.py tests/test_ops.py > "$OUT/td.txt" 2>&1 &
  wait
  for f in ta tb tc td; do echo "$f: $(tail -1 "$OUT/$f.txt")"; done
  grep -h -E "^(FAILED|ERROR)" "$OUT"/t?.txt | head -20
  if [ "${SWEEP:-decode}" = decode ]; then
    timeout ${SWEEP_TIMEOUT:-300} python3 scripts/gpu_check_decode.py --sweep --skip-correct --ms 1,16 \
      > "$OUT/decode_sweep.txt" 2>&1
    tail -14 "$OUT/decode_sweep.txt"
  elif [ "$SWEEP" = swizzle ]; then
    timeout ${SWEEP_TIMEOUT:-300} python3 scripts/gpu_sweep_gemm.py --swizzle --ms ${SWEEP_MS:-512,2048,8192} \
      --shapes "${SWEEP_SHAPES:-8B gate_up,70B gate_up,8B qkv,70B down}" > "$OUT/gemm_sweep_swizzle.txt" 2>&1
    tail -14 "$OUT/gemm_sweep_swizzle.txt"
  elif [ "$SWEEP" = pdl ]; then
    # the default configs with and without programmatic dependent launch, back to back in graphs
    timeout ${SWEEP_TIMEOUT:-300} python3 scripts/bench_linear.py --out "$OUT/pdl" --fmt nvfp4 \
      --m ${SWEEP_MS:-1,16,64} --reps 10 > "$OUT/pdl_ab.txt" 2>&1
    tail -8 "$OUT/pdl_ab.txt"
  elif [ "$SWEEP" = gemm ]; then
    timeout ${SWEEP_TIMEOUT:-200} python3 scripts/gpu_sweep_gemm.py --ms 16,64,128,512 > "$OUT/gemm_sweep.txt" 2>&1
    tail -26 "$OUT/gemm_sweep.txt"
  fi
else
  # TUNES: model:fmt:seconds entries, tuned in order into $DB; then export; BENCH=1 benchmarks.
  # A fresh machine starts from the export of an earlier call, carried in .devsite/db.
  if [ ! -f "$DB" ] && [ -f .devsite/db/nvidia-h200.json ]; then
    python3 -m autofp4 db import .devsite/db/nvidia-h200.json --db "$DB" | tail -1
  fi
  for t in ${TUNES:-}; do
    model=${t%%:*}; rest=${t#*:}; fmt=${rest%%:*}; secs=${rest#*:}
    python3 -m autofp4 tune --model "examples/$model.json" --fmt "$fmt" --db "$DB" \
      --m ${TUNE_MS:-1,16,32,64,128,512,2048,8192} --time-budget "$secs" --no-progress $([ "${FORCE:-0}" = 1 ] && echo --force) > "$OUT/tune-$model-$fmt.txt" 2>&1
    echo "$model $fmt: $(tail -3 "$OUT/tune-$model-$fmt.txt" | head -1 | cut -c1-160)"
  done
  python3 -m autofp4 db export --db "$DB" --env current --out "$OUT/nvidia-h200.json"
  # the database itself too: its trial rows (every config measured) are what defaults are fitted to
  if [ -n "${TUNES:-}" ]; then cp "$DB" "$OUT/tuning-with-trials.db"; fi
  if [ "${BENCH:-1}" = 1 ]; then
    AUTOFP4_DB="$DB" timeout ${BENCH_TIMEOUT:-200} python3 scripts/bench_linear.py --out "$OUT" \
      --partial "$OUT/bench_linear.json" --fmt nvfp4,mxfp4 --reps 10 --rounds ${ROUNDS:-3} > "$OUT/bench_linear.txt" 2>&1
    tail -8 "$OUT/bench_linear.txt"
    AUTOFP4_DB="$DB" timeout 60 python3 scripts/bench_dispatch.py > "$OUT/host-overhead.txt" 2>&1
    tail -4 "$OUT/host-overhead.txt"
  fi
fi
