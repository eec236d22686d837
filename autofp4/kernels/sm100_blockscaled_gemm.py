"""Blackwell (sm_100a) block-scaled W4A4 GEMM: ``out = alpha * (xq @ Wq^T) (+ bias)``.

Both operands are FP4 (E2M1) with per-block scales read by the tensor core itself
(``tcgen05.mma.kind::mxf4nvf4.block_scale``): NVFP4 (E4M3 scales, one per 16 values of K) or
MXFP4 (E8M0 scales, one per 32). ``xq`` is the activation quantized by
:mod:`autofp4.kernels.fp4_act_quant`, ``Wq`` the weight repacked once by :func:`pack_weight`;
``alpha`` (a device fp32 scalar) is the activation's global scale times the weight's (1 for
MXFP4). The MMA's M is the token count, its N the weight's output rows, so one compiled kernel
serves every M.

Data path (a persistent, warp-specialized kernel of 6 warps per CTA):

* warp 5 (TMA) walks the CTA's output tiles (``StaticPersistentTileScheduler``: the grid is
  the number of clusters that fit the GPU at once, each walks tiles ``raster``-first, in bands
  ``swizzle`` clusters wide) and streams, per K tile of 256 values, the x tile, the weight tile
  and both tiles' block scales into a ``stages``-deep shared-memory ring (TMA; out-of-bounds
  rows and K read as zero). In a cluster the CTAs of one cluster row share the weight tile and
  those of one column the x tile by TMA multicast;
* warp 4 (MMA) copies each stage's scale factors to tensor memory (``tcgen05.cp``) and issues
  the block-scaled MMAs into an fp32 accumulator in tensor memory (two accumulator buffers when
  they fit, so the epilogue of one tile overlaps the main loop of the next). With
  ``tile_m = 256`` the two CTAs of a cluster pair run each MMA together (``cta_group::2``: each
  holds 128 rows of x and half of the weight tile);
* warps 0-3 (epilogue) load the accumulator from tensor memory (``tcgen05.ld``) in sub-tiles,
  multiply by ``alpha``, add the bias, convert to bf16/fp16 and store through shared memory
  with TMA (rows past M and columns past N are clipped by the TMA unit).

With dependent launch (:mod:`autofp4.pdl`) the CTAs set up their barriers and tensor memory
while the previous kernel of the stream (the activation quantizer) finishes.

The layouts the MMA reads: FP4 values K-major, two per byte (the low nibble is the even K
index, which is :class:`~autofp4.weights.FP4Weight`'s own byte layout), and block scales in
128 x 4 atoms (:func:`swizzle_offsets`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from .. import pdl
from ..blackwell import SM_COUNT, SMEM_PER_CTA, TMEM_COLS
from ..problem import BLOCK_SIZE, DTYPES, FORMATS

try:  # CuTeDSL is an optional dependency
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import utils
except ImportError:  # pragma: no cover - exercised only without nvidia-cutlass-dsl
    cuda = cutlass = cute = utils = None  # type: ignore[assignment]

#: helper modules whose source is part of this kernel's (kernel cache key, DB provenance)
KERNEL_SOURCES = ("autofp4.kernels.fp4_act_quant",)
TILE_K = 256                 # K per pipeline stage: 4 MMA instructions of K = 64
SF_ATOM_MN = 128             # rows per scale-factor atom
SF_ATOM_K = 4                # scale blocks per scale-factor atom
SWIZZLES = (1, 2, 4, 8)
EPI_C_STAGES = 2             # output sub-tile buffers in shared memory
EPI_C_BYTES = 128 * 32 * 2   # one output sub-tile: 128 rows x 32 columns of bf16/fp16 (a bound)
MISC_SMEM = 1024             # barriers and the tensor-memory address


# --------------------------------------------------------------------------------------------
# Scale-factor atoms (pure torch: the layout the MMA reads and the inverse)
# --------------------------------------------------------------------------------------------
def _up(v: int, to: int) -> int:
    return (v + to - 1) // to * to


def sf_padded_shape(rows: int, blocks: int) -> tuple[int, int]:
    """(rows, scale blocks) of a scale matrix padded to whole 128 x 4 atoms."""
    return _up(rows, SF_ATOM_MN), _up(blocks, SF_ATOM_K)


def swizzle_offsets(rows: int, blocks: int, device: Any = None) -> torch.Tensor:
    """The byte offset of scale ``[r, b]`` (row r, K block b) in the MMA's layout, int64
    ``[rows, blocks]``. The matrix is cut into atoms of 128 rows x 4 blocks (512 bytes), the
    atoms stored K-atom-fastest; inside an atom, row ``r = 32 i + j`` (i < 4, j < 32) and block
    ``c`` sit at ``16 j + 4 i + c``."""
    _, bp = sf_padded_shape(rows, blocks)
    r = torch.arange(rows, device=device, dtype=torch.int64)[:, None]
    b = torch.arange(blocks, device=device, dtype=torch.int64)[None, :]
    atom = (r // SF_ATOM_MN) * (bp // SF_ATOM_K) + b // SF_ATOM_K
    inner = (r % 32) * 16 + ((r % SF_ATOM_MN) // 32) * 4 + b % SF_ATOM_K
    return atom * 512 + inner


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """Block scales ``[rows, blocks]`` (uint8 bytes, or E4M3 viewed as bytes) -> the flat uint8
    buffer of the padded atoms (padding is zero)."""
    raw = scale if scale.dtype == torch.uint8 else scale.view(torch.uint8)
    rows, blocks = raw.shape
    rp, bp = sf_padded_shape(rows, blocks)
    out = torch.zeros(rp * bp, dtype=torch.uint8, device=raw.device)
    out[swizzle_offsets(rows, blocks, raw.device).reshape(-1)] = raw.reshape(-1)
    return out


def unswizzle_scales(buf: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """The inverse of :func:`swizzle_scales`: uint8 ``[rows, blocks]``."""
    return buf[swizzle_offsets(rows, blocks, buf.device)]


# --------------------------------------------------------------------------------------------
# Config space
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sm100BlockScaledConfig:
    kernel: ClassVar[str] = "blockscaled"  # the tag of stored configs (not a field)
    tile_m: int = 128      # tokens per MMA tile: 128 (one SM) or 256 (a CTA pair, cta_group::2)
    tile_n: int = 128      # weight rows per MMA tile: 64, 128 or 256
    stages: int = 4        # shared-memory pipeline depth (K tiles of 256 in flight)
    cluster_m: int = 1     # CTAs per cluster along M (share the weight tile by multicast)
    cluster_n: int = 1     # CTAs per cluster along N (share the x tile by multicast)
    raster: str = "m"      # "m": a cluster walks token tiles first; "n": weight tiles first
    swizzle: int = 1       # the walk goes over bands this many clusters wide
    pdl: bool = False      # launch with programmatic dependent launch (a launch flag, one binary)

    @property
    def two_cta(self) -> bool:
        return self.tile_m == 256

    @property
    def cta_m(self) -> int:
        return self.tile_m // (2 if self.two_cta else 1)

    def sf_tmem_cols(self) -> int:
        """Tensor-memory columns of one stage of the scale factors of x and of the weight."""
        return (self.cta_m // 32) * SF_ATOM_K + (_up(self.tile_n, 128) // 32) * SF_ATOM_K

    @property
    def acc_stages(self) -> int:
        """Accumulator buffers in tensor memory (two when they fit next to the scale factors)."""
        return 2 if 2 * self.tile_n + self.sf_tmem_cols() <= TMEM_COLS else 1

    def stage_bytes(self, fmt: str) -> int:
        """Shared memory of one pipeline stage of one CTA: x, weight and both scale tiles."""
        per_sf = TILE_K // BLOCK_SIZE[fmt]
        b_rows = self.tile_n // (2 if self.two_cta else 1)
        return (self.cta_m + b_rows) * TILE_K // 2 + (self.cta_m + _up(self.tile_n, 128)) * per_sf

    def smem_bytes(self, fmt: str) -> int:
        return self.stages * self.stage_bytes(fmt) + EPI_C_STAGES * EPI_C_BYTES + MISC_SMEM


def validate(cfg: Sm100BlockScaledConfig, n: int, k: int, fmt: str, dtype: str) -> str | None:
    """``None`` if ``cfg`` can run (n, k, fmt, dtype), else the reason (one rule each)."""
    problem = (
        (fmt in FORMATS, f"fmt must be one of {FORMATS}, got {fmt!r}"),
        (dtype in DTYPES, f"dtype must be one of {DTYPES}, got {dtype!r}"),
        (n > 0 and k > 0, f"n and k must be positive, got n={n}, k={k}"),
        (k % 32 == 0, f"k={k} must be a multiple of 32 (16-byte rows of FP4 values for TMA)"),
        (n % 8 == 0, f"n={n} must be a multiple of 8 (16-byte output rows for the TMA store)"),
    )
    for ok, why in problem:
        if not ok:
            return why
    if cfg.tile_m not in (128, 256):
        return f"tile_m must be 128 (one SM) or 256 (a CTA pair), got {cfg.tile_m}"
    if cfg.tile_n not in (64, 128, 256):
        return f"tile_n must be 64, 128 or 256, got {cfg.tile_n}"
    if not 2 <= cfg.stages <= 8:
        return f"stages must be in 2..8, got {cfg.stages}"
    if cfg.cluster_m not in (1, 2, 4) or cfg.cluster_n not in (1, 2, 4):
        return f"cluster_m and cluster_n must be 1, 2 or 4, got {cfg.cluster_m} and {cfg.cluster_n}"
    if cfg.cluster_m * cfg.cluster_n > 8:
        return f"a cluster of {cfg.cluster_m} x {cfg.cluster_n} CTAs exceeds the portable size 8"
    if cfg.two_cta and cfg.cluster_m % 2:
        return "tile_m=256 runs each MMA on a CTA pair: cluster_m must be even"
    if cfg.raster not in ("m", "n"):
        return f"raster must be 'm' or 'n', got {cfg.raster!r}"
    if cfg.swizzle not in SWIZZLES:
        return f"swizzle must be one of {SWIZZLES}, got {cfg.swizzle!r}"
    if not isinstance(cfg.pdl, bool):
        return f"pdl must be a bool, got {cfg.pdl!r}"
    smem = cfg.smem_bytes(fmt)
    if smem > SMEM_PER_CTA:
        return (f"{cfg.stages} stages of {cfg.stage_bytes(fmt)} bytes need {smem} bytes of shared memory, "
                f"more than the {SMEM_PER_CTA} available; use fewer stages or a smaller tile")
    return None


# --------------------------------------------------------------------------------------------
# Weight packing (pure torch)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PackedSm100Weight:
    """What the kernel reads. ``data``: uint8 [N, K/2] (the FP4Weight's own bytes); ``scale``:
    uint8, the block scales in 128 x 4 atoms (:func:`swizzle_scales`); ``global_scale``: fp32 [1]
    (1 for MXFP4); ``input_scale``: the checkpoint's static activation scale or ``None``."""

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    input_scale: torch.Tensor | None
    fmt: str
    n: int
    k: int


def pack_weight(w: Any) -> PackedSm100Weight:
    """An :class:`~autofp4.weights.FP4Weight` ``[N, K]`` in the kernel's layout (built once; the
    backend caches it on the weight)."""
    if w.experts:
        raise ValueError("the sm100 block-scaled GEMM packs 2-D weights [N, K], not stacked experts")
    n, k = w.n, w.k
    gs = w.global_scale if w.global_scale is not None else torch.ones((), device=w.device)
    ins = None if w.input_scale is None else w.input_scale.reshape(1).float()
    return PackedSm100Weight(w.data.contiguous(), swizzle_scales(w.scale), gs.reshape(1).float(), ins, w.fmt, n, k)


def unpack_weight_scales(p: PackedSm100Weight) -> torch.Tensor:
    """The packed block scales back as ``[N, K / block]`` bytes (for checks)."""
    return unswizzle_scales(p.scale, p.n, p.k // BLOCK_SIZE[p.fmt])


# --------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------
class _Sm100BlockScaledKernel:
    """One compiled kernel per (config, n, k, fmt, dtype, sm_count)."""

    EPI_WARPS = (0, 1, 2, 3)
    MMA_WARP = 4
    TMA_WARP = 5

    def __init__(self, cfg: Sm100BlockScaledConfig, n: int, k: int, fmt: str, dtype: str, sms: int):
        self.cfg, self.n, self.k, self.fmt, self.dtype, self.sms = cfg, n, k, fmt, dtype, sms
        self.sf_vec = BLOCK_SIZE[fmt]
        self.threads = 32 * 6

    def build(self):
        from cutlass import pipeline
        from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
        from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
        from cutlass.utils import blackwell_helpers as sm100
        from cutlass.utils import blockscaled_layout as bsl

        cfg, n_real, k_real, sf_vec = self.cfg, self.n, self.k, self.sf_vec
        ab_dtype = cutlass.Float4E2M1FN
        sf_dtype = cutlass.Float8E4M3FN if self.fmt == "nvfp4" else cutlass.Float8E8M0FNU
        c_dtype = cutlass.BFloat16 if self.dtype == "bfloat16" else cutlass.Float16
        acc_dtype = cutlass.Float32
        two_cta = cfg.two_cta
        cta_group = tcgen05.CtaGroup.TWO if two_cta else tcgen05.CtaGroup.ONE
        cluster_mn = (cfg.cluster_m, cfg.cluster_n)
        stages, acc_stages = cfg.stages, cfg.acc_stages
        tile_n = cfg.tile_n
        sfb_n = _up(tile_n, 128)        # the weight's scale tile is loaded 128 rows at a time
        k_major = OperandMajorMode.K
        c_layout_enum = utils.LayoutEnum.ROW_MAJOR
        epi_warps, mma_warp, tma_warp = self.EPI_WARPS, self.MMA_WARP, self.TMA_WARP
        epi_threads = 32 * len(epi_warps)
        threads = self.threads
        max_clusters = max(1, self.sms // (cfg.cluster_m * cfg.cluster_n))
        num_tmem_cols = TMEM_COLS
        epi_sync = pipeline.NamedBarrier(barrier_id=1, num_threads=epi_threads)
        tmem_sync = pipeline.NamedBarrier(barrier_id=2, num_threads=32 * (1 + len(epi_warps)))

        def mmas():
            """The block-scaled tiled MMA, and the one-CTA MMA whose B partition places the
            weight's scale tile (128-row multiples)."""
            mma = sm100.make_blockscaled_trivial_tiled_mma(
                ab_dtype, ab_dtype, k_major, k_major, sf_dtype, sf_vec, cta_group, (cfg.tile_m, tile_n))
            mma_sfb = sm100.make_blockscaled_trivial_tiled_mma(
                ab_dtype, ab_dtype, k_major, k_major, sf_dtype, sf_vec, tcgen05.CtaGroup.ONE,
                (cfg.cta_m, sfb_n))
            return mma, mma_sfb

        @cute.jit
        def host(
            mXq: cute.Tensor,
            mW: cute.Tensor,
            mSFX: cute.Tensor,
            mSFW: cute.Tensor,
            mAlpha: cute.Tensor,
            mBias: cute.Tensor,
            mOut: cute.Tensor,
            use_pdl: cutlass.Int32,
            stream: cuda.CUstream,
        ):
            m = mXq.shape[0]
            # the byte tensors as FP4 / scale-factor tensors of rank 3 (a batch mode of 1)
            a = cute.make_tensor(cute.recast_ptr(mXq.iterator, dtype=ab_dtype),
                                 cute.make_ordered_layout((m, k_real, 1), order=(1, 0, 2)))
            b = cute.make_tensor(cute.recast_ptr(mW.iterator, dtype=ab_dtype),
                                 cute.make_ordered_layout((n_real, k_real, 1), order=(1, 0, 2)))
            c = cute.make_tensor(mOut.iterator, cute.make_ordered_layout((m, n_real, 1), order=(1, 0, 2)))
            sfa = cute.make_tensor(cute.recast_ptr(mSFX.iterator, dtype=sf_dtype),
                                   bsl.tile_atom_to_shape_SF(a.shape, sf_vec))
            sfb = cute.make_tensor(cute.recast_ptr(mSFW.iterator, dtype=sf_dtype),
                                   bsl.tile_atom_to_shape_SF(b.shape, sf_vec))

            tiled_mma, tiled_mma_sfb = mmas()
            inst_k = cute.size(tiled_mma.shape_mnk, mode=[2])
            mma_tiler = (cfg.tile_m, tile_n, inst_k * 4)
            mma_tiler_sfb = (cfg.cta_m, sfb_n, inst_k * 4)
            atom_thr = cute.size(tiled_mma.thr_id.shape)
            cta_tile = (cfg.tile_m // atom_thr, tile_n, inst_k * 4)
            cluster_vmnk = cute.tiled_divide(cute.make_layout((*cluster_mn, 1)), (tiled_mma.thr_id.shape,))
            cluster_sfb_vmnk = cute.tiled_divide(cute.make_layout((*cluster_mn, 1)),
                                                 (tiled_mma_sfb.thr_id.shape,))

            a_smem = sm100.make_smem_layout_a(tiled_mma, mma_tiler, ab_dtype, stages)
            b_smem = sm100.make_smem_layout_b(tiled_mma, mma_tiler, ab_dtype, stages)
            sfa_smem = bsl.make_smem_layout_sfa(tiled_mma, mma_tiler, sf_vec, stages)
            sfb_smem = bsl.make_smem_layout_sfb(tiled_mma, mma_tiler, sf_vec, stages)
            epi_tile = sm100.compute_epilogue_tile_shape(cta_tile, two_cta, c_layout_enum, c_dtype)
            c_smem = sm100.make_smem_layout_epi(c_dtype, c_layout_enum, epi_tile, EPI_C_STAGES)

            one = (None, None, None, 0)
            tma_a_atom, tma_a = cute.nvgpu.make_tiled_tma_atom_A(
                sm100.cluster_shape_to_tma_atom_A(cluster_mn, tiled_mma.thr_id), a,
                cute.slice_(a_smem, one), mma_tiler, tiled_mma, cluster_vmnk.shape)
            tma_b_atom, tma_b = cute.nvgpu.make_tiled_tma_atom_B(
                sm100.cluster_shape_to_tma_atom_B(cluster_mn, tiled_mma.thr_id), b,
                cute.slice_(b_smem, one), mma_tiler, tiled_mma, cluster_vmnk.shape)
            tma_sfa_atom, tma_sfa = cute.nvgpu.make_tiled_tma_atom_A(
                sm100.cluster_shape_to_tma_atom_A(cluster_mn, tiled_mma.thr_id), sfa,
                cute.slice_(sfa_smem, one), mma_tiler, tiled_mma, cluster_vmnk.shape,
                internal_type=cutlass.Int16)
            tma_sfb_atom, tma_sfb = cute.nvgpu.make_tiled_tma_atom_B(
                sm100.cluster_shape_to_tma_atom_SFB(cluster_mn, tiled_mma.thr_id), sfb,
                cute.slice_(sfb_smem, one), mma_tiler_sfb, tiled_mma_sfb, cluster_sfb_vmnk.shape,
                internal_type=cutlass.Int16)
            tx_bytes = (cute.size_in_bytes(ab_dtype, cute.slice_(a_smem, one))
                        + cute.size_in_bytes(ab_dtype, cute.slice_(b_smem, one))
                        + cute.size_in_bytes(sf_dtype, cute.slice_(sfa_smem, one))
                        + cute.size_in_bytes(sf_dtype, cute.slice_(sfb_smem, one))) * atom_thr
            tma_c_atom, tma_c = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), c, cute.slice_(c_smem, (None, None, 0)), epi_tile)

            c_tiles = cute.zipped_divide(c, tiler=cute.slice_(cta_tile, (None, None, 0)))
            sched = utils.PersistentTileSchedulerParams(
                c_tiles[(0, (None, None, None))].shape, (*cluster_mn, 1), cfg.swizzle, cfg.raster == "m")
            grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, max_clusters)

            n_stages, n_acc = stages, acc_stages  # the struct's body sees the jit function's locals

            @cute.struct
            class Storage:
                ab_full: cute.struct.MemRange[cutlass.Int64, n_stages]
                ab_empty: cute.struct.MemRange[cutlass.Int64, n_stages]
                acc_full: cute.struct.MemRange[cutlass.Int64, n_acc]
                acc_empty: cute.struct.MemRange[cutlass.Int64, n_acc]
                tmem_dealloc: cutlass.Int64
                tmem_addr: cutlass.Int32
                sC: cute.struct.Align[cute.struct.MemRange[c_dtype, cute.cosize(c_smem.outer)], 1024]
                sA: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(a_smem.outer)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(b_smem.outer)], 1024]
                sSFA: cute.struct.Align[cute.struct.MemRange[sf_dtype, cute.cosize(sfa_smem)], 1024]
                sSFB: cute.struct.Align[cute.struct.MemRange[sf_dtype, cute.cosize(sfb_smem)], 1024]

            kernel(
                tiled_mma, tiled_mma_sfb, tma_a_atom, tma_a, tma_b_atom, tma_b, tma_sfa_atom, tma_sfa,
                tma_sfb_atom, tma_sfb, tma_c_atom, tma_c, mAlpha, mBias, cluster_vmnk, cluster_sfb_vmnk,
                a_smem, b_smem, sfa_smem, sfb_smem, c_smem, epi_tile, sched, mma_tiler, mma_tiler_sfb,
                cta_tile, tx_bytes, Storage,
            ).launch(grid=grid, block=[threads, 1, 1], cluster=(*cluster_mn, 1), stream=stream,
                     use_pdl=use_pdl, min_blocks_per_mp=1)

        @cute.kernel
        def kernel(
            tiled_mma: cute.TiledMma,
            tiled_mma_sfb: cute.TiledMma,
            tma_a_atom: cute.CopyAtom,
            mA: cute.Tensor,
            tma_b_atom: cute.CopyAtom,
            mB: cute.Tensor,
            tma_sfa_atom: cute.CopyAtom,
            mSFA: cute.Tensor,
            tma_sfb_atom: cute.CopyAtom,
            mSFB: cute.Tensor,
            tma_c_atom: cute.CopyAtom,
            mC: cute.Tensor,
            mAlpha: cute.Tensor,
            mBias: cute.Tensor,
            cluster_vmnk: cute.Layout,
            cluster_sfb_vmnk: cute.Layout,
            a_smem: cute.ComposedLayout,
            b_smem: cute.ComposedLayout,
            sfa_smem: cute.Layout,
            sfb_smem: cute.Layout,
            c_smem: cute.ComposedLayout,
            epi_tile: cute.Tile,
            sched: utils.PersistentTileSchedulerParams,
            mma_tiler: cutlass.Constexpr,
            mma_tiler_sfb: cutlass.Constexpr,
            cta_tile: cutlass.Constexpr,
            tx_bytes: cutlass.Constexpr,
            Storage: cutlass.Constexpr,
        ):
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            tidx, _, _ = cute.arch.thread_idx()
            if warp == tma_warp:
                for atom in (tma_a_atom, tma_b_atom, tma_sfa_atom, tma_sfb_atom, tma_c_atom):
                    cpasync.prefetch_descriptor(atom)

            atom_thr = cute.size(tiled_mma.thr_id.shape)
            bidx, _, _ = cute.arch.block_idx()
            v = bidx % atom_thr                       # this CTA's half of a CTA-pair MMA
            leader = v == 0
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            coord = cluster_vmnk.get_flat_coord(rank)
            coord_sfb = cluster_sfb_vmnk.get_flat_coord(rank)

            smem = utils.SmemAllocator()
            st = smem.allocate(Storage)
            mcast_a = cute.size(cluster_vmnk.shape[2])
            mcast_b = cute.size(cluster_vmnk.shape[1])
            ab_pipe = pipeline.PipelineTmaUmma.create(
                barrier_storage=st.ab_full.data_ptr(), num_stages=stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, mcast_a + mcast_b - 1),
                tx_count=tx_bytes, cta_layout_vmnk=cluster_vmnk, defer_sync=True)
            acc_pipe = pipeline.PipelineUmmaAsync.create(
                barrier_storage=st.acc_full.data_ptr(), num_stages=acc_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, epi_threads * atom_thr),
                cta_layout_vmnk=cluster_vmnk, defer_sync=True)
            tmem = utils.TmemAllocator(st.tmem_addr.ptr, barrier_for_retrieve=tmem_sync,
                                       allocator_warp_id=epi_warps[0], is_two_cta=two_cta,
                                       two_cta_tmem_dealloc_mbar_ptr=st.tmem_dealloc.ptr)
            pipeline_init_arrive(cluster_shape_mn=cluster_mn, is_relaxed=True)

            sA = st.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
            sB = st.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
            sSFA = st.sSFA.get_tensor(sfa_smem)
            sSFB = st.sSFB.get_tensor(sfb_smem)
            sC = st.sC.get_tensor(c_smem.outer, swizzle=c_smem.inner)

            # global tiles: (tile, tile, rest...) and their MMA partitions
            gA = cute.local_tile(mA, cute.slice_(mma_tiler, (None, 0, None)), (None, None, None))
            gB = cute.local_tile(mB, cute.slice_(mma_tiler, (0, None, None)), (None, None, None))
            gSFA = cute.local_tile(mSFA, cute.slice_(mma_tiler, (None, 0, None)), (None, None, None))
            gSFB = cute.local_tile(mSFB, cute.slice_(mma_tiler_sfb, (0, None, None)), (None, None, None))
            gC = cute.local_tile(mC, cute.slice_(mma_tiler, (None, None, 0)), (None, None, None))
            cC = cute.local_tile(cute.make_identity_tensor(mC.shape), cute.slice_(mma_tiler, (None, None, 0)),
                                 (None, None, None))
            k_tiles = cute.size(gA, mode=[3])
            thr_mma = tiled_mma.get_slice(v)
            thr_mma_sfb = tiled_mma_sfb.get_slice(v)
            tCgA = thr_mma.partition_A(gA)
            tCgB = thr_mma.partition_B(gB)
            tCgSFA = thr_mma.partition_A(gSFA)
            tCgSFB = thr_mma_sfb.partition_B(gSFB)
            tCgC = thr_mma.partition_C(gC)
            tCcC = thr_mma.partition_C(cC)

            a_cta = cute.make_layout(cute.slice_(cluster_vmnk, (0, 0, None, 0)).shape)
            b_cta = cute.make_layout(cute.slice_(cluster_vmnk, (0, None, 0, 0)).shape)
            sfb_cta = cute.make_layout(cute.slice_(cluster_sfb_vmnk, (0, None, 0, 0)).shape)
            tAsA, tAgA = cpasync.tma_partition(tma_a_atom, coord[2], a_cta, cute.group_modes(sA, 0, 3),
                                               cute.group_modes(tCgA, 0, 3))
            tBsB, tBgB = cpasync.tma_partition(tma_b_atom, coord[1], b_cta, cute.group_modes(sB, 0, 3),
                                               cute.group_modes(tCgB, 0, 3))
            tAsSFA, tAgSFA = cpasync.tma_partition(tma_sfa_atom, coord[2], a_cta, cute.group_modes(sSFA, 0, 3),
                                                   cute.group_modes(tCgSFA, 0, 3))
            tAsSFA, tAgSFA = cute.filter_zeros(tAsSFA), cute.filter_zeros(tAgSFA)
            tBsSFB, tBgSFB = cpasync.tma_partition(tma_sfb_atom, coord_sfb[1], sfb_cta,
                                                   cute.group_modes(sSFB, 0, 3), cute.group_modes(tCgSFB, 0, 3))
            tBsSFB, tBgSFB = cute.filter_zeros(tBsSFB), cute.filter_zeros(tBgSFB)

            tCrA = tiled_mma.make_fragment_A(sA)
            tCrB = tiled_mma.make_fragment_B(sB)
            acc_shape = tiled_mma.partition_shape_C(mma_tiler[:2])
            tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, acc_stages))

            pipeline_init_wait(cluster_shape_mn=cluster_mn)
            # nothing below reads the previous kernel's output or writes memory it may still read
            cute.arch.griddepcontrol_wait()

            if warp == tma_warp:
                mask_a = mask_b = mask_sfa = mask_sfb = None
                if cutlass.const_expr(mcast_a > 1 or mcast_b > 1 or two_cta):
                    mask_a = cpasync.create_tma_multicast_mask(cluster_vmnk, coord, mcast_mode=2)
                    mask_b = cpasync.create_tma_multicast_mask(cluster_vmnk, coord, mcast_mode=1)
                    mask_sfa = mask_a
                    mask_sfb = cpasync.create_tma_multicast_mask(cluster_sfb_vmnk, coord_sfb, mcast_mode=1)
                scheduler = utils.StaticPersistentTileScheduler.create(sched, cute.arch.block_idx(),
                                                                       cute.arch.grid_dim())
                work = scheduler.initial_work_tile_info()
                prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
                while work.is_valid_tile:
                    tm, tn, tl = tile_coord(work)
                    gA_k = tAgA[(None, tm, None, tl)]
                    gB_k = tBgB[(None, tn, None, tl)]
                    gSFA_k = tAgSFA[(None, tm, None, tl)]
                    sfb_tile = tn
                    if cutlass.const_expr(tile_n == 64):
                        sfb_tile = tn // 2  # a 128-row scale tile serves two 64-row weight tiles
                    gSFB_k = tBgSFB[(None, sfb_tile, None, tl)]
                    prod.reset_count()
                    for _kt in cutlass.range(0, k_tiles, 1, unroll=1):
                        ab_pipe.producer_acquire(prod)
                        bar = ab_pipe.producer_get_barrier(prod)
                        cute.copy(tma_a_atom, gA_k[(None, prod.count)], tAsA[(None, prod.index)],
                                  tma_bar_ptr=bar, mcast_mask=mask_a)
                        cute.copy(tma_b_atom, gB_k[(None, prod.count)], tBsB[(None, prod.index)],
                                  tma_bar_ptr=bar, mcast_mask=mask_b)
                        cute.copy(tma_sfa_atom, gSFA_k[(None, prod.count)], tAsSFA[(None, prod.index)],
                                  tma_bar_ptr=bar, mcast_mask=mask_sfa)
                        cute.copy(tma_sfb_atom, gSFB_k[(None, prod.count)], tBsSFB[(None, prod.index)],
                                  tma_bar_ptr=bar, mcast_mask=mask_sfb)
                        prod.advance()
                    scheduler.advance_to_next_work()
                    work = scheduler.get_current_work()
                cute.arch.griddepcontrol_launch_dependents()
                ab_pipe.producer_tail(prod)

            if warp == mma_warp:
                tmem.wait_for_alloc()
                acc_ptr = tmem.retrieve_ptr(acc_dtype)
                tCtAcc_all = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)
                acc_cols = tile_n * acc_stages
                sfa_cols = (cfg.cta_m // 32) * SF_ATOM_K
                tCtSFA_layout = bsl.make_tmem_layout_sfa(tiled_mma, mma_tiler, sf_vec, cute.slice_(sfa_smem, one4))
                tCtSFA = cute.make_tensor(cute.recast_ptr(acc_ptr + acc_cols, dtype=sf_dtype), tCtSFA_layout)
                tCtSFB_layout = bsl.make_tmem_layout_sfb(tiled_mma, mma_tiler, sf_vec, cute.slice_(sfb_smem, one4))
                tCtSFB = cute.make_tensor(cute.recast_ptr(acc_ptr + acc_cols + sfa_cols, dtype=sf_dtype),
                                          tCtSFB_layout)
                s2t_sfa, sSFA_s2t, tSFA_s2t = s2t_partition(sSFA, tCtSFA)
                s2t_sfb, sSFB_s2t, tSFB_s2t = s2t_partition(sSFB, tCtSFB)

                scheduler = utils.StaticPersistentTileScheduler.create(sched, cute.arch.block_idx(),
                                                                       cute.arch.grid_dim())
                work = scheduler.initial_work_tile_info()
                cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
                accp = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, acc_stages)
                while work.is_valid_tile:
                    tm, tn, tl = tile_coord(work)
                    tCtAcc = tCtAcc_all[(None, None, None, accp.index)]
                    tCtSFB_mma = tCtSFB
                    if cutlass.const_expr(tile_n == 64):
                        # an odd 64-row weight tile reads the upper half of the 128-row scale tile
                        shift = cutlass.Int32((tn % 2) * 2)
                        tCtSFB_mma = cute.make_tensor(
                            cute.recast_ptr(acc_ptr + acc_cols + sfa_cols + shift, dtype=sf_dtype), tCtSFB_layout)
                    cons.reset_count()
                    if leader:
                        acc_pipe.producer_acquire(accp)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                    for kt in cutlass.range(0, k_tiles, 1, unroll=1):
                        if leader:
                            ab_pipe.consumer_wait(cons)
                            at = (None, None, None, None, cons.index)
                            cute.copy(s2t_sfa, sSFA_s2t[at], tSFA_s2t)
                            cute.copy(s2t_sfb, sSFB_s2t[at], tSFB_s2t)
                            tiled_mma.set(tcgen05.Field.ACCUMULATE, kt != 0)
                            stage = (None, None, None, cons.index)
                            cute.gemm(tiled_mma, tCtAcc, [tCrA[stage], tCtSFA], [tCrB[stage], tCtSFB_mma], tCtAcc)
                            ab_pipe.consumer_release(cons)
                        cons.advance()
                    if leader:
                        acc_pipe.producer_commit(accp)
                    accp.advance()
                    scheduler.advance_to_next_work()
                    work = scheduler.get_current_work()
                acc_pipe.producer_tail(accp)

            if warp < mma_warp:
                tmem.allocate(num_tmem_cols)
                tmem.wait_for_alloc()
                acc_ptr = tmem.retrieve_ptr(acc_dtype)
                tCtAcc_all = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)
                alpha = mAlpha[0]

                t2r_atom = sm100.get_tmem_load_op(cta_tile, c_layout_enum, c_dtype, acc_dtype, epi_tile, two_cta)
                tAcc_epi = cute.flat_divide(tCtAcc_all[((None, None), 0, 0, None)], epi_tile)
                t2r = tcgen05.make_tmem_copy(t2r_atom, tAcc_epi[(None, None, 0, 0, 0)])
                thr_t2r = t2r.get_slice(tidx)
                tTR_tAcc_all = thr_t2r.partition_S(tAcc_epi)
                gC_epi = cute.flat_divide(tCgC[((None, None), 0, 0, None, None, None)], epi_tile)
                cC_epi = cute.flat_divide(tCcC[((None, None), 0, 0, None, None, None)], epi_tile)
                tTR_gC = thr_t2r.partition_D(gC_epi)
                tTR_cC_all = thr_t2r.partition_D(cC_epi)
                tTR_rAcc = cute.make_rmem_tensor(tTR_gC[(None, None, None, 0, 0, 0, 0, 0)].shape, acc_dtype)
                tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, c_dtype)
                r2s = cute.make_tiled_copy_D(sm100.get_smem_store_op(c_layout_enum, c_dtype, acc_dtype, t2r), t2r)
                tRS_sC = r2s.get_slice(tidx).partition_D(sC)
                tRS_rC = r2s.retile(tTR_rC)
                bSG_sC, bSG_gC_all = cpasync.tma_partition(
                    tma_c_atom, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), cute.group_modes(gC_epi, 0, 2))

                c_pipe = pipeline.PipelineTmaStore.create(
                    num_stages=EPI_C_STAGES,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, epi_threads))
                scheduler = utils.StaticPersistentTileScheduler.create(sched, cute.arch.block_idx(),
                                                                       cute.arch.grid_dim())
                work = scheduler.initial_work_tile_info()
                accc = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, acc_stages)
                while work.is_valid_tile:
                    tcoord = tile_coord(work)
                    bSG_gC = cute.group_modes(bSG_gC_all[(None, None, None, *tcoord)], 1, 3)
                    tTR_tAcc = tTR_tAcc_all[(None, None, None, None, None, accc.index)]
                    tTR_tAcc = cute.group_modes(tTR_tAcc, 3, cute.rank(tTR_tAcc))
                    tTR_cC = tTR_cC_all[(None, None, None, None, None, *tcoord)]
                    tTR_cC = cute.group_modes(tTR_cC, 3, cute.rank(tTR_cC))
                    acc_pipe.consumer_wait(accc)
                    subtiles = cute.size(tTR_tAcc.shape, mode=[3])
                    done = scheduler.num_tiles_executed * subtiles
                    for sub in cutlass.range(subtiles):
                        cute.copy(t2r, tTR_tAcc[(None, None, None, sub)], tTR_rAcc)
                        crd = tTR_cC[(None, None, None, sub)]
                        for i in cutlass.range_constexpr(cute.size(tTR_rAcc)):
                            col = cutlass.min(crd[i][1], n_real - 1)
                            tTR_rAcc[i] = tTR_rAcc[i] * alpha + mBias[col].to(acc_dtype)
                        tRS_rC.store(r2s.retile(tTR_rAcc).load().to(c_dtype))
                        buf = (done + sub) % EPI_C_STAGES
                        cute.copy(r2s, tRS_rC, tRS_sC[(None, None, None, buf)])
                        cute.arch.fence_proxy("async.shared", space="cta")
                        epi_sync.arrive_and_wait()
                        if warp == epi_warps[0]:
                            cute.copy(tma_c_atom, bSG_sC[(None, buf)], bSG_gC[(None, sub)])
                            c_pipe.producer_commit()
                            c_pipe.producer_acquire()
                        epi_sync.arrive_and_wait()
                    acc_pipe.consumer_release(accc)
                    accc.advance()
                    scheduler.advance_to_next_work()
                    work = scheduler.get_current_work()
                tmem.relinquish_alloc_permit()
                epi_sync.arrive_and_wait()
                tmem.free(acc_ptr)
                c_pipe.producer_tail()

        one4 = (None, None, None, 0)
        pair = 2 if two_cta else 1

        def tile_coord(work):
            """(M, N, batch) of the MMA tile of a scheduled CTA tile (a CTA pair shares one)."""
            t = work.tile_idx
            return (t[0] // pair, t[1], t[2])

        def s2t_partition(sSF, tSF):
            """The shared -> tensor memory copy of a scale-factor tile (``tcgen05.cp``) and its
            source (per stage) and destination partitions."""
            atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(cta_group), sf_dtype)
            tiled = tcgen05.make_s2t_copy(atom, cute.filter_zeros(tSF))
            thr = tiled.get_slice(0)
            src = tcgen05.get_s2t_smem_desc_tensor(tiled, thr.partition_S(cute.filter_zeros(sSF)))
            return tiled, src, thr.partition_D(cute.filter_zeros(tSF))

        return host

    def fake_args(self):
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

        dt = cutlass.BFloat16 if self.dtype == "bfloat16" else cutlass.Float16
        m, sfx = cute.sym_int32(), cute.sym_int32()
        kb = self.k // self.sf_vec
        np_, kbp = sf_padded_shape(self.n, kb)
        xq = make_fake_compact_tensor(cutlass.Uint8, (m, self.k // 2), stride_order=(1, 0), assumed_align=16)
        w = make_fake_compact_tensor(cutlass.Uint8, (self.n, self.k // 2), stride_order=(1, 0), assumed_align=16)
        sf_x = make_fake_compact_tensor(cutlass.Uint8, (sfx,), assumed_align=16)
        sf_w = make_fake_compact_tensor(cutlass.Uint8, (np_ * kbp,), assumed_align=16)
        alpha = make_fake_compact_tensor(cutlass.Float32, (1,), assumed_align=4)
        bias = make_fake_compact_tensor(dt, (self.n,), assumed_align=2)
        out = make_fake_compact_tensor(dt, (m, self.n), stride_order=(1, 0), assumed_align=16)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        return xq, w, sf_x, sf_w, alpha, bias, out, 1, stream


def _check(cfg: Sm100BlockScaledConfig, n: int, k: int, fmt: str, dtype: str) -> None:
    reason = validate(cfg, n, k, fmt, dtype)
    if reason is not None:
        raise ValueError(f"invalid Sm100BlockScaledConfig {cfg} for n={n}, k={k}, {fmt}, {dtype}: {reason}")


def _compile(cfg: Sm100BlockScaledConfig, n: int, k: int, fmt: str, dtype: str, sms: int = SM_COUNT) -> Callable:
    """The compiled launcher, from the disk kernel cache when it holds it. ``sms``: the GPU's
    multiprocessors (the persistent grid); ``pdl`` is a launch argument (one binary)."""
    from ..kernel_cache import compile_cached

    _check(cfg, n, k, fmt, dtype)
    cfg = pdl.binary_config(cfg)

    def build():
        kern = _Sm100BlockScaledKernel(cfg, n, k, fmt, dtype, sms)
        # sm_100a-only instructions (tcgen05): name the target so CPU-only hosts compile it too
        return cute.compile(kern.build(), *kern.fake_args(), options="--enable-tvm-ffi --gpu-arch sm_100a")

    return compile_cached("sm100_blockscaled_gemm", __name__, (cfg, n, k, fmt, dtype, sms), build)


def compile_only(cfg: Sm100BlockScaledConfig, n: int, k: int, fmt: str, dtype: str) -> None:
    """Compile without a GPU (set CUTE_DSL_ARCH=sm_100a), for CI."""
    _compile(cfg, n, k, fmt, dtype)
