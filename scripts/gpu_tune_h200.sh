#!/bin/sh
# Tune the example models on this GPU and export the result as the shipped DB for it, then run the
# side-by-side benchmark with the tuned picks. Writes under $OUT:
#   nvidia-h200.json (-> tuning_db/), tune.txt (summary table, wall time), bench_linear.{json,md,txt}
OUT=${OUT:-out}; mkdir -p "$OUT"
DB=/tmp/autofp4-h200.db
export AUTOFP4_DB=$DB
start=$(date +%s)
python3 -m autofp4 tune --model examples/llama-3.1-8b.json --fmt "${FMT:-nvfp4}" --m "${M:-1,16,64,128,512,2048,8192}" \
  --budget "${BUDGET:-8}" --time-budget "${TUNE_SECONDS:-400}" --no-progress > "$OUT/tune.txt" 2>&1
echo "tune wall time: $(( $(date +%s) - start )) s" | tee -a "$OUT/tune.txt"
tail -40 "$OUT/tune.txt"
python3 -m autofp4 db export --db $DB --env current --out "$OUT/nvidia-h200.json"
timeout ${BENCH_TIMEOUT:-150} python3 scripts/bench_linear.py --out "$OUT" --partial "$OUT/bench_linear.json" \
  --fmt "${FMT:-nvfp4}" --m "${M:-1,16,64,128,512,2048,8192}" --reps 10 \
  --shapes "8B qkv,8B o,8B gate_up,8B down" > "$OUT/bench_linear.txt" 2>&1
tail -12 "$OUT/bench_linear.txt"
