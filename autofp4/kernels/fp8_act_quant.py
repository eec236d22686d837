"""Activation quantization for the W4A8 GEMM (:mod:`.sm90_w4a8_gemm`): bf16/fp16 ``x [M, K]`` ->
E4M3 bytes ``xq [M, K32]`` (``K32`` = K rounded up to 32) and a per-token scale ``sx [M]`` (fp32).

Numerics (bit for bit what :func:`reference_quantize` computes): ``amax = max |x[m, :]|`` in fp32,
``inv = 448 / amax`` (``div.rn``; 0 for an all-zero row), ``q = E4M3(x * inv)`` (``mul.rn``, then
``cvt.rn.satfinite``: nearest, ties to even, saturated at 448), ``sx = amax / 448``. NaN values
are left out of the amax and stay NaN in ``xq``; an inf makes the row's scale inf. Either way that
row of the GEMM output is NaN/inf, as a dense matmul of the row would be.

The bytes of each 32-value block of K are stored in the order the W4A8 GEMM's weight fragment
needs (:data:`PERM32`): the GEMM decodes its FP4 weights into the registers of the FP8 ``wgmma``
A operand straight from the layout the W4A16 kernels use, which places each thread's values at K
offsets (2t, 2t+1, 2t+8, 2t+9) of a 16-value step, where the FP8 instruction expects K offsets
4t..4t+3 of its 32. Permuting x the same way makes the two agree at no cost: the dot product of a
32-value block does not depend on the order of its terms. Pad positions (K..K32) hold zeros.

One warp, or several for a long row (:func:`warps_per_row`: up to 8, each taking every
``per_row``-th chunk of 256 values), quantizes one row: each lane owns 8 consecutive values of
its 256-value chunks (16-byte loads), finds the row's amax (a warp reduction, then the row's
warps' maxima through shared memory), then reads its values again (from L1/L2), converts them,
trades two of its four E4M3 pairs with the neighbour lane and stores 8 bytes at the same offset
it loaded from, so a warp's stores are contiguous.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..problem import DTYPES

try:  # CuTeDSL is an optional dependency
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
except ImportError:  # pragma: no cover - exercised only without nvidia-cutlass-dsl
    cuda = cutlass = cute = None  # type: ignore[assignment]

#: helper modules whose source is part of this kernel's (kernel cache key)
KERNEL_SOURCES = ("autofp4.kernels._ptx",)
E4M3_MAX = 448.0
WARPS = 4
ARCHS = ("sm_90a",)


def _perm32() -> tuple[int, ...]:
    """``PERM32[p]``: the K offset (in its 32-value block) of the value stored at byte ``p``.
    Byte p = 16 h + 4 t + q holds offset 16 h + 2 t + q % 2 + 8 (q // 2)."""
    out = []
    for p in range(32):
        h, t, q = p // 16, p % 16 // 4, p % 4
        out.append(16 * h + 2 * t + q % 2 + 8 * (q // 2))
    return tuple(out)


PERM32 = _perm32()


def padded_k(k: int) -> int:
    """Columns of ``xq`` for ``x [M, k]``: k rounded up to a multiple of 32."""
    return (k + 31) // 32 * 32


def reference_quantize(x: torch.Tensor, permute: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel writes, on any device: (``xq`` uint8 [M, K32] E4M3 bytes, in the
    :data:`PERM32` order unless ``permute`` is False; ``sx`` fp32 [M])."""
    if x.dim() != 2:
        raise ValueError(f"reference_quantize: x must be 2-D [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    k32 = padded_k(k)
    xf = x.float()
    a = xf.abs()
    a = torch.where(a.isnan(), torch.zeros_like(a), a)  # the kernel's max.f32 skips NaN
    amax = a.amax(dim=1) if k else xf.new_zeros(m)
    inv = torch.where(amax > 0, torch.tensor(E4M3_MAX, dtype=torch.float32, device=x.device) / amax,
                      torch.zeros_like(amax))
    y = xf * inv[:, None]
    y = torch.where(y.isnan(), y, y.clamp(-E4M3_MAX, E4M3_MAX))
    q = torch.zeros(m, k32, dtype=torch.uint8, device=x.device)
    q[:, :k] = y.to(torch.float8_e4m3fn).view(torch.uint8)
    if permute:
        idx = torch.tensor(PERM32, device=x.device)
        q = q.view(m, k32 // 32, 32)[:, :, idx].reshape(m, k32)
    sx = amax / torch.tensor(E4M3_MAX, dtype=torch.float32, device=x.device)
    return q.contiguous(), sx


def dequantize(xq: torch.Tensor, sx: torch.Tensor, k: int, permute: bool = True) -> torch.Tensor:
    """The fp32 values ``xq`` and ``sx`` stand for, in x's own K order: ``[M, k]``."""
    m, k32 = xq.shape
    q = xq
    if permute:
        inv = [0] * 32
        for p, off in enumerate(PERM32):
            inv[off] = p
        q = q.view(m, k32 // 32, 32)[:, :, torch.tensor(inv, device=xq.device)].reshape(m, k32)
    return q.view(torch.float8_e4m3fn).float()[:, :k] * sx[:, None]


def warps_per_row(k: int) -> int:
    """Warps that share one row of ``k`` values: one up to 1024 values, then one per 1024, at most
    8 (a few hundred rows of a long K, as at prefill of a down projection, still fill the GPU)."""
    per = 1
    while per < 8 and padded_k(k) > 1024 * per:
        per *= 2
    return per


def validate(k: int, dtype: str, arch: str = "sm_90a") -> str | None:
    if dtype not in DTYPES:
        return f"dtype must be one of {DTYPES}, got {dtype!r}"
    if arch not in ARCHS:
        return f"arch must be one of {ARCHS}, got {arch!r}"
    if k <= 0 or k % 8:
        return f"k={k} must be a positive multiple of 8 (16-byte rows)"
    return None


def _build(k: int, dtype: str):
    from ._ptx import Float32, Int32, Int64, T, Uint32, asm, asm_void, ld_global_v4

    k32 = padded_k(k)
    iters = (k32 + 255) // 256
    per_row = warps_per_row(k)
    warps = max(WARPS, per_row)
    rows_per_cta = warps // per_row
    steps = (iters + per_row - 1) // per_row
    bf16 = dtype == "bfloat16"

    def halves(word):
        """The two fp32 values of a bf16x2 / f16x2 word (low lane first)."""
        if cutlass.const_expr(bf16):
            lo = Float32(asm(T.f32(), [Uint32(word)], "shl.b32 $0, $1, 16;", "=f,r"))
            hi = Float32(asm(T.f32(), [Uint32(word)], "and.b32 $0, $1, 0xFFFF0000;", "=f,r"))
        else:
            lo = Float32(asm(T.f32(), [Uint32(word)],
                             "{ .reg .b16 l, h; mov.b32 {l, h}, $1; cvt.f32.f16 $0, l; }", "=f,r"))
            hi = Float32(asm(T.f32(), [Uint32(word)],
                             "{ .reg .b16 l, h; mov.b32 {l, h}, $1; cvt.f32.f16 $0, h; }", "=f,r"))
        return lo, hi

    def e4m3_pair(lo, hi, inv):
        """E4M3 bytes of (lo * inv, hi * inv) in the low 16 bits (lo in the low byte)."""
        return Uint32(asm(T.i32(), [Float32(lo), Float32(hi), Float32(inv)],
                          "{ .reg .f32 a, b; .reg .b16 h; mul.rn.f32 a, $1, $3; mul.rn.f32 b, $2, $3;"
                          " cvt.rn.satfinite.e4m3x2.f32 h, b, a; cvt.u32.u16 $0, h; }", "=r,f,f,f"))

    def div_rn(a, b):
        return Float32(asm(T.f32(), [Float32(a), Float32(b)], "div.rn.f32 $0, $1, $2;", "=f,f,f"))

    def _abs(v):
        return cute.arch.fmax(v, -v)

    @cute.kernel
    def kernel(mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, m_rows: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        sub = warp % per_row  # this warp's share of the row: 256-value chunks sub, sub + per_row, ...
        row = bidx * rows_per_cta + warp // per_row
        valid = row < m_rows
        red = cutlass.memory.SmemAllocator().allocate_tensor(Float32, cute.make_layout(warps), byte_alignment=16)
        xbase = mX.iterator.toint() + Int64(row) * (k * 2)
        qbase = mQ.iterator.toint() + Int64(row) * k32
        amax = Float32(0.0)
        for it in cutlass.range(steps, unroll=1):
            k0 = (it * per_row + sub) * 256 + lane * 8
            v = ld_global_v4(xbase + Int64(k0) * 2, Int32(valid) * Int32(k0 < k), False)
            for i in cutlass.range_constexpr(4):
                lo, hi = halves(v[i])
                amax = cute.arch.fmax(amax, cute.arch.fmax(_abs(lo), _abs(hi)))
        for sh in cutlass.range_constexpr(5):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << sh))
        if cutlass.const_expr(per_row > 1):  # the row's warps trade their maxima in shared memory
            if lane == 0:
                red[warp] = amax
            cute.arch.barrier()
            first = warp - sub
            for w in cutlass.range_constexpr(per_row):
                amax = cute.arch.fmax(amax, red[first + w])
        inv = Float32(0.0)
        if amax > Float32(0.0):
            inv = div_rn(Float32(E4M3_MAX), amax)
        odd = lane % 2
        for it in cutlass.range(steps, unroll=1):
            k0 = (it * per_row + sub) * 256 + lane * 8
            v = ld_global_v4(xbase + Int64(k0) * 2, Int32(valid) * Int32(k0 < k), False)
            p = []
            for i in cutlass.range_constexpr(4):
                lo, hi = halves(v[i])
                p.append(e4m3_pair(lo, hi, inv))
            # even lane of a pair: offsets 16h + (0..7) -> bytes 16h + 4i + {0, 1};
            # odd lane: offsets 16h + (8..15) -> bytes 16h + 4i + {2, 3}
            send = p[0] | (p[1] << Uint32(16))
            if odd == 0:
                send = p[2] | (p[3] << Uint32(16))
            got = Uint32(cute.arch.shuffle_sync_bfly(send, offset=1))
            w0 = got & Uint32(0xFFFF) | (p[2] << Uint32(16))
            w1 = (got >> Uint32(16)) | (p[3] << Uint32(16))
            if odd == 0:
                w0 = p[0] | (got << Uint32(16))
                w1 = p[1] | ((got >> Uint32(16)) << Uint32(16))
            if Int32(valid) * Int32(k0 < k32) != 0:
                asm_void("st.global.v2.b32 [$0], {$1, $2};", "l,r,r",
                         qbase + Int64(k0), Uint32(w0), Uint32(w1))
        if Int32(valid) * Int32(lane == 0) * Int32(sub == 0) != 0:
            mS[row] = div_rn(amax, Float32(E4M3_MAX))

    @cute.jit
    def host(mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, stream: cuda.CUstream):
        m = mX.shape[0]
        kernel(mX, mQ, mS, m).launch(grid=[(m + rows_per_cta - 1) // rows_per_cta, 1, 1], block=[32 * warps, 1, 1],
                                     stream=stream)

    return host


def _fake_args(k: int, dtype: str):
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    dt = cutlass.BFloat16 if dtype == "bfloat16" else cutlass.Float16
    m = cute.sym_int32()
    x = make_fake_compact_tensor(dt, (m, k), stride_order=(1, 0), assumed_align=16)
    q = make_fake_compact_tensor(cutlass.Uint8, (m, padded_k(k)), stride_order=(1, 0), assumed_align=16)
    s = make_fake_compact_tensor(cutlass.Float32, (m,), assumed_align=4)
    return x, q, s, make_fake_stream(use_tvm_ffi_env_stream=True)


def _compile(k: int, dtype: str, arch: str = "sm_90a") -> Callable:
    from ..kernel_cache import compile_cached

    reason = validate(k, dtype, arch)
    if reason:
        raise ValueError(f"fp8 activation quantizer for k={k}, {dtype}, {arch}: {reason}")

    def build():
        return cute.compile(_build(k, dtype), *_fake_args(k, dtype),
                            options=f"--enable-tvm-ffi --gpu-arch {arch}")

    return compile_cached("fp8_act_quant", __name__, (k, dtype, arch), build)


def compile_only(k: int, dtype: str, arch: str = "sm_90a") -> None:
    """Compile without a GPU (set CUTE_DSL_ARCH to ``arch``), for CI."""
    _compile(k, dtype, arch)


def compile_quantizer(k: int, dtype: str) -> Callable:
    """``quant(x) -> (xq uint8 [M, K32], sx fp32 [M])`` for contiguous ``x [M, k]``."""
    fn = _compile(k, dtype)
    k32 = padded_k(k)

    def quant(x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        m = x.shape[0]
        q = out if out is not None else torch.empty(m, k32, dtype=torch.uint8, device=x.device)
        sx = torch.empty(m, dtype=torch.float32, device=x.device)
        if m:
            fn(x, q, sx)
        return q, sx

    return quant
