"""CPU tests of the Hopper W4A16 GEMM: configs, compilation for sm_90a, the packed layout."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from autofp4.weights import quantize  # noqa: E402
from autofp4.backends import sm90_heuristics as H  # noqa: E402
from autofp4.kernels import sm90_w4a16_gemm as g  # noqa: E402
from autofp4.kernels import _fp4_bits as fp4_bits  # noqa: E402

# compiles CuTeDSL kernels on the CPU (minutes on 2 cores): not in the quick subset
pytestmark = pytest.mark.compile

cute_available = True
try:  # the compile tests need nvidia-cutlass-dsl
    import cutlass  # noqa: F401
except ImportError:  # pragma: no cover
    cute_available = False

needs_cute = pytest.mark.skipif(not cute_available, reason="needs nvidia-cutlass-dsl")


# ------------------------------------------------------------------ an independent decoder
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e4m3_to_float(b: int) -> float:
    e, m = (b >> 3) & 0xF, b & 7
    v = m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if b & 0x80 else v


def _half_bits_to_float(bits: int, dtype: str) -> float:
    """Value of a 16-bit bf16/fp16 bit pattern (normal or subnormal), by hand."""
    sign = -1.0 if bits & 0x8000 else 1.0
    if dtype == "bfloat16":
        e, m, mb, bias = (bits >> 7) & 0xFF, bits & 0x7F, 7, 127
    else:
        e, m, mb, bias = (bits >> 10) & 0x1F, bits & 0x3FF, 10, 15
    if e == 0:
        return sign * m / 2**mb * 2.0 ** (1 - bias)
    return sign * (1 + m / 2**mb) * 2.0 ** (e - bias)


def _u32(b: list[int], off: int) -> int:
    """The little-endian 32-bit word at byte ``off`` of ``b``."""
    return b[off] | b[off + 1] << 8 | b[off + 2] << 16 | b[off + 3] << 24


def _emulate(packed: g.PackedSm90Weight, dtype: str) -> torch.Tensor:
    """Dense [N, K] float64 weight from the packed bytes, computed the way the kernel does:
    thread t of a warpgroup loads bytes [16t, 16t+16) of a 64x64 chunk, word i = k16 step i, and
    decodes pair j of its wgmma A fragment with the shift/mask terms into ``dtype`` bits; row
    group q's scale word of the step (NVFP4) or 32-block (MXFP4) at 2048 + 4 (q * words + i)
    holds bf16 patterns (turned into fp16 ones with the kernel's multiply-add); the product of
    the two is rounded to ``dtype`` and the epilogue multiplies by alpha."""
    data = packed.data.cpu()
    nbk, nkc, _ = data.shape
    n, k = packed.n, packed.k
    out = torch.zeros(nbk * 64, nkc * 64, dtype=torch.float64)
    terms = fp4_bits.decode_terms(dtype)
    is_nv = packed.fmt == "nvfp4"
    nw = 4 if is_nv else 2
    rnd = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    for nb in range(nbk):
        for kc in range(nkc):
            ch = data[nb, kc].tolist()
            for t in range(128):
                warp, lane = t // 32, t % 32
                r0 = 16 * warp + lane // 4
                c = lane % 4
                q = t // 4
                for step in range(4):
                    word = _u32(ch, 16 * t + 4 * step)
                    sw = _u32(ch, 2048 + 4 * (q * nw + (step if is_nv else step // 2)))
                    if dtype == "float16":
                        sw = (sw * 8 + g.FP16_FROM_BF16) & 0xFFFFFFFF
                    scale = [_half_bits_to_float((sw >> (16 * h)) & 0xFFFF, dtype) for h in range(2)]
                    coords = [(r0, 2 * c), (r0, 2 * c + 1), (r0 + 8, 2 * c), (r0 + 8, 2 * c + 1),
                              (r0, 2 * c + 8), (r0, 2 * c + 9), (r0 + 8, 2 * c + 8),
                              (r0 + 8, 2 * c + 9)]
                    for j in range(4):
                        reg = 0
                        for rot, mask in terms[j]:
                            reg |= fp4_bits.rotl(word, rot) & mask
                        reg &= 0xFFFFFFFF
                        for h in range(2):
                            v = _half_bits_to_float((reg >> (16 * h)) & 0xFFFF, dtype)
                            row, col = coords[2 * j + h]
                            prod = v * scale[0 if row == r0 else 1]
                            assert float(torch.tensor(prod, dtype=torch.float64).to(rnd)) == prod, prod
                            out[nb * 64 + row, kc * 64 + step * 16 + col] = prod
    return out[:n, :k].float() * float(packed.alpha)  # products are exact; fp32 epilogue


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_pack_layout_matches_dequantize(fmt, dtype, gen):
    n, k = 80, 96  # not multiples of the chunk: exercises the padding
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).add(0.1)
    fw = quantize(w, fmt)
    packed = g.pack_weight(fw)
    assert packed.data.dtype == torch.uint8
    assert packed.data.shape == (256 // 64, 256 // 64, g.chunk_bytes(fmt))
    got = _emulate(packed, dtype)
    want = fw.dequantize(torch.float32)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # padding is zero
    assert packed.data.float().abs().sum() > 0


def test_pack_decode_terms_cover_each_bit_once():
    for dtype in ("bfloat16", "float16"):
        for j, terms in enumerate(fp4_bits.decode_terms(dtype)):
            masks = [m for _, m in terms]
            union = 0
            for m in masks:
                assert union & m == 0
                union |= m
            target = 0x81C081C0 if dtype == "bfloat16" else 0x8E008E00
            assert union == target, (dtype, j, hex(union))
    seen = set()
    for pos in g._nibble_bit_positions():
        for p in pos:
            assert p not in seen
            seen.add(p)
    assert seen == set(range(32))


def test_nvfp4_negative_and_zero_block_scales(gen):
    """A negative block scale is folded into the values' signs, a zero one zeroes the block; both
    give the weight's exact values (and only positive, nonzero scales reach the kernel)."""
    w = torch.randn(64, 64, generator=gen)
    fw = quantize(w, "nvfp4")
    raw = fw.scale.view(torch.uint8)
    raw[0, 0] |= 0x80  # -s
    raw[5, 2] = 0x00   # +0
    raw[9, 3] = 0x80   # -0
    want = fw.dequantize(torch.float32)
    assert want[0, :16].abs().sum() > 0 and want[5, 32:48].abs().sum() == 0
    packed = g.pack_weight(fw)
    s = packed.data[..., g.VALUE_BYTES:].reshape(-1, 2).view(torch.int16)  # bf16 patterns
    assert int(s.min()) > 0
    for dtype in ("bfloat16", "float16"):
        torch.testing.assert_close(_emulate(packed, dtype), want, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_stored_scales_convert_to_fp16_including_padding(fmt, gen):
    """Every stored scale pattern, padding included, is a positive normal bf16 whose exponent
    field the kernel's fp16 conversion maps into 1..30 (a finite normal fp16)."""
    w = torch.randn(80, 96, generator=gen) * torch.rand(80, 1, generator=gen).add(0.1)
    p = g.pack_weight(quantize(w, fmt))
    assert p.data.shape[-1] == g.VALUE_BYTES + 32 * 4 * (4 if fmt == "nvfp4" else 2)
    halves = p.data[..., g.VALUE_BYTES:].reshape(-1, 2).view(torch.int16).to(torch.int32)
    field = halves >> 7
    assert int(halves.min()) > 0 and int(field.max()) <= 254 and int(field.min()) - 224 >= 1
    words = p.data[..., g.VALUE_BYTES:].reshape(-1, 4).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    f16 = (words * 8 + g.FP16_FROM_BF16) & 0xFFFFFFFF
    for h in (0, 16):
        e5 = (f16 >> (h + 10)) & 0x1F
        assert int(e5.min()) >= 1 and int(e5.max()) <= 30


def test_mxfp4_scale_shift_and_fp16_range(gen):
    w = torch.randn(64, 64, generator=gen)
    w[0, :32] *= 2.0**-20  # a block 20 binades below the rest
    p = g.pack_weight(quantize(w, "mxfp4"))
    assert not p.fp16_ok
    p2 = g.pack_weight(quantize(torch.randn(64, 64, generator=gen), "mxfp4"))
    assert p2.fp16_ok
    assert float(p2.alpha) == 2.0**p2.scale_shift


# ------------------------------------------------------------------ configs
def test_validate_rules():
    ok = g.Sm90GemmConfig()
    assert g.validate(ok, 4096, 4096, "nvfp4", "bfloat16") is None
    bad = {
        "tile_n": g.Sm90GemmConfig(tile_n=96),
        "tile_m": g.Sm90GemmConfig(tile_m=48),
        "tile_k": g.Sm90GemmConfig(tile_k=32),
        "stages": g.Sm90GemmConfig(stages=9),
        "split_k": g.Sm90GemmConfig(split_k=3),
        "cluster_n": g.Sm90GemmConfig(cluster_n=4),
        "raster": g.Sm90GemmConfig(cluster_n=2, raster="m"),
        "raster value": g.Sm90GemmConfig(raster="x"),
        "swizzle must": g.Sm90GemmConfig(swizzle=3),
        "swizzle > 1": g.Sm90GemmConfig(swizzle=4, cluster_n=2),
        "shared memory": g.Sm90GemmConfig(tile_m=128, tile_n=64, tile_k=256, stages=8),
        "registers": g.Sm90GemmConfig(tile_n=256, tile_m=256),
        "ctas_per_sm value": g.Sm90GemmConfig(ctas_per_sm=3),
        "ctas_per_sm smem": g.Sm90GemmConfig(tile_n=128, tile_m=128, tile_k=128, stages=4, ctas_per_sm=2),
        "ctas_per_sm regs": g.Sm90GemmConfig(tile_n=256, tile_m=64, tile_k=64, stages=4, ctas_per_sm=2),
        "scale_select": g.Sm90GemmConfig(scale_select=1),
        "producer must": g.Sm90GemmConfig(producer=1),
        "producer warp": g.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=128, stages=4, ctas_per_sm=2, producer=True),
        "producer puts": g.Sm90GemmConfig(tile_n=128, tile_m=256, tile_k=64, stages=6, producer=True),
        "producer puts 1": g.Sm90GemmConfig(tile_n=128, tile_m=128, tile_k=256, stages=2, producer=True),
    }
    for word, cfg in bad.items():
        reason = g.validate(cfg, 4096, 4096, "nvfp4", "bfloat16")
        assert reason is not None and word.split()[0] in reason, (word, reason)
    assert "shared memory" in g.validate(bad["ctas_per_sm smem"], 4096, 4096, "nvfp4", "bfloat16")
    assert "registers" in g.validate(bad["ctas_per_sm regs"], 4096, 4096, "nvfp4", "bfloat16")
    # two CTAs per SM: both fit (the 64-row, one-warpgroup tile keeps its registers)
    for cfg in (g.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=128, stages=4, ctas_per_sm=2),
                g.Sm90GemmConfig(tile_n=128, tile_m=128, tile_k=64, stages=4, ctas_per_sm=2),
                g.Sm90GemmConfig(tile_n=64, tile_m=128, tile_k=64, stages=4, ctas_per_sm=2)):
        assert g.validate(cfg, 4096, 4096, "nvfp4", "bfloat16") is None, cfg
        assert 2 * (cfg.smem_bytes("nvfp4") + 1024) <= 228 * 1024
    assert "block size" in g.validate(ok, 4096, 4104, "mxfp4", "bfloat16")
    assert "divisible" in g.validate(g.Sm90GemmConfig(tile_k=256, split_k=4), 64, 256, "nvfp4", "bfloat16")
    assert g.validate(ok, 4096, 4096, "int4", "bfloat16") is not None


