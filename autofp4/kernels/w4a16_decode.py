"""Small-M ("decode") W4A16 FP4 linear for Hopper: a memory-bound, warp-level-MMA kernel.

``out[M, N] = (x[M, K] @ W[N, K]^T) * global_scale + bias`` for M = 1..``m_max`` tokens, where
``W`` is NVFP4 or MXFP4. The FP4 bytes stream from HBM once; everything else is small.

How it works
------------
* Swap A and B: the kernel computes ``out^T = W x^T`` with ``mma.sync.m16n8k16`` (fp32
  accumulate). The decoded *weights* are the A operand (16 rows of N per MMA), the tokens the
  N=8 operand (``m_max / 8`` n8 tiles), so M = 1..8 wastes no weight bandwidth.
* Each warp owns ``tiles_per_warp`` 16-row tiles of W (sharing its x fragments) and a range of
  K (``k_split`` CTAs share a tile's K). Without ``x_smem`` the warps share nothing: no shared
  memory, no CTA barriers.
  K is walked in groups of 512 = 8 chunks of 64. Per chunk, each lane issues ONE 16-byte load
  that holds exactly its A fragments for 4 MMAs (rows ``g`` and ``g + 8``, 16 consecutive K).
  The reduction over K is order-free, so lane ``t`` of a quad takes the physical K range
  ``16 t .. 16 t + 15`` of the chunk and MMA step ``j`` uses ``16 t + 4 j .. + 3``; the same map
  is applied to x, whose B fragments then come from two 16-byte loads per lane and n8 tile.
* :func:`pack_weight` reorders the nibbles of each 32-bit word so that the decode is a few
  shift/rotate/and/or ops (:mod:`autofp4.kernels._fp4_bits`): the 3 magnitude bits of an E2M1 value land on the low
  exponent/mantissa bits of a bf16 (fp16) lane and its sign on bit 15, which is the value
  times 2**-126 (2**-14 for fp16; code 1 is a subnormal). The power of two is folded into the
  block scale multiply (``mul.rn.bf16x2``) and the fp32 epilogue, so every product is exact:
  - nvfp4: every E4M3 value, subnormals included, is a normal number with a 3-bit mantissa in
    one of 18 binades (2**-9 .. 2**8), so :func:`pack_weight` stores each block scale as the
    byte ``c = 8 * (binade + 9) + mantissa`` and the kernel builds its bf16 (fp16) lane with one
    integer multiply-add, like mxfp4: ``c * 16 + (236 << 7)`` is the scale times 2**118 in bf16,
    ``c * 128 + (13 << 10)`` the scale times 2**7 in fp16. A zero scale has no code: packing
    zeroes its block's nibbles instead (exact). Decoded
    weight = value * scale * 2**-8 (2**-7); the epilogue multiplies by ``global_scale * 2**8``
    (``* 2**7``).
  - mxfp4: the E8M0 byte ``s`` becomes the bf16 (fp16) power of two ``2**(s + A - 127)``
    (``2**(s + A - 15)``) with one integer multiply-add; ``A = 254 - max(s)`` (``30 - max(s)``)
    is chosen per tensor by :func:`pack_weight`, the epilogue multiplies by ``2**(max(s) - 128)``.
    bf16 needs ``max(s) - min(s) <= 133``, fp16 ``<= 24`` (fp16 has 5 exponent bits); a weight
    outside that range is rejected with a ValueError when run with that dtype.
* Loads: per K group, each lane issues 9 (x tiles_per_warp) 16-byte loads (8 weight chunks
  bypassing L1, one scale record) before decoding; with ``prefetch`` the next group's loads are
  issued into a second register buffer before the current group is computed. x is read with
  L1-cached 16-byte loads (only rows < M; other lanes' loads are predicated off).
* ``x_smem``: the CTA copies each K group of x (M rows of 512) into shared memory between two
  CTA barriers, and every warp reads its B fragments there; the group's weight loads are issued
  before the copy, so both are in flight together.
* ``smem_stages = n``: weights, scales and x of K groups go through an n-deep ring in shared
  memory with ``cp.async`` (``.cg``: L2 only); while group i is computed, the copies of groups
  i+1 .. i+n-1 are in flight. One ``cp.async.wait_group n-2`` and one CTA barrier per group;
  each lane reads back only the 16-byte chunks it copied, one chunk at a time, so the weight
  buffer leaves the registers (56 instead of 107 at m_max = 16). Past K, x is zero-filled.
* ``ctas_per_sm = n``: ``.minnctapersm n``, the compiler caps registers so n CTAs fit per SM.
* ``split_reduce="cluster"``: the ``k_split`` CTAs of a tile form a thread-block cluster; each
  leaves its partial sums in shared memory and, after a cluster barrier, sums its share of the
  outputs over the cluster (``mapa`` + ``ld.shared::cluster``) and stores them.
* ``k_split > 1``: each CTA writes fp32 partial sums to a workspace ``[k_split, M, N16]``
  (``torch.empty`` per call). ``split_reduce="kernel"``: a second small kernel sums them and
  applies the epilogue and bias. ``"last_warp"``: one launch; each warp counts itself in on a
  per-tile int32 counter (``fence.acq_rel.gpu`` + ``atom.add``) and the last one sums the
  partials; it resets the counter, so the counters (zeroed once per device) stay zero between
  launches. No host sync, CUDA-graph capturable either way.
* Dependent launch (:mod:`autofp4.pdl`): both kernels are launched so that they may start
  while the previous kernel of the stream finishes; a warp lets the next kernel launch
  (``griddepcontrol.launch_dependents``) once it has read all its weights, so the next kernel's
  CTAs arrive for this one's tail, not its whole run; with ``pdl_early`` it does so right after
  its own ``griddepcontrol.wait``, so the next kernel launches and prefetches its weights while
  this one streams its own (it cannot launch before this one has passed its wait, so at most one
  kernel runs ahead). Before ``griddepcontrol.wait`` a warp only
  pulls its first ``PF_GROUPS`` K groups of weights and scales into L2
  (``cp.async.bulk.prefetch``; about 16 MB over the grid at most); x, the outputs, the workspace
  and the counters are touched only after it.
* One compile serves every ``1 <= M <= m_max`` (symbolic M); n8 tiles beyond M are skipped at
  run time. Larger M raises a ValueError (the wgmma kernel serves those).
"""

import os
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from .. import pdl
from ..hopper import MAX_CLUSTER, REGS_PER_SM, SMEM_PER_CTA, THREADS_PER_SM
from ..problem import BLOCK_SIZE, DTYPES, FORMATS
from ._fp4_bits import decode_terms, rotl, word_bit

#: helper modules whose source is part of this kernel's (kernel cache key, DB provenance)
KERNEL_SOURCES = ("autofp4.kernels._ptx", "autofp4.kernels._fp4_bits")

TILE_N = 16  # weight rows per warp (the MMA's M)
CHUNK_K = 64  # K per 16-byte lane load (4 MMA k-steps)
CHUNKS = 8  # chunks per K group (one 16-byte scale load per lane covers a group)
GROUP_K = CHUNK_K * CHUNKS  # 512
M_MAX_CHOICES = (8, 16, 32, 64)
WARPS_CHOICES = (1, 2, 4, 8, 16)
MAX_K_SPLIT = 64
SPLIT_REDUCE = ("kernel", "last_warp", "cluster")
CLUSTER_SMEM_PER_CTA = 96 * 1024  # shared memory for the partial sums of one CTA
TILES_PER_WARP_CHOICES = (1, 2)
MAX_CTAS_PER_SM = 32
MIN_REGS_CAP = 64  # ptxas -v: m_max = 8 needs 62 registers (48 spill 64 bytes); m_max = 16 fits 78
SMEM_STAGES_CHOICES = (0, 2, 3, 4)
PDL_PREFETCH_BYTES = 16 << 20  # weight bytes a grid prefetches into L2 before its dependent wait

