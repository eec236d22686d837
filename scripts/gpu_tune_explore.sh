#!/bin/sh
# Tune the Llama-3.1-8B shapes on this GPU with a wide per-shape budget and keep the whole
# database (every trial) under $OUT for offline analysis. env: FMT, M, BUDGET, TUNE_SECONDS.
OUT=${OUT:-out}; mkdir -p "$OUT"
DB=${DB:-/tmp/autofp4-h200.db}
start=$(date +%s)
python3 -m autofp4 tune --model examples/llama-3.1-8b.json --db "$DB" --fmt "${FMT:-nvfp4}" \
  --m "${M:-1,16,64,128,512,2048,8192}" --budget "${BUDGET:-24}" --time-budget "${TUNE_SECONDS:-420}" \
  --no-progress > "$OUT/tune.txt" 2>&1
echo "tune wall time: $(( $(date +%s) - start )) s" | tee -a "$OUT/tune.txt"
for f in "$DB" "$DB-wal" "$DB-shm"; do [ -f "$f" ] && cp "$f" "$OUT/"; done
python3 -m autofp4 db export --db "$DB" --env current --out "$OUT/nvidia-h200.json"
tail -34 "$OUT/tune.txt" | cut -c1-170
