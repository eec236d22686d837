"""Hopper (sm_90a) W4A8 GEMM: ``out = (sx * xq) @ dequant(W).T (+ bias)`` on the FP8 tensor cores.

Opt-in (it changes the numerics): activations quantized to E4M3 per token by
:mod:`.fp8_act_quant` (``xq`` in its K order, ``sx`` per row), FP4 weights converted to E4M3 in
the kernel. FP8 ``wgmma`` runs at twice the bf16 rate, the way past the bf16 ceiling of the
W4A16 kernel at large M.

The weight is the W4A16 kernel's packed weight (:func:`.sm90_w4a16_gemm.pack_weight`), read as
it is: one packed copy serves both kernels. The data path is that kernel's (read its docstring):
``out^T = W x^T`` with the decoded weight as the register (A) operand of ``wgmma`` and the x tile
as the shared-memory (B) operand, weight chunks by 1-D bulk copies and x by TMA into an mbarrier
ring, a producer warp or consumer warp 0 refilling it, double-buffered A fragments. What differs
is the decode of one thread's 8 values of a k16 step (one packed word):

* the 4 pairs are decoded to bf16 and multiplied by the block scale exactly as in the W4A16
  kernel, giving ``v * s * 2**-14`` (NVFP4) or ``v * 2**(e - e_max + 1)`` (MXFP4);
* a constant is added to both bf16 exponent fields: ``2**C`` with ``C = 11`` (NVFP4) or 5
  (MXFP4), which puts the largest possible product at 336 (NVFP4: 6 x 448 / 8) or 384 (MXFP4: 6 x
  2**6), inside E4M3's 448. The products are below 1 and 12 before, so no exponent field
  overflows into the sign; a zero becomes a tiny value that converts to zero;
* each bf16 lane is widened to fp32 (a shift or a mask) and two of them converted to E4M3 with
  ``cvt.rn.satfinite.e4m3x2.f32``; pairs 0 and 2 (row r) make one A register, 1 and 3 (row r + 8)
  another. Those hold K offsets (2t, 2t+1, 2t+8, 2t+9) of the step, which the FP8 fragment
  expects at 4t..4t+3 of its 32; the activation quantizer stores x in that permuted order
  (:data:`.fp8_act_quant.PERM32`), so both operands agree.

The epilogue multiplies by ``alpha * 2**-C`` (the packed weight's fp32 factor) and by the token's
``sx``, adds the bias and stores bf16/fp16 pairs as the W4A16 kernel does.

Exactness of the weight conversion
----------------------------------
MXFP4: ``v * 2**(e - e_max + 6)`` is an E4M3 value (normal or subnormal) for every block whose
exponent is within 14 binades of the weight's largest, i.e. exactly when the packed weight's
``fp16_ok`` holds; blocks further down are rounded to nearest (to E4M3 subnormals or zero): an
error below 2**-10 in units where the largest weight is 384, i.e. below 2**-18 of the weight's
largest magnitude. Such a weight is detected at packing time and warned about
(:func:`warn_if_rounded`); the kernel and the reference compute the same rounded values.
NVFP4: an E2M1 value (2 significant bits) times an E4M3 scale (4) has up to 5 significant bits;
E4M3 keeps 4, so the weight is rounded once, to nearest even: a relative error of at most
2**-4 per weight (zero for the 7 of 15 nonzero magnitude/scale mantissa combinations that fit).
:func:`reference_weight` gives the converted weight, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from .. import pdl
from ..hopper import SMEM_PER_CTA
from ..problem import DTYPES, FORMATS
from . import fp8_act_quant
from ._fp4_bits import decode_terms
from ._run_args import checked_x
from .sm90_w4a16_gemm import (
    CHUNK_K, CHUNK_N, PAD, SWIZZLES, VALUE_BYTES, PackedSm90Weight, _pad, _scale_words, chunk_bytes,
)

try:  # CuTeDSL is an optional dependency; annotations of the jit functions resolve here
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
except ImportError:  # pragma: no cover - exercised only without nvidia-cutlass-dsl
    cuda = cutlass = cute = None  # type: ignore[assignment]

#: helper modules whose source is part of this kernel's (kernel cache key, DB provenance): the
#: packed layout it reads is defined by the W4A16 kernel's module
KERNEL_SOURCES = ("autofp4.kernels._ptx", "autofp4.kernels._fp4_bits", "autofp4.kernels.sm90_w4a16_gemm")
#: the power of two added to the products before the E4M3 conversion, per format
EXP_SHIFT = {"nvfp4": 11, "mxfp4": 5}
MAX_REGS = 192  # accumulators + two A fragments per thread that leave room for the decode
# with a producer warp, 9 warps put 3 on one of the SM's 4 schedulers (168 registers per thread at
# most); ptxas then serializes the wgmmas of tiles with more than 64 accumulators per thread
PRODUCER_ACC_REGS = 64


@dataclass(frozen=True)
class Sm90W4A8Config:
    kernel: ClassVar[str] = "gemm_fp8"  # the tag of stored configs (not a field)
    tile_n: int = 128      # weight rows per CTA (64 per wgmma atom; 2 warpgroups from 128)
    tile_m: int = 256      # tokens per CTA (wgmma N)
    tile_k: int = 128      # K per pipeline stage (bytes of an x row: 128 = the TMA swizzle)
    stages: int = 5        # shared-memory pipeline depth
    raster: str = "n"      # "n": consecutive CTAs walk weight tiles; "m": walk token tiles
    swizzle: int = 1       # > 1: the walk goes over bands this many tiles wide on the other axis
    pdl: bool = False      # launch with programmatic dependent launch (a launch flag, one binary)
    producer: bool = False  # a dedicated producer warp streams the stages (else consumer warp 0 does)

    @property
    def warpgroups(self) -> int:
        return min(self.tile_n // CHUNK_N, 2)

    @property
    def reps(self) -> int:
        """64-row wgmma atoms per consumer warpgroup."""
        return self.tile_n // CHUNK_N // self.warpgroups

    def smem_bytes(self, fmt: str) -> int:
        per_stage = self.tile_m * self.tile_k + (self.tile_n // CHUNK_N) * (self.tile_k // CHUNK_K) * chunk_bytes(fmt)
        return self.stages * per_stage + 2 * 8 * self.stages + 1024 * 3


def validate(cfg: Sm90W4A8Config, n: int, k: int, fmt: str, dtype: str) -> str | None:
    """``None`` if ``cfg`` can run (n, k, fmt, dtype), else the reason (one rule each)."""
    if fmt not in FORMATS:
        return f"fmt must be one of {FORMATS}, got {fmt!r}"
    if dtype not in DTYPES:
        return f"dtype must be one of {DTYPES}, got {dtype!r}"
    if n <= 0 or k <= 0:
        return f"n and k must be positive, got n={n}, k={k}"
    block = 16 if fmt == "nvfp4" else 32
    if k % block:
        return f"k={k} must be a multiple of the {fmt} block size {block}"
    if cfg.tile_n not in (64, 128, 256):
        return f"tile_n must be 64, 128 or 256, got {cfg.tile_n}"
    if cfg.tile_m not in (64, 128, 192, 256):
        return f"tile_m must be 64, 128, 192 or 256, got {cfg.tile_m}"
    if cfg.tile_k not in (128, 256):
        return f"tile_k must be 128 or 256, got {cfg.tile_k}"
    if not 2 <= cfg.stages <= 8:
        return f"stages must be in 2..8, got {cfg.stages}"
    if cfg.raster not in ("n", "m"):
        return f"raster must be 'n' or 'm', got {cfg.raster!r}"
    if cfg.swizzle not in SWIZZLES:
        return f"swizzle must be one of {SWIZZLES}, got {cfg.swizzle!r}"
    if not isinstance(cfg.producer, bool):
        return f"producer must be a bool, got {cfg.producer!r}"
    if _pad(k) % cfg.tile_k:
        return f"padded k={_pad(k)} must be divisible by tile_k={cfg.tile_k}"
    acc_regs = cfg.reps * cfg.tile_m // 2
    if acc_regs > 128:
        return (f"accumulators need {acc_regs} registers per thread (tile_n={cfg.tile_n}, "
                f"tile_m={cfg.tile_m}); the limit is 128")
    frag_regs = cfg.reps * cfg.tile_k // 32 * 4
    if acc_regs + 2 * frag_regs > MAX_REGS:
        return (f"accumulators + 2 weight fragments need {acc_regs + 2 * frag_regs} registers per "
                f"thread; the limit is {MAX_REGS}")
    if cfg.producer and cfg.warpgroups == 2 and acc_regs > PRODUCER_ACC_REGS:
        return (f"a producer warp with two warpgroups leaves 168 registers per thread: {acc_regs} "
                f"accumulators (more than {PRODUCER_ACC_REGS}) serialize the wgmmas; drop the producer "
                "warp or use a smaller tile")
    smem = cfg.smem_bytes(fmt)
    if smem > SMEM_PER_CTA:
        return f"needs {smem} bytes of shared memory, more than the {SMEM_PER_CTA} available"
    return None


# --------------------------------------------------------------------------------------------
# Reference numerics (pure torch)
# --------------------------------------------------------------------------------------------
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


_WARNED_ROUNDED: set = set()


def warn_if_rounded(w: Any, exact: bool | None = None) -> None:
    """Warn once per weight when its E4M3 conversion rounds (an MXFP4 weight whose block
    exponents span more than 14 binades; ``exact``: that fact where the caller knows it)."""
    if w.fmt != "mxfp4":
        return
    if exact is None:
        raw = w.scale if w.scale.dtype == torch.uint8 else w.scale.view(torch.uint8)
        exact = int(raw.max()) - int(raw.min()) <= 14
    if exact:
        return
    key = (w.data.data_ptr(), tuple(w.shape))
    if key not in _WARNED_ROUNDED:
        _WARNED_ROUNDED.add(key)
        import warnings

        warnings.warn(f"autofp4 W4A8: an mxfp4 weight {list(w.shape)} has block exponents spanning more than "
                      "14 binades: FP8 (E4M3) rounds its smallest blocks (by less than 2**-18 of its largest "
                      "weight)", stacklevel=4)


def weight_exact(packed: PackedSm90Weight) -> bool:
    """Whether the E4M3 conversion keeps every weight exactly (MXFP4 whose block exponents span
    at most 14 binades); NVFP4 weights are rounded (see the module docstring) and give False."""
    return packed.fmt == "mxfp4" and packed.fp16_ok


def reference_weight(w: Any) -> tuple[torch.Tensor, float]:
    """The kernel's E4M3 weight of an FP4Weight (2-D) as fp32 ``[N, K]`` values ``q``, and the
    factor ``f`` with ``dequant(W) ~= q * f`` (exactly for an exact MXFP4 weight): what the
    W4A8 GEMM multiplies, bit for bit (the same scale handling as the packing)."""
    n, k = int(w.shape[-2]), int(w.shape[-1])
    codes = w.data.to(torch.uint8)
    q4 = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(n, k).to(torch.int64)
    table = torch.tensor(_E2M1, dtype=torch.float64, device=codes.device)
    v = table[q4 & 7] * torch.where(q4 >= 8, -1.0, 1.0).to(torch.float64)
    raw = w.scale if w.scale.dtype == torch.uint8 else w.scale.view(torch.uint8)
    c = EXP_SHIFT[w.fmt]
    if w.fmt == "nvfp4":
        s = raw.reshape(n, k // 16).view(torch.float8_e4m3fn).to(torch.float64)
        prod = v * s.repeat_interleave(16, dim=1) * 2.0 ** (c - 14)
        factor = float(w.global_scale.reshape(-1)[0]) * 2.0 ** (14 - c)
    else:
        e = raw.reshape(n, k // 32).to(torch.int64)
        emax = int(e.max())
        prod = v * torch.pow(2.0, (e - emax + 1 + c).to(torch.float64)).repeat_interleave(32, dim=1)
        factor = 2.0 ** (emax - 128 - c)
    q = prod.to(torch.float32).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)
    return q, factor


def reference(x: torch.Tensor, w: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W4A8 result in float64 math on what the kernel multiplies: E4M3 activations with
    their per-token scales (:func:`.fp8_act_quant.reference_quantize`) and the converted
    weight (:func:`reference_weight`); returned in x's dtype. The tuner's correctness gate and
    the path without a Hopper GPU."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    xq, sx = fp8_act_quant.reference_quantize(x2, permute=False)
    xv = xq[:, :k].view(torch.float8_e4m3fn).to(torch.float64) * sx.to(torch.float64)[:, None]
    q, f = reference_weight(w)
    out = (xv @ q.to(torch.float64).T) * f
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])


# --------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------
class _Sm90W4A8Kernel:
    """One compiled kernel per (config, N, K, fmt, dtype); M is symbolic. ``grouped`` (None: the
    dense GEMM) makes it a grouped GEMM of a MoE layer, as for the W4A16 kernel
    (:mod:`.sm90_moe_gemm`: ``kind``, ``bias``, ``act``), on the sorted rows' E4M3 bytes and scales."""

    def __init__(self, cfg: Sm90W4A8Config, n: int, k: int, fmt: str, dtype: str, grouped: Any = None):
        self.cfg = cfg
        self.grouped = grouped
        self.n, self.k, self.fmt, self.dtype = n, k, fmt, dtype
        self.np_, self.kp = _pad(n), _pad(k)
        self.k32 = fp8_act_quant.padded_k(k)
        self.chunk = chunk_bytes(fmt)
        self.terms = decode_terms("bfloat16")

    def build(self):
        import cutlass.pipeline as pipeline
        import cutlass.utils as utils
        import cutlass.utils.hopper_helpers as sm90_utils
        from cutlass.cute.nvgpu import cpasync, warpgroup
        from cutlass.cutlass_dsl import T

        from ._ptx import asm, asm_void, decode_pair, griddep_launch_dependents, griddep_wait, prefetch_l2

        cfg = self.cfg
        dt = cutlass.BFloat16 if self.dtype == "bfloat16" else cutlass.Float16
        f8 = cutlass.Float8E4M3FN
        is_nv = self.fmt == "nvfp4"
        tile_n, tile_m, tile_k = cfg.tile_n, cfg.tile_m, cfg.tile_k
        stages = cfg.stages
        num_wg = cfg.warpgroups
        reps = cfg.reps
        cons_threads = 128 * num_wg
        cons_warps = cons_threads // 32
        producer = cfg.producer
        threads = cons_threads + (32 if producer else 0)
        load_warp = cons_warps if producer else 0
        kc_per_tile = tile_k // CHUNK_K
        chunk = self.chunk
        n_real = self.n
        nkc_total = self.kp // CHUNK_K
        nb_per_cta = tile_n // CHUNK_N
        w_copy_bytes = kc_per_tile * chunk
        w_stage_bytes = nb_per_cta * w_copy_bytes
        k_tiles = self.kp // tile_k
        raster_n = cfg.raster == "n"
        swz = cfg.swizzle
        terms = self.terms
        n_tiles = self.np_ // tile_n
        tx_bytes = tile_m * tile_k + w_stage_bytes
        s_words = _scale_words(self.fmt)
        c_shift = EXP_SHIFT[self.fmt]
        exp_add = (c_shift << 7) | (c_shift << 23)
        out_scale = 2.0 ** -c_shift
        cvt_x2 = "cvt.rn.bf16x2.f32" if dt is cutlass.BFloat16 else "cvt.rn.f16x2.f32"

        def mul_half(v, sw, hi: int):
            """``v`` times the low (``hi=0``) or high half of ``sw`` in both bf16 lanes."""
            h = "h, h" if hi else "l, l"
            return cutlass.Uint32(asm(
                T.i32(), [cutlass.Uint32(v), cutlass.Uint32(sw)],
                f"{{ .reg .b16 l, h; .reg .b32 s; mov.b32 {{l, h}}, $2; mov.b32 s, {{{h}}}; mul.rn.bf16x2 $0, $1, s; }}",
                "=r,r,r"))

        def to_e4m3x4(pa, pb):
            """E4M3 bytes (pa.lo, pa.hi, pb.lo, pb.hi) of two bf16x2 products times 2**C."""
            return cutlass.Uint32(asm(
                T.i32(), [cutlass.Uint32(pa), cutlass.Uint32(pb)],
                "{ .reg .b32 a, b, a0, a1, b0, b1; .reg .b16 lo, hi;\n"
                f"add.u32 a, $1, {exp_add}; add.u32 b, $2, {exp_add};\n"
                "shl.b32 a0, a, 16; and.b32 a1, a, 0xFFFF0000; shl.b32 b0, b, 16; and.b32 b1, b, 0xFFFF0000;\n"
                "cvt.rn.satfinite.e4m3x2.f32 lo, a1, a0; cvt.rn.satfinite.e4m3x2.f32 hi, b1, b0;\n"
                "mov.b32 $0, {lo, hi}; }",
                "=r,r,r"))

        def st_x2(addr, lo, hi):
            """out[addr] = (lo, hi) rounded to the output dtype, one 4-byte store."""
            asm_void("{ .reg .b32 p; " + cvt_x2 + " p, $2, $1; st.global.b32 [$0], p; }", "l,f,f",
                     cutlass.Int64(addr), cutlass.Float32(lo), cutlass.Float32(hi))

        def load_stage(pipe, state, n_row0, tma_atom_x, tXgX, tXsX, bulk_atom, mW, sW):
            pipe.producer_acquire(state)
            bar = pipe.producer_get_barrier(state)
            kt = state.count
            cute.copy(tma_atom_x, tXgX[(None, kt)], tXsX[(None, state.index)], tma_bar_ptr=bar)
            with cute.arch.elect_one():
                for b in range(nb_per_cta):
                    goff = ((n_row0 + b) * nkc_total + kt * kc_per_tile) * chunk
                    src = cute.make_tensor(mW.iterator + goff, cute.make_layout((w_copy_bytes,)))
                    dst = cute.make_tensor(sW[(None, state.index)].iterator + b * w_copy_bytes,
                                           cute.make_layout((w_copy_bytes,)))
                    cute.copy(bulk_atom, src, dst, mbar_ptr=bar)
            pipe.producer_commit(state)

        grp_kind = self.grouped.kind if self.grouped is not None else None
        grp_act = self.grouped.act if grp_kind == "up" else None
        grp_bias = self.grouped is not None and self.grouped.bias
        inter = n_real // 2

        def gate_row(p):
            """The output of the up GEMM's interleaved weight row ``p = 16 q + s`` (s < 8): 8 q + s."""
            return p // 16 * 8 + p % 16

        @cute.jit
        def grouped_store(mOut, grp, nn, mm, lo, hi):
            """"up": the activation at h[mm, j] (gate row nn = 16 q + s -> j = 8 q + s); "down":
            the weighted expert output at the pair's row of ``y [pairs, N]`` (none for padding)."""
            if cutlass.const_expr(grp_kind == "up"):
                j = gate_row(nn)
                if j < inter:
                    st_x2(mOut.iterator.toint() + cutlass.Int64(mm * inter + j) * 2, lo, hi)
            else:
                pair = grp[1][mm]
                if nn < n_real and pair >= 0:
                    st_x2(mOut.iterator.toint() + cutlass.Int64(pair * n_real + nn) * 2, lo, hi)

        def banded(lin, walked, across):
            per_band = swz * walked
            band = lin // per_band
            width = cutlass.min(across - band * swz, swz)
            local = lin - band * per_band
            return band * swz + local % width, local // width

        @cute.kernel
        def kernel(
            tma_atom_x: cute.CopyAtom,
            mX: cute.Tensor,
            mW: cute.Tensor,
            mAlpha: cute.Tensor,
            mSX: cute.Tensor,
            mBias: cute.Tensor,
            mOut: cute.Tensor,
            m_size: cutlass.Int32,
            tiled_mma: cute.TiledMma,
            x_smem_layout_staged: cute.ComposedLayout,
        ):
            tidx, _, _ = cute.arch.thread_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            bidx, bidy, _ = cute.arch.block_idx()
            if cutlass.const_expr(swz > 1):
                m_tiles = (m_size + tile_m - 1) // tile_m
                if cutlass.const_expr(raster_n):
                    pid_m, pid_n = banded(bidx + bidy * n_tiles, n_tiles, m_tiles)
                else:
                    pid_n, pid_m = banded(bidx + bidy * m_tiles, m_tiles, n_tiles)
            elif cutlass.const_expr(raster_n):
                pid_n = bidx
                pid_m = bidy
            else:
                pid_n = bidy
                pid_m = bidx
            cta(tma_atom_x, mX, mW, mAlpha, mSX, mBias, mOut, m_size, tiled_mma, x_smem_layout_staged,
                tidx, warp_idx, pid_n, pid_m, None)

        @cute.kernel
        def grouped_kernel(
            tma_atom_x: cute.CopyAtom,
            mX: cute.Tensor,
            mW: cute.Tensor,
            mAlpha: cute.Tensor,
            mSX: cute.Tensor,
            mBias: cute.Tensor,
            mOut: cute.Tensor,
            m_size: cutlass.Int32,
            tiled_mma: cute.TiledMma,
            x_smem_layout_staged: cute.ComposedLayout,
            mBlockExpert: cute.Tensor,
            mRows: cute.Tensor,
            mTopkW: cute.Tensor,
        ):
            tidx, _, _ = cute.arch.thread_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            bidx, bidy, _ = cute.arch.block_idx()
            pid_n, pid_m = (bidx, bidy) if raster_n else (bidy, bidx)
            griddep_wait()  # the routing metadata comes from the previous kernels of the stream
            expert = mBlockExpert[pid_m]
            if expert >= 0:
                cta(tma_atom_x, mX, mW, mAlpha, mSX, mBias, mOut, m_size, tiled_mma, x_smem_layout_staged,
                    tidx, warp_idx, pid_n, pid_m, (expert, mRows, mTopkW))

        @cute.jit
        def cta(tma_atom_x, mX, mW, mAlpha, mSX, mBias, mOut, m_size, tiled_mma, x_smem_layout_staged,
                tidx, warp_idx, pid_n, pid_m, grp):
            """The tile (pid_n, pid_m) of one CTA; ``grp``: None (dense) or the grouped GEMM's
            (expert, sorted rows, router weights)."""
            if warp_idx == load_warp:
                cpasync.prefetch_descriptor(tma_atom_x)

            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, stages * 2]
                sX: cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN, cute.cosize(x_smem_layout_staged)], 1024]
                sW: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, w_stage_bytes * stages], 1024]

            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sX = storage.sX.get_tensor(x_smem_layout_staged.outer, swizzle=x_smem_layout_staged.inner)
            sW = storage.sW.get_tensor(cute.make_layout((w_stage_bytes, stages)))
            n_chunks_stage = nb_per_cta * kc_per_tile
            sWv = cute.make_tensor(
                cute.recast_ptr(storage.sW.data_ptr(), dtype=cutlass.Uint32),
                cute.make_layout((4, 128, n_chunks_stage, stages), stride=(1, 4, chunk // 4, w_stage_bytes // 4)),
            )
            sSv = cute.make_tensor(
                cute.recast_ptr(storage.sW.data_ptr(), dtype=cutlass.Uint32) + VALUE_BYTES // 4,
                cute.make_layout((s_words, 32, n_chunks_stage, stages),
                                 stride=(1, s_words, chunk // 4, w_stage_bytes // 4)),
            )

            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(),
                num_stages=stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, cons_warps),
                tx_count=tx_bytes,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            )
            gX = cute.local_tile(mX, (tile_m, tile_k), (pid_m, None))
            tXsX, tXgX = cpasync.tma_partition(
                tma_atom_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
            bulk_atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), cutlass.Uint8, num_bits_per_copy=w_copy_bytes * 8)

            wg = cute.arch.make_warp_uniform(tidx // 128)
            wtid = tidx % 128
            thr_mma = tiled_mma.get_slice(wtid)
            tCsB = thr_mma.partition_B(sX)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((CHUNK_N * reps, tile_m)), cutlass.Float32)
            acc.fill(0.0)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            a_shape = thr_mma.partition_shape_A((CHUNK_N * reps, tile_k))
            rAs = [tiled_mma.make_fragment_A(a_shape), tiled_mma.make_fragment_A(a_shape)]
            wregs = cute.make_rmem_tensor(cute.make_layout((4, reps)), cutlass.Uint32)
            swords = cute.make_rmem_tensor(cute.make_layout((s_words, reps)), cutlass.Uint32)

            prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
            cons_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            rel_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            n_row0 = pid_n * nb_per_cta
            if cutlass.const_expr(grp is not None):
                n_row0 = n_row0 + grp[0] * (self.np_ // CHUNK_N)  # in the expert's packed weight
            lane_q = wtid // 4

            n_pre = cutlass.min(stages, k_tiles)
            if tidx == load_warp * 32:
                for b in range(nb_per_cta):
                    goff = (n_row0 + b) * nkc_total * chunk
                    prefetch_l2(mW.iterator.toint() + cutlass.Int64(goff), n_pre * w_copy_bytes)
            griddep_wait()
            if warp_idx == load_warp:
                for i in cutlass.range(k_tiles if producer else n_pre, unroll=1):
                    load_stage(pipe, prod_state, n_row0, tma_atom_x, tXgX, tXsX, bulk_atom, mW, sW)
                    prod_state.advance()

            if warp_idx < cons_warps:
                for kt2 in cutlass.range((k_tiles + 1) // 2, unroll=1):
                    for buf in cutlass.range_constexpr(2):
                        t_cur = kt2 * 2 + buf
                        if t_cur < k_tiles:
                            rA = rAs[buf]
                            # (register, rep, k32 step): registers 0/1 rows r / r + 8 of the even
                            # k16 step, 2/3 of the odd one
                            rA32 = cute.make_tensor(cute.recast_ptr(rA.iterator, dtype=cutlass.Uint32),
                                                    cute.make_layout((4, reps, tile_k // 32)))
                            pipe.consumer_wait(cons_state)
                            for kc in cutlass.range_constexpr(kc_per_tile):
                                for r in cutlass.range_constexpr(reps):
                                    cidx = (wg * reps + r) * kc_per_tile + kc
                                    cute.autovec_copy(sWv[(None, wtid, cidx, cons_state.index)], wregs[(None, r)])
                                    cute.autovec_copy(sSv[(None, lane_q, cidx, cons_state.index)], swords[(None, r)])
                                for st in cutlass.range_constexpr(4):
                                    for r in cutlass.range_constexpr(reps):
                                        sw = swords[st if is_nv else st // 2, r]
                                        word = wregs[st, r]
                                        p = [mul_half(decode_pair(word, terms[j]), sw, j % 2) for j in range(4)]
                                        k8 = kc * 2 + st // 2
                                        rA32[2 * (st % 2), r, k8] = to_e4m3x4(p[0], p[2])
                                        rA32[2 * (st % 2) + 1, r, k8] = to_e4m3x4(p[1], p[3])
                                cute.nvgpu.warpgroup.fence()
                                for s8 in cutlass.range_constexpr(2):
                                    cute.gemm(tiled_mma, acc, rA[(None, None, kc * 2 + s8)],
                                              tCrB[(None, None, kc * 2 + s8, cons_state.index)], acc)
                            cute.nvgpu.warpgroup.commit_group()
                            cons_state.advance()
                            cute.nvgpu.warpgroup.wait_group(1)
                            if t_cur > 0:
                                pipe.consumer_release(rel_state)
                                rel_state.advance()
                                if cutlass.const_expr(not producer):
                                    if warp_idx == 0:
                                        if prod_state.count < k_tiles:
                                            load_stage(pipe, prod_state, n_row0, tma_atom_x, tXgX, tXsX,
                                                       bulk_atom, mW, sW)
                                            prod_state.advance()
                cute.nvgpu.warpgroup.wait_group(0)
            griddep_launch_dependents()

            # ---- epilogue: out[m, n] = acc[n, m] * alpha * 2**-C * sx[m] + bias[n] (grouped: see
            # the module docstring of .sm90_moe_gemm; "up" applies the activation to the gate and
            # up rows r, r + 8, "down" multiplies by the pair's router weight)
            alpha = (mAlpha[0] if grp is None else mAlpha[grp[0]]) * cutlass.Float32(out_scale)
            row0 = pid_n * tile_n + wg * (reps * CHUNK_N)
            col0 = pid_m * tile_m
            tcid = thr_mma.partition_C(cute.make_identity_tensor((CHUNK_N * reps, tile_m)))
            n_acc = cute.size(acc)
            r0, c0 = tcid[0]
            lane_odd = (tidx // 4) % 2
            if cutlass.const_expr(grp is None):
                bias_rows = [mBias[cutlass.min(row0 + r0 + 8 * h + CHUNK_N * rep, n_real - 1)].to(cutlass.Float32)
                             for rep in range(reps) for h in range(2)]
            if warp_idx < cons_warps:
                for i in cutlass.range_constexpr(0, n_acc, 2):
                    h = i // 2 % 2
                    rep = i // (tile_m // 2)
                    if cutlass.const_expr(grp_kind != "up" or h == 0):
                        col = col0 + c0 + i // 4 % (tile_m // 8) * 8
                        s0 = mSX[cutlass.min(col, m_size - 1)] * alpha
                        s1 = mSX[cutlass.min(col + 1, m_size - 1)] * alpha
                        if cutlass.const_expr(grp is None):
                            v0 = acc[i] * s0 + bias_rows[rep * 2 + h]
                            v1 = acc[i + 1] * s1 + bias_rows[rep * 2 + h]
                        elif cutlass.const_expr(grp_kind == "up"):
                            g0, g1 = acc[i] * s0, acc[i + 1] * s1
                            u0, u1 = acc[i + 2] * s0, acc[i + 3] * s1
                            if cutlass.const_expr(grp_bias):  # bias [E, 2I]: gate j, up I + j
                                jb = grp[0] * n_real + cutlass.min(gate_row(row0 + r0 + CHUNK_N * rep), inter - 1)
                                bg, bu = mBias[jb], mBias[jb + inter]
                                g0, g1, u0, u1 = g0 + bg, g1 + bg, u0 + bu, u1 + bu
                            v0 = grp_act(g0, u0)
                            v1 = grp_act(g1, u1)
                        else:  # "down": (+ bias [E, H]) times the router weight of the column's pair
                            d0, d1 = acc[i] * s0, acc[i + 1] * s1
                            if cutlass.const_expr(grp_bias):
                                bn = mBias[grp[0] * n_real + cutlass.min(row0 + r0 + 8 * h + CHUNK_N * rep,
                                                                         n_real - 1)]
                                d0, d1 = d0 + bn, d1 + bn
                            v0 = d0 * grp[2][cutlass.max(grp[1][col], 0)]
                            v1 = d1 * grp[2][cutlass.max(grp[1][col + 1], 0)]
                        # lanes 4 apart hold rows r, r + 1: trade so each stores two n of one m
                        send = v1
                        if lane_odd == 1:
                            send = v0
                        got = cute.arch.shuffle_sync_bfly(send, offset=4)
                        lo = v0
                        hi = got
                        if lane_odd == 1:
                            lo = got
                            hi = v1
                        nn = row0 + r0 + 8 * h + CHUNK_N * rep - lane_odd
                        mm = col + lane_odd
                        if cutlass.const_expr(grp is not None):
                            grouped_store(mOut, grp, nn, mm, lo, hi)
                        elif nn < n_real and mm < m_size:
                            if cutlass.const_expr(n_real % 2 == 0):
                                st_x2(mOut.iterator.toint() + cutlass.Int64(mm * n_real + nn) * 2, lo, hi)
                            else:
                                mOut[mm, nn] = lo.to(dt)
                                if nn + 1 < n_real:
                                    mOut[mm, nn + 1] = hi.to(dt)

        def operands(mX: cute.Tensor):
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                f8, f8, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, cutlass.Float32,
                (1, 1, 1), tiler_mn=(CHUNK_N, tile_m), a_source=warpgroup.OperandSource.RMEM)
            x_smem_layout_staged = sm90_utils.make_smem_layout_b(
                utils.LayoutEnum.ROW_MAJOR, (CHUNK_N, tile_m, tile_k), f8, stages)
            x_smem_one = cute.slice_(x_smem_layout_staged, (None, None, 0))
            tma_atom_x, tma_x = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), mX, x_smem_one, (tile_m, tile_k))
            return tiled_mma, x_smem_layout_staged, tma_atom_x, tma_x

        @cute.jit
        def host(mXq: cute.Tensor, mW: cute.Tensor, mAlpha: cute.Tensor, mSX: cute.Tensor, mBias: cute.Tensor,
                 mOut: cute.Tensor, use_pdl: cutlass.Int32, stream: cuda.CUstream):
            mX = cute.make_tensor(cute.recast_ptr(mXq.iterator, dtype=f8), mXq.layout)  # the E4M3 bytes
            tiled_mma, x_smem_layout_staged, tma_atom_x, tma_x = operands(mX)
            m_size = mX.shape[0]
            m_tiles = (m_size + tile_m - 1) // tile_m
            grid = (n_tiles, m_tiles, 1) if raster_n else (m_tiles, n_tiles, 1)
            kernel(tma_atom_x, tma_x, mW, mAlpha, mSX, mBias, mOut, m_size, tiled_mma, x_smem_layout_staged,
                   ).launch(grid=grid, block=[threads, 1, 1], stream=stream, use_pdl=use_pdl)

        @cute.jit
        def host_grouped(mXq: cute.Tensor, mW: cute.Tensor, mAlpha: cute.Tensor, mSX: cute.Tensor,
                         mBias: cute.Tensor, mOut: cute.Tensor, mBlockExpert: cute.Tensor, mRows: cute.Tensor,
                         mTopkW: cute.Tensor, use_pdl: cutlass.Int32, stream: cuda.CUstream):
            mX = cute.make_tensor(cute.recast_ptr(mXq.iterator, dtype=f8), mXq.layout)
            tiled_mma, x_smem_layout_staged, tma_atom_x, tma_x = operands(mX)
            blocks = mBlockExpert.shape[0]
            grid = (n_tiles, blocks, 1) if raster_n else (blocks, n_tiles, 1)
            grouped_kernel(tma_atom_x, tma_x, mW, mAlpha, mSX, mBias, mOut, mX.shape[0], tiled_mma,
                           x_smem_layout_staged, mBlockExpert, mRows, mTopkW,
                           ).launch(grid=grid, block=[threads, 1, 1], stream=stream, use_pdl=use_pdl)

        return host if self.grouped is None else host_grouped

    def fake_args_grouped(self):
        """x [rows, K32] E4M3 bytes of the sorted rows, every expert's packed weight, alpha [E],
        sx [rows], bias [E * N] (fp32; read only by a kernel built with it), out ("up": h [rows, N / 2];
        "down": y [pairs, N]), block_expert [blocks], sorted_rows [rows], topk_weights [pairs] (fp32)."""
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

        dt = cutlass.BFloat16 if self.dtype == "bfloat16" else cutlass.Float16
        e, rows, blocks, pairs = (cute.sym_int32() for _ in range(4))
        xq = make_fake_compact_tensor(cutlass.Uint8, (rows, self.k32), stride_order=(1, 0), assumed_align=16)
        w = make_fake_compact_tensor(
            cutlass.Uint8, (e * (self.np_ // CHUNK_N * (self.kp // CHUNK_K) * self.chunk),), assumed_align=16)
        alpha = make_fake_compact_tensor(cutlass.Float32, (e,), assumed_align=4)
        sx = make_fake_compact_tensor(cutlass.Float32, (rows,), assumed_align=4)
        bias = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int32(),), assumed_align=4)
        out_shape = (rows, self.n // 2) if self.grouped.kind == "up" else (pairs, self.n)
        out = make_fake_compact_tensor(dt, out_shape, stride_order=(1, 0), assumed_align=4)
        bexp = make_fake_compact_tensor(cutlass.Int32, (blocks,), assumed_align=4)
        srows = make_fake_compact_tensor(cutlass.Int32, (rows,), assumed_align=4)
        tw = make_fake_compact_tensor(cutlass.Float32, (pairs,), assumed_align=4)
        return xq, w, alpha, sx, bias, out, bexp, srows, tw, 1, make_fake_stream(use_tvm_ffi_env_stream=True)

    def fake_args(self):
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

        dt = cutlass.BFloat16 if self.dtype == "bfloat16" else cutlass.Float16
        m = cute.sym_int32()
        xq = make_fake_compact_tensor(cutlass.Uint8, (m, self.k32), stride_order=(1, 0), assumed_align=16)
        w = make_fake_compact_tensor(
            cutlass.Uint8, (self.np_ // CHUNK_N * (self.kp // CHUNK_K) * self.chunk,), assumed_align=16)
        alpha = make_fake_compact_tensor(cutlass.Float32, (1,), assumed_align=4)
        sx = make_fake_compact_tensor(cutlass.Float32, (m,), assumed_align=4)
        bias = make_fake_compact_tensor(dt, (self.n,), assumed_align=2)
        out = make_fake_compact_tensor(dt, (m, self.n), stride_order=(1, 0), assumed_align=4)
        return xq, w, alpha, sx, bias, out, 1, make_fake_stream(use_tvm_ffi_env_stream=True)


def _check(cfg: Sm90W4A8Config, n: int, k: int, fmt: str, dtype: str) -> None:
    reason = validate(cfg, n, k, fmt, dtype)
    if reason is not None:
        raise ValueError(f"invalid Sm90W4A8Config {cfg} for n={n}, k={k}, {fmt}, {dtype}: {reason}")


def _compile(cfg: Sm90W4A8Config, n: int, k: int, fmt: str, dtype: str) -> Callable:
    from ..kernel_cache import compile_cached

    _check(cfg, n, k, fmt, dtype)
    cfg = pdl.binary_config(cfg)

    def build():
        kern = _Sm90W4A8Kernel(cfg, n, k, fmt, dtype)
        return cute.compile(kern.build(), *kern.fake_args(), options="--enable-tvm-ffi --gpu-arch sm_90a")

    return compile_cached("sm90_w4a8_gemm", __name__, (cfg, n, k, fmt, dtype), build)


def compile_only(cfg: Sm90W4A8Config, n: int, k: int, fmt: str, dtype: str) -> None:
    """Compile without a GPU (set CUTE_DSL_ARCH=sm_90a), for CI."""
    _compile(cfg, n, k, fmt, dtype)


def compile_kernel(cfg: Sm90W4A8Config, n: int, k: int, fmt: str, dtype: str) -> Callable:
    """``run(x, packed, bias)`` for any M: quantizes ``x`` (:mod:`.fp8_act_quant`), then runs the
    compiled GEMM for (cfg, n, k, fmt, dtype)."""
    fn = _compile(cfg, n, k, fmt, dtype)
    quant = fp8_act_quant.compile_quantizer(k, dtype)
    tdt = getattr(torch, dtype)
    zeros: dict[torch.device, torch.Tensor] = {}
    use_pdl = cfg.pdl

    def run(x: torch.Tensor, packed: PackedSm90Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = checked_x(x, packed, n, k, fmt, tdt)
        m = x.shape[0]
        out = torch.empty(m, n, dtype=tdt, device=x.device)
        if m == 0:
            return out
        b = bias
        if b is None:
            b = zeros.get(x.device)
            if b is None:
                b = zeros[x.device] = torch.zeros(n, dtype=tdt, device=x.device)
        xq, sx = quant(x)
        fn(xq, packed.data.view(-1), packed.alpha, sx, b, out, pdl.launch_flag(use_pdl))
        return out

    return run


__all__ = ["Sm90W4A8Config", "validate", "compile_kernel", "compile_only", "reference", "reference_weight",
           "weight_exact", "EXP_SHIFT", "PAD"]


# --------------------------------------------------------------------------------------------
# The MoE layer (grouped GEMMs)
# --------------------------------------------------------------------------------------------
def _compile_grouped(cfg: Sm90W4A8Config, n: int, k: int, fmt: str, dtype: str, part: str, bias: bool) -> Callable:
    """The grouped W4A8 GEMM ``part`` of a layer ``2I = n``, ``H = k``: ``"down"`` or an
    activation (the up GEMM with it), with or without the per-expert ``bias``."""
    from ..kernel_cache import compile_cached
    from ._moe_act import ACTIVATIONS
    from .sm90_moe_gemm import _gemms, _Grouped

    if part != "down" and part not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {part!r}")
    grouped = _Grouped("down", bias=bias) if part == "down" else _Grouped("up", part, bias)
    gn, gk = _gemms(n, k)[grouped.kind]
    _check(cfg, gn, gk, fmt, dtype)
    if grouped.kind == "up" and (gn // 2) % 8:
        raise ValueError(f"the up GEMM's intermediate size {gn // 2} must be a multiple of 8")
    cfg = pdl.binary_config(cfg)

    def build():
        kern = _Sm90W4A8Kernel(cfg, gn, gk, fmt, dtype, grouped=grouped)
        return cute.compile(kern.build(), *kern.fake_args_grouped(), options="--enable-tvm-ffi --gpu-arch sm_90a")

    return compile_cached("sm90_w4a8_moe", __name__, (cfg, n, k, fmt, dtype, part, bias), build)


def compile_moe_only(cfg: Sm90W4A8Config, n: int, k: int, fmt: str, dtype: str, activation: str = "silu") -> None:
    """Compile a layer's two grouped GEMMs without a GPU (``CUTE_DSL_ARCH=sm_90a``)."""
    _compile_grouped(cfg, n, k, fmt, dtype, activation, False)
    _compile_grouped(cfg, n, k, fmt, dtype, "down", False)


def compile_moe(cfg: Sm90W4A8Config, n: int, k: int, fmt: str, dtype: str) -> Callable:
    """``run(x, packed13, packed2, topk_weights, topk_ids, activation, expert_map=None, w13_bias=None,
    w2_bias=None) -> [T, H]`` with FP8 activations, for any T. The W4A16 grouped path
    (:mod:`.sm90_moe_gemm`) with a quantizer in front of each GEMM: x per token before the
    gather (a token's rows share its scale), h per sorted row after the up GEMM; ``tile_m`` is the
    routing's token block. The experts are those packed for the W4A16 grouped GEMM
    (:func:`.sm90_moe_gemm.pack_experts`)."""
    from ..routing import moe_routing

    tdt = getattr(torch, dtype)
    quant_x = fp8_act_quant.compile_quantizer(k, dtype)
    quant_h = fp8_act_quant.compile_quantizer(n // 2, dtype)
    fns: dict[tuple[str, bool], Callable] = {}
    no_bias: dict[torch.device, torch.Tensor] = {}
    use_pdl = pdl.launch_flag(cfg.pdl)

    def fn(part: str, bias: torch.Tensor | None, dev: torch.device) -> tuple[Callable, torch.Tensor]:
        f = fns.get((part, bias is not None))
        if f is None:
            f = fns[part, bias is not None] = _compile_grouped(cfg, n, k, fmt, dtype, part, bias is not None)
        if bias is None:
            b = no_bias.get(dev)
            if b is None:
                b = no_bias[dev] = torch.zeros(1, dtype=torch.float32, device=dev)
            return f, b
        return f, bias.reshape(-1).float().contiguous()

    def run(x: torch.Tensor, p13: Any, p2: Any, topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
            expert_map: torch.Tensor | None = None, w13_bias: torch.Tensor | None = None,
            w2_bias: torch.Tensor | None = None) -> torch.Tensor:
        if (p13.n, p13.k, p2.n, p2.k) != (n, k, k, n // 2) or p13.fmt != fmt or p2.fmt != fmt:
            raise ValueError(f"kernels compiled for 2I={n}, H={k}, {fmt}; got w13 [{p13.n}, {p13.k}] and "
                             f"w2 [{p2.n}, {p2.k}] in {p13.fmt}")
        if x.dtype != tdt or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"expected x [T, {k}] {tdt}, got {tuple(x.shape)} {x.dtype}")
        t, top_k = topk_ids.shape
        if t == 0:
            return torch.empty(0, k, dtype=tdt, device=x.device)
        if not x.is_contiguous():
            x = x.contiguous()
        r = moe_routing(topk_ids, p13.experts, cfg.tile_m, expert_map=expert_map)
        tok = r.sorted_rows.clamp(min=0) // top_k
        xq, sx = quant_x(x)
        xs, sxs = xq.index_select(0, tok), sx.index_select(0, tok)
        h = torch.empty(r.sorted_rows.numel(), n // 2, dtype=tdt, device=x.device)
        tw = topk_weights.reshape(-1).float().contiguous()
        (up, b13), (down, b2) = fn(activation, w13_bias, x.device), fn("down", w2_bias, x.device)
        up(xs, p13.data, p13.alpha, sxs, b13, h, r.block_expert, r.sorted_rows, tw, use_pdl)
        hq, sh = quant_h(h)
        y = (torch.zeros if expert_map is not None else torch.empty)(t * top_k, k, dtype=tdt, device=x.device)
        down(hq, p2.data, p2.alpha, sh, b2, y, r.block_expert, r.sorted_rows, tw, use_pdl)
        return y.view(t, top_k, k).sum(1)

    return run