# fp32 epilogue factors that undo the power of two folded into the decode (nvfp4)
_NV_SHIFT = {"bfloat16": 8, "float16": 7}
# mxfp4: largest biased exponent the scaled block scale may take, and the range it needs
_MX_TOP = {"bfloat16": 254, "float16": 30}
_MX_SPAN = {"bfloat16": 133, "float16": 24}
_MX_MUL = {"bfloat16": 0x00800080, "float16": 0x04000400}
# nvfp4 scale codes (see the module docstring): multiplier and addend of the lane pattern
_NV_MUL = {"bfloat16": 0x00100010, "float16": 0x00800080}
_NV_ADD = {"bfloat16": (236 << 7) | (236 << 23), "float16": (13 << 10) | (13 << 26)}


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True)
class DecodeConfig:
    """One point of the decode kernel's search space.

    warps:   warps per CTA; each warp owns one 16-row tile of W, so a CTA covers 16 * warps rows.
    k_split: CTAs that share one tile's K range (split-K; > 1 adds a tiny reduction kernel).
    m_max:   largest M this compile serves (m_max / 8 n8 MMA tiles per warp).
    prefetch: load K group i+1 into a second register buffer while group i is computed
             (more bytes in flight per warp, more registers).
    split_reduce: how split-K partials are summed: "kernel" (a second small kernel),
             "last_warp" (the last warp to finish a tile sums them in the same launch, using
             per-tile arrival counters that reset themselves) or "cluster" (the k_split CTAs of
             a tile form a thread-block cluster and sum through distributed shared memory:
             one launch, no global workspace; k_split <= 8).
    tiles_per_warp: 16-row tiles one warp decodes against the same x fragments (fewer x
             loads per weight byte, more registers).
    x_smem:  stage each K group of x (M rows x 512) in shared memory once per CTA, read by all
             its warps, instead of every warp reading x through L1/L2 (at M >= 16 and large K
             those re-reads can move as many bytes through L2 as the weights); no prefetch.
    ctas_per_sm: 0 leaves the register allocation to the compiler; n > 0 asks it to fit n CTAs
             per SM (``.minnctapersm``: at most 65536 / (n x threads) registers per thread).
             At m_max = 16 the compiler takes 107 registers, 4 CTAs of 4 warps per SM (25%
             occupancy, measured with Nsight Compute on an H200); 6 CTAs fit in 78 without spills.
    smem_stages: 0 loads each K group's weights into registers right before computing it. n >= 2
             streams weights, scales and x through an n-deep ring of K groups in shared memory
             with ``cp.async``: while group i is computed, groups i+1 .. i+n-1 are in flight, one
             CTA barrier per group, and each lane reads back its own 16-byte chunks (needs
             x_smem=True).
    pdl:     launch with programmatic dependent launch (:mod:`autofp4.pdl`); a launch flag, so
             both values share one compiled binary.
    pdl_early: let the next kernel launch right after this one's dependent wait instead of after
             its main loop (needs ``pdl``; a different binary).
    """

    kernel: ClassVar[str] = "decode"  # the tag of stored configs (not a field)
    warps: int = 4
    k_split: int = 1
    m_max: int = 16
    prefetch: bool = False
    split_reduce: str = "kernel"
    tiles_per_warp: int = 1
    x_smem: bool = False
    ctas_per_sm: int = 0
    smem_stages: int = 0
    pdl: bool = False
    pdl_early: bool = False

    @property
    def rows_per_cta(self) -> int:
        return TILE_N * self.warps * self.tiles_per_warp