def test_default_config_is_valid_for_llama_shapes():
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (64, 64)]:
        for fmt in ("nvfp4", "mxfp4"):
            for m in (None, 1, 64, 512, 8192):
                cfg = H.gemm_default(n, k, fmt, "bfloat16", m)
                assert g.validate(cfg, n, k, fmt, "bfloat16") is None, (n, k, fmt, m, cfg)


def test_default_streams_from_a_producer_warp_from_m_64_where_the_tile_allows():
    for m, want in ((16, False), (32, False), (64, True), (128, True), (8192, False)):
        cfg = H.gemm_default(4096, 4096, "nvfp4", "bfloat16", m)
        assert cfg.producer is want, (m, cfg)
    # the large-M tile (128 x 256) has no registers left for one
    assert g.validate(dataclasses.replace(H.gemm_default(4096, 4096, "nvfp4", "bfloat16", 8192), producer=True),
                      4096, 4096, "nvfp4", "bfloat16") is not None


def test_default_broadcasts_scales_by_operand_select_up_to_m_128():
    for m, want in ((16, True), (64, True), (128, True), (512, False), (8192, False), (None, False)):
        assert H.gemm_default(4096, 4096, "nvfp4", "bfloat16", m).scale_select is want, m


@needs_cute
@pytest.mark.parametrize("dtype,mul", [("bfloat16", "mul.rn.bf16x2"), ("float16", "mul.rn.f16x2")])
def test_scale_select_replaces_the_permutes_in_ptx(dtype, mul, tmp_path):
    """With scale_select each k16 step's two scale broadcasts are moves into a {half, half} pair
    (ptxas folds them into the multiply's operand select) instead of PRMTs; the multiplies stay."""
    import cutlass.cute as cute

    texts = {}
    for sel in (False, True):
        out = tmp_path / str(sel)
        out.mkdir()
        kern = g._Sm90W4A16Kernel(g.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=128, stages=4, scale_select=sel),
                                  1024, 1024, "nvfp4", dtype)
        cute.compile(kern.build(), *kern.fake_args(),
                     options=f"--enable-tvm-ffi --gpu-arch sm_90a --keep-ptx --dump-dir={out}")
        (ptx,) = out.glob("*.ptx")
        texts[sel] = ptx.read_text()
    muls = texts[False].count(mul)
    assert muls > 0 and texts[True].count(mul) == muls
    assert texts[False].count("prmt.b32") == muls // 2 and "prmt.b32" not in texts[True]
    assert texts[True].count("mov.b32 s, {l, l}") == texts[True].count("mov.b32 s, {h, h}") == muls // 2


