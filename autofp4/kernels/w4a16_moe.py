"""Grouped W4A16 FP4 mixture-of-experts for Hopper: both expert GEMMs of a MoE layer with
warp-level MMA, on the routing metadata of :mod:`autofp4.routing`, with no host sync.

``y[t] = sum_j w[t, j] * W2[e] act(W13[e] x[t])``, ``e = topk_ids[t, j]``, for NVFP4 or MXFP4
experts ``w13 [E, 2I, H]`` (gate rows ``0..I-1``, up rows ``I..2I-1``) and ``w2 [E, H, I]``:

* The pairs (token, slot) are sorted by expert and padded per expert to blocks of ``m_block``
  rows (:func:`autofp4.routing.moe_routing`); block ``b`` belongs to expert
  ``block_expert[b]`` (``-1``: unused, its CTAs exit at once). Every size depends on T, top-k
  and E only, so a layer is CUDA-graph capturable; only the experts the batch hits are read.
* Both GEMMs work like the decode kernel (:mod:`.w4a16_decode`, whose packed weight layout,
  decode and ``mma.sync.m16n8k16`` inner loop they use): ``out^T = W x^T``, each warp owns 16-row
  tiles of one expert's weight and a K range; per K group of 512 a lane issues one 16-byte load
  per chunk of 64 that holds its A fragments for 4 MMAs (a K stored zero-padded to a multiple of
  512 is read only up to its last chunk of 64); the tokens of a block are the MMA's N
  (``m_block / 8`` n8 tiles). x rows are gathered by index: a lane loads the row of its column's
  pair (no load for padding).
* **Up** (``up_kernel``): grid ``(weight tile pairs / (warps / k_warps), blocks)``. The experts'
  w13 are packed with the gate and up rows interleaved in 16-row tiles (gate rows ``16 q ..`` then
  up rows ``16 q ..``), so one warp holds the gate and the up tile of the same 16 rows and applies
  the activation to its accumulators (plus the expert's gate and up biases, if any):
  ``h = act(gate, up)`` (:mod:`._moe_act`: SiLU, tanh-GELU or gpt-oss's clamped SwiGLU) in fp32,
  stored in the activation dtype at the pair's sorted position, ``h [rows, I]``. With
  ``k_warps > 1`` the ``k_warps`` warps of a tile pair split its K (= H) range: each leaves its
  partial sums in shared memory and, after one CTA barrier, the first sums them and applies the
  activation (more loads in flight per expert where a batch hits few experts).
* **Down** (``down_kernel``): grid ``(weight tiles / warps, blocks, k_split)``: ``h`` of the block
  (contiguous rows) times W2 of its expert, times the expert's alpha, plus the expert's bias (if
  any; the CTAs of K slice 0 add it), times the pair's router weight, added into an fp32
  ``[T, H]`` with ``red.global.add.f32`` (the top-k sum; K split across CTAs adds into the same
  sums), which the up kernel's grid zeroes first. The caller converts to the activation dtype.
* Dependent launch (``pdl``): the up kernel lets the down kernel launch right after its own
  ``griddepcontrol.wait``, so the down kernel's CTAs arrive while the up GEMM streams its
  weights; before its wait, a down warp reads its block's expert (the routing is complete by
  then: every up CTA has passed its wait), loads its first K group of weights and scales into
  registers and pulls the rest of its K range into L2. After the wait it reads the expert again
  (and reloads that group if it changed); ``h`` and ``y`` are touched only after the wait.
* Biases (``w13_bias [E, 2I]``, ``w2_bias [E, H]``) are compile-time options: a kernel built
  without them reads none; with them it reads fp32, bf16 or fp16 values and adds them in fp32.
* Each expert's packed weights are at a fixed stride; its epilogue factor (``alpha``: NVFP4
  global scale and the decode's power of two) and its scale-code addend (MXFP4: from the
  expert's largest exponent) are per expert, ``[E, 2]`` (bf16, fp16).
"""
import os
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from .. import pdl
from ..problem import DTYPES, FORMATS
from . import _moe_act
from ._moe_act import ACTIVATIONS
from .w4a16_decode import CHUNK_K, CHUNKS, GROUP_K, TILE_N, _MX_MUL, _NV_MUL, _groups, _tiles, pack_weight

#: helper modules whose source is part of this kernel's (kernel cache key, DB provenance)
KERNEL_SOURCES = ("autofp4.kernels._ptx", "autofp4.kernels._fp4_bits", "autofp4.kernels.w4a16_decode",
                  "autofp4.kernels._moe_act")
