"""GPU tests of the Hopper W4A16 GEMM against float64 math on the dequantized weight."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autofp4.weights import quantize
from autofp4.backends import sm90_heuristics as H  # noqa: E402
from autofp4.kernels import sm90_w4a16_gemm as g

pytestmark = pytest.mark.gpu


def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs a Hopper (sm_90) GPU")

_RUNNERS: dict = {}


def _runner(cfg, n, k, fmt, dtype):
    key = (cfg, n, k, fmt, dtype)
    if key not in _RUNNERS:
        _RUNNERS[key] = g.compile_kernel(cfg, n, k, fmt, dtype)
    return _RUNNERS[key]


def _check(out, x, w, bias, dtype):
    """Elementwise bound: rounding of the output to ``dtype`` plus fp32 accumulation error.
    A misplaced nibble or block scale moves an element by about one |x_k w_k| term, far above."""
    wd = w.dequantize(torch.float32).double()
    xd = x.double()
    ref = xd @ wd.T
    mag = xd.abs() @ wd.abs().T
    if bias is not None:
        ref = ref + bias.double()
        mag = mag + bias.double().abs()
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-10
    tol = ulp * ref.abs() + 2e-6 * mag + 1e-30
    err = (out.double() - ref).abs()
    bad = err > tol
    if bad.any():
        idx = int((err / tol).argmax())
        row, col = divmod(idx, err.shape[1])
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} elements off; worst err/tol "
            f"{float((err / tol).max()):.3g} at (m={row}, n={col}): got {float(out[row, col]):.6g}, "
            f"want {float(ref[row, col]):.6g}"
        )
    rel = float((out.double() - ref).norm() / ref.norm())
    assert rel < (4e-3 if dtype == torch.bfloat16 else 1e-3), rel


def _weight(n, k, fmt, gen, device):
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).add(0.05)
    w[:, : k // 3] *= 4.0  # blocks of different scale along K
    return quantize(w, fmt).to(device)


CASES = [
    # (n, k, cfg)
    (256, 512, g.Sm90GemmConfig(tile_n=128, tile_m=128, tile_k=128, stages=4)),
    (192, 320, g.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=64, stages=3)),       # N, K edges
    (512, 1024, g.Sm90GemmConfig(tile_n=256, tile_m=64, tile_k=64, stages=4)),
    (320, 256, g.Sm90GemmConfig(tile_n=64, tile_m=16, tile_k=256, stages=2, raster="m")),
    (384, 2048, g.Sm90GemmConfig(tile_n=128, tile_m=32, tile_k=128, stages=5, split_k=2)),
    (256, 4096, g.Sm90GemmConfig(tile_n=128, tile_m=128, tile_k=64, stages=6, split_k=4)),
    (512, 1024, g.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=128, stages=4, cluster_n=2)),
    (1024, 512, g.Sm90GemmConfig(tile_n=256, tile_m=128, tile_k=64, stages=4, split_k=2, cluster_n=2)),
    # split-K summed in the cluster: deep tile, ragged N, 4 slices of 2 K tiles
    (576, 1536, g.Sm90GemmConfig(tile_n=256, tile_m=64, tile_k=64, stages=8, split_k=2)),
    (320, 2048, g.Sm90GemmConfig(tile_n=64, tile_m=64, tile_k=256, stages=4, split_k=4)),
    # two CTAs per SM (registers capped at 128): ragged N, with and without split-K
    (448, 1024, g.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=128, stages=4, split_k=2, ctas_per_sm=2)),
    (384, 768, g.Sm90GemmConfig(tile_n=128, tile_m=128, tile_k=64, stages=4, ctas_per_sm=2)),
    # grouped CTA order: bands of 4 token tiles (the last one narrower at M = 100 and 4097) and
    # of 8 weight tiles out of 12 (a band of 4 last), the second with split-K in the cluster
    (640, 512, g.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=64, stages=4, swizzle=4)),
    (704, 1024, g.Sm90GemmConfig(tile_n=64, tile_m=128, tile_k=128, stages=4, split_k=2, raster="m",
                                 swizzle=8)),
    # odd N: rows of out are not 4-byte aligned, the epilogue stores its pairs of outputs singly
    (191, 320, g.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=64, stages=3)),
    (97, 512, g.Sm90GemmConfig(tile_n=64, tile_m=32, tile_k=128, stages=4, split_k=2)),
    # a dedicated producer warp: two warpgroups with split-K in the cluster and ragged N; one
    # warpgroup, two CTAs per SM; x multicast over a cluster of two with fp32 atomics
    (576, 1536, g.Sm90GemmConfig(tile_n=128, tile_m=128, tile_k=64, stages=6, split_k=2, producer=True)),
    (448, 1024, g.Sm90GemmConfig(tile_n=64, tile_m=64, tile_k=128, stages=4, ctas_per_sm=2, producer=True)),
    (1024, 512, g.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=64, stages=4, split_k=2, cluster_n=2,
                                 producer=True)),
    # 256-token tiles (128 accumulator registers per thread), ragged N
    (704, 1536, g.Sm90GemmConfig(tile_n=128, tile_m=256, tile_k=64, stages=4)),
]


@needs_sm90
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference(case, fmt, dtype, gen):
    n, k, cfg = CASES[case]
    dname = str(dtype).removeprefix("torch.")
    assert g.validate(cfg, n, k, fmt, dname) is None
    dev = torch.device("cuda")
    w = _weight(n, k, fmt, gen, dev)
    packed = g.pack_weight(w)
    run = _runner(cfg, n, k, fmt, dname)
    for m in (1, 7, 100, 1000, 4097):
        x = torch.randn(m, k, generator=gen).to(dev, dtype)
        bias = torch.randn(n, generator=gen).to(dev, dtype) if m % 2 else None
        out = run(x, packed, bias)
        assert out.shape == (m, n) and out.dtype == dtype
        _check(out, x, w, bias, dtype)


# (setting, case): settings that change how the kernel runs, not what it computes
SAME_BITS = ([({"scale_select": True}, c) for c in (0, 1, 3, 4, 9, 19)]
             + [({"producer": True}, c) for c in (0, 3, 4, 6, 8, 9, 13, 14)])


@needs_sm90
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("setting,case", SAME_BITS, ids=lambda v: "+".join(f"{k}={x}" for k, x in v.items())
                         if isinstance(v, dict) else str(v))
def test_a_setting_gives_the_same_bits(setting, case, fmt, dtype, gen):
    """Broadcasting the block scale by operand select (``scale_select``) computes the very same
    products; a dedicated producer warp (``producer``) changes who issues the copies, not the
    arithmetic: the output equals the kernel's without the setting bit for bit (and the
    reference within bounds)."""
    n, k, cfg = CASES[case]
    dname = str(dtype).removeprefix("torch.")
    changed = dataclasses.replace(cfg, **setting)
    assert g.validate(changed, n, k, fmt, dname) is None
    dev = torch.device("cuda")
    w = _weight(n, k, fmt, gen, dev)
    packed = g.pack_weight(w)
    plain = _runner(cfg, n, k, fmt, dname)
    flagged = _runner(changed, n, k, fmt, dname)
    for m in (1, 100, 1000):
        x = torch.randn(m, k, generator=gen).to(dev, dtype)
        bias = torch.randn(n, generator=gen).to(dev, dtype) if m % 2 else None
        out = flagged(x, packed, bias)
        assert torch.equal(out, plain(x, packed, bias))
        _check(out, x, w, bias, dtype)


@needs_sm90
def test_default_config_llama_shape_and_graph_capture(gen):
    n, k = 1024, 4096
    dev = torch.device("cuda")
    w = _weight(n, k, "nvfp4", gen, dev)
    packed = g.pack_weight(w)
    cfg = H.gemm_default(n, k, "nvfp4", "bfloat16", 512)
    run = _runner(cfg, n, k, "nvfp4", "bfloat16")
    x = torch.randn(512, k, generator=gen).to(dev, torch.bfloat16)
    out = run(x, packed, None)
    _check(out, x, w, None, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    with torch.cuda.graph(graph):
        static_out = run(static_x, packed, None)
    static_x.copy_(torch.randn(512, k, generator=gen).to(dev, torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    _check(static_out, static_x, w, None, torch.bfloat16)


@needs_sm90
def test_wrong_problem_rejected(gen):
    dev = torch.device("cuda")
    w = _weight(128, 256, "nvfp4", gen, dev)
    run = _runner(g.Sm90GemmConfig(tile_n=64, tile_m=64, tile_k=64, stages=2), 128, 512, "nvfp4", "bfloat16")
    with pytest.raises(ValueError, match="compiled for"):
        run(torch.randn(4, 256, device=dev, dtype=torch.bfloat16), g.pack_weight(w), None)
