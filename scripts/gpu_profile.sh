#!/bin/sh
# Nsight Compute profiles of the default kernels (scripts/profile_kernels.py): speed of light,
# occupancy, launch statistics and warp stall reasons, one text report per case under $OUT.
# FULL=1: the full section set instead, saved as a report, plus the per-instruction SASS view
# (executed instructions, stall samples per SASS line) as CSV and the opcode mix
# (scripts/sass_mix.py). CONFIG='{"warps": 8}': JSON fields over the default config.
OUT=${OUT:-out}; mkdir -p "$OUT"
for case in ${CASES:-decode-m1 decode-m16 gemm-m128}; do
  for shape in ${SHAPES:-small large}; do
    name="$case-$shape"
    if [ "${FULL:-0}" = 1 ]; then
      timeout ${CASE_TIMEOUT:-150} ncu --nvtx --nvtx-include "profile/" --set full --import-source no \
        -f -o "$OUT/ncu-$name" python3 scripts/profile_kernels.py --case "$case" --shape "$shape" \
        ${CONFIG:+--config "$CONFIG"} > "$OUT/ncu-$name.log" 2>&1
      echo "$name rc=$? $(grep -m1 -E 'rel_err|ERR_' "$OUT/ncu-$name.log" | cut -c1-60)"
      ncu -i "$OUT/ncu-$name.ncu-rep" --page details > "$OUT/ncu-$name.txt" 2>&1
      ncu -i "$OUT/ncu-$name.ncu-rep" --page source --print-source sass --csv > "$OUT/sass-$name.csv" 2>&1
      nk=$(grep -m1 -o "N=[0-9]* K=[0-9]*" "$OUT/ncu-$name.log" | sed 's/N=//; s/ K=/,/')
      python3 scripts/sass_mix.py "$OUT/sass-$name.csv" --nk "$nk" --hot 400 > "$OUT/mix-$name.txt" 2>&1
      head -14 "$OUT/mix-$name.txt"
    else
      timeout ${CASE_TIMEOUT:-90} ncu --nvtx --nvtx-include "profile/" --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 scripts/profile_kernels.py --case "$case" --shape "$shape" ${CONFIG:+--config "$CONFIG"} \
        > "$OUT/ncu-$name.txt" 2>&1
      echo "$name rc=$? $(grep -m1 -E 'rel_err|ERR_' "$OUT/ncu-$name.txt" | cut -c1-60)"
    fi
    grep -E "^\s+(Memory Throughput|DRAM Throughput|Duration|Achieved Occupancy|Registers Per Thread|Theoretical Occupancy|Compute \(SM\) Throughput|Executed Ipc Active|Issue Slots Busy)" \
      "$OUT/ncu-$name.txt" | tr -s ' ' | head -16
  done
done