#: the element types a bias is read in (other float dtypes are converted to float32 first)
BIAS_DTYPES = ("float32", "bfloat16", "float16")
M_BLOCKS = (8, 16)
WARPS_CHOICES = (1, 2, 4, 8)
MAX_K_SPLIT = 16


@dataclass(frozen=True)
class MoEDecodeConfig:
    """One point of the grouped MoE kernels' space.

    m_block: pair rows per block (the routing's token tile): 8 or 16 (one or two n8 MMA tiles).
    warps:   warps per CTA (each warp: one 16-row tile pair in the up GEMM, one tile in down).
    k_split: CTAs that share the down GEMM's K (= I) range; their sums meet in the fp32 atomics.
    k_warps: warps of a CTA that share one up-GEMM tile pair's K (= H) range; their sums meet in
             shared memory (``warps / k_warps`` tile pairs per CTA).
    pdl:     launch with programmatic dependent launch (a launch flag, one binary).
    per_pair: one block per (token, slot) pair, unsorted (:func:`autofp4.routing.per_pair_routing`:
             no sort or scan on the host stream; an expert chosen by several pairs is read once
             per pair), instead of the pairs sorted by expert in blocks of ``m_block``.
    """

    kernel: ClassVar[str] = "moe_decode"  # the tag of stored configs (not a field)
    m_block: int = 8
    warps: int = 4
    k_split: int = 1
    pdl: bool = False
    per_pair: bool = False
    k_warps: int = 1


