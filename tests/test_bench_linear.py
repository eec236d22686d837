"""CPU checks of ``scripts/bench_linear.py``'s derived columns and tables and of the weights it
rotates (``scripts/_common.py``); the timing itself needs a GPU and is a benchmark, not a test."""
import math
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

import _common  # noqa: E402
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


def test_shape_weights_rotate_beyond_the_l2_and_quantize_the_dense_copies():
    import torch

    import autofp4

    n, k, l2 = 64, 256, 40_000  # bf16 copy 32 KiB, FP4 copies ~9 KiB: 3 and 9 copies exceed 2 x l2
    gen, dense, quantized = _common.shape_weights(n, k, ["nvfp4", "mxfp4"], l2, torch.device("cpu"))
    assert len(dense) == 3 and len(dense) * n * k * 2 > 2 * l2
    assert not torch.equal(dense[0], dense[1])
    for fmt, (ws, fp4_bytes) in quantized.items():
        assert fp4_bytes == n * k // 2 + ws[0].scale.numel() * ws[0].scale.element_size()
        assert len(ws) * fp4_bytes > 2 * l2 and (len(ws) - 1) * fp4_bytes <= 2 * l2
        for d, w in zip(dense, ws):  # the first copies are the bf16 ones quantized
            ref = autofp4.quantize(d, fmt)
            assert torch.equal(w.data, ref.data) and torch.equal(w.scale, ref.scale)
        assert not torch.equal(ws[len(dense)].data, ws[0].data)  # then fresh weights
    assert isinstance(gen, torch.Generator)
