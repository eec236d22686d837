"""CPU checks of ``scripts/bench_linear.py``'s derived columns and tables (the timing itself
needs a GPU and is a benchmark, not a test)."""
import math
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

import bench_linear as B  # noqa: E402


def _row(shape, fmt, m, cublas, tuned, rng):
    r = {"shape": shape, "n": 4096, "k": 4096, "fmt": fmt, "m": m, "cublas_graph_us": cublas,
         "default_graph_us": tuned * rng.uniform(1.0, 1.5), "tuned_graph_us": tuned,
         "tuned_nopdl_graph_us": tuned * rng.uniform(1.0, 1.2), "hbm_floor_us": tuned * rng.uniform(0.3, 0.9),
         "cublas_eager_us": cublas * 1.1, "api_eager_us": tuned * 1.3}
    return B.derive(r)


def test_each_row_is_also_compared_with_the_fastest_cublas_time_of_its_shape_and_m():
    rng = random.Random(7)
    rows = []
    for shape in ("8B qkv", "8B o"):
        for m in (1, 16, 64):
            c = rng.uniform(10, 100)
            rows += [_row(shape, "nvfp4", m, c * rng.uniform(1.0, 1.2), rng.uniform(3, 40), rng),
                     _row(shape, "mxfp4", m, c * rng.uniform(1.0, 1.2), rng.uniform(3, 40), rng)]
    B.against_fastest_cublas(rows)
    for r in rows:
        same = [q["cublas_graph_us"] for q in rows if (q["shape"], q["m"]) == (r["shape"], r["m"])]
        assert len(same) == 2 and r["cublas_fastest_graph_us"] == min(same)
        assert math.isclose(r["speedup_tuned_fastest"], min(same) / r["tuned_graph_us"])
        assert r["speedup_tuned_fastest"] <= r["speedup_tuned"]
    md = B.markdown({"gpu": "test GPU", "date": "2026-11-30", "torch": "x", "copy_bandwidth_tbs": 4.0, "rows": rows})
    line = next(x for x in md.splitlines() if x.startswith("| nvfp4 | 1,16 |"))
    sel = [r for r in rows if r["fmt"] == "nvfp4" and r["m"] in (1, 16)]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3] == f"{B.geomean(r['speedup_tuned'] for r in sel):.2f}x"
    assert cells[5] == f"{B.geomean(r['speedup_tuned_fastest'] for r in sel):.2f}x"
    assert cells[6] == "2.5x"