def validate(cfg: MoEDecodeConfig, n: int, k: int, fmt: str, dtype: str) -> str | None:
    """``None`` if ``cfg`` can run the MoE problem ``n = 2 I`` (w13 rows), ``k = H``, else why not."""
    if not isinstance(cfg, MoEDecodeConfig):
        return f"expected a MoEDecodeConfig, got {type(cfg).__name__}"
    if fmt not in FORMATS:
        return f"fmt must be one of {FORMATS}, got {fmt!r}"
    if dtype not in DTYPES:
        return f"dtype must be one of {DTYPES}, got {dtype!r}"
    if not (isinstance(n, int) and n > 0 and n % 32 == 0):
        return f"2 * intermediate must be a positive multiple of 32 (gate and up in 16-row tiles), got {n}"
    if not (isinstance(k, int) and k > 0 and k % 32 == 0):
        return f"the hidden size must be a positive multiple of 32, got {k}"
    if cfg.m_block not in M_BLOCKS:
        return f"m_block must be one of {M_BLOCKS}, got {cfg.m_block!r}"
    if cfg.warps not in WARPS_CHOICES:
        return f"warps must be one of {WARPS_CHOICES}, got {cfg.warps!r}"
    if not (isinstance(cfg.k_split, int) and 1 <= cfg.k_split <= MAX_K_SPLIT):
        return f"k_split must be an int in 1..{MAX_K_SPLIT}, got {cfg.k_split!r}"
    if cfg.k_split > _groups(n // 2):
        return (f"k_split={cfg.k_split} exceeds the {_groups(n // 2)} K groups of {GROUP_K} of the down GEMM "
                f"(intermediate {n // 2}); some CTAs would have no work")
    if not (isinstance(cfg.k_warps, int) and cfg.k_warps in WARPS_CHOICES and cfg.warps % cfg.k_warps == 0):
        return f"k_warps must be one of {WARPS_CHOICES} and divide warps={cfg.warps}, got {cfg.k_warps!r}"
    per_warp = -(-_groups(k) // cfg.k_warps)
    if cfg.k_warps > _groups(k) or -(-_groups(k) // per_warp) != cfg.k_warps:
        return (f"k_warps={cfg.k_warps} leaves a warp without work: the up GEMM's {_groups(k)} K groups "
                f"of {GROUP_K} (hidden {k}) in shares of {per_warp}")
    if not isinstance(cfg.pdl, bool):
        return f"pdl must be a bool, got {cfg.pdl!r}"
    if not isinstance(cfg.per_pair, bool):
        return f"per_pair must be a bool, got {cfg.per_pair!r}"
    if cfg.per_pair and cfg.m_block != 8:
        return "per_pair puts one pair in a block: m_block=8 (one n8 MMA tile) is the least padding"
    return None


# ----------------------------------------------------------------------------- layout
@dataclass(frozen=True, eq=False)
class MoEPacked:
    """Stacked experts in the decode kernel's layout, one expert after the other."""

    fmt: str
    experts: int
    n: int
    k: int
    data: torch.Tensor  # uint8 [E * data_stride]
    scales: torch.Tensor  # uint8 [E * scale_stride]
    alpha: torch.Tensor  # fp32 [E, 2]: epilogue factor per expert for bf16, fp16 activations
    scale_add: torch.Tensor  # int32 [E, 2]: scale-code addend per expert (bf16, fp16)
    unsupported: tuple[str | None, str | None]  # (bf16, fp16): why these experts cannot run

    @property
    def data_stride(self) -> int:
        return self.data.numel() // self.experts

    @property
    def scale_stride(self) -> int:
        return self.scales.numel() // self.experts


def gate_up_order(n: int) -> torch.Tensor:
    """Row order of an expert's w13 ``[2I, H]`` that puts gate rows ``16 q .. 16 q + 15`` and up
    rows ``I + 16 q ..`` in consecutive 16-row tiles."""
    i = n // 2
    q = torch.arange(i // TILE_N)
    gate = q[:, None] * TILE_N + torch.arange(TILE_N)
    return torch.stack((gate, gate + i), dim=1).reshape(-1)


def pack_experts(w: Any, gate_up: bool) -> MoEPacked:
    """Pack stacked experts (an ``FP4Weight [E, N, K]``) expert by expert in the decode kernel's
    layout (:func:`.w4a16_decode.pack_weight`); ``gate_up``: w13, rows in :func:`gate_up_order`."""
    if not getattr(w, "experts", 0):
        raise ValueError(f"pack_experts takes stacked experts [E, N, K], got shape {tuple(w.shape)}")
    order = gate_up_order(w.n).to(w.data.device) if gate_up else None
    parts = []
    for e in range(w.experts):
        we = w.expert(e)
        if order is not None:
            we = type(we)(we.fmt, we.data[order], we.scale[order], we.global_scale, check_values=False)
        parts.append(pack_weight(we))
    dev = w.data.device
    unsupported = tuple(next((p.unsupported[i] for p in parts if p.unsupported[i]), None) for i in range(2))
    return MoEPacked(
        w.fmt, w.experts, w.n, w.k,
        torch.cat([p.data for p in parts]), torch.cat([p.scales for p in parts]),
        torch.stack([p.alpha for p in parts]).to(dev),
        torch.tensor([list(p.scale_add) for p in parts], dtype=torch.int32, device=dev),
        unsupported,  # type: ignore[arg-type]
    )


# ----------------------------------------------------------------------------- kernels
def _dsl():
    import cutlass
    import cutlass.cute as cute

    return cutlass, cute


def _build(cfg: MoEDecodeConfig, n: int, k: int, fmt: str, dtype: str, activation: str,
           bias13: str | None, bias2: str | None):
    """The @cute.jit launcher of the up and the down kernel for one MoE problem (``bias13``,
    ``bias2``: the dtype of w13's and w2's biases, None for none)."""
    cutlass, cute = _dsl()
    from cutlass import Float32, Int32, Int64, Uint32

    from ._fp4_bits import decode_terms
    from ._ptx import (asm_void, decode_pair, griddep_launch_dependents, griddep_wait, ld_global_v4,
                       make_load_group, mma_m16n8k16, mul_x2, prefetch_l2)

    inter, hidden = n // 2, k
    WARPS, NT, BM, KS = cfg.warps, cfg.m_block // 8, cfg.m_block, cfg.k_split
    KW = cfg.k_warps
    PW = WARPS // KW  # up-GEMM tile pairs per CTA
    ACC13 = 2 * NT * 4  # a lane's up-GEMM accumulators (gate and up tiles x n8 tiles x 4)
    SLOTS = 32 if fmt == "nvfp4" else 16
    TERMS = decode_terms(dtype)
    BF16 = dtype == "bfloat16"
    DI = 0 if BF16 else 1
    SCALE_MUL = (_NV_MUL if fmt == "nvfp4" else _MX_MUL)[dtype]
    NBUF = 4 + CHUNKS * 4
    # the two GEMMs: (weight rows, K, tiles, K groups, per-expert packed bytes)
    T13, G13 = _tiles(n), _groups(hidden)
    T2, G2 = _tiles(hidden), _groups(inter)
    D13, S13 = T13 * G13 * CHUNKS * 512, T13 * G13 * SLOTS * 16
    D2, S2 = T2 * G2 * CHUNKS * 512, T2 * G2 * SLOTS * 16
    GPS2 = -(-G2 // KS)
    GPW13 = -(-G13 // KW)  # up-GEMM K groups per warp of a tile pair

    def ld16(addr, pred, stream: bool):
        return ld_global_v4(addr, pred, stream)

    def mma(a, b0, b1, c):
        return mma_m16n8k16(a, b0, b1, c, BF16)

    def red_add(addr, v):
        asm_void("red.global.add.f32 [$0], $1;", "l,f", Int64(addr), Float32(v))

    def st_zero16(addr):
        asm_void("st.global.v4.u32 [$0], {$1, $1, $1, $1};", "l,r", Int64(addr), Uint32(0))

    def bounded_load_group(kdim: int):
        """The loads of one lane's K group (:func:`._ptx.make_load_group`), without the chunks
        past ``kdim``: a K that is not a multiple of 512 is stored zero-padded to one, and the last
        group's padding chunks (Qwen3-30B-A3B's I = 768: a quarter of w2's bytes) stay unread
        (zeros, as the padding holds)."""
        full = make_load_group(SLOTS, CHUNKS)
        live = -(-kdim // CHUNK_K)  # the chunks that hold weights
        if live % CHUNKS == 0:
            return full

        @cute.jit
        def load_group(buf: cute.Tensor, off: cutlass.Constexpr, w_base, s_base, gi, pred):
            v = ld16(s_base + Int64(gi) * (SLOTS * 16), pred, True)
            for i in cutlass.range_constexpr(4):
                buf[off + i] = v[i]
            for c in cutlass.range_constexpr(CHUNKS):
                v = ld16(w_base + (Int64(gi) * CHUNKS + c) * 512, pred & Int32(gi * CHUNKS + c < live), True)
                for i in cutlass.range_constexpr(4):
                    buf[off + 4 + 4 * c + i] = v[i]

        return load_group

    load13, load2 = bounded_load_group(hidden), bounded_load_group(inter)

    @cute.jit
    def compute_group(buf: cute.Tensor, acc: cute.Tensor, xv: cute.Tensor, xrow: cute.Tensor, x_addr,
                      kdim: cutlass.Constexpr, tpw: cutlass.Constexpr, gi, t, sadd):
        """One K group of ``tpw`` tiles against the block's ``NT`` n8 tiles of gathered rows
        (``xrow[nt]``: the row of x this lane's column reads, -1 for a padding row)."""
        for c in cutlass.range_constexpr(CHUNKS):
            kk = gi * GROUP_K + c * CHUNK_K + t * 16
            for nt in cutlass.range_constexpr(NT):
                ok = Int32((xrow[nt] >= 0) & (kk < kdim))
                xa = x_addr + (Int64(cutlass.max(xrow[nt], 0)) * kdim + kk) * 2
                v0 = ld16(xa, ok, False)
                v1 = ld16(xa + Int64(16), ok, False)
                for i in cutlass.range_constexpr(4):
                    xv[nt * 8 + i] = v0[i]
                    xv[nt * 8 + 4 + i] = v1[i]
            for tw in cutlass.range_constexpr(tpw):
                b = tw * NBUF
                wo = b + 4 + 4 * c
                bits = buf[b + c // 2] >> Uint32(16 * (c % 2))
                s_g = (bits & Uint32(0xFF)) * Uint32(SCALE_MUL) + sadd
                s_g8 = ((bits >> Uint32(8)) & Uint32(0xFF)) * Uint32(SCALE_MUL) + sadd
                for j in cutlass.range_constexpr(4):
                    wd = Uint32(buf[wo + j])
                    a = [mul_x2(decode_pair(wd, TERMS[0]), s_g, BF16), mul_x2(decode_pair(wd, TERMS[1]), s_g8, BF16),
                         mul_x2(decode_pair(wd, TERMS[2]), s_g, BF16), mul_x2(decode_pair(wd, TERMS[3]), s_g8, BF16)]
                    for nt in cutlass.range_constexpr(NT):
                        q = (tw * NT + nt) * 4
                        res = mma(a, xv[nt * 8 + 2 * j], xv[nt * 8 + 2 * j + 1],
                                  [acc[q], acc[q + 1], acc[q + 2], acc[q + 3]])
                        for i in cutlass.range_constexpr(4):
                            acc[q + i] = res[i]

    def lane_bases(wq, sc, e, tile, lane, g, t, dstride, sstride, groups):
        slot = lane
        if cutlass.const_expr(SLOTS == 16):
            slot = g * 2 + t // 2
        w_base = wq.iterator.toint() + Int64(e) * dstride + Int64((tile * groups * CHUNKS * 32 + lane) * 16)
        s_base = sc.iterator.toint() + Int64(e) * sstride + Int64((tile * groups * SLOTS + slot) * 16)
        return w_base, s_base

    @cute.kernel
    def up_kernel(x: cute.Tensor, wq: cute.Tensor, sc: cute.Tensor, alpha: cute.Tensor, sadd: cute.Tensor,
                  b13: cute.Tensor, rows: cute.Tensor, bexp: cute.Tensor, h: cute.Tensor, y: cute.Tensor,
                  top_k: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, blk, _ = cute.arch.block_idx()
        griddep_wait()
        # the down kernel may launch now: its CTAs pull their weights while this one streams its own
        griddep_launch_dependents()
        # the fp32 top-k sums start at zero: the grid clears y ([T, H], 16 bytes a thread a step)
        gx, gy, _ = cute.arch.grid_dim()
        step = gx * gy * (32 * WARPS)
        for i in cutlass.range((blk * gx + bx) * (32 * WARPS) + tidx, y.shape[0] * (hidden // 4), step, unroll=1):
            st_zero16(y.iterator.toint() + Int64(i) * 16)
        e = bexp[blk]
        warp, lane = tidx // 32, tidx % 32
        g, t = lane // 4, lane % 4
        kw = warp % KW  # this warp's share of the K range
        pair = bx * PW + warp // KW  # its (gate, up) tile pair: packed tiles 2 pair, 2 pair + 1
        acc = cute.make_rmem_tensor((ACC13,), Float32)
        for i in cutlass.range_constexpr(ACC13):
            acc[i] = Float32(0.0)
        if (e >= 0) & (pair * 2 < T13):
            xv = cute.make_rmem_tensor((NT * 8,), Uint32)
            buf = cute.make_rmem_tensor((2 * NBUF,), Uint32)
            xrow = cute.make_rmem_tensor((NT,), Int32)
            for nt in cutlass.range_constexpr(NT):
                p = rows[blk * BM + nt * 8 + g]
                xrow[nt] = Int32(-1)
                if p >= 0:
                    xrow[nt] = p // top_k
            su = Uint32(sadd[e, DI])
            wb0, sb0 = lane_bases(wq, sc, e, pair * 2, lane, g, t, D13, S13, G13)
            wb1, sb1 = lane_bases(wq, sc, e, pair * 2 + 1, lane, g, t, D13, S13, G13)
            for gi in cutlass.range(kw * GPW13, cutlass.min(kw * GPW13 + GPW13, G13), 1):
                load13(buf, 0, wb0, sb0, gi, Int32(1))
                load13(buf, NBUF, wb1, sb1, gi, Int32(1))
                compute_group(buf, acc, xv, xrow, x.iterator.toint(), hidden, 2, gi, t, su)
        if cutlass.const_expr(KW > 1):
            # [warp][accumulator][lane]: the K shares of each tile pair meet in its first warp
            smem = cutlass.memory.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout(WARPS * ACC13 * 32), byte_alignment=16)
            if e >= 0:
                if kw > 0:
                    for i in cutlass.range_constexpr(ACC13):
                        red[(warp * ACC13 + i) * 32 + lane] = acc[i]
                cute.arch.barrier()
                if kw == 0:
                    for j in cutlass.range_constexpr(1, KW):
                        for i in cutlass.range_constexpr(ACC13):
                            acc[i] = acc[i] + red[((warp + j) * ACC13 + i) * 32 + lane]
        if (e >= 0) & (kw == 0) & (pair * 2 < T13):
            al = alpha[e, DI]
            for nt in cutlass.range_constexpr(NT):
                for i in cutlass.range_constexpr(4):
                    mm = blk * BM + nt * 8 + 2 * t + (i % 2)
                    col = pair * TILE_N + g + 8 * (i // 2)
                    if (rows[mm] >= 0) & (col < inter):
                        gate = acc[nt * 4 + i] * al
                        up = acc[(NT + nt) * 4 + i] * al
                        if cutlass.const_expr(bias13 is not None):
                            gate = gate + b13[e, col].to(Float32)
                            up = up + b13[e, inter + col].to(Float32)
                        h[mm, col] = _moe_act.activation(activation, gate, up).to(h.element_type)

    @cute.kernel
    def down_kernel(h: cute.Tensor, wq: cute.Tensor, sc: cute.Tensor, alpha: cute.Tensor, sadd: cute.Tensor,
                    b2: cute.Tensor, rows: cute.Tensor, bexp: cute.Tensor, tw: cute.Tensor, y: cute.Tensor,
                    top_k: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, blk, bz = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        g, t = lane // 4, lane % 4
        tile = bx * WARPS + warp
        g0 = bz * GPS2
        g1 = cutlass.min(g0 + GPS2, G2)
        # Before the wait: this grid launched once every CTA of the up kernel had passed its own
        # wait, so the routing is written; this warp loads its first K group of weights into
        # registers and pulls the rest of its K range into L2. The expert is read again after
        # the wait (and the group reloaded if it differs); h and y only after it.
        e_pre = bexp[blk]
        ok_pre = (e_pre >= 0) & (e_pre < alpha.shape[0]) & (tile < T2) & (g0 < g1)
        buf = cute.make_rmem_tensor((NBUF,), Uint32)
        wb, sb = lane_bases(wq, sc, cutlass.max(e_pre, 0), tile, lane, g, t, D2, S2, G2)
        load2(buf, 0, wb, sb, g0, Int32(ok_pre))
        if ok_pre & (lane == 0) & (g1 - g0 > 1):
            w0 = wq.iterator.toint() + Int64(e_pre) * D2 + Int64((tile * G2 + g0 + 1) * (CHUNKS * 512))
            s0 = sc.iterator.toint() + Int64(e_pre) * S2 + Int64((tile * G2 + g0 + 1) * (SLOTS * 16))
            prefetch_l2(w0, (g1 - g0 - 1) * (CHUNKS * 512))
            prefetch_l2(s0, (g1 - g0 - 1) * (SLOTS * 16))
        griddep_wait()
        e = bexp[blk]
        if (e >= 0) & (tile < T2) & (g0 < g1):
            acc = cute.make_rmem_tensor((NT * 4,), Float32)
            for i in cutlass.range_constexpr(NT * 4):
                acc[i] = Float32(0.0)
            xv = cute.make_rmem_tensor((NT * 8,), Uint32)
            xrow = cute.make_rmem_tensor((NT,), Int32)
            for nt in cutlass.range_constexpr(NT):
                r = blk * BM + nt * 8 + g
                xrow[nt] = Int32(-1)
                if rows[r] >= 0:
                    xrow[nt] = r
            su = Uint32(sadd[e, DI])
            wb, sb = lane_bases(wq, sc, e, tile, lane, g, t, D2, S2, G2)
            if e != e_pre:
                load2(buf, 0, wb, sb, g0, Int32(1))
            compute_group(buf, acc, xv, xrow, h.iterator.toint(), inter, 1, g0, t, su)
            for gi in cutlass.range(g0 + 1, g1, 1):
                load2(buf, 0, wb, sb, gi, Int32(1))
                compute_group(buf, acc, xv, xrow, h.iterator.toint(), inter, 1, gi, t, su)
            griddep_launch_dependents()
            al = alpha[e, DI]
            for nt in cutlass.range_constexpr(NT):
                for i in cutlass.range_constexpr(4):
                    mm = blk * BM + nt * 8 + 2 * t + (i % 2)
                    col = tile * TILE_N + g + 8 * (i // 2)
                    p = rows[mm]
                    if (p >= 0) & (col < hidden):
                        v = acc[nt * 4 + i] * al
                        if cutlass.const_expr(bias2 is not None):
                            if bz == 0:
                                v = v + b2[e, col].to(Float32)
                        red_add(y.iterator.toint() + (Int64(p // top_k) * hidden + col) * 4, v * tw[p])

    @cute.jit
    def launch(x: cute.Tensor, w13: cute.Tensor, s13: cute.Tensor, a13: cute.Tensor, sa13: cute.Tensor,
               b13: cute.Tensor, w2: cute.Tensor, s2: cute.Tensor, a2: cute.Tensor, sa2: cute.Tensor,
               b2: cute.Tensor, rows: cute.Tensor, bexp: cute.Tensor, tw: cute.Tensor, h: cute.Tensor,
               y: cute.Tensor, top_k: Int32, use_pdl: Int32, stream):
        blocks = bexp.shape[0]
        up_kernel(x, w13, s13, a13, sa13, b13, rows, bexp, h, y, top_k).launch(
            grid=[-(-T13 // (2 * PW)), blocks, 1], block=[32 * WARPS, 1, 1], stream=stream, use_pdl=use_pdl)
        down_kernel(h, w2, s2, a2, sa2, b2, rows, bexp, tw, y, top_k).launch(
            grid=[-(-T2 // WARPS), blocks, KS], block=[32 * WARPS, 1, 1], stream=stream, use_pdl=use_pdl)

    return launch


def _compile_now(cfg: MoEDecodeConfig, n: int, k: int, fmt: str, dtype: str, activation: str,
                 bias13: str | None, bias2: str | None, extra: str = ""):
    cutlass, cute = _dsl()
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    dt = cutlass.BFloat16 if dtype == "bfloat16" else cutlass.Float16
    inter, hidden = n // 2, k
    slots = 32 if fmt == "nvfp4" else 16
    e = cute.sym_int()
    t = cute.sym_int()
    rows = cute.sym_int()
    blocks = cute.sym_int()
    pairs = cute.sym_int()
    t13, g13, t2, g2 = _tiles(n), _groups(hidden), _tiles(hidden), _groups(inter)
    fx = make_fake_compact_tensor(dt, (t, hidden), stride_order=(1, 0), assumed_align=16)
    fw13 = make_fake_compact_tensor(cutlass.Uint8, (e * (t13 * g13 * CHUNKS * 512),), assumed_align=16)
    fs13 = make_fake_compact_tensor(cutlass.Uint8, (e * (t13 * g13 * slots * 16),), assumed_align=16)
    fw2 = make_fake_compact_tensor(cutlass.Uint8, (e * (t2 * g2 * CHUNKS * 512),), assumed_align=16)
    fs2 = make_fake_compact_tensor(cutlass.Uint8, (e * (t2 * g2 * slots * 16),), assumed_align=16)
    fa = [make_fake_compact_tensor(cutlass.Float32, (e, 2), stride_order=(1, 0), assumed_align=4) for _ in range(2)]
    fsa = [make_fake_compact_tensor(cutlass.Int32, (e, 2), stride_order=(1, 0), assumed_align=4) for _ in range(2)]
    # a bias [E, cols] in its dtype; without one, a 1-element fp32 placeholder the kernel never reads
    bias_types = {"float32": (cutlass.Float32, 4), "bfloat16": (cutlass.BFloat16, 2), "float16": (cutlass.Float16, 2)}
    fb = [make_fake_compact_tensor(cutlass.Float32, (1,), assumed_align=4) if b is None else
          make_fake_compact_tensor(bias_types[b][0], (e, cols), stride_order=(1, 0), assumed_align=bias_types[b][1])
          for b, cols in ((bias13, n), (bias2, hidden))]
    frows = make_fake_compact_tensor(cutlass.Int32, (rows,), assumed_align=4)
    fbexp = make_fake_compact_tensor(cutlass.Int32, (blocks,), assumed_align=4)
    ftw = make_fake_compact_tensor(cutlass.Float32, (pairs,), assumed_align=4)
    fh = make_fake_compact_tensor(dt, (rows, inter), stride_order=(1, 0), assumed_align=16)
    fy = make_fake_compact_tensor(cutlass.Float32, (t, hidden), stride_order=(1, 0), assumed_align=16)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    fn = _build(cfg, n, k, fmt, dtype, activation, bias13, bias2)
    return cute.compile(fn, fx, fw13, fs13, fa[0], fsa[0], fb[0], fw2, fs2, fa[1], fsa[1], fb[1], frows, fbexp,
                        ftw, fh, fy, 1, 0, stream, options=f"--enable-tvm-ffi --gpu-arch sm_90a {extra}".strip())


def _check(cfg: MoEDecodeConfig, n: int, k: int, fmt: str, dtype: str, activation: str,
           bias13: str | None, bias2: str | None) -> None:
    reason = validate(cfg, n, k, fmt, dtype)
    if reason is None and activation not in ACTIVATIONS:
        reason = f"activation must be one of {ACTIVATIONS}, got {activation!r}"
    if reason is None and not {bias13, bias2} <= {None, *BIAS_DTYPES}:
        reason = f"bias dtypes must be None or one of {BIAS_DTYPES}, got {bias13!r} and {bias2!r}"
    if reason is not None:
        raise ValueError(f"invalid MoEDecodeConfig {cfg} for 2I={n}, H={k}, {fmt}, {dtype}: {reason}")


def _compile(cfg: MoEDecodeConfig, n: int, k: int, fmt: str, dtype: str, activation: str,
             bias13: str | None = None, bias2: str | None = None) -> Callable:
    """The compiled launcher; ``bias13``, ``bias2``: the biases' dtypes (None: the kernel has none).
    ``$AUTOFP4_CUTE_DSL_OPTIONS`` (extra CuTeDSL options for inspection, e.g. ``--keep-ptx
    --dump-dir=/tmp/d``) bypasses the kernel cache."""
    from ..kernel_cache import compile_cached

    _check(cfg, n, k, fmt, dtype, activation, bias13, bias2)
    cfg = pdl.binary_config(cfg)
    extra = os.environ.get("AUTOFP4_CUTE_DSL_OPTIONS", "").strip()
    if extra:
        return _compile_now(cfg, n, k, fmt, dtype, activation, bias13, bias2, extra)
    return compile_cached("w4a16_moe", __name__, (cfg, n, k, fmt, dtype, activation, bias13, bias2),
                          lambda: _compile_now(cfg, n, k, fmt, dtype, activation, bias13, bias2))


def compile_only(cfg: MoEDecodeConfig, n: int, k: int, fmt: str, dtype: str) -> None:
    """Compile every activation, without biases (no GPU needed with ``CUTE_DSL_ARCH=sm_90a``)."""
    for activation in ACTIVATIONS:
        _compile(cfg, n, k, fmt, dtype, activation)


def compile_kernel(cfg: MoEDecodeConfig, n: int, k: int, fmt: str, dtype: str) -> Callable:
    """``run(x, packed13, packed2, topk_weights, topk_ids, activation, expert_map=None, w13_bias=None,
    w2_bias=None) -> [T, H]``, for any T (``expert_map`` and the biases: see :func:`autofp4.moe`;
    a bias of a dtype other than fp32, bf16 and fp16 is converted to fp32)."""
    from ..routing import moe_routing, per_pair_routing

    tdt = getattr(torch, dtype)
    di = DTYPES.index(dtype)
    fns: dict[tuple, Callable] = {}
    use_pdl = cfg.pdl
    placeholders: dict[torch.device, torch.Tensor] = {}  # the bias argument of a kernel without one

    def bias_arg(b: torch.Tensor | None, shape: tuple[int, int], x: torch.Tensor, what: str):
        if b is None:
            ph = placeholders.get(x.device)
            if ph is None:
                ph = placeholders[x.device] = torch.zeros(1, dtype=torch.float32, device=x.device)
            return ph, None
        if tuple(b.shape) != shape or not b.is_floating_point() or b.device != x.device:
            raise ValueError(f"{what} must be a float tensor {list(shape)} on {x.device}, got "
                             f"{tuple(b.shape)} {b.dtype} on {b.device}")
        name = str(b.dtype).removeprefix("torch.")
        if name not in BIAS_DTYPES:
            b, name = b.float(), "float32"
        return b.contiguous(), name

    def run(x: torch.Tensor, p13: MoEPacked, p2: MoEPacked, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, activation: str, expert_map: torch.Tensor | None = None,
            w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None) -> torch.Tensor:
        if (p13.n, p13.k, p2.n, p2.k) != (n, k, k, n // 2) or p13.fmt != fmt or p2.fmt != fmt:
            raise ValueError(f"kernels compiled for 2I={n}, H={k}, {fmt}; got w13 [{p13.n}, {p13.k}] and "
                             f"w2 [{p2.n}, {p2.k}] in {p13.fmt}")
        for p in (p13, p2):
            if p.unsupported[di]:
                raise ValueError(p.unsupported[di])
        if x.dtype != tdt or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"expected x [T, {k}] {tdt}, got {tuple(x.shape)} {x.dtype}")
        b13, bt13 = bias_arg(w13_bias, (p13.experts, n), x, "w13_bias")
        b2, bt2 = bias_arg(w2_bias, (p13.experts, k), x, "w2_bias")
        variant = (activation, bt13, bt2)
        fn = fns.get(variant)
        if fn is None:
            fn = fns[variant] = _compile(cfg, n, k, fmt, dtype, *variant)
        x = x.contiguous()
        route = per_pair_routing if cfg.per_pair else moe_routing
        r = route(topk_ids, p13.experts, cfg.m_block, expert_map=expert_map)
        h = torch.empty(r.sorted_rows.numel(), n // 2, dtype=tdt, device=x.device)
        y = torch.empty(x.shape[0], k, dtype=torch.float32, device=x.device)  # the up kernel zeroes it
        if x.shape[0] == 0:
            return y.to(tdt)
        tw = topk_weights.reshape(-1).float().contiguous()
        fn(x, p13.data, p13.scales, p13.alpha, p13.scale_add, b13, p2.data, p2.scales, p2.alpha, p2.scale_add, b2,
           r.sorted_rows, r.block_expert, tw, h, y, topk_ids.shape[1], pdl.launch_flag(use_pdl))
        return y.to(tdt)

    return run
