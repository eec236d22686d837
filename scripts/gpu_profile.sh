#!/bin/sh
# Nsight Compute profiles of the default kernels (scripts/profile_kernels.py): speed of light,
# occupancy, launch statistics and warp stall reasons, one text report per case under $OUT.
OUT=${OUT:-out}; mkdir -p "$OUT"
for case in ${CASES:-decode-m1 decode-m16 gemm-m128}; do
  for shape in ${SHAPES:-small large}; do
    timeout ${CASE_TIMEOUT:-90} ncu --nvtx --nvtx-include "profile/" --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
      python3 scripts/profile_kernels.py --case "$case" --shape "$shape" > "$OUT/ncu-$case-$shape.txt" 2>&1
    echo "$case $shape rc=$? $(grep -m1 -E 'rel_err|ERR_' "$OUT/ncu-$case-$shape.txt" | cut -c1-60)"
    grep -E "^\s+(Memory Throughput|DRAM Throughput|Duration|Achieved Occupancy|Registers Per Thread|Theoretical Occupancy|Compute \(SM\) Throughput)" \
      "$OUT/ncu-$case-$shape.txt" | tr -s ' ' | head -14
  done
done
