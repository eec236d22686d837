"""Hopper (sm_90a) W4A16 GEMM for medium and large M: ``out = x @ dequant(W).T (+ bias)``.

The kernel computes ``out^T = W x^T`` so that the FP4 weight is the *register* (A) operand of
``wgmma`` and the activations are the shared-memory (B) operand: the weight's N becomes the MMA's
M (64 rows per warpgroup atom) and the token count M becomes the MMA's N (``tile_m``).

Data path of one CTA (``tile_n`` weight rows x ``tile_m`` tokens):

* one warp streams, per K tile and pipeline stage, the prepacked weight chunks (FP4 values and
  their block scales, contiguous) with 1-D bulk copies and the ``x`` tile with a TMA tensor copy
  (out-of-bounds tokens / K read as zero; with ``cluster_n = 2`` the two CTAs of a cluster each
  load half of the shared ``x`` tile and multicast it) into shared memory, completing on an
  mbarrier (``stages``-deep ring). Without ``producer`` that is consumer warp 0, which refills a
  stage between its own K tiles, once every consumer warp has released it (so one lagging
  warpgroup holds up the other's next tile); with ``producer`` a dedicated extra warp issues
  every stage as soon as it is released and does nothing else. It makes the CTA 5 or 9 warps;
  at 9, 3 share one of the SM's 4 schedulers and their 16K registers, 168 per thread, so the
  tiles that need more (the 256-token ones) cannot have it (``validate``);
* the grid walks the weight tiles (``raster="n"``) or the token tiles (``"m"``); with
  ``swizzle > 1`` it walks them in bands that many tiles wide on the other axis, so the CTAs
  resident at one time share a few tiles of both operands in L2;
* each consumer warpgroup (1 or 2; 64 or 128 weight rows each) reads, per 64x64 weight chunk,
  one 16-byte vector (its 32 FP4 values of 4 ``k16`` steps) and one 8- or 4-byte vector of block
  scales, decodes E2M1 to bf16/fp16 with shifts, rotates and masks (:mod:`._fp4_bits`), multiplies by the block scale
  (exact; the scale word holds rows r and r + 8, so each multiply needs one half broadcast: a
  byte permute, or with ``scale_select`` two moves that ptxas folds into the multiply's operand
  select, two instructions fewer per 8 weights), fences once and issues the chunk's 4 ``wgmma`` with the decoded fragment as A and
  the ``x`` tile as B, accumulating in fp32. The A fragment is double-buffered across K tiles:
  tile t+1 is decoded while tile t's wgmmas run (``wait_group(1)``);
* dependent launch (:mod:`autofp4.pdl`): the kernel may start while the previous one of the
  stream finishes (a CTA lets the next one launch after its main loop); until
  ``griddepcontrol.wait`` returns it only sets up its barriers and pulls
  the weight bytes of its first ``stages`` K tiles into L2 (``cp.async.bulk.prefetch``);
* the epilogue multiplies by ``alpha`` (a device fp32 scalar: the NVFP4 global scale times the
  power of two folded out of the decode, see below), adds the bias, and stores ``out[m, n]``
  predicated on ``m < M`` and ``n < N``. With ``split_k > 1`` the K slices of a tile run as one
  thread-block cluster (``(1, 1, split_k)``): after the main loop each CTA writes its fp32
  accumulators, in register order, into its own (now idle) ``x`` stage buffers; after a cluster
  barrier CTA ``z`` sums every ``split_k``-th accumulator over the cluster's CTAs through
  distributed shared memory (``mapa`` + ``ld.shared::cluster``) and stores it, so one launch
  writes the output with no workspace. With ``cluster_n = 2`` (the cluster already multicasts
  ``x`` across weight tiles) the slices instead add into a zeroed fp32 buffer with atomics and
  ``run`` converts it.

Exactness of the decode
-----------------------
A nibble ``s e1 e0 m`` is placed as ``sign -> bit 15``, ``e1 e0 m -> exponent[1:0], mantissa[6]``
of a bf16 (for fp16: exponent[1:0], mantissa[9]); this is exactly ``v * 2**-126`` (bf16) or
``v * 2**-14`` (fp16), E2M1 subnormals included. The block scale is converted exactly and
pre-multiplied by a power of two so that the product is ``v * s * 2**-7`` (NVFP4) or
``v * s * 2**-t`` (MXFP4, ``t`` chosen per weight at pack time), a normal number computed exactly
by one ``mul``; the power of two goes back in the fp32 epilogue through ``alpha``.
FP16 + MXFP4 requires the weight's E8M0 exponents to span at most 14 binades (checked on the
host from pack-time statistics, no device sync); otherwise use bfloat16 activations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from .. import pdl
from ..hopper import SMEM_PER_CTA, SMEM_PER_CTA_RESERVED, SMEM_PER_SM
from ..problem import DTYPES, FORMATS
from ._fp4_bits import decode_terms, word_bit

try:  # CuTeDSL is an optional dependency; annotations of the jit functions resolve here
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
except ImportError:  # pragma: no cover - exercised only without nvidia-cutlass-dsl
    cuda = cutlass = cute = None  # type: ignore[assignment]

#: helper modules whose source is part of this kernel's (kernel cache key, DB provenance)
KERNEL_SOURCES = ("autofp4.kernels._ptx", "autofp4.kernels._fp4_bits")
CO_RESIDENT_REGS = 96             # accumulator + fragment registers that fit a 128-register cap
# with a producer warp, 9 (or 2 x 5) warps put 3 on one of the SM's 4 schedulers, whose 16K
# registers then cap a thread at 168; ptxas -v over the tile grid: accumulators <= 64 and
# accumulators + 2 fragments <= 160 compile without spills or serialized wgmmas (the rest did not)
PRODUCER_ACC_REGS = 64
PRODUCER_REGS = 160
CHUNK_N = 64                      # weight rows per wgmma atom / pack chunk
CHUNK_K = 64                      # K per pack chunk (4 k16 steps)
PAD = 256                         # pack pads N and K to multiples of this (largest tiles)
SWIZZLES = (1, 2, 4, 8, 16)       # band widths of the grouped CTA order
VALUE_BYTES = CHUNK_N * CHUNK_K // 2   # 2048 bytes of FP4 values per chunk


def _scale_words(fmt: str) -> int:
    """32-bit block-scale words per row group (4 threads) and chunk: one per k16 step (NVFP4) or
    per 32-value block (MXFP4), each holding the scales of rows r (low half) and r + 8."""
    return 4 if fmt == "nvfp4" else 2


def _scale_bytes(fmt: str) -> int:
    """Block-scale bytes per 64x64 chunk: 32 row groups x their words."""
    return 32 * 4 * _scale_words(fmt)


def chunk_bytes(fmt: str) -> int:
    return VALUE_BYTES + _scale_bytes(fmt)


def _pad(v: int, to: int = PAD) -> int:
    return (v + to - 1) // to * to


# --------------------------------------------------------------------------------------------
# Config space
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sm90GemmConfig:
    kernel: ClassVar[str] = "gemm"  # the tag of stored configs (not a field)
    tile_n: int = 128      # weight rows per CTA (wgmma M side), multiple of 64
    tile_m: int = 128      # tokens per CTA (wgmma N)
    tile_k: int = 128      # K per pipeline stage
    stages: int = 4        # shared-memory pipeline depth
    split_k: int = 1       # K slices reduced with fp32 atomics
    cluster_n: int = 1     # CTAs (consecutive weight tiles) per cluster sharing x by TMA multicast
    raster: str = "n"      # "n": consecutive CTAs walk weight tiles; "m": walk token tiles
    swizzle: int = 1       # > 1: the walk goes over bands this many tiles wide on the other axis
    ctas_per_sm: int = 0   # 0: as registers and shared memory allow; 2: ask for two (.minnctapersm)
    pdl: bool = False      # launch with programmatic dependent launch (a launch flag, one binary)
    scale_select: bool = False  # broadcast a block scale's half by operand select, not a byte permute
    producer: bool = False  # a dedicated producer warp streams the stages (else consumer warp 0 does)

    @property
    def warpgroups(self) -> int:
        return min(self.tile_n // CHUNK_N, 2)

    @property
    def cluster_reduce(self) -> bool:
        """split-K partials summed through distributed shared memory (else fp32 atomics)."""
        return self.split_k > 1 and self.cluster_n == 1

    @property
    def reps(self) -> int:
        """64-row wgmma atoms per consumer warpgroup."""
        return self.tile_n // CHUNK_N // self.warpgroups

    def smem_bytes(self, fmt: str) -> int:
        per_stage = self.tile_m * self.tile_k * 2 + (self.tile_n // CHUNK_N) * (
            self.tile_k // CHUNK_K
        ) * chunk_bytes(fmt)
        return self.stages * per_stage + 2 * 8 * self.stages + 1024 * 3


def validate(cfg: Sm90GemmConfig, n: int, k: int, fmt: str, dtype: str) -> str | None:
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
    if k % 8:
        return f"k={k} must be a multiple of 8 (16-byte rows of x for TMA)"
    if cfg.tile_n not in (64, 128, 256):
        return f"tile_n must be 64, 128 or 256, got {cfg.tile_n}"
    if cfg.tile_m not in (16, 32, 64, 128, 256):
        return f"tile_m must be 16, 32, 64, 128 or 256, got {cfg.tile_m}"
    if cfg.tile_k not in (64, 128, 256):
        return f"tile_k must be 64, 128 or 256, got {cfg.tile_k}"
    if not 2 <= cfg.stages <= 8:
        return f"stages must be in 2..8, got {cfg.stages}"
    if cfg.split_k not in (1, 2, 4):
        return f"split_k must be 1, 2 or 4, got {cfg.split_k}"
    if cfg.cluster_n not in (1, 2):
        return f"cluster_n must be 1 or 2, got {cfg.cluster_n}"
    if cfg.raster not in ("n", "m"):
        return f"raster must be 'n' or 'm', got {cfg.raster!r}"
    if cfg.cluster_n > 1 and cfg.raster != "n":
        return "cluster_n > 1 (x multicast across weight tiles) needs raster='n'"
    if cfg.swizzle not in SWIZZLES:
        return f"swizzle must be one of {SWIZZLES}, got {cfg.swizzle!r}"
    if cfg.swizzle > 1 and cfg.cluster_n > 1:
        return "swizzle > 1 needs cluster_n=1 (a cluster's CTAs share one token tile)"
    if cfg.cluster_n > 1 and (_pad(n) // cfg.tile_n) % cfg.cluster_n:
        return (
            f"cluster_n={cfg.cluster_n} must divide the number of weight tiles "
            f"{_pad(n) // cfg.tile_n} (padded n={_pad(n)}, tile_n={cfg.tile_n})"
        )
    kp = _pad(k)
    if kp % (cfg.tile_k * cfg.split_k):
        return (
            f"padded k={kp} must be divisible by tile_k*split_k={cfg.tile_k * cfg.split_k}"
        )
    if kp // (cfg.tile_k * cfg.split_k) < 1:
        return "each K slice needs at least one K tile"
    acc_regs = cfg.reps * cfg.tile_m // 2
    if acc_regs > 128:
        return (
            f"accumulators need {acc_regs} registers per thread (tile_n={cfg.tile_n}, "
            f"tile_m={cfg.tile_m}); the limit is 128"
        )
    frag_regs = cfg.reps * cfg.tile_k // 16 * 4
    if acc_regs + 2 * frag_regs > 192:
        return (
            f"accumulators + 2 decoded weight fragments need {acc_regs + 2 * frag_regs} registers per "
            "thread; the limit is 192"
        )
    if cfg.cluster_reduce and cfg.stages * cfg.tile_k < 2 * cfg.tile_n:
        return (
            f"split_k={cfg.split_k} sums the K slices through shared memory in the x stage buffers, "
            f"which hold {cfg.stages} x {cfg.tile_k} K per token and need 2 x tile_n = {2 * cfg.tile_n}; "
            "use more stages or a deeper tile_k"
        )
    smem = cfg.smem_bytes(fmt)
    if smem > SMEM_PER_CTA:
        return f"needs {smem} bytes of shared memory, more than the {SMEM_PER_CTA} available"
    if not isinstance(cfg.scale_select, bool):
        return f"scale_select must be a bool, got {cfg.scale_select!r}"
    if not isinstance(cfg.producer, bool):
        return f"producer must be a bool, got {cfg.producer!r}"
    if cfg.ctas_per_sm not in (0, 2):
        return f"ctas_per_sm must be 0 (as resources allow) or 2, got {cfg.ctas_per_sm!r}"
    if cfg.ctas_per_sm == 2:
        if 2 * (smem + SMEM_PER_CTA_RESERVED) > SMEM_PER_SM:
            return (f"ctas_per_sm=2 needs two CTAs' shared memory ({smem} bytes each + "
                    f"{SMEM_PER_CTA_RESERVED} reserved) within the SM's {SMEM_PER_SM}; use fewer stages "
                    "or a smaller tile_k")
        if cfg.warpgroups == 2 and cfg.producer:
            return ("ctas_per_sm=2 with two warpgroups and a producer warp (2 x 9 warps, 5 on one "
                    "scheduler) leaves about 100 registers per thread; drop the producer warp or use "
                    "one warpgroup")
        if cfg.warpgroups == 2 and acc_regs + 2 * frag_regs > CO_RESIDENT_REGS:
            return (f"ctas_per_sm=2 caps registers at 128 per thread; accumulators + 2 decoded weight "
                    f"fragments need {acc_regs + 2 * frag_regs} (at most {CO_RESIDENT_REGS} leave room for "
                    "the decode without spills)")
    if cfg.producer and (cfg.warpgroups == 2 or cfg.ctas_per_sm == 2) and (
            acc_regs > PRODUCER_ACC_REGS or acc_regs + 2 * frag_regs > PRODUCER_REGS):
        return (f"a producer warp puts 3 warps on one scheduler, 168 registers per thread at most: "
                f"{acc_regs} accumulator + 2 x {frag_regs} fragment registers need more (at most "
                f"{PRODUCER_ACC_REGS} and {PRODUCER_REGS} in all, else the wgmmas serialize); "
                "drop the producer warp or use a smaller tile")
    return None


# --------------------------------------------------------------------------------------------
# Weight packing (pure torch)
# --------------------------------------------------------------------------------------------
def _nibble_bit_positions() -> list[tuple[int, int, int, int]]:
    """For each wgmma A fragment value e0..e7 of one thread and k16 step, the bits of its word
    holding (magnitude 0, 1, 2, sign): pair ``e // 2``, half ``e % 2`` (:mod:`._fp4_bits`)."""
    return [tuple(word_bit(e // 2, e % 2, b) for b in range(4)) for e in range(8)]


@dataclass(frozen=True)
class PackedSm90Weight:
    """What the kernel reads. ``data``: uint8 [Np/64, Kp/64, chunk] (chunk = 2048 value bytes +
    block-scale bytes, see ``pack_weight``); ``alpha``: fp32 [1] epilogue factor;
    ``scale_shift``: MXFP4 exponent shift ``t`` (0 for NVFP4); ``fp16_ok``: MXFP4 exponents fit
    fp16 decode."""

    data: torch.Tensor
    alpha: torch.Tensor
    fmt: str
    n: int
    k: int
    scale_shift: int
    fp16_ok: bool


def _fragment_coords() -> tuple[torch.Tensor, torch.Tensor]:
    """Row (0..63) and k (0..15) of value e of thread t in one 64x16 wgmma A atom: [128, 8]."""
    t = torch.arange(128)
    warp, lane = t // 32, t % 32
    g, c = lane // 4, lane % 4
    r0 = 16 * warp + g
    rows = torch.stack([r0, r0, r0 + 8, r0 + 8, r0, r0, r0 + 8, r0 + 8], dim=1)
    k0 = 2 * c
    ks = torch.stack([k0, k0 + 1, k0, k0 + 1, k0 + 8, k0 + 9, k0 + 8, k0 + 9], dim=1)
    return rows, ks


# A bf16 pattern (per half) of a value v >= 0 -> the fp16 pattern of v * 2**-112 (exponent field
# - (254 - 30), mantissa << 3), on both halves of a word at once with one IMAD:
# ``word * 8 + FP16_FROM_BF16`` (mod 2**32); exact for 2**-98 <= v < 2**128
FP16_FROM_BF16 = (-(((254 - 30) << 7) * 0x10001) * 8) % (1 << 32)


def _pack_scales(w: Any, q: torch.Tensor, np_: int, kp: int):
    """Block scales as 16-bit bf16 patterns, the value the kernel multiplies the decoded weight
    by, arranged [nb, kc, row group, step or block, (row r, row r + 8)]; and the epilogue factor.

    The decoded bf16 weight is ``v * 2**-126``: NVFP4 stores ``s * 2**112`` (exact: E4M3 has 4
    significant bits), so products are ``v * s * 2**-14``; the epilogue multiplies by the global
    scale times 2**14. MXFP4 stores ``2**(e - e_max + 127)``, so products are ``v * 2**(e - e_max
    + 1)`` (always normal: spans up to 126 binades), times ``2**(e_max - 128)`` in the epilogue.
    With fp16 activations the kernel turns the pattern into the fp16 one of the value times
    2**-112 with one integer multiply-add (``FP16_FROM_BF16``), against a decoded weight of
    ``v * 2**-14``: the same products, exact (multiples of 2**-24 with at most 6 significant
    bits) for NVFP4 and for MXFP4 exponents spanning at most 14 binades (``fp16_ok``).

    NVFP4 blocks with a negative scale get their values' signs flipped instead (exact), and
    all-zero-scale blocks zero values with a scale of 1, so every stored scale is positive,
    nonzero and in the range where the fp16 conversion holds. Rewrites ``q`` (codes) in place.
    """
    n, k = int(w.shape[-2]), int(w.shape[-1])
    dev = q.device
    fmt = w.fmt
    bs = 16 if fmt == "nvfp4" else 32
    nb = k // bs
    raw = w.scale if w.scale.dtype == torch.uint8 else w.scale.view(torch.uint8)
    raw = raw.reshape(n, nb)
    shift = 0
    fp16_ok = True
    if fmt == "nvfp4":
        sval = raw.view(torch.float8_e4m3fn).float()
        blocks = q[:n, :k].reshape(n, nb, bs)
        blocks = (blocks ^ ((sval < 0).to(torch.uint8) * 8).unsqueeze(-1)) * (sval != 0).to(
            torch.uint8).unsqueeze(-1)
        q[:n, :k] = blocks.reshape(n, k)
        sval = torch.where(sval == 0, torch.ones_like(sval), sval.abs())
        full = torch.ones(np_, kp // bs, dtype=torch.float32, device=dev)
        full[:n, :nb] = sval
        bits = (full * 2.0**112).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
        alpha = w.global_scale.reshape(1).to(device=dev, dtype=torch.float32) * 2.0**14
    else:
        e = raw.to(torch.int32)
        emax, emin = int(e.max()), int(e.min())
        if emax == 255:
            raise ValueError("mxfp4 scales contain the E8M0 NaN (255)")
        shift = emax - 128
        if emin - shift < 2:
            raise ValueError(
                f"mxfp4 scale exponents span {emax - emin} binades (min {emin}, max {emax}); "
                "the sm90 decode supports at most 126"
            )
        fp16_ok = emax - emin <= 14
        full = torch.full((np_, kp // bs), emax, dtype=torch.int32, device=dev)  # padding: in range
        full[:n, :nb] = e
        bits = (full - emax + 254) << 7
        alpha = torch.full((1,), 2.0**shift, dtype=torch.float32, device=dev)
    per_chunk = _scale_words(fmt)
    # rows = 64 nb + 16 warp + 8 half + g -> [nb, kc, warp, g, step, half]
    sv = bits.view(np_ // CHUNK_N, 4, 2, 8, kp // CHUNK_K, per_chunk).permute(0, 4, 1, 3, 5, 2)
    return _le_bytes(sv[..., 0] | (sv[..., 1] << 16)), alpha, shift, fp16_ok


def _le_bytes(words: torch.Tensor) -> torch.Tensor:
    """32-bit words (any integer dtype, values in [0, 2**32)) as their little-endian bytes:
    uint8 ``[*words.shape, 4]``."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).contiguous()
    return w.view(torch.uint8).reshape(*words.shape, 4)


def pack_weight(w: Any) -> PackedSm90Weight:
    """Reorder an FP4Weight (2-D) into the chunked layout the kernel reads. Pure torch.

    Layout: chunk (nb, kc) covers rows [64 nb, 64 nb + 64) and K [64 kc, 64 kc + 64). Bytes
    [0, 2048): thread t (of the 128 of a warpgroup) owns bytes [16 t, 16 t + 16) = 4 words, word
    i holding its 8 wgmma-A-fragment values of k16 step i (bit positions: ``_nibble_bit_positions``). Bytes
    [2048, ...): block scales (see ``_pack_scales``), per row group q = 8 warp + lane // 4 (rows
    r = 16 warp + lane // 4 and r + 8): one 32-bit word per k16 step (NVFP4, 4 words) or 32-value
    block (MXFP4, 2 words), the scale of row r in its low and of row r + 8 in its high 16 bits.
    """
    if w.fmt not in FORMATS:
        raise ValueError(f"expected fmt in {FORMATS}, got {w.fmt!r}")
    if getattr(w, "experts", 0):
        raise ValueError("pack_weight expects a 2-D weight; use w.expert(e) for MoE weights")
    n, k = int(w.shape[-2]), int(w.shape[-1])
    fmt = w.fmt
    dev = w.data.device
    np_, kp = _pad(n), _pad(k)
    data = w.data.to(torch.uint8)
    q = torch.zeros(np_, kp, dtype=torch.uint8, device=dev)
    q[:n, 0:k:2] = data & 0xF
    q[:n, 1:k:2] = data >> 4
    scales, alpha, shift, fp16_ok = _pack_scales(w, q, np_, kp)
    nbk, nkc = np_ // CHUNK_N, kp // CHUNK_K
    # [nbk, 64, nkc, 4 steps, 16] -> values per (nb, kc, step, t, e)
    qv = q.view(nbk, CHUNK_N, nkc, 4, 16)
    rows, ks = _fragment_coords()
    rows, ks = rows.to(dev), ks.to(dev)
    # gather -> [nbk, nkc, 4, 128, 8]
    qv = qv.permute(0, 2, 3, 1, 4)  # [nbk, nkc, 4, 64, 16]
    vals = qv[:, :, :, rows, ks].to(torch.int64)  # [nbk, nkc, 4, 128, 8]
    mag = vals & 7
    sign = (vals >> 3) & 1
    word = torch.zeros(vals.shape[:-1], dtype=torch.int64, device=dev)
    for e, (p0, p1, p2, ps) in enumerate(_nibble_bit_positions()):
        m = mag[..., e]
        word |= (m & 1) << p0
        word |= ((m >> 1) & 1) << p1
        word |= ((m >> 2) & 1) << p2
        word |= sign[..., e] << ps
    # [nbk, nkc, 128 t, 4 steps] words, little-endian bytes
    wbytes = _le_bytes(word.permute(0, 1, 3, 2)).reshape(nbk, nkc, VALUE_BYTES)

    packed = torch.cat([wbytes, scales.reshape(nbk, nkc, _scale_bytes(fmt))], dim=-1).contiguous()
    return PackedSm90Weight(
        data=packed, alpha=alpha.contiguous(), fmt=fmt, n=n, k=k, scale_shift=shift,
        fp16_ok=fp16_ok,
    )


# --------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------
class _Sm90W4A16Kernel:
    """One compiled kernel per (config, N, K, fmt, dtype); M is symbolic.

    ``grouped`` (None: the dense GEMM) makes it the grouped GEMM of a MoE layer
    (:mod:`.sm90_moe_gemm`), an object with ``kind`` (``"up"`` or ``"down"``), ``bias`` (whether
    the epilogue adds a per-expert bias) and, for ``"up"``, ``act(gate, up)`` (fp32 -> fp32,
    traced in the epilogue): x holds the token rows sorted by
    expert in blocks of ``tile_m`` rows (a block's expert read from ``block_expert``, -1: the CTA
    exits), the weight is every expert's packed weight one after the other, ``alpha`` is per expert.
    """

    def __init__(self, cfg: Sm90GemmConfig, n: int, k: int, fmt: str, dtype: str, grouped: Any = None):
        self.cfg = cfg
        self.grouped = grouped
        self.n, self.k, self.fmt, self.dtype = n, k, fmt, dtype
        self.np_, self.kp = _pad(n), _pad(k)
        self.chunk = chunk_bytes(fmt)
        self.num_wg = cfg.warpgroups
        self.reps = cfg.reps
        self.cons_threads = 128 * self.num_wg  # the consumer warpgroups
        self.threads = self.cons_threads + (32 if cfg.producer else 0)
        self.kc_per_tile = cfg.tile_k // CHUNK_K
        self.w_stage_bytes = (cfg.tile_n // CHUNK_N) * self.kc_per_tile * self.chunk
        self.k_tiles = self.kp // cfg.tile_k
        self.k_tiles_per_split = self.k_tiles // cfg.split_k
        self.terms = decode_terms(dtype)

    def build(self):
        import cutlass
        import cutlass.cute as cute
        import cutlass.pipeline as pipeline
        import cutlass.utils as utils
        import cutlass.utils.hopper_helpers as sm90_utils
        from cutlass.cute.nvgpu import cpasync, warpgroup

        cfg = self.cfg
        dt = cutlass.BFloat16 if self.dtype == "bfloat16" else cutlass.Float16
        is_nv = self.fmt == "nvfp4"
        tile_n, tile_m, tile_k = cfg.tile_n, cfg.tile_m, cfg.tile_k
        stages = cfg.stages
        reps = self.reps
        threads = self.threads
        cons_threads = self.cons_threads
        cons_warps = cons_threads // 32
        producer = cfg.producer
        load_warp = cons_warps if producer else 0  # the warp that issues the stage copies
        kc_per_tile = self.kc_per_tile
        chunk = self.chunk
        s_words = _scale_words(self.fmt)  # scale words each row group (4 threads) reads per chunk
        n_real = self.n
        np_ = self.np_
        nkc_total = self.kp // CHUNK_K
        w_stage_bytes = self.w_stage_bytes
        w_copy_bytes = kc_per_tile * chunk
        nb_per_cta = tile_n // CHUNK_N
        k_tiles_split = self.k_tiles_per_split
        split_k = cfg.split_k
        raster_n = cfg.raster == "n"
        swz = cfg.swizzle
        cl = cfg.cluster_n
        x_mcast_kw = {"mcast_mask": cutlass.Int16((1 << cl) - 1)} if cl > 1 else {}
        terms = self.terms
        is_bf16 = dt is cutlass.BFloat16
        n_tiles = np_ // tile_n
        x_bytes = tile_m * tile_k * 2
        tx_bytes = x_bytes + w_stage_bytes
        cluster_red = cfg.cluster_reduce
        # the carveout is given so that the compiler needs no device query (CPU-only compiles)
        occupancy = ({"min_blocks_per_mp": cfg.ctas_per_sm, "preferred_smem_carveout": -1}
                     if cfg.ctas_per_sm else {})
        out_is_f32 = split_k > 1 and not cluster_red
        pair_out = not out_is_f32  # two consecutive n of one m per store (see the epilogue)
        from cutlass.cutlass_dsl import T

        from ._ptx import asm, asm_void, decode_pair, griddep_launch_dependents, griddep_wait, mul_x2, prefetch_l2, prmt
        mul_op = "mul.rn.bf16x2" if is_bf16 else "mul.rn.f16x2"
        scale_select = cfg.scale_select

        def mul_half(v, sw, hi: int):
            """``v`` times the low (``hi=0``) or high half of ``sw`` in both lanes; the {h, h}
            pair is built by moves, which ptxas folds into the multiply's operand select."""
            h = "h, h" if hi else "l, l"
            return cutlass.Uint32(asm(
                T.i32(), [cutlass.Uint32(v), cutlass.Uint32(sw)],
                f"{{ .reg .b16 l, h; .reg .b32 s; mov.b32 {{l, h}}, $2; mov.b32 s, {{{h}}}; {mul_op} $0, $1, s; }}",
                "=r,r,r"))
        if cluster_red:
            from ._ptx import ld_dsmem_f32
        cvt_x2 = "cvt.rn.bf16x2.f32" if is_bf16 else "cvt.rn.f16x2.f32"

        def st_x2(addr, lo, hi):
            """out[addr] = (lo, hi) rounded to the output dtype, one 4-byte store."""
            asm_void("{ .reg .b32 p; " + cvt_x2 + " p, $2, $1; st.global.b32 [$0], p; }", "l,f,f",
                     cutlass.Int64(addr), cutlass.Float32(lo), cutlass.Float32(hi))

        def load_stage(pipe, state, k_tile0, n_row0, tma_atom_x, tXgX, tXsX, bulk_atom, mW, sW):
            """Warp 0: acquire the stage at ``state``, issue its x tile (TMA, multicast across the
            cluster) and weight tiles (bulk copies) on its barrier, and commit. The caller advances
            ``state`` (in the kernel body, so the DSL carries it through its loops)."""
            pipe.producer_acquire(state)
            bar = pipe.producer_get_barrier(state)
            kt = k_tile0 + state.count
            cute.copy(tma_atom_x, tXgX[(None, kt)], tXsX[(None, state.index)], tma_bar_ptr=bar, **x_mcast_kw)
            with cute.arch.elect_one():
                for b in range(nb_per_cta):  # (traced as plain Python: unrolled)
                    goff = ((n_row0 + b) * nkc_total + kt * kc_per_tile) * chunk
                    src = cute.make_tensor(mW.iterator + goff, cute.make_layout((w_copy_bytes,)))
                    dst = cute.make_tensor(
                        sW[(None, state.index)].iterator + b * w_copy_bytes, cute.make_layout((w_copy_bytes,))
                    )
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
            """The grouped GEMM's store of weight rows (nn, nn + 1) of sorted row mm: "up" writes
            the activation at h[mm, j] (gate row nn = 16 q + s -> j = 8 q + s); "down" writes the
            weighted expert output at the pair's row of ``y [pairs, N]`` (none for padding)."""
            if cutlass.const_expr(grp_kind == "up"):
                j = gate_row(nn)
                if j < inter:
                    st_x2(mOut.iterator.toint() + cutlass.Int64(mm * inter + j) * 2, lo, hi)
            else:
                pair = grp[1][mm]
                if nn < n_real and pair >= 0:
                    st_x2(mOut.iterator.toint() + cutlass.Int64(pair * n_real + nn) * 2, lo, hi)

        def banded(lin, walked, across):
            """(band-axis tile, walked-axis tile) of linear CTA index ``lin`` when the grid walks
            ``walked`` tiles in bands ``swz`` wide of the ``across`` axis."""
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
            mBias: cute.Tensor,
            mOut: cute.Tensor,
            m_size: cutlass.Int32,
            tiled_mma: cute.TiledMma,
            x_smem_layout_staged: cute.ComposedLayout,
        ):
            tidx, _, _ = cute.arch.thread_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            bidx, bidy, bidz = cute.arch.block_idx()
            if cutlass.const_expr(swz > 1):
                # grouped order: the CTAs walk the long axis in bands of ``swz`` tiles of the
                # other one (the last band may be narrower), so the CTAs resident at one time
                # share a few tiles of both operands in L2
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
            cta(tma_atom_x, mX, mW, mAlpha, mBias, mOut, m_size, tiled_mma, x_smem_layout_staged,
                tidx, warp_idx, bidz, pid_n, pid_m, None)

        @cute.kernel
        def grouped_kernel(
            tma_atom_x: cute.CopyAtom,
            mX: cute.Tensor,
            mW: cute.Tensor,
            mAlpha: cute.Tensor,
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
            bidx, bidy, bidz = cute.arch.block_idx()
            pid_n, pid_m = (bidx, bidy) if raster_n else (bidy, bidx)
            griddep_wait()  # the routing metadata comes from the previous kernels of the stream
            expert = mBlockExpert[pid_m]
            if expert >= 0:
                cta(tma_atom_x, mX, mW, mAlpha, mBias, mOut, m_size, tiled_mma, x_smem_layout_staged,
                    tidx, warp_idx, bidz, pid_n, pid_m, (expert, mRows, mTopkW))

        @cute.jit
        def cta(tma_atom_x, mX, mW, mAlpha, mBias, mOut, m_size, tiled_mma, x_smem_layout_staged,
                tidx, warp_idx, bidz, pid_n, pid_m, grp):
            """The tile (pid_n, pid_m) of one CTA; ``grp``: None (dense) or the grouped GEMM's
            (expert, sorted rows, router weights)."""
            if warp_idx == load_warp:
                cpasync.prefetch_descriptor(tma_atom_x)

            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, stages * 2]
                sX: cute.struct.Align[
                    cute.struct.MemRange[dt, cute.cosize(x_smem_layout_staged)], 1024
                ]
                sW: cute.struct.Align[
                    cute.struct.MemRange[cutlass.Uint8, w_stage_bytes * stages], 1024
                ]

            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sX = storage.sX.get_tensor(
                x_smem_layout_staged.outer, swizzle=x_smem_layout_staged.inner
            )
            sW = storage.sW.get_tensor(cute.make_layout((w_stage_bytes, stages)))
            n_chunks_stage = nb_per_cta * kc_per_tile
            sWv = cute.make_tensor(
                cute.recast_ptr(storage.sW.data_ptr(), dtype=cutlass.Uint32),
                cute.make_layout(
                    (4, 128, n_chunks_stage, stages),
                    stride=(1, 4, chunk // 4, w_stage_bytes // 4),
                ),
            )
            sSv = cute.make_tensor(
                cute.recast_ptr(storage.sW.data_ptr(), dtype=cutlass.Uint32) + VALUE_BYTES // 4,
                cute.make_layout(
                    (s_words, 32, n_chunks_stage, stages),
                    stride=(1, s_words, chunk // 4, w_stage_bytes // 4),
                ),
            )

            prod_group = pipeline.CooperativeGroup(pipeline.Agent.Thread)
            # every consumer warp releases a stage in each CTA of the cluster (they multicast x)
            cons_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, cons_warps * cl)
            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(),
                num_stages=stages,
                producer_group=prod_group,
                consumer_group=cons_group,
                tx_count=tx_bytes,
                # the split-K cluster is (1, 1, split_k): its CTAs share no stage, each signals itself
                cta_layout_vmnk=cute.make_layout((1, cl, 1, split_k if cluster_red else 1)),
            )

            k_tile0 = bidz * k_tiles_split
            # x tiles: (tile_m, tile_k, m_tiles?, k_tiles)
            gX = cute.local_tile(mX, (tile_m, tile_k), (pid_m, None))
            if cutlass.const_expr(cl > 1):
                cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            else:
                cta_rank = 0
            tXsX, tXgX = cpasync.tma_partition(
                tma_atom_x,
                cta_rank,
                cute.make_layout(cl),
                cute.group_modes(sX, 0, 2),
                cute.group_modes(gX, 0, 2),
            )
            bulk_atom = cute.make_copy_atom(
                cpasync.CopyBulkG2SOp(), cutlass.Uint8, num_bits_per_copy=w_copy_bytes * 8
            )

            # MMA setup (per warpgroup)
            wg = cute.arch.make_warp_uniform(tidx // 128)
            wtid = tidx % 128
            thr_mma = tiled_mma.get_slice(wtid)
            tCsB = thr_mma.partition_B(sX)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            acc = cute.make_rmem_tensor(
                thr_mma.partition_shape_C((CHUNK_N * reps, tile_m)), cutlass.Float32
            )
            acc.fill(0.0)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            a_shape = thr_mma.partition_shape_A((CHUNK_N * reps, tile_k))
            rAs = [tiled_mma.make_fragment_A(a_shape), tiled_mma.make_fragment_A(a_shape)]
            wregs = cute.make_rmem_tensor(cute.make_layout((4, reps)), cutlass.Uint32)
            swords = cute.make_rmem_tensor(cute.make_layout((s_words, reps)), cutlass.Uint32)

            prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
            cons_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            rel_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)

            n_row0 = pid_n * nb_per_cta  # first 64-row block of this CTA
            if cutlass.const_expr(grp is not None):
                n_row0 = n_row0 + grp[0] * (np_ // CHUNK_N)  # in the expert's packed weight
            lane_q = wtid // 4  # row group 0..31 (scale bytes)

            # ---- prologue: until the previous kernel has finished (dependent launch) only pull
            # the weight bytes of the first stages into L2; then fill the pipeline (a producer
            # warp goes on to stream every K tile, waiting for each stage to be released)
            n_pre = cutlass.min(stages, k_tiles_split)
            if tidx == load_warp * 32:
                for b in range(nb_per_cta):
                    goff = ((n_row0 + b) * nkc_total + k_tile0 * kc_per_tile) * chunk
                    prefetch_l2(mW.iterator.toint() + cutlass.Int64(goff), n_pre * w_copy_bytes)
            griddep_wait()
            if warp_idx == load_warp:
                for i in cutlass.range(k_tiles_split if producer else n_pre, unroll=1):
                    load_stage(pipe, prod_state, k_tile0, n_row0, tma_atom_x, tXgX, tXsX, bulk_atom, mW, sW)
                    prod_state.advance()

            if warp_idx < cons_warps:
                # ---- mainloop (consumer warps), unrolled by two for the double-buffered A
                # fragment: decode K tile t into buffer t % 2 and issue its wgmmas; then wait for
                # tile t-1's wgmmas and release its stage (without a producer warp, warp 0 then
                # refills it)
                for kt2 in cutlass.range((k_tiles_split + 1) // 2, unroll=1):
                    for buf in cutlass.range_constexpr(2):
                        t_cur = kt2 * 2 + buf
                        if t_cur < k_tiles_split:
                            rA = rAs[buf]
                            rA32 = cute.make_tensor(
                                cute.recast_ptr(rA.iterator, dtype=cutlass.Uint32),
                                cute.make_layout((4, reps, tile_k // 16)),
                            )
                            pipe.consumer_wait(cons_state)
                            for kc in cutlass.range_constexpr(kc_per_tile):
                                for r in cutlass.range_constexpr(reps):
                                    cidx = (wg * reps + r) * kc_per_tile + kc
                                    cute.autovec_copy(
                                        sWv[(None, wtid, cidx, cons_state.index)], wregs[(None, r)]
                                    )
                                    cute.autovec_copy(
                                        sSv[(None, lane_q, cidx, cons_state.index)], swords[(None, r)]
                                    )
                                for st in cutlass.range_constexpr(4):
                                    kb = kc * 4 + st
                                    for r in cutlass.range_constexpr(reps):
                                        # the (row r, row r + 8) scales -> (r, r) and (r + 8, r + 8)
                                        sw = swords[st if is_nv else st // 2, r]
                                        if cutlass.const_expr(not is_bf16):
                                            sw = sw * cutlass.Uint32(8) + cutlass.Uint32(FP16_FROM_BF16)
                                        word = wregs[st, r]
                                        if cutlass.const_expr(not scale_select):
                                            s_pair = (prmt(sw, 0x1010), prmt(sw, 0x3232))
                                        for j in cutlass.range_constexpr(4):
                                            v = decode_pair(word, terms[j])
                                            # pairs 0, 2: row r; 1, 3: row r + 8
                                            if cutlass.const_expr(scale_select):
                                                rA32[j, r, kb] = mul_half(v, sw, j % 2)
                                            else:
                                                rA32[j, r, kb] = mul_x2(v, s_pair[j % 2], is_bf16)
                                # one fence per 64-K chunk: the 4 k16 steps decode independently
                                # (ILP), then their wgmmas are issued back to back
                                cute.nvgpu.warpgroup.fence()
                                for st in cutlass.range_constexpr(4):
                                    cute.gemm(
                                        tiled_mma,
                                        acc,
                                        rA[(None, None, kc * 4 + st)],
                                        tCrB[(None, None, kc * 4 + st, cons_state.index)],
                                        acc,
                                    )
                            cute.nvgpu.warpgroup.commit_group()
                            cons_state.advance()
                            # the previous tile's wgmmas are done after this: its registers and stage are free
                            cute.nvgpu.warpgroup.wait_group(1)
                            if t_cur > 0:
                                pipe.consumer_release(rel_state)
                                rel_state.advance()
                                if cutlass.const_expr(not producer):
                                    if warp_idx == 0:
                                        if prod_state.count < k_tiles_split:
                                            load_stage(pipe, prod_state, k_tile0, n_row0, tma_atom_x, tXgX,
                                                       tXsX, bulk_atom, mW, sW)
                                            prod_state.advance()

                cute.nvgpu.warpgroup.wait_group(0)
            # the main loop is done: the next kernel may launch once every CTA got here (or
            # exited) and prefetch its weights during this epilogue
            griddep_launch_dependents()
            if cutlass.const_expr(cl > 1):
                # keep this CTA's shared memory alive until the peer's multicasts into it are done,
                # and (release order, not relaxed) make this CTA's last remote stage releases on
                # the peer land before the peer may exit: relaxed, a cluster of two under PDL in a
                # CUDA graph faulted in 5 of 14 stress runs on the H200, released in 0 of 19
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()

            # ---- epilogue: out[m, n] = acc[n, m] * alpha + bias[n]
            alpha = mAlpha[0] if grp is None else mAlpha[grp[0]]
            row0 = pid_n * tile_n + wg * (reps * CHUNK_N)
            col0 = pid_m * tile_m
            cid = cute.make_identity_tensor((CHUNK_N * reps, tile_m))
            tcid = thr_mma.partition_C(cid)
            n_acc = cute.size(acc)
            if cutlass.const_expr(cluster_red):
                # split-K in the cluster: accumulators [i][thread] into the idle x buffers (every
                # warpgroup's wgmmas must be done reading them), then CTA bidz sums the pairs of
                # accumulators (i, i + 1) where i // 2 % split_k == bidz over the cluster and stores them
                cute.arch.barrier()
                red_base = cutlass.Int32(storage.sX.data_ptr().toint())
                sRed = cute.make_tensor(
                    cute.recast_ptr(storage.sX.data_ptr(), dtype=cutlass.Float32),
                    cute.make_layout((n_acc, cons_threads), stride=(cons_threads, 1)),
                )
                if warp_idx < cons_warps:
                    for i in cutlass.range_constexpr(n_acc):
                        sRed[i, tidx] = acc[i]
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
            if cutlass.const_expr(pair_out):
                # accumulator i = c + 2 h + 4 g + tile_m / 2 * rep of this thread holds row
                # r0 + 8 h + 64 rep, column c0 + c + 8 g (the wgmma fragment). Lanes 4 apart hold
                # rows r, r + 1 (r even) of the same columns: the even one trades its column c + 1
                # for the odd one's column c, and each stores two consecutive n of one m (bf16x2)
                r0, c0 = tcid[0]
                lane_odd = (tidx // 4) % 2
                if cutlass.const_expr(grp is None):
                    bias_rows = [mBias[cutlass.min(row0 + r0 + 8 * h + CHUNK_N * rep, n_real - 1)].to(cutlass.Float32)
                                 for rep in range(reps) for h in range(2)]
                if warp_idx < cons_warps:  # (not the producer warp)
                    for i in cutlass.range_constexpr(0, n_acc, 2):
                        h = i // 2 % 2
                        rep = i // (tile_m // 2)
                        # grouped "up": rows r (h = 0, gate) and r + 8 (h = 1, up) make one output
                        if cutlass.const_expr(grp_kind != "up" or h == 0):
                            if bidz == (i // 2 % split_k if cluster_red else 0):
                                if cutlass.const_expr(cluster_red):
                                    t0 = cutlass.Float32(0.0)
                                    t1 = cutlass.Float32(0.0)
                                    for z in cutlass.range_constexpr(split_k):
                                        t0 = t0 + ld_dsmem_f32(red_base + (i * cons_threads + tidx) * 4, z)
                                        t1 = t1 + ld_dsmem_f32(red_base + ((i + 1) * cons_threads + tidx) * 4, z)
                                else:
                                    t0 = acc[i]
                                    t1 = acc[i + 1]
                                if cutlass.const_expr(grp is None):
                                    v0 = t0 * alpha + bias_rows[rep * 2 + h]
                                    v1 = t1 * alpha + bias_rows[rep * 2 + h]
                                elif cutlass.const_expr(grp_kind == "up"):
                                    g0, g1 = t0 * alpha, t1 * alpha
                                    u0, u1 = acc[i + 2] * alpha, acc[i + 3] * alpha
                                    if cutlass.const_expr(grp_bias):  # bias [E, 2I]: gate j, up I + j
                                        jb = grp[0] * n_real + cutlass.min(
                                            gate_row(row0 + r0 + CHUNK_N * rep), inter - 1)
                                        bg, bu = mBias[jb], mBias[jb + inter]
                                        g0, g1, u0, u1 = g0 + bg, g1 + bg, u0 + bu, u1 + bu
                                    v0 = grp_act(g0, u0)
                                    v1 = grp_act(g1, u1)
                                else:  # "down": (+ bias [E, H]) times the router weight of the column's pair
                                    col = col0 + c0 + i // 4 % (tile_m // 8) * 8
                                    d0, d1 = t0 * alpha, t1 * alpha
                                    if cutlass.const_expr(grp_bias):
                                        bn = mBias[grp[0] * n_real + cutlass.min(row0 + r0 + 8 * h + CHUNK_N * rep,
                                                                                 n_real - 1)]
                                        d0, d1 = d0 + bn, d1 + bn
                                    v0 = d0 * grp[2][cutlass.max(grp[1][col], 0)]
                                    v1 = d1 * grp[2][cutlass.max(grp[1][col + 1], 0)]
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
                                mm = col0 + c0 + i // 4 % (tile_m // 8) * 8 + lane_odd
                                if cutlass.const_expr(grp is not None):
                                    grouped_store(mOut, grp, nn, mm, lo, hi)
                                elif nn < n_real and mm < m_size:
                                    if cutlass.const_expr(n_real % 2 == 0):
                                        st_x2(mOut.iterator.toint() + cutlass.Int64(mm * n_real + nn) * 2, lo, hi)
                                    else:  # rows of out are not 4-byte aligned
                                        mOut[mm, nn] = lo.to(dt)
                                        if nn + 1 < n_real:
                                            mOut[mm, nn + 1] = hi.to(dt)
                if cutlass.const_expr(cluster_red):
                    # every CTA's shared memory stays alive until its peers have read it
                    cute.arch.cluster_arrive()
                    cute.arch.cluster_wait()
            if cutlass.const_expr(out_is_f32):
                # split-K over a cluster that multicasts x: fp32 atomics into the zeroed output
                if warp_idx < cons_warps:
                    for i in cutlass.range_constexpr(n_acc):
                        rr, cc = tcid[i]
                        nn = row0 + rr
                        mm = col0 + cc
                        if nn < n_real and mm < m_size:
                            val = acc[i] * alpha
                            if bidz == 0:
                                val = val + mBias[nn].to(cutlass.Float32)
                            cute.arch.atomic_add((mOut.iterator + (mm * n_real + nn)).llvm_ptr, val)

        def operands(mX: cute.Tensor):
            """The tiled wgmma, the staged x layout in shared memory, and x's TMA atom + tensor."""
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                dt,
                dt,
                cute.nvgpu.OperandMajorMode.K,
                cute.nvgpu.OperandMajorMode.K,
                cutlass.Float32,
                (1, 1, 1),
                tiler_mn=(CHUNK_N, tile_m),
                a_source=warpgroup.OperandSource.RMEM,
            )
            x_smem_layout_staged = sm90_utils.make_smem_layout_b(
                utils.LayoutEnum.ROW_MAJOR, (CHUNK_N, tile_m, tile_k), dt, stages
            )
            x_smem_one = cute.slice_(x_smem_layout_staged, (None, None, 0))
            tma_atom_x, tma_x = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SMulticastOp() if cl > 1
                else cpasync.CopyBulkTensorTileG2SOp(),
                mX, x_smem_one, (tile_m, tile_k), num_multicast=cl
            )
            return tiled_mma, x_smem_layout_staged, tma_atom_x, tma_x

        @cute.jit
        def host(
            mX: cute.Tensor,
            mW: cute.Tensor,
            mAlpha: cute.Tensor,
            mBias: cute.Tensor,
            mOut: cute.Tensor,
            use_pdl: cutlass.Int32,
            stream: cuda.CUstream,
        ):
            tiled_mma, x_smem_layout_staged, tma_atom_x, tma_x = operands(mX)
            m_size = mX.shape[0]
            m_tiles = (m_size + tile_m - 1) // tile_m
            if cutlass.const_expr(raster_n):
                grid = (n_tiles, m_tiles, split_k)
            else:
                grid = (m_tiles, n_tiles, split_k)
            kernel(
                tma_atom_x, tma_x, mW, mAlpha, mBias, mOut, m_size, tiled_mma,
                x_smem_layout_staged,
            ).launch(grid=grid, block=[threads, 1, 1],
                     cluster=(1, 1, split_k) if cluster_red else (cl, 1, 1), stream=stream, use_pdl=use_pdl,
                     **occupancy)

        @cute.jit
        def host_grouped(
            mX: cute.Tensor,
            mW: cute.Tensor,
            mAlpha: cute.Tensor,
            mBias: cute.Tensor,
            mOut: cute.Tensor,
            mBlockExpert: cute.Tensor,
            mRows: cute.Tensor,
            mTopkW: cute.Tensor,
            use_pdl: cutlass.Int32,
            stream: cuda.CUstream,
        ):
            tiled_mma, x_smem_layout_staged, tma_atom_x, tma_x = operands(mX)
            blocks = mBlockExpert.shape[0]
            grid = (n_tiles, blocks, 1) if raster_n else (blocks, n_tiles, 1)
            grouped_kernel(
                tma_atom_x, tma_x, mW, mAlpha, mBias, mOut, mX.shape[0], tiled_mma, x_smem_layout_staged,
                mBlockExpert, mRows, mTopkW,
            ).launch(grid=grid, block=[threads, 1, 1], cluster=(cl, 1, 1), stream=stream, use_pdl=use_pdl,
                     **occupancy)

        return host if self.grouped is None else host_grouped

    def fake_args(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

        dt = cutlass.BFloat16 if self.dtype == "bfloat16" else cutlass.Float16
        m = cute.sym_int32()
        x = make_fake_compact_tensor(dt, (m, self.k), stride_order=(1, 0), assumed_align=16)
        w = make_fake_compact_tensor(
            cutlass.Uint8, (self.np_ // CHUNK_N * (self.kp // CHUNK_K) * self.chunk,),
            assumed_align=16,
        )
        alpha = make_fake_compact_tensor(cutlass.Float32, (1,), assumed_align=4)
        bias = make_fake_compact_tensor(dt, (self.n,), assumed_align=2)
        out_dt = cutlass.Float32 if self.cfg.split_k > 1 and not self.cfg.cluster_reduce else dt
        out = make_fake_compact_tensor(out_dt, (m, self.n), stride_order=(1, 0), assumed_align=4)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        return x, w, alpha, bias, out, 1, stream

    def fake_args_grouped(self):
        """The grouped GEMM's arguments: x [rows, K] sorted rows, every expert's packed weight,
        alpha [E], bias [E * N] (fp32; read only by a kernel built with it), out ("up": h [rows, N / 2];
        "down": y [pairs, N]), block_expert [blocks], sorted_rows [rows], topk_weights [pairs] (fp32)."""
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

        dt = cutlass.BFloat16 if self.dtype == "bfloat16" else cutlass.Float16
        e, rows, blocks, pairs = (cute.sym_int32() for _ in range(4))
        x = make_fake_compact_tensor(dt, (rows, self.k), stride_order=(1, 0), assumed_align=16)
        w = make_fake_compact_tensor(
            cutlass.Uint8, (e * (self.np_ // CHUNK_N * (self.kp // CHUNK_K) * self.chunk),), assumed_align=16)
        alpha = make_fake_compact_tensor(cutlass.Float32, (e,), assumed_align=4)
        bias = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int32(),), assumed_align=4)  # [E * N] or unused
        out_shape = (rows, self.n // 2) if self.grouped.kind == "up" else (pairs, self.n)
        out = make_fake_compact_tensor(dt, out_shape, stride_order=(1, 0), assumed_align=4)
        bexp = make_fake_compact_tensor(cutlass.Int32, (blocks,), assumed_align=4)
        srows = make_fake_compact_tensor(cutlass.Int32, (rows,), assumed_align=4)
        tw = make_fake_compact_tensor(cutlass.Float32, (pairs,), assumed_align=4)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        return x, w, alpha, bias, out, bexp, srows, tw, 1, stream


def _check(cfg: Sm90GemmConfig, n: int, k: int, fmt: str, dtype: str) -> None:
    reason = validate(cfg, n, k, fmt, dtype)
    if reason is not None:
        raise ValueError(f"invalid Sm90GemmConfig {cfg} for n={n}, k={k}, {fmt}, {dtype}: {reason}")


def _compile(cfg: Sm90GemmConfig, n: int, k: int, fmt: str, dtype: str) -> Callable:
    """The compiled launcher, from the disk kernel cache when it holds it (see kernel_cache).
    ``pdl`` is a launch argument: both values share one binary."""
    from ..kernel_cache import compile_cached

    _check(cfg, n, k, fmt, dtype)
    cfg = pdl.binary_config(cfg)

    def build():
        import cutlass.cute as cute

        kern = _Sm90W4A16Kernel(cfg, n, k, fmt, dtype)
        host = kern.build()
        # the kernel is sm_90a-only: name the target so CPU-only hosts (CI) compile it too
        return cute.compile(host, *kern.fake_args(), options="--enable-tvm-ffi --gpu-arch sm_90a")

    return compile_cached("sm90_w4a16_gemm", __name__, (cfg, n, k, fmt, dtype), build)


def compile_only(cfg: Sm90GemmConfig, n: int, k: int, fmt: str, dtype: str) -> None:
    """Compile without a GPU (set CUTE_DSL_ARCH=sm_90a), for CI."""
    _compile(cfg, n, k, fmt, dtype)


def compile_kernel(cfg: Sm90GemmConfig, n: int, k: int, fmt: str, dtype: str) -> Callable:
    """Compile once for (cfg, n, k, fmt, dtype); the returned ``run(x, packed, bias)`` serves any M."""
    fn = _compile(cfg, n, k, fmt, dtype)
    tdt = getattr(torch, dtype)
    zeros: dict[torch.device, torch.Tensor] = {}
    split = cfg.split_k > 1 and not cfg.cluster_reduce  # fp32 atomics into a zeroed buffer
    use_pdl = cfg.pdl

    def run(x: torch.Tensor, packed: PackedSm90Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if packed.n != n or packed.k != k or packed.fmt != fmt:
            raise ValueError(
                f"kernel compiled for n={n}, k={k}, {fmt}; got a packed weight n={packed.n}, "
                f"k={packed.k}, {packed.fmt}"
            )
        if x.dtype != tdt or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"expected x [M, {k}] {tdt}, got {tuple(x.shape)} {x.dtype}")
        if fmt == "mxfp4" and dtype == "float16" and not packed.fp16_ok:
            raise ValueError(
                "this mxfp4 weight's scale exponents span more than 14 binades: float16 "
                "activations cannot hold the scaled values exactly; use bfloat16"
            )
        if not x.is_contiguous() or x.data_ptr() % 16:
            x = x.contiguous() if not x.is_contiguous() else x.clone()
        m = x.shape[0]
        if bias is None:
            b = zeros.get(x.device)
            if b is None:
                b = zeros[x.device] = torch.zeros(n, dtype=tdt, device=x.device)
        else:
            b = bias
        if split:
            out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
        else:
            out = torch.empty(m, n, dtype=tdt, device=x.device)
        if m == 0:
            return out.to(tdt)
        fn(x, packed.data.view(-1), packed.alpha, b, out, pdl.launch_flag(use_pdl))
        return out.to(tdt) if split else out

    return run
