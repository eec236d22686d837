"""Choices for the Hopper W4A16 backend that do not change what a kernel computes or how fast
one config runs: the default config per shape, the tuner's search space and the configs it
tries first.

They live apart from the kernel modules on purpose: the source hash that stamps tuning
results (provenance) covers the kernels, so a better default or a wider search space here
leaves every stored measurement valid. This module imports the kernels (for their config
dataclasses and validity rules); the kernels never import it.

The measurements quoted below were taken on an NVIDIA H200 (132 SMs) in November 2026 with
torch 2.11 + CUDA 13.0 and CuTeDSL 4.8.1, on the Llama-3.1-8B and -70B GEMM shapes
("8B qkv" = 6144 x 4096 and so on, see ``scripts/bench_linear.py``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..hopper import SM_COUNT

#: largest M the default sends to the decode kernel. On the Llama-3.1 8B/70B shapes, both
#: formats: at M = 32 the GEMM with 32-token tiles and K split in two beat
#: the decode kernel's m_max = 32 default on 10 of 16 points, by up to 1.6x (70B o 19.7 against
#: 30.9 us, 70B gate_up 124.4 against 180.2); the decode kernel's time doubles from M = 16 to 32
#: on the large shapes (70B gate_up 91 -> 180 us), the GEMM's barely moves. At M = 16 the decode
#: kernel won 12 of 16.
DECODE_MAX_M = 16
#: largest M whose tuner seeds still include decode configs
DECODE_SEED_MAX_M = 32


def _decode():
    from ..kernels import w4a16_decode

    return w4a16_decode


def _gemm():
    from ..kernels import sm90_w4a16_gemm

    return sm90_w4a16_gemm


# ----------------------------------------------------------------------------- decode kernel
def decode_config_space(n: int, k: int, fmt: str, dtype: str) -> dict[str, list]:
    """Values of the decode kernel worth sweeping for ``(n, k)``."""
    D = _decode()
    g = D._groups(k)
    splits = sorted({s for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if s <= g})
    return {"warps": [2, 4, 8, 16], "k_split": splits, "m_max": list(D.M_MAX_CHOICES),
            "prefetch": [False, True], "split_reduce": list(D.SPLIT_REDUCE),
            "tiles_per_warp": list(D.TILES_PER_WARP_CHOICES), "x_smem": [False, True],
            "ctas_per_sm": [0, 6, 8], "smem_stages": list(D.SMEM_STAGES_CHOICES), "pdl": [False, True],
            "pdl_early": [False, True]}


def _sm_count() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return SM_COUNT


def decode_default(n: int, k: int, fmt: str, dtype: str, m: int | None = None):
    """Heuristic from H200 sweeps of the decode kernel's configs (the Llama shapes at M = 1 and
    16): the smallest m_max that covers ``m``; x staged in shared memory (faster in 11
    of the 12 cases); split K until about 32 (m_max = 8) or 16 (larger m_max) warps per SM have
    work, keeping every split non-empty, and at m_max = 8 at least two ways when K has four or
    more groups; at m_max = 8 and K <= 8192 the split CTAs sum through a cluster where it fits
    (one launch, the fastest reduction there; at K = 28672 the reduction kernel was 5% faster),
    otherwise in the reduction kernel. At m_max = 16 and K >= 8192 (16 or more K groups):
    8 warps per CTA, at least two splits, and the weights streamed through a 2-deep ring in
    shared memory (``smem_stages=2``: 50.7 vs 60.3 us on 70B down, 100.0 vs 104.7 on 70B
    gate_up, 18.3 vs 20.5 on 8B down at M = 16; at K = 4096 it was 0-15% slower)."""
    D = _decode()
    m = 16 if m is None else m
    m_max = next((c for c in D.M_MAX_CHOICES if c >= m), D.M_MAX_CHOICES[-1])
    tiles = D._tiles(n)
    g = D._groups(k)
    streamed = m_max == 16 and g >= 16  # (unmeasured at larger m_max: more shared memory)
    warps, stages = (8, 2) if streamed else (4, 0)
    target_warps = _sm_count() * (32 if m_max == 8 else 16)
    split = max(1, min(g, round(target_warps / max(tiles, 1))))
    if (m_max == 8 and g >= 4) or streamed:
        split = max(split, 2)
    # snap to a split that leaves no empty CTA
    while split > 1:
        for red in (("cluster", "kernel") if (m_max == 8 or streamed) and g <= 16 else ("kernel",)):
            cfg = D.DecodeConfig(warps=warps, k_split=split, m_max=m_max, split_reduce=red, x_smem=True,
                                 smem_stages=stages)
            if D.validate(cfg, n, k, fmt, dtype) is None:
                return cfg
        split -= 1
    cfg = D.DecodeConfig(warps=warps, k_split=1, m_max=m_max, x_smem=True, smem_stages=stages)
    if D.validate(cfg, n, k, fmt, dtype) is None:
        return cfg
    return D.DecodeConfig(warps=4, k_split=1, m_max=m_max, x_smem=True)


# ----------------------------------------------------------------------------- GEMM kernel
def gemm_config_space(n: int, k: int, fmt: str, dtype: str) -> dict[str, list]:
    """Values of the wgmma GEMM worth sweeping."""
    return {
        "tile_n": [64, 128, 256],
        "tile_m": [16, 32, 64, 128, 256],
        "tile_k": [64, 128, 256],
        "stages": [2, 3, 4, 5, 6, 8],
        "split_k": [1, 2, 4],
        "cluster_n": [1, 2],
        "raster": ["n", "m"],
        "swizzle": [1, 4, 8],
        "ctas_per_sm": [0, 2],
        "pdl": [False, True],
        "scale_select": [False, True],
        "producer": [False, True],
    }


# Medium-M tiles (tile_n, tile_m, tile_k, stage cap) and their relative per-CTA efficiency,
# fitted to an H200 sweep of the benchmark shapes at M = 64, 128, 512
_MEDIUM_TILES = (
    ((128, 256, 64, 6), 1.0),
    ((256, 64, 128, 4), 0.85),
    ((128, 128, 128, 5), 0.8),
    ((128, 64, 256, 4), 0.7),
    ((64, 128, 128, 6), 0.6),
    ((64, 64, 256, 4), 0.5),
)


# Modelled cost of splitting K in two. Against the 18 (shape, M) points of the H200 sweeps
# (M = 64, 128, 512, every pick measured): 1.3 makes the default 4.5% slower than the
# best measured config on average (worst 18%), 1.25 5.5% (worst 23%, 8B o at M = 512), 1.5 6.9%.
_SPLIT_COST = 1.3


def _deepest(tile_n: int, tile_m: int, tile_k: int, cap: int, split: int, raster: str,
             n: int, k: int, fmt: str, dtype: str, ctas_per_sm: int = 0, swizzle: int = 1):
    """The config with the most pipeline stages (at most ``cap``) that is valid, or None."""
    G = _gemm()
    for stages in range(cap, 1, -1):
        cfg = G.Sm90GemmConfig(tile_n=tile_n, tile_m=tile_m, tile_k=tile_k, stages=stages,
                               split_k=split, raster=raster, ctas_per_sm=ctas_per_sm, swizzle=swizzle)
        if G.validate(cfg, n, k, fmt, dtype) is None:
            return cfg
    return None


def _medium_ranking(n: int, k: int, fmt: str, dtype: str, m: int) -> list:
    """Tiles and split-K by modelled time, least first: waves of CTAs over the multiprocessors
    x work per CTA / tile efficiency, x ``_SPLIT_COST`` when K is split (the cluster reduction,
    more x loads, a shorter pipeline per CTA)."""
    sms = SM_COUNT
    np_ = _gemm()._pad(n)
    m_pow2 = 1 << (max(m, 64) - 1).bit_length()
    ranked = []
    for (tn, tm, tk, cap), eff in _MEDIUM_TILES:
        if tm > m_pow2:
            continue
        if tn == 256 and m > 64:  # 256-row tiles were measured at M = 64 only
            continue
        for split in ((1,) if tn == 256 else (1, 2)):  # split 4 and split 256-row tiles never won
            cfg = _deepest(tn, tm, tk, cap, split, "n", n, k, fmt, dtype)
            if cfg is None:
                continue
            ctas = -(-np_ // tn) * -(-m // tm) * split
            cost = -(-ctas // sms) * tn * tm * (k / split) / eff * (_SPLIT_COST if split > 1 else 1.0)
            ranked.append((cost, len(ranked), cfg))
    return [cfg for _, _, cfg in sorted(ranked, key=lambda t: t[:2])]


# Largest M whose GEMM default broadcasts block scales by operand select (``scale_select``).
# The GEMM winners of the benchmark shapes with and without it: faster in 37 of 39 cases at
# M = 16-128 (geomean NVFP4 0.955, MXFP4 0.978), a wash at M = 512 and 2048 but for 70B gate_up
# at 2048 (7-9% slower).
SCALE_SELECT_MAX_M = 128


def _scale_select(m: int | None) -> bool:
    """Whether a GEMM default or seed for ``m`` tokens broadcasts block scales by operand select."""
    return m is not None and m <= SCALE_SELECT_MAX_M


# Smallest M whose GEMM default streams its stages from a dedicated producer warp (where the
# tile leaves it the registers). The GEMM winners at M = 64..2048 with and without it: faster in
# all 17 cases where it was valid and the winner's tile was at most 128 tokens (by 4-12%; 8B o at
# 128 13.3 -> 11.8 us, 70B down MXFP4 at 128 95.0 -> 83.5); the 256-token tiles it slowed by
# 18-37% (their wgmmas serialize in the 168 registers a 9-warp CTA leaves: now invalid).
# Unmeasured at M <= 32.
PRODUCER_MIN_M = 64


def gemm_default(n: int, k: int, fmt: str, dtype: str, m: int | None = None):
    """:func:`gemm_tiles`, with block scales broadcast by operand select up to
    ``SCALE_SELECT_MAX_M`` tokens, and from ``PRODUCER_MIN_M`` tokens a producer warp where the
    tile allows one."""
    return _with_producer(replace(gemm_tiles(n, k, fmt, dtype, m), scale_select=_scale_select(m)),
                          n, k, fmt, dtype, m)


def _with_producer(cfg, n: int, k: int, fmt: str, dtype: str, m: int | None):
    """``cfg`` with a producer warp from ``PRODUCER_MIN_M`` tokens where that is valid."""
    if m is not None and m >= PRODUCER_MIN_M:
        prod = replace(cfg, producer=True)
        if _gemm().validate(prod, n, k, fmt, dtype) is None:
            return prod
    return cfg


def gemm_tiles(n: int, k: int, fmt: str, dtype: str, m: int | None = None):
    """Heuristic from H200 sweeps of the GEMM's configs.

    * M <= 16 (normally served by the decode kernel): 16-token tiles, 256-row weight tiles when
      N alone nearly fills the GPU with them, else 64-row tiles with a 256-deep K tile;
    * 16 < M <= 32: the M = 32 tuning winners, 32-token tiles with a 256-deep K tile and K split
      in two (see ``DECODE_MAX_M``);
    * 32 < M <= 1024: the tile (``_MEDIUM_TILES``) and split-K (summed in a cluster) with the
      least modelled time, waves of CTAs x work per CTA / tile efficiency (``_medium_ranking``);
    * larger M: 128 x 256 x 64 (measured at parity with cuBLAS bf16 from M = 2048), CTAs in
      bands (``swizzle``) so the ones resident together share tiles of both operands in L2.
    The deepest pipeline that fits shared memory."""
    G = _gemm()
    if m is None:
        m = 1024
    if 32 < m <= 1024:
        ranked = _medium_ranking(n, k, fmt, dtype, m)
        if ranked:
            cfg = ranked[0]
            # 256-token tiles from M = 512 in bands of 4 token tiles (the swizzle sweep at
            # M = 512: 8B qkv 46.0 against 50.7 us, 70B gate_up 649 against 671; 8B gate_up and
            # 70B down within 1%)
            return replace(cfg, swizzle=4) if cfg.tile_m == 256 and m >= 512 else cfg
    sms = SM_COUNT
    np_ = G._pad(n)
    raster, swizzle = "n", 1
    stages_cap = 8
    split = 1
    if 16 < m <= 32:
        # the M = 32 tuning winners (see DECODE_MAX_M): K split in two, summed in the cluster;
        # 128-row tiles, 64-row ones on the smallest problem (8B o, MXFP4: 9.3 us)
        tile_m, tile_k, split = 32, 256, 2
        tile_n, stages_cap = (64, 8) if np_ * k <= 4096 * 4096 else (128, 6)
    elif m <= 64:
        tile_m = 16 if m <= 16 else 64
        if np_ // 256 >= (3 * sms) // 4:
            tile_n, tile_k, stages_cap = 256, 128, 4
        else:
            tile_n, tile_k, stages_cap = 64, 256, 4
    else:
        tile_n, tile_m, tile_k = 128, 256, 64
        # the CTA order (a sweep of raster and swizzle, NVFP4): bands of 4 token
        # tiles over the weight tiles at M = 8192 (70B gate_up 11555 us against 12848 for the
        # plain token-tile walk, 8B gate_up 2994 against 3271); at M = 2048 and N >= 16384 bands
        # of 8 weight tiles over the token tiles (8B gate_up 714 against 732)
        swizzle = 4
        if n >= 16384 and m <= 2048:
            raster, swizzle = "m", 8
    cfg = _deepest(tile_n, tile_m, tile_k, stages_cap, split, raster, n, k, fmt, dtype, swizzle=swizzle)
    if cfg is None and split > 1:
        cfg = _deepest(tile_n, tile_m, tile_k, stages_cap, 1, raster, n, k, fmt, dtype, swizzle=swizzle)
    return cfg or G.Sm90GemmConfig(tile_n=64, tile_m=min(tile_m, 64), tile_k=64, stages=2)


# ----------------------------------------------------------------------------- the backend
def with_pdl(kcfg: Any) -> Any:
    """``kcfg`` with the default programmatic dependent launch setting: on, and for the decode
    kernel with the early trigger (``pdl_early``).

    Measured with ``scripts/bench_linear.py`` (the six benchmark shapes back to back in CUDA
    graphs, the pick with and without PDL in interleaved rounds): the GEMM was as fast or faster
    with it at M = 64..512 (8B qkv at 64: 14.3 against 16.4 us). With the decode kernel's trigger
    right after its dependent wait, the stored M = 1 winners ran as fast or faster than without
    PDL on all six shapes and both formats (NVFP4 8B qkv 7.16 against 8.57 us, 8B o 6.08 against
    6.84, 70B down 35.8 against 37.2; at worst 8B gate_up, 20.8 against 21.0), and the M = 16
    winner of 8B down 16.9 against 19.1. The tuner tries both."""
    if kcfg.kernel == "decode":
        return replace(kcfg, pdl=True, pdl_early=True)
    return replace(kcfg, pdl=True)


def default(n: int, k: int, fmt: str, dtype: str, m: int | None = None) -> Any:
    """The config the backend runs untuned: the decode kernel's up to ``DECODE_MAX_M`` tokens,
    the GEMM's above (and when M is unknown)."""
    D = _decode()
    if m is not None and m <= DECODE_MAX_M:
        kcfg = decode_default(n, k, fmt, dtype, m)
        if D.validate(kcfg, n, k, fmt, dtype) is None:
            return with_pdl(kcfg)
    return with_pdl(gemm_default(n, k, fmt, dtype, m))


