"""GPU tests of the small-M decode kernel against float64 math on fresh random data."""
import pytest
import torch

import autofp4
from autofp4.kernels import w4a16_decode as D
from autofp4.weights import FP4Weight

pytestmark = pytest.mark.gpu

CASES = [  # fmt, dtype, n, k, config, Ms, bias
    ("nvfp4", "bfloat16", 4096, 4096, D.DecodeConfig(4, 8, 8), (1, 3, 8), False),
    ("nvfp4", "bfloat16", 40, 1040, D.DecodeConfig(2, 1, 32), (1, 17, 32), True),
    ("nvfp4", "bfloat16", 1000, 2048, D.DecodeConfig(8, 4, 16), (16, 5), True),
    ("mxfp4", "bfloat16", 200, 1056, D.DecodeConfig(4, 3, 64), (33, 64, 1), False),
    ("nvfp4", "float16", 1000, 2048, D.DecodeConfig(4, 4, 16), (16, 5), True),
    ("mxfp4", "float16", 72, 512, D.DecodeConfig(4, 1, 8), (1, 8), True),
    ("mxfp4", "float16", 300, 4096, D.DecodeConfig(2, 8, 32, split_reduce="last_warp"), (32, 2), True),
    ("mxfp4", "bfloat16", 6144, 4096, D.DecodeConfig(4, 8, 16, prefetch=True), (16, 9), True),
    ("nvfp4", "bfloat16", 4096, 14336, D.DecodeConfig(4, 7, 64), (64, 33), False),
    ("nvfp4", "bfloat16", 520, 3072, D.DecodeConfig(4, 3, 16, True, "last_warp"), (1, 16), True),
    ("nvfp4", "bfloat16", 1000, 4096, D.DecodeConfig(4, 4, 16, tiles_per_warp=2), (16, 1), True),
    ("mxfp4", "float16", 24, 1536, D.DecodeConfig(2, 3, 8, False, "last_warp", 2), (8, 3), False),
    ("nvfp4", "bfloat16", 4096, 4096, D.DecodeConfig(4, 1, 64, tiles_per_warp=2), (64, 17), False),
    # split-K summed through distributed shared memory (one cluster per tile group)
    ("nvfp4", "bfloat16", 4096, 4096, D.DecodeConfig(4, 8, 8, split_reduce="cluster"), (1, 5, 8), True),
    ("mxfp4", "float16", 1000, 2048, D.DecodeConfig(8, 4, 16, split_reduce="cluster"), (16, 3), True),
    ("nvfp4", "bfloat16", 520, 3072, D.DecodeConfig(2, 3, 32, split_reduce="cluster", tiles_per_warp=2), (32, 1), False),
    ("mxfp4", "bfloat16", 4096, 14336, D.DecodeConfig(4, 7, 16, split_reduce="cluster"), (16, 2), True),
    # x staged in shared memory per K group (ragged M and K, every reduction)
    ("nvfp4", "bfloat16", 4096, 4096, D.DecodeConfig(4, 1, 16, x_smem=True), (16, 1, 7), True),
    ("mxfp4", "float16", 200, 1056, D.DecodeConfig(4, 3, 32, x_smem=True), (32, 17), False),
    ("nvfp4", "float16", 1000, 2048, D.DecodeConfig(8, 4, 16, split_reduce="cluster", tiles_per_warp=2,
                                                    x_smem=True), (16, 9), True),
    ("nvfp4", "bfloat16", 520, 3072, D.DecodeConfig(4, 2, 64, split_reduce="last_warp", x_smem=True), (64, 33), True),
    # registers capped for 6 / 8 CTAs per SM
    ("nvfp4", "bfloat16", 4096, 4096, D.DecodeConfig(4, 4, 16, x_smem=True, ctas_per_sm=6), (16, 5), True),
    ("mxfp4", "float16", 1000, 2048, D.DecodeConfig(4, 4, 8, split_reduce="cluster", x_smem=True, ctas_per_sm=8),
     (1, 8), False),
    # weights, scales and x streamed through a ring of K groups in shared memory (cp.async):
    # more groups than stages, fewer (K tail zero-filled), every reduction, tiles past N
    ("nvfp4", "bfloat16", 4096, 4096, D.DecodeConfig(4, 2, 16, x_smem=True, smem_stages=3), (16, 1, 7), True),
    ("mxfp4", "float16", 200, 1056, D.DecodeConfig(4, 1, 32, x_smem=True, smem_stages=4), (32, 17), False),
    ("nvfp4", "float16", 1000, 2048, D.DecodeConfig(8, 4, 16, split_reduce="cluster", tiles_per_warp=2,
                                                    x_smem=True, smem_stages=2), (16, 9), True),
    ("nvfp4", "bfloat16", 520, 3072, D.DecodeConfig(4, 2, 64, split_reduce="last_warp", x_smem=True,
                                                    smem_stages=2), (64, 33), True),
    ("mxfp4", "bfloat16", 4096, 14336, D.DecodeConfig(4, 7, 8, x_smem=True, smem_stages=3), (1, 8), False),
    ("nvfp4", "bfloat16", 1000, 4096, D.DecodeConfig(4, 1, 8, tiles_per_warp=2, x_smem=True, smem_stages=4),
     (1, 5), True),
]