def _groups(k: int) -> int:
    return -(-k // GROUP_K)


def _tiles(n: int) -> int:
    return -(-n // TILE_N)


def validate(cfg: DecodeConfig, n: int, k: int, fmt: str, dtype: str) -> str | None:
    """``None`` if ``cfg`` can run ``(n, k, fmt, dtype)``, else why not (one rule each)."""
    if not isinstance(cfg, DecodeConfig):
        return f"expected a DecodeConfig, got {type(cfg).__name__}"
    if fmt not in FORMATS:
        return f"fmt must be one of {FORMATS}, got {fmt!r}"
    if dtype not in DTYPES:
        return f"dtype must be one of {DTYPES}, got {dtype!r}"
    if not (isinstance(n, int) and n > 0):
        return f"n must be a positive int, got {n!r}"
    if not (isinstance(k, int) and k > 0):
        return f"k must be a positive int, got {k!r}"
    if k % BLOCK_SIZE[fmt]:
        return f"k must be a multiple of the {fmt} block size {BLOCK_SIZE[fmt]}, got k={k}"
    if cfg.warps not in WARPS_CHOICES:
        return f"warps must be one of {WARPS_CHOICES}, got {cfg.warps}"
    if cfg.m_max not in M_MAX_CHOICES:
        return f"m_max must be one of {M_MAX_CHOICES}, got {cfg.m_max}"
    if not (isinstance(cfg.k_split, int) and cfg.k_split >= 1):
        return f"k_split must be an int >= 1, got {cfg.k_split!r}"
    if cfg.k_split > MAX_K_SPLIT:
        return f"k_split must be <= {MAX_K_SPLIT}, got {cfg.k_split}"
    if cfg.k_split > _groups(k):
        return (f"k_split={cfg.k_split} exceeds the {_groups(k)} K groups of {GROUP_K} "
                f"(k={k}); some CTAs would have no work")
    per_split = -(-_groups(k) // cfg.k_split)
    if -(-_groups(k) // per_split) != cfg.k_split:
        return (f"k_split={cfg.k_split} leaves an empty split: {_groups(k)} K groups in chunks "
                f"of {per_split} need only {-(-_groups(k) // per_split)} splits")
    if not isinstance(cfg.prefetch, bool):
        return f"prefetch must be a bool, got {cfg.prefetch!r}"
    if cfg.split_reduce not in SPLIT_REDUCE:
        return f"split_reduce must be one of {SPLIT_REDUCE}, got {cfg.split_reduce!r}"
    if cfg.split_reduce != "kernel" and cfg.k_split == 1:
        return f"split_reduce={cfg.split_reduce!r} only applies with k_split > 1; use 'kernel'"
    if cfg.split_reduce == "cluster":
        if cfg.k_split > MAX_CLUSTER:
            return (f"split_reduce='cluster' makes the {cfg.k_split} K-split CTAs one cluster; "
                    f"at most {MAX_CLUSTER} CTAs per cluster")
        if _cluster_smem_bytes(cfg) > CLUSTER_SMEM_PER_CTA:
            return (f"split_reduce='cluster' needs {_cluster_smem_bytes(cfg)} bytes of shared memory "
                    f"per CTA for the partial sums (limit {CLUSTER_SMEM_PER_CTA}); use fewer warps or m_max")
    if not isinstance(cfg.pdl_early, bool):
        return f"pdl_early must be a bool, got {cfg.pdl_early!r}"
    if cfg.pdl_early and not cfg.pdl:
        return "pdl_early moves the trigger of programmatic dependent launch; it needs pdl=True"
    if not isinstance(cfg.x_smem, bool):
        return f"x_smem must be a bool, got {cfg.x_smem!r}"
    if cfg.x_smem and cfg.prefetch:
        return "x_smem=True stages x per K group between CTA barriers; it needs prefetch=False"
    if cfg.tiles_per_warp not in TILES_PER_WARP_CHOICES:
        return f"tiles_per_warp must be one of {TILES_PER_WARP_CHOICES}, got {cfg.tiles_per_warp}"
    if not (isinstance(cfg.ctas_per_sm, int) and 0 <= cfg.ctas_per_sm <= MAX_CTAS_PER_SM):
        return f"ctas_per_sm must be an int in 0..{MAX_CTAS_PER_SM}, got {cfg.ctas_per_sm!r}"
    if cfg.ctas_per_sm:
        threads = cfg.ctas_per_sm * cfg.warps * 32
        if threads > THREADS_PER_SM:
            return (f"ctas_per_sm={cfg.ctas_per_sm} CTAs of {cfg.warps} warps need {threads} threads per SM; "
                    f"an SM holds {THREADS_PER_SM}")
        cap = REGS_PER_SM // threads // 8 * 8
        if cap < MIN_REGS_CAP:
            return (f"ctas_per_sm={cfg.ctas_per_sm} with {cfg.warps} warps caps registers at {cap} per thread; "
                    f"below {MIN_REGS_CAP} the decode spills")
    if cfg.smem_stages not in SMEM_STAGES_CHOICES:
        return f"smem_stages must be one of {SMEM_STAGES_CHOICES}, got {cfg.smem_stages!r}"
    if cfg.smem_stages:
        if not cfg.x_smem:
            return "smem_stages > 0 stages x in shared memory with the weights; it needs x_smem=True"
        need = _smem_bytes(cfg)
        if need > SMEM_PER_CTA:
            return (f"smem_stages={cfg.smem_stages} needs {need} bytes of shared memory per CTA "
                    f"(limit {SMEM_PER_CTA}); use fewer stages, warps or tiles per warp, or a smaller m_max")
    regs = _register_estimate(cfg)
    if regs > 255:
        return (f"about {regs} registers per thread needed (m_max={cfg.m_max}, tiles_per_warp="
                f"{cfg.tiles_per_warp}, prefetch={cfg.prefetch}); the limit is 255")
    if regs * 32 * cfg.warps > REGS_PER_SM:
        return (f"a CTA of {cfg.warps} warps x about {regs} registers per thread exceeds the "
                f"64K-register file; use fewer warps or a smaller m_max")
    return None


X_ROW_BYTES = GROUP_K * 2 + 16  # a staged x row, padded: conflict-free 16-byte fragment reads


def _cluster_smem_bytes(cfg: DecodeConfig) -> int:
    """fp32 partial sums of every lane of a CTA: warps x tiles x (m_max / 8) n8 tiles x 4 x 32."""
    return cfg.warps * cfg.tiles_per_warp * (cfg.m_max // 8) * 4 * 32 * 4


W_STAGE_BYTES = (CHUNKS + 1) * 32 * 16  # one warp's K group of one tile: 8 weight chunks + scales


def _smem_bytes(cfg: DecodeConfig) -> int:
    """Shared memory per CTA: the cluster partial sums, and the staged x (and weight) groups."""
    total = _cluster_smem_bytes(cfg) if cfg.split_reduce == "cluster" and cfg.k_split > 1 else 0
    x_group = cfg.m_max * X_ROW_BYTES
    if cfg.smem_stages:
        return total + cfg.smem_stages * (x_group + cfg.warps * cfg.tiles_per_warp * W_STAGE_BYTES)
    return total + (x_group if cfg.x_smem else 0)


def _register_estimate(cfg: DecodeConfig) -> int:
    """Rough registers per thread: weight/scale buffers, x fragments, accumulators, temporaries."""
    nt = cfg.m_max // 8
    buffers = (4 + CHUNKS * 4) * cfg.tiles_per_warp * (2 if cfg.prefetch else 1)
    if cfg.smem_stages:  # a chunk and the scales of each tile at a time
        buffers = 8 * cfg.tiles_per_warp
    return 32 + buffers + 8 * nt + 4 * nt * cfg.tiles_per_warp


# ----------------------------------------------------------------------------- layout
# Each 32-bit word of a lane holds the 8 values of one MMA k-step, as the 4 pairs of its A
# registers: register r holds rows g (r even) / g + 8 (r odd) and physical K offsets 0,1 (r < 2)
# / 2,3 (r >= 2) of the step; its bits are placed by :func:`._fp4_bits.word_bit` (pair r).


@dataclass(frozen=True, eq=False)
class DecodePacked:
    """A weight in the decode kernel's layout (see :func:`pack_weight`)."""

    fmt: str
    n: int
    k: int
    data: torch.Tensor  # uint8 [tiles * groups * 8 * 32 * 16]
    scales: torch.Tensor  # uint8 [tiles * groups * slots * 16]
    alpha: torch.Tensor  # fp32 [2]: epilogue factor for bf16, fp16 activations
    scale_add: tuple[int, int]  # integer added to scale code * _MX_MUL / _NV_MUL (bf16, fp16)
    unsupported: tuple[str | None, str | None]  # (bf16, fp16): why this weight cannot run

    @property
    def device(self) -> torch.device:
        return self.data.device


def _codes(w: Any) -> torch.Tensor:
    d = w.data
    return torch.stack((d & 0x0F, d >> 4), dim=-1).reshape(d.shape[0], d.shape[1] * 2)


_NV_CODE_LUT: list[int] = []


def _nv_scale_code_lut() -> list[int]:
    """E4M3 byte -> scale code ``8 * (binade + 9) + mantissa`` of its magnitude (-1: a zero or NaN)."""
    if not _NV_CODE_LUT:
        for b in range(256):
            e, m = (b >> 3) & 0xF, b & 7
            if (b & 0x7F) == 0x7F or (e == 0 and m == 0):
                _NV_CODE_LUT.append(-1)
            elif e == 0:  # subnormal m * 2**-9: normalize the 3-bit mantissa
                top = m.bit_length() - 1  # m = 2**top * (1 + frac)
                _NV_CODE_LUT.append(8 * top + ((m << (3 - top)) & 7))
            else:  # 2**(e - 7) * (1 + m / 8)
                _NV_CODE_LUT.append(8 * (e + 2) + m)
    return _NV_CODE_LUT


def _nv_scale_codes(raw: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Scale codes of an NVFP4 weight's E4M3 block scales ``raw`` (uint8 ``[N, K / 16]``, none
    negative or NaN: ``FP4Weight`` rejects those). A zero scale has no code: its block's nibbles
    (``codes``, ``[N, K]``) are zeroed in place instead, so its values decode to zero."""
    lut = torch.tensor(_nv_scale_code_lut(), dtype=torch.int16, device=raw.device)
    out = lut[raw.long()]
    codes[(out < 0).repeat_interleave(16, dim=1)] = 0
    return out.clamp_min(0).to(torch.uint8)


def pack_weight(w: Any) -> DecodePacked:
    """Reorder an ``FP4Weight`` ``[N, K]`` into the layout the decode kernel streams.

    data: for tile (16 rows), K group (512), chunk (64), lane (g, t): 16 bytes = 4 words, word
    ``j`` holding rows ``g``/``g + 8`` x K ``16 t + 4 j .. + 3`` of the chunk, bits placed by
    :func:`_fp4_bits.word_bit`. scales: per tile, group and lane slot, 16 bytes = for chunk ``c``, byte
    ``2 c`` (row g) and ``2 c + 1`` (row g + 8). Rows and K are zero-padded to 16 / 512.
    Pure torch; runs on any device.
    """
    if getattr(w, "experts", 0):
        raise ValueError(f"pack_weight takes a 2-D weight, got stacked experts of shape {tuple(w.shape)}")
    fmt = w.fmt
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    n, k = int(w.shape[-2]), int(w.shape[-1])
    if k % BLOCK_SIZE[fmt]:
        raise ValueError(f"k must be a multiple of {BLOCK_SIZE[fmt]} for {fmt}, got {k}")
    dev = w.data.device
    tiles, groups = _tiles(n), _groups(k)
    n_pad, k_pad = tiles * TILE_N, groups * GROUP_K

    codes = _codes(w)
    if fmt == "nvfp4":
        nv_codes = _nv_scale_codes(w.scale.view(torch.uint8), codes)
    q = torch.zeros(n_pad, k_pad, dtype=torch.uint8, device=dev)
    q[:n, :k] = codes
    # [tile, h, g, group, chunk, t, j, kk] -> [tile, group, chunk, g, t, j, h, kk]
    q = q.view(tiles, 2, 8, groups, CHUNKS, 4, 4, 4).permute(0, 3, 4, 2, 5, 6, 1, 7)
    word = torch.zeros(q.shape[:6], dtype=torch.int32, device=dev)  # bit 31 wraps: fine
    for r in range(4):
        h, k0 = r & 1, 2 * (r >> 1)
        for e in range(2):
            code = q[..., h, k0 + e]
            for b in range(4):
                word |= ((code >> b) & 1).to(torch.int32) << word_bit(r, e, b)
    data = word.contiguous().view(torch.uint8).reshape(-1)

    nb = k // BLOCK_SIZE[fmt]
    per_group = GROUP_K // BLOCK_SIZE[fmt]  # 32 (nvfp4) or 16 (mxfp4) blocks per group
    raw = w.scale
    sc = torch.zeros(n_pad, groups * per_group, dtype=torch.uint8, device=dev)
    unsupported: list[str | None] = [None, None]
    if fmt == "nvfp4":
        sc[:n, :nb] = nv_codes
        scale_add = (_NV_ADD["bfloat16"], _NV_ADD["float16"])
        gs = w.global_scale.to(device=dev, dtype=torch.float32).reshape(())
        alpha = torch.stack([gs * 2.0 ** _NV_SHIFT["bfloat16"], gs * 2.0 ** _NV_SHIFT["float16"]])
        tq = 4
    else:
        smax, smin = int(raw.max()), int(raw.min())
        if smax == 255:
            raise ValueError("mxfp4 scales contain the E8M0 NaN (255)")
        sc[:n, :nb] = raw
        sc[n:, :] = smax
        sc[:, nb:] = smax
        adds = []
        for i, dt in enumerate(DTYPES):
            a = _MX_TOP[dt] - smax
            add = (a * _MX_MUL[dt]) & 0xFFFFFFFF  # uint32 arithmetic, passed as an int32
            adds.append(add - (1 << 32) if add >= 1 << 31 else add)
            if smax - smin > _MX_SPAN[dt]:
                unsupported[i] = (f"mxfp4 block exponents span {smax - smin} binades "
                                  f"(E8M0 {smin}..{smax}); {dt} activations hold at most "
                                  f"{_MX_SPAN[dt]} exactly: use bfloat16")
            if smax < 2:
                unsupported[i] = f"mxfp4 scales are all below 2**-125 (max E8M0 byte {smax})"
        scale_add = (adds[0], adds[1])
        alpha = torch.full((2,), 2.0 ** (smax - 128), dtype=torch.float32, device=dev)
        tq = 2
    # [tile, h, g, group, chunk, tq] -> [tile, group, g, tq, chunk, h]
    sc = sc.view(tiles, 2, 8, groups, CHUNKS, tq).permute(0, 3, 2, 5, 4, 1)
    return DecodePacked(fmt, n, k, data, sc.contiguous().reshape(-1), alpha.contiguous(),
                        scale_add, (unsupported[0], unsupported[1]))


def unpack_reference(p: DecodePacked, dtype: str = "bfloat16") -> torch.Tensor:
    """fp32 ``[N, K]`` weight decoded from the packed layout by emulating the kernel's decode
    (``decode_terms`` bit ops, scale encodings, epilogue factor) in torch. Used by tests to
    prove the packed layout and the decode formulas agree with ``FP4Weight.dequantize``."""
    tiles, groups = _tiles(p.n), _groups(p.k)
    words = p.data.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    words = words.view(tiles, groups, CHUNKS, 8, 4, 4)  # tile, group, chunk, g, t, j
    t16 = torch.float16 if dtype == "float16" else torch.bfloat16
    # scales per (tile, group, g, slot, chunk, h), as the kernel builds them in `dtype`
    tq = 4 if p.fmt == "nvfp4" else 2
    sc = p.scales.view(tiles, groups, 8, tq, CHUNKS, 2)
    mul = (_NV_MUL if p.fmt == "nvfp4" else _MX_MUL)[dtype]
    add = p.scale_add[0 if dtype == "bfloat16" else 1]
    bits = (sc.to(torch.int64) * mul + add) & 0xFFFF  # low half: row g lane
    scale = bits.to(torch.int32).to(torch.int16).view(t16)
    scale = scale[:, :, :, torch.arange(4, device=scale.device) // (4 // tq)]  # lane t -> slot
    scale = scale.permute(0, 1, 4, 2, 3, 5).float()  # tile, group, chunk, g, t, h
    vals = torch.zeros(tiles, groups, CHUNKS, 8, 4, 4, 2, 4, dtype=torch.float64,
                       device=words.device)  # ..., j, h, kk
    for r, terms in enumerate(decode_terms(dtype)):
        reg = torch.zeros_like(words)
        for rot, mask in terms:
            reg |= rotl(words, rot) & mask
        h = r & 1
        for e in range(2):
            half = ((reg >> (16 * e)) & 0xFFFF).to(torch.int32).to(torch.int16)
            tiny = half.view(t16).float()
            prod = (tiny * scale[..., None, h]).to(t16)  # mul.rn in the activation dtype
            vals[..., h, 2 * (r >> 1) + e] = prod.double()
    vals = vals * p.alpha[0 if dtype == "bfloat16" else 1].double()
    # [tile, group, chunk, g, t, j, h, kk] -> [tile, h, g, group, chunk, t, j, kk]
    dense = vals.permute(0, 6, 3, 1, 2, 4, 5, 7).reshape(tiles * TILE_N, groups * GROUP_K)
    return dense[: p.n, : p.k].float()


# ----------------------------------------------------------------------------- kernel
def _dsl():
    """Import CuTeDSL lazily (the layout helpers above need only torch)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    return cutlass, cute, llvm, T


def _build(cfg: DecodeConfig, n: int, k: int, fmt: str, dtype: str, has_bias: bool):
    """The main (and, for k_split > 1, the reduction) @cute.jit launchers for one problem."""
    cutlass, cute, llvm, T = _dsl()
    from cutlass import Float32, Int32, Int64, Uint32

    from ._ptx import (asm, asm_void, decode_pair, griddep_launch_dependents, griddep_wait, ld_dsmem_f32,
                       ld_global_v4, make_load_group, mma_m16n8k16, mul_x2, prefetch_l2)

    WARPS, KS, NT = cfg.warps, cfg.k_split, cfg.m_max // 8
    PREFETCH, LAST_WARP = cfg.prefetch, cfg.split_reduce == "last_warp"
    CLUSTER = cfg.split_reduce == "cluster" and cfg.k_split > 1
    XS = cfg.x_smem
    STAGES = cfg.smem_stages  # 0: weights through registers; else cp.async ring depth
    THREADS = 32 * cfg.warps
    J = cfg.tiles_per_warp * (cfg.m_max // 8) * 4  # accumulators per lane
    TPW = cfg.tiles_per_warp
    TILES, GROUPS = _tiles(n), _groups(k)
    GPS = -(-GROUPS // KS)  # K groups per split
    N_PAD = TILES * TILE_N
    SLOTS = 32 if fmt == "nvfp4" else 16
    # K groups of its weights (and their scales) each warp pulls into L2 before it waits for the
    # previous kernel (dependent launch): its first ones, about 16 MB over the whole grid at most
    PF_GROUPS = max(1, min(GPS, PDL_PREFETCH_BYTES // (TILES * KS * (CHUNKS * 512 + SLOTS * 16))))
    TERMS = decode_terms(dtype)
    BF16 = dtype == "bfloat16"
    ALPHA_IDX = 0 if BF16 else 1
    SCALE_MUL = (_NV_MUL if fmt == "nvfp4" else _MX_MUL)[dtype]

    def ld16(addr, pred, stream: bool):
        return ld_global_v4(addr, pred, stream)

    def mma(a, b0, b1, c):
        return mma_m16n8k16(a, b0, b1, c, BF16)

    def scale_pairs(bits16, sadd):
        """Low 16 bits = (row g, row g+8) scale codes -> replicated (S_g, S_g), (S_g8, S_g8)."""
        lo = (bits16 & Uint32(0xFF)) * Uint32(SCALE_MUL) + sadd
        hi = ((bits16 >> Uint32(8)) & Uint32(0xFF)) * Uint32(SCALE_MUL) + sadd
        return lo, hi

    def decode(word, r):
        return decode_pair(Uint32(word), TERMS[r])

    def ld_cg_f32(addr):
        return Float32(asm(T.f32(), [Int64(addr)], "ld.global.cg.f32 $0, [$1];", "=f,l"))

    def arrive(addr):
        """Release this warp's partial sums and count it in; returns the previous count."""
        return Int32(asm(T.i32(), [Int64(addr)], "fence.acq_rel.gpu;\natom.global.add.u32 $0, [$1], 1;",
                         "=r,l", side_effects=True))

    def fence_gpu():
        asm_void("fence.acq_rel.gpu;")

    def store_u32(addr, v):
        asm_void("st.global.u32 [$0], $1;", "l,r", Int64(addr), Int32(v))

    def store_f32(addr, v):
        asm_void("st.global.cg.f32 [$0], $1;", "l,f", Int64(addr), Float32(v))

    def ld_shared16(addr):
        """16 bytes of shared memory (volatile: it must stay between the CTA barriers)."""
        r = asm(llvm.StructType.get_literal([T.i32()] * 4), [Int32(addr)],
                "ld.shared.v4.u32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r", side_effects=True)
        return [Uint32(llvm.extractvalue(T.i32(), r, [i])) for i in range(4)]

    def cp_async16(dst, src, pred, nbytes):
        """``@pred`` copy 16 bytes global -> shared without registers (``cp.async.cg``: L2 only);
        the ``16 - nbytes`` bytes past ``nbytes`` (0 or 16) are zero-filled."""
        asm_void("{ .reg .pred p; setp.ne.b32 p, $2, 0;\n"
                 "@p cp.async.cg.shared.global [$0], [$1], 16, $3; }",
                 "r,l,r,r", Int32(dst), Int64(src), Int32(pred), Int32(nbytes))

    def cp_commit():
        asm_void("cp.async.commit_group;")

    def cp_wait(pending: int):
        """Until at most ``pending`` of this thread's newest copy groups are in flight."""
        asm_void(f"cp.async.wait_group {pending};")

    def st_shared16(addr, v):
        asm_void("st.shared.v4.u32 [$0], {$1,$2,$3,$4};", "r,r,r,r,r", Int32(addr), *(Uint32(e) for e in v))

    NBUF = 4 + CHUNKS * 4  # 16 B of scales + 8 x 16 B of weights per lane and K group

    load_group = make_load_group(SLOTS, CHUNKS)

    def tile_bases(wq, sc, tile0, lane, g, t):
        """Per tile of this warp: its lane's weight and scale addresses, and whether it exists."""
        slot = lane
        if cutlass.const_expr(SLOTS == 16):
            slot = g * 2 + t // 2
        w_bases, s_bases, valid = [], [], []
        for tw in range(TPW):
            w_bases.append(wq.iterator.toint() + Int64(((tile0 + tw) * GROUPS * CHUNKS * 32 + lane) * 16))
            s_bases.append(sc.iterator.toint() + Int64(((tile0 + tw) * GROUPS * SLOTS + slot) * 16))
            valid.append(tile0 + tw < TILES)
        return w_bases, s_bases, valid

    def load_tiles(buf, w_bases, s_bases, gi, valid, pred):
        for tw in range(TPW):
            load_group(buf, tw * NBUF, w_bases[tw], s_bases[tw], gi, Int32(valid[tw] & pred))

    @cute.jit
    def copy_tile(dst, w_base, s_base, gi, ok):
        """One lane's weight chunks and scale record of K group ``gi`` -> its slots at ``dst``."""
        cp_async16(dst + CHUNKS * 512, s_base + Int64(gi) * (SLOTS * 16), ok, 16)
        for c in cutlass.range_constexpr(CHUNKS):
            cp_async16(dst + c * 512, w_base + (Int64(gi) * CHUNKS + c) * 512, ok, 16)

    XPR = GROUP_K // 8  # 16-byte x chunks per row and K group
    XPT = -(-cfg.m_max * XPR // THREADS)  # x chunks per thread and K group

    def x_slots(tidx):
        """This thread's x chunks of every K group: (row, column) with the byte offsets of the
        chunk in x (of group 0) and in a staged group; loop-invariant, computed once."""
        slots = []
        for i in range(XPT):
            if THREADS % XPR == 0 and i > 0:  # the same column, rows a constant step further
                r0, col, src0, dst0 = slots[0]
                step = i * (THREADS // XPR)
                slots.append((r0 + step, col, src0 + step * k * 2, dst0 + step * X_ROW_BYTES))
                continue
            q = tidx + i * THREADS
            row, col = q // XPR, q % XPR
            slots.append((row, col, Int64(row) * (k * 2) + col * 16, row * X_ROW_BYTES + col * 16))
        return slots

    def x_chunk(x_addr, slot, gi):
        """Address of a slot's chunk of K group ``gi`` (always a valid one) and whether it is
        inside K."""
        row, col, src, _ = slot
        kk = gi * GROUP_K + col * 8
        if cutlass.const_expr(k % GROUP_K == 0):
            return x_addr + src + Int64(gi) * (GROUP_K * 2), kk < k
        return x_addr + (Int64(row) * k + Int64(cutlass.min(kk, k - 8))) * 2, kk < k

    def copy_x(x_addr, xs_stage, gi, live, slots, m_rows):
        """The CTA's threads copy K group ``gi`` of x (M rows) into one stage; past K, zeros."""
        for slot in slots:
            src, kin = x_chunk(x_addr, slot, gi)
            cp_async16(xs_stage + slot[3], src, Int32(live & (slot[0] < m_rows)), Int32(kin) * 16)

    def copy_stage(w_stage, w_bases, s_bases, valid, have_tile, gi, g1, x_addr, xs_stage, slots, m_rows):
        """Issue (not wait for) every copy of K group ``gi`` into one stage; none past ``g1``."""
        live = gi < g1
        for tw in range(TPW):
            copy_tile(w_stage + tw * W_STAGE_BYTES, w_bases[tw], s_bases[tw], gi,
                      Int32(valid[tw] & live & have_tile))
        copy_x(x_addr, xs_stage, gi, live, slots, m_rows)

    @cute.jit
    def compute_group(buf: cute.Tensor, acc, xv, x_base, gi, g, t, sadd_u, m_rows, w_smem):
        """One K group. ``x_base``: this lane's x address in global memory, or (x_smem) in the
        staged group in shared memory (rows >= M hold stale values: they only feed MMA columns
        that are never stored). With shared-memory stages, ``w_smem`` is this lane's slot of
        the staged group (chunk c of tile tw at ``tw * W_STAGE_BYTES + c * 512``, the scales
        after the chunks); the lane reads back only what it copied, and ``buf`` holds one
        chunk and the scales of each tile at a time."""
        if cutlass.const_expr(STAGES):
            for tw in cutlass.range_constexpr(TPW):
                v = ld_shared16(w_smem + tw * W_STAGE_BYTES + CHUNKS * 512)
                for i in cutlass.range_constexpr(4):
                    buf[tw * 8 + i] = v[i]
        for c in cutlass.range_constexpr(CHUNKS):
            kin = gi * GROUP_K + c * CHUNK_K + t * 16 < k
            for nt in cutlass.range_constexpr(NT):
                if nt * 8 < m_rows:
                    m = nt * 8 + g
                    if cutlass.const_expr(XS):
                        xa = x_base + m * X_ROW_BYTES + c * CHUNK_K * 2
                        v0 = ld_shared16(xa)
                        v1 = ld_shared16(xa + 16)
                    else:
                        xa = x_base + (Int64(m) * k + Int64(gi) * GROUP_K + c * CHUNK_K) * 2
                        ok = Int32((m < m_rows) & kin)
                        v0 = ld16(xa, ok, False)
                        v1 = ld16(xa + Int64(16), ok, False)
                    for i in cutlass.range_constexpr(4):
                        xv[nt * 8 + i] = v0[i]
                        xv[nt * 8 + 4 + i] = v1[i]
            for tw in cutlass.range_constexpr(TPW):  # the x fragments serve every tile
                b = tw * NBUF
                wo = b + 4 + 4 * c  # this chunk's 4 words in buf
                if cutlass.const_expr(STAGES):
                    b, wo = tw * 8, tw * 8 + 4
                    v = ld_shared16(w_smem + tw * W_STAGE_BYTES + c * 512)
                    for i in cutlass.range_constexpr(4):
                        buf[wo + i] = v[i]
                s_g, s_g8 = scale_pairs(buf[b + c // 2] >> Uint32(16 * (c % 2)), sadd_u)
                for j in cutlass.range_constexpr(4):
                    wd = buf[wo + j]
                    a = [mul_x2(decode(wd, 0), s_g, BF16), mul_x2(decode(wd, 1), s_g8, BF16),
                         mul_x2(decode(wd, 2), s_g, BF16), mul_x2(decode(wd, 3), s_g8, BF16)]
                    for nt in cutlass.range_constexpr(NT):
                        if nt * 8 < m_rows:
                            q = (tw * NT + nt) * 4
                            cur = [acc[q + i] for i in range(4)]
                            res = mma(a, xv[nt * 8 + 2 * j], xv[nt * 8 + 2 * j + 1], cur)
                            for i in cutlass.range_constexpr(4):
                                acc[q + i] = res[i]

    @cute.kernel
    def main_kernel(x: cute.Tensor, wq: cute.Tensor, sc: cute.Tensor, alpha: cute.Tensor,
                    out: cute.Tensor, bias: cute.Tensor, ws: cute.Tensor, cnt: cute.Tensor,
                    sadd: Int32, m_rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bz, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        t = lane % 4
        tile0 = (bidx * WARPS + warp) * TPW  # this warp's first 16-row tile
        g0 = bz * GPS
        g1 = cutlass.min(g0 + GPS, GROUPS)
        acc = cute.make_rmem_tensor((TPW * NT * 4,), Float32)
        for i in cutlass.range_constexpr(TPW * NT * 4):
            acc[i] = Float32(0.0)
        xv = cute.make_rmem_tensor((NT * 8,), Uint32)
        buf_a = cute.make_rmem_tensor((TPW * NBUF,), Uint32)
        buf_b = cute.make_rmem_tensor((TPW * NBUF,), Uint32)
        sadd_u = Uint32(sadd)
        w_bases, s_bases, valid = tile_bases(wq, sc, tile0, lane, g, t)
        # dependent launch: until the previous kernel has finished, only pull this warp's first
        # weight groups into L2
        if lane == 0:
            n_pf = cutlass.min(g1 - g0, PF_GROUPS)
            for tw in range(TPW):
                if (tile0 + tw < TILES) & (n_pf > 0):
                    prefetch_l2(wq.iterator.toint() + Int64(((tile0 + tw) * GROUPS + g0) * (CHUNKS * 512)),
                                n_pf * (CHUNKS * 512))
                    prefetch_l2(sc.iterator.toint() + Int64(((tile0 + tw) * GROUPS + g0) * (SLOTS * 16)),
                                n_pf * (SLOTS * 16))
        griddep_wait()
        if cutlass.const_expr(cfg.pdl_early):
            # the next kernel may launch now and prefetch its weights while this one streams
            griddep_launch_dependents()
        smem = cutlass.memory.SmemAllocator()
        if cutlass.const_expr(CLUSTER):
            # every lane's partial sums, [warp][accumulator][lane], read by the cluster's CTAs
            sred = smem.allocate_tensor(Float32, cute.make_layout(WARPS * J * 32), byte_alignment=16)
        if cutlass.const_expr(STAGES):
            # a ring of STAGES K groups: x (m_max padded rows) and every lane's weight chunks
            # and scales; group i + STAGES - 1 is copied while group i is computed
            X_STAGE = cfg.m_max * X_ROW_BYTES
            W_STAGE = WARPS * TPW * W_STAGE_BYTES
            xs = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(STAGES * X_STAGE), byte_alignment=16)
            wsm = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(STAGES * W_STAGE), byte_alignment=16)
            xs_base = Int32(xs.iterator.toint())
            w_lane = Int32(wsm.iterator.toint()) + warp * (TPW * W_STAGE_BYTES) + lane * 16
            x_addr = x.iterator.toint()
            slots = x_slots(tidx)
            for s0 in cutlass.range_constexpr(STAGES - 1):
                copy_stage(w_lane + s0 * W_STAGE, w_bases, s_bases, valid, tile0 < TILES, g0 + s0, g1,
                           x_addr, xs_base + s0 * X_STAGE, slots, m_rows)
                cp_commit()
            for gi in cutlass.range(g0, g1, 1):
                it = gi - g0
                cp_wait(STAGES - 2)  # this thread's copies of group gi have landed
                cute.arch.barrier()  # ... and every thread's; group gi - 1 is no longer read
                nxt = (it + STAGES - 1) % STAGES
                copy_stage(w_lane + nxt * W_STAGE, w_bases, s_bases, valid, tile0 < TILES, gi + STAGES - 1,
                           g1, x_addr, xs_base + nxt * X_STAGE, slots, m_rows)
                cp_commit()
                if tile0 < TILES:
                    stage = it % STAGES
                    compute_group(buf_a, acc, xv, xs_base + stage * X_STAGE + t * 32, gi, g, t, sadd_u,
                                  m_rows, w_lane + stage * W_STAGE)
            cp_wait(0)
        elif cutlass.const_expr(XS):
            # one K group of x: m_max rows of 512 values (padded rows)
            xs = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(cfg.m_max * X_ROW_BYTES), byte_alignment=16)
            xs_base = Int32(xs.iterator.toint())
            # every warp (also those past the last tile) takes part in staging x and in the
            # barriers; the weight loads of a group are in flight while x is staged
            slots = x_slots(tidx)
            for gi in cutlass.range(g0, g1, 1):
                load_tiles(buf_a, w_bases, s_bases, gi, valid, tile0 < TILES)
                for slot in slots:
                    if slot[0] < m_rows:
                        src, kin = x_chunk(x.iterator.toint(), slot, gi)
                        st_shared16(xs_base + slot[3], ld16(src, Int32(kin), False))
                cute.arch.barrier()
                if tile0 < TILES:
                    compute_group(buf_a, acc, xv, xs_base + t * 32, gi, g, t, sadd_u, m_rows, Int32(0))
                cute.arch.barrier()
        if tile0 < TILES:
            x_base = x.iterator.toint() + Int64(t * 32)
            if cutlass.const_expr(XS or STAGES):
                pass  # computed above, between the barriers
            elif cutlass.const_expr(PREFETCH):
                # two-deep register pipeline over K groups: load group i+1 while computing i
                load_tiles(buf_a, w_bases, s_bases, g0, valid, g0 < g1)
                for gi in cutlass.range(g0, g1, 2):
                    load_tiles(buf_b, w_bases, s_bases, gi + 1, valid, gi + 1 < g1)
                    compute_group(buf_a, acc, xv, x_base, gi, g, t, sadd_u, m_rows, Int32(0))
                    load_tiles(buf_a, w_bases, s_bases, gi + 2, valid, gi + 2 < g1)
                    if gi + 1 < g1:
                        compute_group(buf_b, acc, xv, x_base, gi + 1, g, t, sadd_u, m_rows, Int32(0))
            else:
                # all loads of a group issued at once; other warps hide the latency
                for gi in cutlass.range(g0, g1, 1):
                    load_tiles(buf_a, w_bases, s_bases, gi, valid, gi < g1)
                    compute_group(buf_a, acc, xv, x_base, gi, g, t, sadd_u, m_rows, Int32(0))
            # the weights are read: the next kernel may launch once every CTA got here (or
            # exited) and prefetch its own while this one sums and stores
            if cutlass.const_expr(not cfg.pdl_early):
                griddep_launch_dependents()
            # accumulator c0,c1 -> row g, tokens 2t, 2t+1; c2,c3 -> row g+8
            last = Int32(1)
            if cutlass.const_expr(CLUSTER):
                for j in cutlass.range_constexpr(J):
                    sred[(warp * J + j) * 32 + lane] = acc[j]
                last = Int32(0)  # the cluster reduction below finishes
            if cutlass.const_expr(KS > 1 and not CLUSTER):
                # split-K: publish fp32 partials [k_split, M, N16]
                ws_base = ws.iterator.toint()
                for tw in cutlass.range_constexpr(TPW):
                    for nt in cutlass.range_constexpr(NT):
                        for i in cutlass.range_constexpr(4):
                            ms = nt * 8 + 2 * t + (i % 2)
                            ns = (tile0 + tw) * TILE_N + g + 8 * (i // 2)
                            if (ms < m_rows) & (ns < N_PAD):
                                store_f32(ws_base + ((Int64(bz) * m_rows + ms) * N_PAD + ns) * 4,
                                          acc[(tw * NT + nt) * 4 + i])
                if cutlass.const_expr(LAST_WARP):
                    # the last warp to arrive for this tile sums the partials and finishes
                    fence_gpu()
                    cute.arch.sync_warp()
                    prev = Int32(0)
                    if lane == 0:
                        prev = arrive(cnt.iterator.toint() + Int64(tile0) * 4)
                    prev = cute.arch.shuffle_sync(prev, 0)
                    last = Int32(prev == KS - 1)
                    if last != 0:
                        fence_gpu()
                        for tw in cutlass.range_constexpr(TPW):
                            for nt in cutlass.range_constexpr(NT):
                                for i in cutlass.range_constexpr(4):
                                    mr = nt * 8 + 2 * t + (i % 2)
                                    nr = (tile0 + tw) * TILE_N + g + 8 * (i // 2)
                                    if (mr < m_rows) & (nr < N_PAD):
                                        tot = Float32(0.0)
                                        for z in cutlass.range_constexpr(KS):
                                            tot = tot + ld_cg_f32(
                                                ws_base + ((Int64(z) * m_rows + mr) * N_PAD + nr) * 4)
                                        acc[(tw * NT + nt) * 4 + i] = tot
                        if lane == 0:
                            store_u32(cnt.iterator.toint() + Int64(tile0) * 4, Int32(0))
                else:
                    last = Int32(0)  # reduce_kernel finishes
            if last != 0:
                al = alpha[ALPHA_IDX]
                for tw in cutlass.range_constexpr(TPW):
                    for nt in cutlass.range_constexpr(NT):
                        for i in cutlass.range_constexpr(4):
                            mm = nt * 8 + 2 * t + (i % 2)
                            nn = (tile0 + tw) * TILE_N + g + 8 * (i // 2)
                            if (mm < m_rows) & (nn < n):
                                v = acc[(tw * NT + nt) * 4 + i] * al
                                if cutlass.const_expr(has_bias):
                                    v = v + bias[nn].to(Float32)
                                out[mm, nn] = v.to(out.element_type)
        if cutlass.const_expr(CLUSTER):
            # split-K through distributed shared memory: after the cluster barrier (release /
            # acquire) CTA ``bz`` sums accumulator ``q`` of every warp where q % k_split == bz,
            # over the k_split CTAs of the cluster, and stores it; a second barrier keeps every
            # CTA's shared memory alive until its peers have read it.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            if tile0 < TILES:
                base = Int32(sred.iterator.toint())
                al = alpha[ALPHA_IDX]
                for tw in cutlass.range_constexpr(TPW):
                    for nt in cutlass.range_constexpr(NT):
                        for i in cutlass.range_constexpr(4):
                            q = warp * J + (tw * NT + nt) * 4 + i
                            mm = nt * 8 + 2 * t + (i % 2)
                            nn = (tile0 + tw) * TILE_N + g + 8 * (i // 2)
                            if (q % KS == bz) & (mm < m_rows) & (nn < n):
                                tot = Float32(0.0)
                                for z in cutlass.range_constexpr(KS):
                                    tot = tot + ld_dsmem_f32(base + (q * 32 + lane) * 4, z)
                                v = tot * al
                                if cutlass.const_expr(has_bias):
                                    v = v + bias[nn].to(Float32)
                                out[mm, nn] = v.to(out.element_type)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.kernel
    def reduce_kernel(ws: cute.Tensor, alpha: cute.Tensor, out: cute.Tensor, bias: cute.Tensor,
                      m_rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        griddep_launch_dependents()
        griddep_wait()
        idx = bidx * 256 + tidx
        mm = idx // n
        nn = idx % n
        if mm < m_rows:
            s = ws[0, mm, nn]
            for z in cutlass.range_constexpr(1, KS):
                s = s + ws[z, mm, nn]
            v = s * alpha[ALPHA_IDX]
            if cutlass.const_expr(has_bias):
                v = v + bias[nn].to(Float32)
            out[mm, nn] = v.to(out.element_type)

    grid_x = -(-TILES // (WARPS * TPW))

    @cute.jit
    def launch(x: cute.Tensor, wq: cute.Tensor, sc: cute.Tensor, alpha: cute.Tensor,
               out: cute.Tensor, bias: cute.Tensor, ws: cute.Tensor, cnt: cute.Tensor,
               sadd: Int32, use_pdl: Int32, stream):
        m_rows = x.shape[0]
        cluster = {"cluster": [1, KS, 1]} if CLUSTER else {}
        # the carveout is given so that the compiler needs no device query (CPU-only compiles)
        occupancy = ({"min_blocks_per_mp": cfg.ctas_per_sm, "preferred_smem_carveout": -1}
                     if cfg.ctas_per_sm else {})
        main_kernel(x, wq, sc, alpha, out, bias, ws, cnt, sadd, m_rows).launch(
            grid=[grid_x, KS, 1], block=[32 * WARPS, 1, 1], stream=stream, use_pdl=use_pdl, **cluster,
            **occupancy)
        if cutlass.const_expr(KS > 1 and not LAST_WARP and not CLUSTER):
            reduce_kernel(ws, alpha, out, bias, m_rows).launch(
                grid=[(m_rows * n + 255) // 256, 1, 1], block=[256, 1, 1], stream=stream, use_pdl=use_pdl)

    return launch


def _cute_dtype(dtype: str):
    import cutlass

    return cutlass.BFloat16 if dtype == "bfloat16" else cutlass.Float16


def _compile(cfg: DecodeConfig, n: int, k: int, fmt: str, dtype: str, has_bias: bool):
    """The compiled launcher, from the disk kernel cache when it holds it (see kernel_cache);
    ``$AUTOFP4_CUTE_DSL_OPTIONS`` (extra CuTeDSL options for inspection, e.g. ``--keep-ptx
    --keep-cubin --dump-dir=/tmp/d``) bypasses the cache."""
    from ..kernel_cache import compile_cached

    cfg = pdl.binary_config(cfg)
    extra = os.environ.get("AUTOFP4_CUTE_DSL_OPTIONS", "").strip()
    if extra:
        return _compile_now(cfg, n, k, fmt, dtype, has_bias, extra)
    return compile_cached("w4a16_decode", __name__, (cfg, n, k, fmt, dtype, has_bias),
                          lambda: _compile_now(cfg, n, k, fmt, dtype, has_bias, ""))


def _compile_now(cfg: DecodeConfig, n: int, k: int, fmt: str, dtype: str, has_bias: bool, extra: str):
    cutlass, cute, _, _ = _dsl()
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    dt = _cute_dtype(dtype)
    tiles, groups = _tiles(n), _groups(k)
    slots = 32 if fmt == "nvfp4" else 16
    m = cute.sym_int()
    fx = make_fake_compact_tensor(dt, (m, k), stride_order=(1, 0), assumed_align=16)
    fw = make_fake_compact_tensor(cutlass.Uint8, (tiles * groups * CHUNKS * 32 * 16,), assumed_align=16)
    fs = make_fake_compact_tensor(cutlass.Uint8, (tiles * groups * slots * 16,), assumed_align=16)
    fa = make_fake_compact_tensor(cutlass.Float32, (2,), assumed_align=4)
    fo = make_fake_compact_tensor(dt, (m, n), stride_order=(1, 0), assumed_align=2)
    fb = make_fake_compact_tensor(dt, (n,) if has_bias else (1,), assumed_align=2)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    fn = _build(cfg, n, k, fmt, dtype, has_bias)
    opts = ("--enable-tvm-ffi " + extra).strip()
    # split-K workspace [k_split, M, N16] fp32 and per-tile arrival counters (int32, self-resetting)
    ws_shape = (cfg.k_split, m, tiles * TILE_N) if _needs_workspace(cfg) else (1,)
    fws = make_fake_compact_tensor(cutlass.Float32, ws_shape,
                                   stride_order=tuple(reversed(range(len(ws_shape)))), assumed_align=16)
    fc = make_fake_compact_tensor(cutlass.Int32, (tiles,), assumed_align=4)
    return cute.compile(fn, fx, fw, fs, fa, fo, fb, fws, fc, 0, 1, stream, options=opts)


def _needs_workspace(cfg: DecodeConfig) -> bool:
    """Split-K through global memory: the "kernel" and "last_warp" reductions."""
    return cfg.k_split > 1 and cfg.split_reduce != "cluster"


def _check_problem(cfg: DecodeConfig, n: int, k: int, fmt: str, dtype: str) -> None:
    reason = validate(cfg, n, k, fmt, dtype)
    if reason:
        raise ValueError(f"invalid decode config {cfg} for n={n}, k={k}, {fmt}, {dtype}: {reason}")


def compile_only(cfg: DecodeConfig, n: int, k: int, fmt: str, dtype: str) -> None:
    """Compile (no GPU needed with ``CUTE_DSL_ARCH=sm_90a``), with and without bias."""
    _check_problem(cfg, n, k, fmt, dtype)
    _compile(cfg, n, k, fmt, dtype, False)
    _compile(cfg, n, k, fmt, dtype, True)


def compile_kernel(cfg: DecodeConfig, n: int, k: int, fmt: str, dtype: str) -> Callable:
    """``run(x, packed, bias) -> out`` for every ``1 <= M <= cfg.m_max`` (one compile)."""
    _check_problem(cfg, n, k, fmt, dtype)
    tdt = getattr(torch, dtype)
    di = DTYPES.index(dtype)
    compiled: dict[bool, Any] = {False: _compile(cfg, n, k, fmt, dtype, False)}
    ks, m_max, tiles = cfg.k_split, cfg.m_max, _tiles(n)
    use_ws = _needs_workspace(cfg)
    use_pdl = cfg.pdl
    n_pad = tiles * TILE_N
    # per-device helpers: a dummy bias / workspace, and the split-K arrival counters. The
    # counters start at zero and every launch leaves them at zero, so one set per device serves
    # every call (calls of one runner on one device must not run concurrently on two streams).
    state: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def device_state(dev: torch.device):
        st = state.get(dev)
        if st is None:
            st = state[dev] = (torch.zeros(1, dtype=tdt, device=dev),
                               torch.zeros(1, dtype=torch.float32, device=dev),
                               torch.zeros(tiles, dtype=torch.int32, device=dev))
        return st

    def run(x: torch.Tensor, packed: DecodePacked, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != k or x.dtype != tdt:
            raise ValueError(f"x must be [M, {k}] {tdt}, got {tuple(x.shape)} {x.dtype}")
        m = x.shape[0]
        if not 1 <= m <= m_max:
            raise ValueError(f"this decode kernel serves 1 <= M <= {m_max}, got M={m}")
        if not x.is_contiguous() or x.data_ptr() % 16:
            raise ValueError("x must be contiguous and 16-byte aligned")
        if not x.is_cuda or packed.data.device != x.device:
            raise ValueError(f"x ({x.device}) and the packed weight ({packed.data.device}) must be "
                             "on the same CUDA device")
        if packed.fmt != fmt or packed.n != n or packed.k != k:
            raise ValueError(f"packed weight is {packed.fmt} [{packed.n}, {packed.k}], "
                             f"this kernel was compiled for {fmt} [{n}, {k}]")
        if packed.unsupported[di]:
            raise ValueError(packed.unsupported[di])
        dummy_b, dummy_ws, cnt = device_state(x.device)
        out = torch.empty(m, n, dtype=tdt, device=x.device)
        if bias is None:
            b, fn = dummy_b, compiled[False]
        else:
            if bias.shape != (n,) or bias.dtype != tdt:
                raise ValueError(f"bias must be [{n}] {tdt}, got {tuple(bias.shape)} {bias.dtype}")
            b = bias.contiguous()
            fn = compiled.get(True)
            if fn is None:
                fn = compiled[True] = _compile(cfg, n, k, fmt, dtype, True)
        ws = torch.empty(ks, m, n_pad, dtype=torch.float32, device=x.device) if use_ws else dummy_ws
        fn(x, packed.data, packed.scales, packed.alpha, out, b, ws, cnt, packed.scale_add[di],
           pdl.launch_flag(use_pdl))
        return out

    return run