def seeds(n: int, k: int, fmt: str, dtype: str, m: int | None) -> list[Any]:
    """Configs the tuner tries right after the default, most promising first: the default with
    programmatic dependent launch the other way (a decode default: with the late trigger, then
    without PDL; see :func:`with_pdl`; a GEMM default also with ``scale_select`` and with
    ``producer`` the other way), then the sweep winners of :func:`_sweep_seeds` with the default
    settings."""
    dflt = default(n, k, fmt, dtype, m)
    if dflt.kernel == "decode":
        out = [replace(dflt, pdl_early=False), replace(dflt, pdl=False, pdl_early=False)]
    else:
        out = [replace(dflt, pdl=not dflt.pdl), replace(dflt, scale_select=not dflt.scale_select),
               replace(dflt, producer=not dflt.producer)]
    select = _scale_select(m)
    return out + [with_pdl(_with_producer(replace(c, scale_select=select), n, k, fmt, dtype, m)
                           if c.kernel == "gemm" else c)
                  for c in _sweep_seeds(n, k, fmt, dtype, m)]


def _sweep_seeds(n: int, k: int, fmt: str, dtype: str, m: int | None) -> list[Any]:
    """The points that won H200 sweeps of the GEMM's configs near this shape and M, so a short
    tuning run (a few trials per job) still reaches them. Invalid ones are dropped by the
    caller. Measured winners they stand for (M = 64 / 128, NVFP4):

    * two CTAs per SM (``ctas_per_sm=2``) with 128-row tiles: 8B gate_up 36.3 / 53.2 us against
      the default's 38.4 / 58.5, 70B gate_up 127.3 / 201.3 against 137.0 / 215.4, 8B qkv at 64
      13.9 against 14.8;
    * 128 x 128 x 128 split 2: 70B down at 128, 99.5 against the default's 117.6;
    * at M = 512, 128 x 128 x 128 without split: 8B o 29.0 against 35.7;
    * at M <= 32, 16-token GEMM tiles split in 2: 8B qkv 10.6 against the decode kernel's 11.2;
    * at M >= 512, the CTA order (raster and swizzle): bands of 4 or 8 tiles won 7 of the 12
      (shape, M) points, by up to 10% (70B gate_up at M = 8192).
    """
    G = _gemm()
    out: list[Any] = []
    gm = G.Sm90GemmConfig
    m_ = 1024 if m is None else m
    if m_ <= DECODE_SEED_MAX_M:
        dflt = decode_default(n, k, fmt, dtype, m_)
        tm = 16 if m_ <= 16 else 32
        gemms = [gm(128, tm, 256, 6, split_k=2), gm(64, tm, 256, 8, split_k=2),
                 gm(256, tm, 128, 4), gm(64, tm, 256, 8), gm(128, tm, 256, 6)]
        if m_ > 8:  # past one n8 tile the GEMM's 16-token tiles can win (8B qkv at 16)
            out += gemms[:2]
        if m_ > DECODE_MAX_M:  # the GEMM is the default here; the decode kernel's own default
            out.append(dflt)
        for ks in (dflt.k_split * 2, max(1, dflt.k_split // 2)):
            for red in (dflt.split_reduce, "kernel", "cluster"):
                out.append(replace(dflt, k_split=ks, split_reduce=red))
        out.append(replace(dflt, ctas_per_sm=6))
        return out + gemms
    if m_ <= 64:
        pts = [gm(128, 64, 128, 4, split_k=s, ctas_per_sm=2) for s in (1, 2, 4)]
        pts += [gm(256, 64, 128, 4), gm(128, 64, 256, 4, split_k=2), gm(64, 64, 256, 4, split_k=2),
                gm(64, 32, 256, 4, split_k=2)]
    elif m_ <= 128:
        pts = [gm(128, 128, 64, 4, split_k=s, ctas_per_sm=2) for s in (1, 2)]
        pts += [gm(128, 128, 128, 5, split_k=s) for s in (1, 2)]
        pts += [gm(128, 64, 128, 4, split_k=s, ctas_per_sm=2) for s in (1, 2, 4)]
        pts += [gm(128, 64, 256, 4, split_k=s) for s in (1, 2)]
    elif m_ <= 1024:
        pts = [gm(128, 128, 128, 5, split_k=s) for s in (1, 2)]
        pts += [gm(128, 256, 64, 6, raster="n", swizzle=w) for w in (4, 8)]
        pts += [gm(128, 256, 64, 6, split_k=s, raster=r) for s in (1, 2) for r in ("n", "m")]
        pts += [gm(128, 128, 64, 4, split_k=s, ctas_per_sm=2) for s in (1, 2)]
    else:
        pts = [gm(128, 256, 64, 6, raster=r, swizzle=w) for r, w in (("n", 4), ("m", 8), ("n", 8), ("m", 16),
                                                                     ("n", 1), ("m", 1))]
        pts += [gm(128, 128, 128, 5, swizzle=8), gm(128, 128, 64, 4, ctas_per_sm=2), gm(256, 128, 64, 4)]
    ranked = _medium_ranking(n, k, fmt, dtype, m_) if 32 < m_ <= 1024 else []
    return out + pts + ranked[1:4]


# ----------------------------------------------------------------------------- MoE
def _moe_kernel():
    from ..kernels import w4a16_moe

    return w4a16_moe


def _moe_gemm():
    from ..kernels import sm90_moe_gemm

    return sm90_moe_gemm


#: pairs per hit expert (uniform routing) from which the MoE default is the grouped GEMM (the
#: H200 tuning winners: the grouped GEMM from 8 pairs per expert, DeepSeek-V3's EP slice at T = 256)
MOE_GEMM_MIN_PAIRS = 8
#: N x K (of w13) from which 128-row token blocks are the default at 96 or more pairs per expert
#: (the winners at T = 4096: Mixtral and DeepSeek-V3 128, Qwen3-30B-A3B's small experts 64)
MOE_GEMM_BIG_EXPERT = 16 << 20


def moe_gemm_config_space(n: int, k: int, fmt: str, dtype: str) -> dict[str, list]:
    """Values of the grouped MoE GEMM worth sweeping."""
    return {"tile_n": [128, 256], "tile_m": [16, 32, 64, 128, 256], "tile_k": [64, 128], "stages": [3, 4, 6, 8],
            "cluster_n": [1, 2], "raster": ["m", "n"], "producer": [False, True], "scale_select": [False, True],
            "pdl": [False, True], "persistent": [False, True], "fused_sum": [False, True], "ctas_per_sm": [0, 2]}


def _pairs_per_expert(experts: int, topk: int, m: int | None) -> float:
    pairs = (m if m is not None else 1) * topk
    return pairs / min(experts, pairs) if pairs else 0.0


def _moe_gemm_default(n: int, k: int, fmt: str, dtype: str, per_expert: float):
    """128-row weight tiles, token blocks of 128 rows from 96 pairs per expert for large experts
    (``MOE_GEMM_BIG_EXPERT``) and of 64 otherwise, the CTAs walking the weight tiles of a block
    first (``raster="n"``, 4 of the 6 grouped-GEMM tuning winners), the deepest pipeline of
    64-deep K tiles (up to 6) that fits, a producer warp."""
    G = _moe_gemm()
    tile_m = 128 if per_expert >= 96 and n * k >= MOE_GEMM_BIG_EXPERT else 64
    for stages in (6, 5, 4, 3):
        for producer in (True, False):
            cfg = G.MoEGemmConfig(tile_n=128, tile_m=tile_m, tile_k=64, stages=stages, raster="n",
                                  producer=producer)
            if G.validate(cfg, n, k, fmt, dtype) is None:
                return cfg
    return G.MoEGemmConfig(tile_m=tile_m)


def moe_seeds(n: int, k: int, fmt: str, dtype: str, experts: int, topk: int, m: int | None = None) -> list[Any]:
    """Grouped-GEMM configs next to the default where a hit expert gets enough pairs: token
    blocks of 16 or 32 where they fit the pairs per expert, the other token block, the other
    raster, 128-deep K tiles, 256-row weight tiles, two CTAs of one warpgroup per SM, the
    persistent kernels (with and without the fused top-k sum), and below 16 pairs per expert the
    warp-level kernel in 16-row blocks; else the warp-level kernel's seeds."""
    from dataclasses import replace

    per_expert = _pairs_per_expert(experts, topk, m)
    if per_expert < MOE_GEMM_MIN_PAIRS / 2:
        return _moe_decode_seeds(moe_decode_default(n, k, fmt, dtype, experts, topk, m))
    d = _moe_gemm_default(n, k, fmt, dtype, per_expert)
    out = [replace(d, tile_m=192 - d.tile_m), replace(d, raster="m"), replace(d, tile_k=128, stages=4),
           replace(d, tile_n=256, stages=4), replace(d, producer=not d.producer), replace(d, tile_m=256, stages=4)]
    # two CTAs of one warpgroup per SM (one's epilogue under the other's main loop); the persistent
    # kernels (producer warp, block-major units), one CTA of two warpgroups or two of one per SM,
    # the top-k sum fused or not (the H200 sweep's winners among them, 3-36% over the rest)
    out.append(replace(d, tile_n=64, tile_m=128, stages=4, ctas_per_sm=2, raster="n"))
    pers = replace(d, producer=True, raster="n", cluster_n=1, persistent=True)
    out += [replace(pers, tile_m=128, stages=6), replace(pers, tile_n=64, tile_m=64, stages=6, ctas_per_sm=2),
            replace(pers, tile_n=64, tile_m=128, stages=4, ctas_per_sm=2, fused_sum=True),
            replace(pers, tile_n=64, tile_m=128, stages=4, ctas_per_sm=2)]
    # token blocks that fit the pairs per hit expert (each expert's run is padded to a block)
    small = [tm for tm in (16, 32) if per_expert <= 1.5 * tm]
    out = [replace(d, tile_m=tm) for tm in small] + out
    if per_expert < 2 * MOE_GEMM_MIN_PAIRS:
        # near the crossover the warp-level kernel in 16-row blocks can still win (gpt-oss-120b
        # at T = 256, 8 pairs per expert: 627 us against the grouped GEMM's 913 on the H200)
        wd = moe_decode_default(n, k, fmt, dtype, experts, topk, m)
        out += [wd, replace(wd, m_block=16, k_split=1, k_warps=1), replace(wd, m_block=16)]
    return out


def moe_config_space(n: int, k: int, fmt: str, dtype: str) -> dict[str, list]:
    """Values of the grouped MoE kernels worth sweeping."""
    M = _moe_kernel()
    return {"m_block": list(M.M_BLOCKS), "warps": [2, 4, 8], "k_split": [1, 2, 4], "pdl": [False, True],
            "per_pair": [False, True], "k_warps": [1, 2, 4]}


#: up-GEMM warp tasks (hit blocks x tile pairs x K shares) up to which the warp-level MoE
#: default splits H over more warps of a CTA (``k_warps``): about 62 warps per SM of the H200.
#: In the H200 tuning runs the most shares won at T = 1 and 4 (Qwen3-30B-A3B, Mixtral-8x7B,
#: gpt-oss-120b: 4, 4 and 2, the most valid)
MOE_UP_WARP_TASKS = 8192
#: down-GEMM warp tasks (hit blocks x 16-row tiles of H x K slices) up to which the default
#: splits I over CTAs (``k_split``): the T = 1 winners were 2 (Qwen3-30B-A3B, 1024 tasks), 4
#: (gpt-oss-120b, 720; Mixtral-8x7B, 512), by 11-39% over no split
MOE_DOWN_WARP_TASKS = 3072


def _moe_split(n: int, k: int, fmt: str, dtype: str, blocks: int, warps: int) -> tuple[int, int]:
    """``(k_warps, k_split)``: the most K shares of the up GEMM (dividing ``warps``, valid for
    H = ``k``) that keep ``blocks`` x (``n`` / 32 tile pairs) x ``k_warps`` within
    ``MOE_UP_WARP_TASKS``, and the most K slices of the down GEMM that keep ``blocks`` x
    (``k`` / 16 tiles) x ``k_split`` within ``MOE_DOWN_WARP_TASKS``."""
    M = _moe_kernel()
    kw_best = ks_best = 1
    for kw in (2, 4, 8):
        cfg = M.MoEDecodeConfig(warps=warps, k_warps=kw)
        if kw <= warps and blocks * (n // 32) * kw <= MOE_UP_WARP_TASKS and M.validate(cfg, n, k, fmt, dtype) is None:
            kw_best = kw
    for ks in (2, 4):
        cfg = M.MoEDecodeConfig(warps=warps, k_split=ks)
        if blocks * (k // 16) * ks <= MOE_DOWN_WARP_TASKS and M.validate(cfg, n, k, fmt, dtype) is None:
            ks_best = ks
    return kw_best, ks_best


def _moe_decode_seeds(d: Any) -> list[Any]:
    """Warp-level configs next to its default ``d``: other K shares of the up GEMM (``k_warps``)
    at 4 and 8 warps, other K splits of the down GEMM (1, 2, 4), dependent launch on."""
    from dataclasses import replace

    out = [replace(d, warps=w, k_warps=kw) for w, kw in ((4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (8, 8))]
    out += [replace(d, k_split=s) for s in (1, 2, 4)] + [replace(d, pdl=True)]
    return [c for c in out if c != d]


def moe_decode_default(n: int, k: int, fmt: str, dtype: str, experts: int, topk: int, m: int | None = None) -> Any:
    """The warp-level MoE kernel's default: one block per pair, unsorted, while the batch has at
    most as many (token, slot) pairs as experts (the winner at Qwen3-30B-A3B's T = 16); else the
    pairs sorted by expert in blocks of 16 rows where a hit expert gets more than 8 pairs on
    average (uniform routing), of 8 below; 4 warps; the up GEMM's H split over as many of a
    CTA's warps and the down GEMM's I over as many CTAs as keep their warp tasks within
    ``MOE_UP_WARP_TASKS`` and ``MOE_DOWN_WARP_TASKS``."""
    M = _moe_kernel()
    pairs = (m if m is not None else 1) * topk
    if pairs <= experts:
        kw, ks = _moe_split(n, k, fmt, dtype, pairs, 4)
        return M.MoEDecodeConfig(m_block=8, warps=4, k_split=ks, per_pair=True, k_warps=kw)
    m_block = 16 if _pairs_per_expert(experts, topk, m) > 8 else 8
    blocks = min(experts, pairs) + pairs // m_block  # hit experts' blocks, about
    kw, ks = _moe_split(n, k, fmt, dtype, blocks, 4)
    return M.MoEDecodeConfig(m_block=m_block, warps=4, k_split=ks, k_warps=kw)


def moe_gemm_default(n: int, k: int, fmt: str, dtype: str, experts: int, topk: int, m: int | None = None) -> Any:
    """The grouped GEMM's default (``_moe_gemm_default``)."""
    return _moe_gemm_default(n, k, fmt, dtype, _pairs_per_expert(experts, topk, m))


def moe_default(n: int, k: int, fmt: str, dtype: str, experts: int, topk: int, m: int | None = None) -> Any:
    """The MoE default: the grouped GEMM from ``MOE_GEMM_MIN_PAIRS`` pairs per hit expert (where
    valid), else the warp-level kernel (:func:`moe_decode_default`)."""
    if _pairs_per_expert(experts, topk, m) >= MOE_GEMM_MIN_PAIRS:
        cfg = moe_gemm_default(n, k, fmt, dtype, experts, topk, m)
        if _moe_gemm().validate(cfg, n, k, fmt, dtype) is None:
            return cfg
    return moe_decode_default(n, k, fmt, dtype, experts, topk, m)