def _device_gen(gen):
    return torch.Generator("cuda").manual_seed(gen.initial_seed())


def err_over_bound(out, x, w, bias, dtype):
    """The worst |out - ref| / (2u|ref| + 1e-5 sum|x||w|) against a float64 reference (u: unit
    roundoff of the output dtype; the second term covers fp32 accumulation), and the largest
    error relative to max |ref|. A misplaced nibble or block scale gives errors of order
    sum|x||w| / K or more, i.e. >= 20x this bound for K <= 4096."""
    wd = w.dequantize(torch.float64)
    ref = x.double() @ wd.T
    if bias is not None:
        ref = ref + bias.double()
    absdot = x.double().abs() @ wd.abs().T
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    err = (out.double() - ref).abs()
    bound = 2 * u * ref.abs() + 1e-5 * absdot
    assert out.shape == ref.shape and out.dtype == dtype
    return (err / bound).max().item(), (err.max() / ref.abs().max()).item()


def _check(out, x, w, bias, dtype):
    worst, _ = err_over_bound(out, x, w, bias, dtype)
    assert worst <= 1.0, f"max err/bound = {worst:.3f}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}x{c[3]}-{c[4]}")
def test_decode_matches_float64(case, gen):
    fmt, dt, n, k, cfg, ms, use_bias = case
    g = _device_gen(gen)
    tdt = getattr(torch, dt)
    w = autofp4.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.05, fmt)
    packed = D.pack_weight(w)
    run = D.compile_kernel(cfg, n, k, fmt, dt)
    bias = torch.randn(n, device="cuda", dtype=tdt, generator=g) if use_bias else None
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=tdt, generator=g)
        _check(run(x, packed, bias), x, w, bias, tdt)


def test_one_compile_serves_every_m_and_rejects_larger(gen):
    g = _device_gen(gen)
    n, k = 96, 1024
    w = autofp4.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.05, "nvfp4")
    packed = D.pack_weight(w)
    run = D.compile_kernel(D.DecodeConfig(2, 2, 16), n, k, "nvfp4", "bfloat16")
    for m in range(1, 17):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        _check(run(x, packed, None), x, w, None, torch.bfloat16)
    with pytest.raises(ValueError, match="M=17"):
        run(torch.randn(17, k, device="cuda", dtype=torch.bfloat16), packed, None)
    with pytest.raises(ValueError, match="compiled for"):
        other = D.pack_weight(autofp4.quantize(torch.randn(n, 512, device="cuda"), "nvfp4"))
        run(torch.randn(2, k, device="cuda", dtype=torch.bfloat16), other, None)


@pytest.mark.parametrize("cfg", [D.DecodeConfig(4, 1, 8), D.DecodeConfig(4, 4, 8),
                                 D.DecodeConfig(4, 4, 8, split_reduce="last_warp"),
                                 D.DecodeConfig(4, 4, 8, split_reduce="cluster")])
def test_cuda_graph_replay(cfg, gen):
    """Captured once, replayed with new inputs (and again, exercising the split-K counters)."""
    g = _device_gen(gen)
    n, k = 512, 2048
    w = autofp4.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.05, "nvfp4")
    packed = D.pack_weight(w)
    run = D.compile_kernel(cfg, n, k, "nvfp4", "bfloat16")
    x = torch.randn(4, k, device="cuda", dtype=torch.bfloat16, generator=g)
    run(x, packed, None)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x, packed, None)
    for _ in range(3):
        x.copy_(torch.randn(4, k, device="cuda", dtype=torch.bfloat16, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, x, w, None, torch.bfloat16)


def test_mxfp4_fp16_out_of_range_raises(gen):
    g = _device_gen(gen)
    w = autofp4.quantize(torch.randn(16, 512, device="cuda", generator=g), "mxfp4")
    scale = w.scale.clone()
    scale[0, 0], scale[1, 1] = 90, 140
    w2 = FP4Weight("mxfp4", w.data, scale)
    packed = D.pack_weight(w2)
    run = D.compile_kernel(D.DecodeConfig(1, 1, 8), 16, 512, "mxfp4", "float16")
    with pytest.raises(ValueError, match="bfloat16"):
        run(torch.randn(1, 512, device="cuda", dtype=torch.float16), packed, None)
    run_bf = D.compile_kernel(D.DecodeConfig(1, 1, 8), 16, 512, "mxfp4", "bfloat16")
    x = torch.randn(3, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    _check(run_bf(x, packed, None), x, w2, None, torch.bfloat16)
