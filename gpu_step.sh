#!/bin/sh
# one GPU step: the MoE benchmark on the shipped DB, then the remaining GPU tests (MoE, JIT)
. .devsite/b/env.sh || exit 3
export AUTOFP4_DB=$OUT/user.db
timeout 320 python3 scripts/bench_moe.py --t 1,4,16,64,256,1024,4096 --rounds 3 --out $OUT > $OUT/bench.log 2>&1
echo "bench rc=$?"
timeout 210 python3 -m pytest -m gpu tests/test_moe_kernel.py tests/test_jit.py tests/test_transformers_experts.py -q -p no:warnings 2>&1 | tail -15 > $OUT/tests.txt
tail -8 $OUT/tests.txt
grep -A3 Geomean $OUT/moe.md
