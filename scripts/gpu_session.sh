#!/bin/sh
# All GPU work of one short session, in order of priority; every stage writes under $OUT.
#   1. quantize speed (timed alone)   2. every `gpu` test, four pytest processes at once
#   3. the side-by-side linear benchmark on a subset, until the time left runs out
OUT=${OUT:-out}; mkdir -p "$OUT"
export AUTOFP4_DB=/tmp/autofp4-bench.db
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 scripts/bench_quantize.py > "$OUT/bench_quantize.txt" 2>&1
tail -6 "$OUT/bench_quantize.txt"
T=${TEST_TIMEOUT:-110}
timeout $T python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_formats.py tests/test_weights.py tests/test_timing.py tests/test_dispatch.py tests/test_ops.py > "$OUT/t1.txt" 2>&1 &
timeout $T python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_api.py > "$OUT/t2.txt" 2>&1 &
timeout $T python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_gpu.py > "$OUT/t3.txt" 2>&1 &
timeout $T python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sm90_gemm_gpu.py > "$OUT/t4.txt" 2>&1 &
wait
for f in t1 t2 t3 t4; do echo "$f: $(grep -E 'passed|failed|error' "$OUT/$f.txt" | tail -1)"; done
grep -h -E "^(FAILED|ERROR)" "$OUT"/t?.txt | head -20
timeout ${BENCH_TIMEOUT:-120} python3 scripts/bench_linear.py --out "$OUT" --partial "$OUT/bench_linear.json" \
  --fmt "${BENCH_FMT:-nvfp4}" --m "${BENCH_M:-1,16,128,2048}" --reps 10 \
  --shapes "8B qkv,8B o,8B gate_up,8B down" > "$OUT/bench_linear.txt" 2>&1
grep -E "cublas|WRONG|Error" "$OUT/bench_linear.txt" | tail -20
