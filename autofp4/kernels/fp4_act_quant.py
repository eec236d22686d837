"""Activation quantization for the block-scaled W4A4 GEMM: bf16/fp16 ``x [M, K]`` -> FP4 codes
``[M, K/2]`` (two a byte, the even K index in the low nibble) and block scales in the MMA's
128 x 4 atoms (:func:`autofp4.kernels.sm100_blockscaled_gemm.swizzle_offsets`).

The numerics are those of :mod:`autofp4.formats`, bit for bit: NVFP4 with a given fp32 global
scale ``g`` (the weight's static ``input_scale``, or ``amax(|x|) / (6 * 448)`` of the call:
:func:`dynamic_global_scale`), ``scale = E4M3(min(amax_b / 6 / g, 448))`` and codes of
``|x| / (fp32(scale) * g)`` (zero codes where that product is zero); MXFP4 with the OCP E8M0
exponent ``clamp(floor(log2(amax_b)) - 2, -127, 127)`` and codes of ``|x| / 2**e``. Codes are
nearest with ties to even, saturated at 6, the sign of ``x`` in bit 3. Every division and
product is IEEE fp32 (``div.rn``/``mul.rn`` in PTX), the E4M3 rounding ``cvt.rn.satfinite``.

One thread quantizes one block (16 or 32 values) and writes its codes and its scale byte; the
threads of the padding blocks (rows up to the next multiple of 128, blocks up to the next
multiple of 4) write zero scales, so the buffers need no clearing. The kernel uses no
Blackwell instruction: it is compiled for sm_90a as well (and checked there against
:func:`autofp4.quantize` on an H200).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..formats import E2M1_MAX, E4M3_MAX
from ..problem import BLOCK_SIZE, DTYPES, FORMATS

try:  # CuTeDSL is an optional dependency
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
except ImportError:  # pragma: no cover - exercised only without nvidia-cutlass-dsl
    cuda = cutlass = cute = None  # type: ignore[assignment]

#: helper modules whose source is part of this kernel's (kernel cache key)
KERNEL_SOURCES = ("autofp4.kernels._ptx",)
THREADS = 128
ARCHS = ("sm_90a", "sm_100a")
#: E2M1 rounding midpoints (as in autofp4.formats): ">" where the tie stays on the lower
#: (even) code, ">=" where it moves up
_STRICT = (0.25, 1.25, 2.5, 5.0)
_INCLUSIVE = (0.75, 1.75, 3.5)


def padded_scale_bytes(m: int, k: int, fmt: str) -> int:
    """Bytes of the swizzled scale buffer of ``x [m, k]``."""
    rows = (m + 127) // 128 * 128
    blocks = (k // BLOCK_SIZE[fmt] + 3) // 4 * 4
    return rows * blocks


def dynamic_global_scale(x: torch.Tensor) -> torch.Tensor:
    """The NVFP4 global scale of ``x`` for this call, fp32 [1] on x's device (no host sync):
    ``amax(|x|) / (6 * 448)``, or 1 for an all-zero ``x`` (as :func:`autofp4.quantize`)."""
    amax = x.abs().amax().float().reshape(1)
    gs = amax / torch.tensor(E2M1_MAX * E4M3_MAX, dtype=torch.float32, device=x.device)
    return torch.where(gs > 0, gs, torch.ones_like(gs))


def _build(k: int, fmt: str, dtype: str):
    from ._ptx import Float32, Int32, T, Uint32, asm

    bs = BLOCK_SIZE[fmt]
    kb_real = k // bs
    kbp = (kb_real + 3) // 4 * 4
    nvfp4 = fmt == "nvfp4"

    def div_rn(a, b):
        return Float32(asm(T.f32(), [Float32(a), Float32(b)], "div.rn.f32 $0, $1, $2;", "=f,f,f"))

    def mul_rn(a, b):
        return Float32(asm(T.f32(), [Float32(a), Float32(b)], "mul.rn.f32 $0, $1, $2;", "=f,f,f"))

    def e4m3_byte(v):
        """The E4M3 byte of fp32 ``v >= 0`` (nearest even, saturated at 448)."""
        return Uint32(asm(T.i32(), [Float32(v)],
                          "{ .reg .b16 h; cvt.rn.satfinite.e4m3x2.f32 h, 0f00000000, $1; cvt.u32.u16 $0, h; }",
                          "=r,f"))

    def e4m3_value(byte):
        """The fp32 value of an E4M3 byte (exact, through fp16)."""
        return Float32(asm(T.f32(), [Uint32(byte)],
                           "{ .reg .b16 h, lo, hi; .reg .b32 w; cvt.u16.u32 h, $1; cvt.rn.f16x2.e4m3x2 w, h;"
                           " mov.b32 {lo, hi}, w; cvt.f32.f16 $0, lo; }", "=f,r"))

    def bits_f32(bits):
        return Float32(asm(T.f32(), [Uint32(bits)], "mov.b32 $0, $1;", "=f,r"))

    def f32_bits(v):
        return Uint32(asm(T.i32(), [Float32(v)], "mov.b32 $0, $1;", "=r,f"))

    def code_of(y, neg):
        """E2M1 code of the scaled magnitude ``y`` (nearest even, saturated), sign bit ``neg``."""
        c = Int32(0)
        for t in _STRICT:
            c = c + Int32(y > Float32(t))
        for t in _INCLUSIVE:
            c = c + Int32(y >= Float32(t))
        return c | (Int32(neg) << 3)

    @cute.kernel
    def kernel(mX: cute.Tensor, mQ: cute.Tensor, mSF: cute.Tensor, mGS: cute.Tensor, m_rows: cutlass.Int32,
               total: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * THREADS + tidx
        if i < total:
            r = i // kbp
            kb = i - r * kbp
            off = ((r // 128) * (kbp // 4) + kb // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + kb % 4
            byte = Uint32(0)
            if r < m_rows and kb < kb_real:
                vals = cute.make_rmem_tensor((bs,), cutlass.Float32)
                amax = Float32(0.0)
                for j in cutlass.range_constexpr(bs):
                    vals[j] = mX[r, kb * bs + j].to(cutlass.Float32)
                    amax = cute.arch.fmax(amax, _abs(vals[j]))
                inv = Float32(0.0)
                if cutlass.const_expr(nvfp4):
                    g = mGS[0]
                    s = div_rn(div_rn(amax, Float32(E2M1_MAX)), g)
                    s = cute.arch.fmin(s, Float32(E4M3_MAX))
                    byte = e4m3_byte(s)
                    denom = mul_rn(e4m3_value(byte), g)
                    if denom > Float32(0.0):
                        inv = denom
                else:
                    field = Int32((f32_bits(amax) >> 23) & Uint32(0xFF))
                    e = cutlass.max(cutlass.min(field - 2, Int32(254)), Int32(0))
                    byte = Uint32(e)
                    pw = Uint32(0x00400000)  # 2**-127, a subnormal
                    if e < 254:
                        pw = Uint32(254 - e) << 23
                    inv = bits_f32(pw)  # 2**(127 - e): y = |x| * 2**-e is exact
                for p in cutlass.range_constexpr(bs // 2):
                    lo = Int32(0)
                    hi = Int32(0)
                    if cutlass.const_expr(nvfp4):
                        if inv > Float32(0.0):
                            lo = code_of(div_rn(_abs(vals[2 * p]), inv), vals[2 * p] < Float32(0.0))
                            hi = code_of(div_rn(_abs(vals[2 * p + 1]), inv), vals[2 * p + 1] < Float32(0.0))
                        else:
                            lo = Int32(vals[2 * p] < Float32(0.0)) << 3
                            hi = Int32(vals[2 * p + 1] < Float32(0.0)) << 3
                    else:
                        lo = code_of(mul_rn(_abs(vals[2 * p]), inv), vals[2 * p] < Float32(0.0))
                        hi = code_of(mul_rn(_abs(vals[2 * p + 1]), inv), vals[2 * p + 1] < Float32(0.0))
                    mQ[r, kb * (bs // 2) + p] = cutlass.Uint8(lo | (hi << 4))
            mSF[off] = cutlass.Uint8(byte & Uint32(0xFF))

    def _abs(v):
        return cute.arch.fmax(v, -v)

    @cute.jit
    def host(mX: cute.Tensor, mQ: cute.Tensor, mSF: cute.Tensor, mGS: cute.Tensor, stream: cuda.CUstream):
        m = mX.shape[0]
        total = (m + 127) // 128 * 128 * kbp
        kernel(mX, mQ, mSF, mGS, m, total).launch(
            grid=[(total + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream)

    return host


def _fake_args(k: int, dtype: str):
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    dt = cutlass.BFloat16 if dtype == "bfloat16" else cutlass.Float16
    m, sf = cute.sym_int32(), cute.sym_int32()
    x = make_fake_compact_tensor(dt, (m, k), stride_order=(1, 0), assumed_align=16)
    q = make_fake_compact_tensor(cutlass.Uint8, (m, k // 2), stride_order=(1, 0), assumed_align=16)
    s = make_fake_compact_tensor(cutlass.Uint8, (sf,), assumed_align=16)
    g = make_fake_compact_tensor(cutlass.Float32, (1,), assumed_align=4)
    return x, q, s, g, make_fake_stream(use_tvm_ffi_env_stream=True)


def validate(k: int, fmt: str, dtype: str, arch: str) -> str | None:
    if fmt not in FORMATS:
        return f"fmt must be one of {FORMATS}, got {fmt!r}"
    if dtype not in DTYPES:
        return f"dtype must be one of {DTYPES}, got {dtype!r}"
    if arch not in ARCHS:
        return f"arch must be one of {ARCHS}, got {arch!r}"
    if k <= 0 or k % 32:
        return f"k={k} must be a positive multiple of 32"
    return None


def _compile(k: int, fmt: str, dtype: str, arch: str) -> Callable:
    from ..kernel_cache import compile_cached

    reason = validate(k, fmt, dtype, arch)
    if reason:
        raise ValueError(f"fp4 activation quantizer for k={k}, {fmt}, {dtype}, {arch}: {reason}")

    def build():
        return cute.compile(_build(k, fmt, dtype), *_fake_args(k, dtype),
                            options=f"--enable-tvm-ffi --gpu-arch {arch}")

    return compile_cached("fp4_act_quant", __name__, (k, fmt, dtype, arch), build)


def compile_only(k: int, fmt: str, dtype: str, arch: str) -> None:
    """Compile without a GPU (set CUTE_DSL_ARCH to ``arch``), for CI."""
    _compile(k, fmt, dtype, arch)


def compile_quantizer(k: int, fmt: str, dtype: str, arch: str) -> Callable:
    """``quant(x, global_scale) -> (codes uint8 [M, K/2], swizzled scales uint8)`` for ``x [M, k]``
    (``global_scale``: fp32 [1] on x's device for NVFP4, ignored for MXFP4)."""
    fn = _compile(k, fmt, dtype, arch)
    ones: dict[torch.device, torch.Tensor] = {}

    def quant(x: torch.Tensor, global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        m = x.shape[0]
        q = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
        sf = torch.empty(padded_scale_bytes(m, k, fmt), dtype=torch.uint8, device=x.device)
        g = global_scale
        if g is None:
            g = ones.get(x.device)
            if g is None:
                g = ones[x.device] = torch.ones(1, dtype=torch.float32, device=x.device)
        if m:
            fn(x, q, sf, g)
        return q, sf

    return quant


def reference_quantize(x: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None) -> tuple[Any, Any]:
    """What the kernel writes, computed with :mod:`autofp4.formats` on any device: (codes
    [M, K/2], swizzled scale buffer)."""
    from ..formats import quantize_mxfp4, quantize_nvfp4
    from .sm100_blockscaled_gemm import sf_padded_shape, swizzle_scales

    if fmt == "nvfp4":
        q, s, _ = quantize_nvfp4(x, global_scale=global_scale)
    else:
        q, s = quantize_mxfp4(x)
    buf = swizzle_scales(s)
    rows, blocks = s.shape
    rp, bp = sf_padded_shape(rows, blocks)
    assert buf.numel() == rp * bp
    return q, buf
