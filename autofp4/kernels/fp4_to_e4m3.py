"""FP4 weights to E4M3 bytes, for W4A8 GEMMs run by cuBLAS's FP8 GEMM (sm_89 and later).

``codes [R, K/2]`` (two E2M1 values a byte, low nibble first) and their block scales (NVFP4: one
E4M3 byte per 16 values; MXFP4: one E8M0 byte per 32) -> ``q [R, K32]`` E4M3 bytes, with the same
values, bit for bit, as the in-kernel conversion of the W4A8 GEMM
(:func:`.sm90_w4a8_gemm.reference_weight`): NVFP4 ``E4M3(v * s * 2**-3)``, MXFP4
``E4M3(v * 2**(e - e_max + 6))`` (round to nearest even, saturated), to be multiplied by the
weight's factor (:func:`factor`). Each 32-value block of K is stored in the activation
quantizer's order (:data:`.fp8_act_quant.PERM32`), so ``q`` multiplies its ``xq`` as it is; K
positions past K (K32 = K rounded up to 32) are zeros.

One thread converts 16 values (one NVFP4 block, half an MXFP4 one): from its block scale it builds
the 8 E4M3 bytes of the block's magnitudes (``cvt.rn.satfinite.e4m3x2.f32`` of ``v * S``) as a
two-register table, then each 4-byte output word is one ``prmt`` gathering its 4 nibbles, a
``prmt`` looking them up in the table, and the signs: a ``prmt`` in sign-replicating mode turns
each nibble's sign bit into a byte of 0x00 / 0x7F, which one shift and a ``lop3`` flip into the
bytes' sign bits. Memory bound: 8 bytes in, 16 out per thread.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .fp8_act_quant import padded_k

try:  # CuTeDSL is an optional dependency
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
except ImportError:  # pragma: no cover - exercised only without nvidia-cutlass-dsl
    cuda = cutlass = cute = None  # type: ignore[assignment]

#: helper modules whose source is part of this kernel's (kernel cache key)
KERNEL_SOURCES = ("autofp4.kernels._ptx",)
THREADS = 256
ARCHS = ("sm_90a", "sm_100a")
#: the power of two the W4A8 conversion adds, per format (:data:`.sm90_w4a8_gemm.EXP_SHIFT`)
_SHIFT = {"nvfp4": -3, "mxfp4": 6}


def validate(k: int, fmt: str, arch: str = "sm_90a") -> str | None:
    if fmt not in _SHIFT:
        return f"fmt must be one of {tuple(_SHIFT)}, got {fmt!r}"
    if arch not in ARCHS:
        return f"arch must be one of {ARCHS}, got {arch!r}"
    block = 16 if fmt == "nvfp4" else 32
    if k <= 0 or k % block:
        return f"k={k} must be a positive multiple of the {fmt} block size {block}"
    return None


def _linear_weight(w: Any, what: str) -> None:
    """ValueError unless ``w`` is one linear layer's weight ``[N, K]`` (stacked experts have a
    global scale, and a reference exponent, each)."""
    if len(tuple(w.shape)) != 2:
        raise ValueError(f"fp4_to_e4m3.{what}: takes one linear layer's weight [N, K], got shape {list(w.shape)} "
                         "(stacked experts: convert each expert's weight)")


def e_max(w: Any) -> int:
    """The largest E8M0 block exponent of an MXFP4 weight (the reference of its conversion); 0 for
    NVFP4. One device-to-host read: callers keep it with the weight."""
    _linear_weight(w, "e_max")
    if w.fmt != "mxfp4":
        return 0
    raw = w.scale if w.scale.dtype == torch.uint8 else w.scale.view(torch.uint8)
    return int(raw.max())


def factor(w: Any, emax: int) -> float:
    """``dequant(W) ~= q * factor`` (exactly where the conversion is): NVFP4 the global scale
    times 2**3, MXFP4 ``2**(e_max - 127 - 6)``."""
    _linear_weight(w, "factor")
    if w.fmt == "nvfp4":
        return float(w.global_scale.reshape(-1)[0]) * 2.0 ** -_SHIFT["nvfp4"]
    return 2.0 ** (emax - 127 - _SHIFT["mxfp4"])


def reference(w: Any, rows: slice | None = None) -> torch.Tensor:
    """What the kernel writes for the 2-D FP4Weight ``w`` (``rows``: a slice of its rows), on any
    device: uint8 ``[R, K32]``."""
    from . import fp8_act_quant
    from .sm90_w4a8_gemm import reference_weight

    _linear_weight(w, "reference")
    if rows is not None and not isinstance(rows, slice):
        raise TypeError(f"fp4_to_e4m3.reference: rows must be a slice of the weight's rows, got {type(rows).__name__}")
    q, _ = reference_weight(w)
    if rows is not None:
        q = q[rows]
    r, k = q.shape
    k32 = padded_k(k)
    out = torch.zeros(r, k32, dtype=torch.uint8, device=q.device)
    out[:, :k] = q.to(torch.float8_e4m3fn).view(torch.uint8)
    idx = torch.tensor(fp8_act_quant.PERM32, device=q.device)
    return out.view(r, k32 // 32, 32)[:, :, idx].reshape(r, k32).contiguous()


def _f32_hex(v: float) -> str:
    """``v`` as the 8 hex digits of its fp32 bits (a PTX ``0f`` literal)."""
    import struct

    return struct.pack(">f", v).hex().upper()


def _build(k: int, fmt: str):
    from ._ptx import Float32, Int32, Int64, T, Uint32, asm, asm_void, llvm

    k32 = padded_k(k)
    units = k32 // 16           # 16-value units of an output row
    real_units = k // 16        # of which hold weights
    code_row = k // 2
    nv = fmt == "nvfp4"
    scale_row = k // 16 if nv else k // 32
    shift = _SHIFT[fmt]

    def scale_f32(byte, emax):
        """The block's multiplier S as fp32: NVFP4 the E4M3 scale times 2**-3; MXFP4
        2**(e - e_max + 6), its exponent field clamped to [1, 254] (below, every product
        converts to zero either way)."""
        if cutlass.const_expr(nv):
            return asm(T.f32(), [Uint32(byte)],
                       "{ .reg .b16 b, lo, hi; .reg .b32 h; .reg .f32 s; cvt.u16.u32 b, $1;"
                       " cvt.rn.f16x2.e4m3x2 h, b; mov.b32 {lo, hi}, h; cvt.f32.f16 s, lo;"
                       f" mul.rn.f32 $0, s, 0f{_f32_hex(2.0 ** shift)}; }}", "=f,r")
        return asm(T.f32(), [Uint32(byte), Int32(emax)],
                   "{ .reg .s32 e; sub.s32 e, $1, $2; add.s32 e, e, " + str(127 + shift) + ";"
                   " max.s32 e, e, 1; min.s32 e, e, 254; shl.b32 $0, e, 23; }", "=f,r,r")

    def table(s):
        """The E4M3 bytes of (0, .5, 1, 1.5) * s and (2, 3, 4, 6) * s: two registers."""
        r = asm(llvm.StructType.get_literal([T.i32(), T.i32()]), [Float32(s)],
                "{ .reg .f32 a, b, c, d, e, f, z; .reg .b16 h0, h1, h2, h3;\n"
                "mov.f32 z, 0f00000000; mul.rn.f32 a, $2, 0f3F000000; mul.rn.f32 b, $2, 0f3FC00000;\n"
                "mul.rn.f32 c, $2, 0f40000000; mul.rn.f32 d, $2, 0f40400000;\n"
                "mul.rn.f32 e, $2, 0f40800000; mul.rn.f32 f, $2, 0f40C00000;\n"
                "cvt.rn.satfinite.e4m3x2.f32 h0, a, z; cvt.rn.satfinite.e4m3x2.f32 h1, b, $2;\n"
                "cvt.rn.satfinite.e4m3x2.f32 h2, d, c; cvt.rn.satfinite.e4m3x2.f32 h3, f, e;\n"
                "mov.b32 $0, {h0, h1}; mov.b32 $1, {h2, h3}; }", "=r,=r,f")
        return Uint32(llvm.extractvalue(T.i32(), r, [0])), Uint32(llvm.extractvalue(T.i32(), r, [1]))

    def word(w0, w1, t: int, tlo, thi):
        """Output word ``t``: the E4M3 bytes of values (2t, 2t+1, 2t+8, 2t+9) of the unit."""
        return Uint32(asm(
            T.i32(), [Uint32(w0), Uint32(w1), Uint32(tlo), Uint32(thi)],
            "{ .reg .b32 s, m, p, r, c;\n"
            f"prmt.b32 s, $1, $2, {(4 + t) << 4 | t:#x};\n"
            "and.b32 m, s, 0x7777; prmt.b32 p, $3, $4, m;\n"
            "mov.b32 c, 0x7F7F7F7F; prmt.b32 r, c, c, s; shl.b32 r, r, 1;\n"
            "not.b32 r, r; and.b32 r, r, 0x80808080; xor.b32 $0, p, r; }", "=r,r,r,r,r"))

    @cute.kernel
    def kernel(mC: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor, rows: cutlass.Int32, emax: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        u = Int64(bidx) * THREADS + Int64(tidx)
        if u < Int64(rows) * units:
            r = u // units
            j = u - r * units
            real = Int32(j < real_units)  # a unit past K (K32 > K) writes zeros: its loads give 0
            sj = j if cutlass.const_expr(nv) else j // 2
            w = asm(llvm.StructType.get_literal([T.i32(), T.i32(), T.i32()]),
                    [Int64(mC.iterator.toint() + r * code_row + j * 8),
                     Int64(mS.iterator.toint() + r * scale_row + sj), real],
                    "{ .reg .pred p; .reg .u16 b; setp.ne.b32 p, $5, 0;\n"
                    "mov.b32 $0, 0; mov.b32 $1, 0; mov.u16 b, 0;\n"
                    "@p ld.global.nc.L1::no_allocate.v2.u32 {$0, $1}, [$3];\n"
                    "@p ld.global.nc.u8 b, [$4]; cvt.u32.u16 $2, b; }", "=r,=r,=r,l,l,r")
            w0, w1, sb = (Uint32(llvm.extractvalue(T.i32(), w, [i])) for i in range(3))
            tlo, thi = table(scale_f32(sb, emax))
            o = [word(w0, w1, t, tlo, thi) for t in range(4)]
            asm_void("st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r",
                     Int64(mO.iterator.toint() + r * k32 + j * 16), o[0], o[1], o[2], o[3])

    @cute.jit
    def host(mC: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor, emax: cutlass.Int32, stream: cuda.CUstream):
        rows = mC.shape[0]
        total = rows * units
        kernel(mC, mS, mO, rows, emax).launch(grid=[(total + THREADS - 1) // THREADS, 1, 1],
                                              block=[THREADS, 1, 1], stream=stream)

    return host


def _fake_args(k: int, fmt: str):
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    r = cute.sym_int32()
    c = make_fake_compact_tensor(cutlass.Uint8, (r, k // 2), stride_order=(1, 0), assumed_align=8)
    s = make_fake_compact_tensor(cutlass.Uint8, (r, k // (16 if fmt == "nvfp4" else 32)), stride_order=(1, 0),
                                 assumed_align=1)
    o = make_fake_compact_tensor(cutlass.Uint8, (r, padded_k(k)), stride_order=(1, 0), assumed_align=16)
    return c, s, o, cutlass.Int32(0), make_fake_stream(use_tvm_ffi_env_stream=True)


def _compile(k: int, fmt: str, arch: str = "sm_90a") -> Callable:
    from ..kernel_cache import compile_cached

    reason = validate(k, fmt, arch)
    if reason:
        raise ValueError(f"fp4 -> e4m3 conversion for k={k}, {fmt}, {arch}: {reason}")

    def build():
        return cute.compile(_build(k, fmt), *_fake_args(k, fmt), options=f"--enable-tvm-ffi --gpu-arch {arch}")

    return compile_cached("fp4_to_e4m3", __name__, (k, fmt, arch), build)


def compile_only(k: int, fmt: str, arch: str = "sm_90a") -> None:
    """Compile without a GPU (set CUTE_DSL_ARCH to ``arch``), for CI."""
    _compile(k, fmt, arch)


def compile_converter(k: int, fmt: str, arch: str = "sm_90a") -> Callable:
    """``convert(codes, scales, emax, out)``: ``codes`` uint8 ``[R, k/2]`` and ``scales`` uint8
    ``[R, k/block]`` (both contiguous; E4M3 scales viewed as bytes) into ``out`` uint8
    ``[R, K32]`` (contiguous, 16-byte aligned); returns ``out``."""
    fn = _compile(k, fmt, arch)

    def convert(codes: torch.Tensor, scales: torch.Tensor, emax: int, out: torch.Tensor) -> torch.Tensor:
        if codes.shape[0]:
            fn(codes, scales, out, emax)
        return out

    return convert