def test_config_space_values_are_known():
    space = H.gemm_config_space(4096, 4096, "nvfp4", "bfloat16")
    names = {f.name for f in dataclasses.fields(g.Sm90GemmConfig)}
    assert set(space) == names


@needs_cute
def test_invalid_config_rejected_before_compiling():
    with pytest.raises(ValueError, match="registers"):
        g.compile_only(g.Sm90GemmConfig(tile_n=256, tile_m=256), 4096, 4096, "nvfp4", "bfloat16")
    with pytest.raises(ValueError, match="block size"):
        g.compile_kernel(g.Sm90GemmConfig(), 4096, 4100, "nvfp4", "bfloat16")


@needs_cute
@pytest.mark.parametrize(
    "cfg,fmt,dtype",
    [
        (g.Sm90GemmConfig(tile_n=128, tile_m=128, tile_k=128, stages=4), "nvfp4", "bfloat16"),
        (g.Sm90GemmConfig(tile_n=64, tile_m=64, tile_k=64, stages=3, raster="m"), "mxfp4", "float16"),
        (g.Sm90GemmConfig(tile_n=256, tile_m=64, tile_k=64, stages=8, split_k=2), "nvfp4", "float16"),
        (g.Sm90GemmConfig(tile_n=64, tile_m=64, tile_k=256, stages=4, split_k=4), "mxfp4", "bfloat16"),
        (g.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=128, stages=4, split_k=2, cluster_n=2), "nvfp4", "bfloat16"),
        (g.Sm90GemmConfig(tile_n=128, tile_m=16, tile_k=256, stages=3), "mxfp4", "bfloat16"),
        (g.Sm90GemmConfig(tile_n=256, tile_m=64, tile_k=128, stages=4, cluster_n=2), "nvfp4", "bfloat16"),
        (g.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=128, stages=4, split_k=2, ctas_per_sm=2), "nvfp4", "bfloat16"),
        (g.Sm90GemmConfig(tile_n=128, tile_m=128, tile_k=64, stages=4, ctas_per_sm=2), "mxfp4", "float16"),
        (g.Sm90GemmConfig(tile_n=128, tile_m=256, tile_k=64, stages=6, swizzle=8), "nvfp4", "bfloat16"),
        (g.Sm90GemmConfig(tile_n=64, tile_m=128, tile_k=128, stages=4, split_k=2, raster="m", swizzle=4),
         "mxfp4", "float16"),
        (g.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=128, stages=4, ctas_per_sm=2, scale_select=True),
         "nvfp4", "bfloat16"),
        (g.Sm90GemmConfig(tile_n=64, tile_m=16, tile_k=256, stages=4, split_k=2, scale_select=True),
         "mxfp4", "float16"),
        # a dedicated producer warp: split-K in the cluster, x multicast with atomics, 2 CTAs per SM
        (g.Sm90GemmConfig(tile_n=128, tile_m=128, tile_k=64, stages=6, split_k=2, producer=True), "nvfp4", "bfloat16"),
        (g.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=128, stages=4, split_k=2, cluster_n=2, producer=True),
         "mxfp4", "float16"),
        (g.Sm90GemmConfig(tile_n=64, tile_m=64, tile_k=128, stages=4, ctas_per_sm=2, producer=True,
                          scale_select=True), "nvfp4", "bfloat16"),
    ],
)
def test_compiles_for_sm90a(cfg, fmt, dtype):
    assert g.validate(cfg, 1000, 4096, fmt, dtype) is None
    g.compile_only(cfg, 1000, 4096, fmt, dtype)


def test_cluster_split_k_needs_room_for_the_partial_sums():
    # the K slices sum through the x stage buffers: stages x tile_k >= 2 x tile_n
    short = g.Sm90GemmConfig(tile_n=256, tile_m=64, tile_k=64, stages=4, split_k=2)
    assert "stage buffers" in g.validate(short, 4096, 4096, "nvfp4", "bfloat16")
    assert g.validate(g.Sm90GemmConfig(tile_n=256, tile_m=64, tile_k=64, stages=8, split_k=2),
                      4096, 4096, "nvfp4", "bfloat16") is None
    # with cluster_n = 2 the slices add with atomics and need no such room
    assert g.validate(g.Sm90GemmConfig(tile_n=256, tile_m=64, tile_k=64, stages=4, split_k=2, cluster_n=2),
                      4096, 4096, "nvfp4", "bfloat16") is None
    assert g.Sm90GemmConfig(split_k=2).cluster_reduce and not g.Sm90GemmConfig(split_k=2, cluster_n=2).cluster_reduce


def test_cluster_needs_even_tile_count():
    cfg = g.Sm90GemmConfig(tile_n=256, tile_m=64, tile_k=128, stages=4, cluster_n=2)
    assert "divide" in g.validate(cfg, 768, 4096, "nvfp4", "bfloat16")
