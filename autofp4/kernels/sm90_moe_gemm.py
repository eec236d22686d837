"""Hopper (sm_90a) grouped W4A16 GEMMs for the MoE layer at larger batches (prefill).

The dense GEMM kernel (:mod:`.sm90_w4a16_gemm`: TMA + mbarrier pipeline, ``wgmma`` with the FP4
weight decoded into the register operand, ``out^T = W x^T``) run over the routing's (expert,
token block) list (:func:`autofp4.routing.moe_routing` with ``block_m = tile_m``):

* the pairs (token, slot) are sorted by expert and each expert's run is padded to ``tile_m``
  rows; x is gathered into that order (``xs [rows, H]``, one ``index_select``) so that a block's
  rows are contiguous and TMA loads them like a dense tile;
* CTA ``(weight tile, block)`` reads ``block_expert[block]`` (``-1``: past the used blocks, it
  exits at once) and streams that expert's packed weight (every expert's packed weight lies one
  after the other; ``alpha`` per expert);
* **up**: ``w13`` is packed with gate and up rows interleaved in groups of 8, so that one thread
  holds the gate and the up accumulator of the same output (rows ``r`` and ``r + 8`` of the wgmma
  fragment); the epilogue applies the activation (:mod:`._moe_act`) and stores ``h [rows, I]``
  in the sorted order, two consecutive outputs per store;
* **down**: ``h`` (already in block order) times ``w2``, times the expert's alpha and the pair's
  router weight, stored at the pair's row of ``y [T * top_k, H]`` (padding rows store nothing);
  ``y.view(T, top_k, H).sum(1)`` is the top-k sum (fp32 accumulation, one rounding).

Every size depends on T, top-k and E only (the grid covers the largest possible number of
blocks), so the layer is CUDA-graph capturable with no host synchronization, and only the
experts the batch hits are read. With ``expert_map``, pairs routed to another rank's experts are
not in the routing and their rows of ``y`` stay zero.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from .. import pdl
from ..problem import DTYPES, FORMATS
from . import sm90_w4a16_gemm as G
from ._moe_act import ACTIVATIONS, activation

#: helper modules whose source is part of this kernel's (kernel cache key, DB provenance)
KERNEL_SOURCES = ("autofp4.kernels.sm90_w4a16_gemm", "autofp4.kernels._ptx", "autofp4.kernels._fp4_bits",
                  "autofp4.kernels._moe_act", "autofp4.kernels.sm90_moe_persistent")
GATE_UP_GROUP = 8  # gate and up rows alternate in groups of this many (the wgmma fragment's r, r + 8)


@dataclass(frozen=True)
class MoEGemmConfig:
    """One point of the grouped GEMMs' space; both GEMMs of the layer use it. The fields are the
    dense GEMM's (:class:`.sm90_w4a16_gemm.Sm90GemmConfig`); ``tile_m`` is also the routing's
    token block, ``raster="m"`` walks the blocks of one weight tile first (the weight tile is
    reused from L2 by the blocks of its expert). ``persistent`` runs both GEMMs as the persistent
    kernels of :mod:`.sm90_moe_persistent` (about one CTA per SM walking the (block, weight tile)
    units, a producer warp streaming them back to back; with ``ctas_per_sm=2`` two CTAs per SM, so
    that one's epilogue overlaps the other's main loop); ``ctas_per_sm=2`` asks for two resident
    CTAs per SM (the dense kernel's rules: registers and shared memory for both); ``fused_sum`` (with ``persistent``) adds
    the down GEMM's outputs into the top-k sum in its epilogue (fp32 reductions), not in a pass
    over ``y [T * top_k, H]``."""

    kernel: ClassVar[str] = "moe_gemm"  # the tag of stored configs (not a field)
    tile_n: int = 128
    tile_m: int = 128
    tile_k: int = 64
    stages: int = 4
    cluster_n: int = 1
    raster: str = "m"
    producer: bool = False
    scale_select: bool = False
    pdl: bool = False
    persistent: bool = False
    fused_sum: bool = False
    ctas_per_sm: int = 0

    def gemm(self) -> G.Sm90GemmConfig:
        """The dense kernel's config each of the two GEMMs compiles with."""
        return G.Sm90GemmConfig(tile_n=self.tile_n, tile_m=self.tile_m, tile_k=self.tile_k, stages=self.stages,
                                cluster_n=self.cluster_n, raster=self.raster, producer=self.producer,
                                scale_select=self.scale_select, pdl=self.pdl, ctas_per_sm=self.ctas_per_sm)


def _gemms(n: int, k: int) -> dict[str, tuple[int, int]]:
    """The (N, K) of the up and the down GEMM of a layer ``n = 2 I``, ``k = H``."""
    return {"up": (n, k), "down": (k, n // 2)}


def validate(cfg: MoEGemmConfig, n: int, k: int, fmt: str, dtype: str) -> str | None:
    """``None`` if ``cfg`` can run the MoE problem ``n = 2 I`` (w13 rows), ``k = H``, else why not."""
    if not isinstance(cfg, MoEGemmConfig):
        return f"expected a MoEGemmConfig, got {type(cfg).__name__}"
    if fmt not in FORMATS:
        return f"fmt must be one of {FORMATS}, got {fmt!r}"
    if dtype not in DTYPES:
        return f"dtype must be one of {DTYPES}, got {dtype!r}"
    if not (isinstance(n, int) and n > 0 and n % (2 * GATE_UP_GROUP) == 0):
        return f"2 * intermediate must be a positive multiple of {2 * GATE_UP_GROUP} (gate and up rows in groups of 8), got {n}"
    if not (isinstance(k, int) and k > 0 and k % 2 == 0):
        return f"the hidden size must be a positive even number (two outputs per store), got {k}"
    for b in ("producer", "scale_select", "pdl", "persistent", "fused_sum"):
        if not isinstance(getattr(cfg, b), bool):
            return f"{b} must be a bool, got {getattr(cfg, b)!r}"
    if cfg.fused_sum and not cfg.persistent:
        return "fused_sum needs persistent=True (only the persistent down GEMM sums the top-k slots)"
    if cfg.persistent and not (cfg.producer and cfg.cluster_n == 1 and cfg.raster == "n"):
        return "persistent=True needs producer=True, cluster_n=1 and raster='n' (its units go block by block)"
    g = cfg.gemm()
    for what, (gn, gk) in _gemms(n, k).items():
        reason = G.validate(g, gn, gk, fmt, dtype)
        if reason is not None:
            return f"the {what} GEMM (N={gn}, K={gk}): {reason}"
    return None


# ----------------------------------------------------------------------------- layout
@dataclass(frozen=True, eq=False)
class GroupedPacked:
    """Stacked experts in the dense GEMM's layout, one expert after the other."""

    fmt: str
    experts: int
    n: int
    k: int
    data: torch.Tensor  # uint8 [E * per-expert bytes]
    alpha: torch.Tensor  # fp32 [E]: each expert's epilogue factor
    unsupported: tuple[str | None, str | None]  # (bf16, fp16): why these experts cannot run


def gate_up_rows(n: int) -> torch.Tensor:
    """Row order of an expert's w13 ``[2I, H]`` with gate rows ``8 q .. 8 q + 7`` followed by up rows
    ``I + 8 q ..``."""
    i = n // 2
    gate = torch.arange(i // GATE_UP_GROUP)[:, None] * GATE_UP_GROUP + torch.arange(GATE_UP_GROUP)
    return torch.stack((gate, gate + i), dim=1).reshape(-1)


def pack_experts(w: Any, gate_up: bool) -> GroupedPacked:
    """Pack stacked experts (an ``FP4Weight [E, N, K]``) expert by expert with
    :func:`.sm90_w4a16_gemm.pack_weight`; ``gate_up``: w13, rows in :func:`gate_up_rows`."""
    if not getattr(w, "experts", 0):
        raise ValueError(f"pack_experts takes stacked experts [E, N, K], got shape {tuple(w.shape)}")
    order = gate_up_rows(w.n).to(w.data.device) if gate_up else None
    parts = []
    for e in range(w.experts):
        we = w.expert(e)
        if order is not None:
            we = type(we)(we.fmt, we.data[order], we.scale[order], we.global_scale, check_values=False)
        parts.append(G.pack_weight(we))
    fp16 = None if all(p.fp16_ok for p in parts) else "mxfp4 scale exponents span more than fp16 can hold"
    return GroupedPacked(w.fmt, w.experts, w.n, w.k, torch.cat([p.data.reshape(-1) for p in parts]),
                         torch.cat([p.alpha for p in parts]), (None, fp16))


# ----------------------------------------------------------------------------- kernels
_SMS: dict[int, int] = {}


def _sm_count(dev: torch.device) -> int:
    """The SMs of ``dev`` (the persistent kernels' grid), cached per device index."""
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


@dataclass(frozen=True)
class _Grouped:
    """What makes the dense kernel a grouped one (see ``_Sm90W4A16Kernel``)."""

    kind: str  # "up" or "down"
    activation: str | None = None
    bias: bool = False  # the epilogue adds a per-expert bias

    def act(self, gate, up):
        return activation(self.activation, gate, up)


def _compile(cfg: MoEGemmConfig, n: int, k: int, fmt: str, dtype: str, part: str, bias: bool) -> Callable:
    """The compiled grouped GEMM ``part`` (``"down"`` or an activation: the up GEMM with it),
    with or without the per-expert ``bias``."""
    from ..kernel_cache import compile_cached

    reason = validate(cfg, n, k, fmt, dtype)
    if reason is None and part != "down" and part not in ACTIVATIONS:
        reason = f"activation must be one of {ACTIVATIONS}, got {part!r}"
    if reason is not None:
        raise ValueError(f"invalid MoEGemmConfig {cfg} for 2I={n}, H={k}, {fmt}, {dtype}: {reason}")
    cfg = pdl.binary_config(cfg)
    grouped = _Grouped("down", bias=bias) if part == "down" else _Grouped("up", part, bias)
    gn, gk = _gemms(n, k)[grouped.kind]

    def build():
        import cutlass.cute as cute

        if cfg.persistent:
            from .sm90_moe_persistent import PersistentMoEKernel

            kern = PersistentMoEKernel(cfg, gn, gk, fmt, dtype, grouped.kind, grouped.act, bias, cfg.fused_sum)
            args = kern.fake_args()
        else:
            kern = G._Sm90W4A16Kernel(cfg.gemm(), gn, gk, fmt, dtype, grouped=grouped)
            args = kern.fake_args_grouped()
        return cute.compile(kern.build(), *args, options="--enable-tvm-ffi --gpu-arch sm_90a")

    return compile_cached("sm90_moe_gemm", __name__, (cfg, n, k, fmt, dtype, part, bias), build)


def compile_only(cfg: MoEGemmConfig, n: int, k: int, fmt: str, dtype: str) -> None:
    """Compile the down GEMM and the up GEMM with each activation, without biases, and both
    with the biases of gpt-oss's activation (no GPU needed with ``CUTE_DSL_ARCH=sm_90a``)."""
    for part in ("down", *ACTIVATIONS):
        _compile(cfg, n, k, fmt, dtype, part, False)
    for part in ("down", "swigluoai"):
        _compile(cfg, n, k, fmt, dtype, part, True)


def compile_kernel(cfg: MoEGemmConfig, n: int, k: int, fmt: str, dtype: str) -> Callable:
    """``run(x, packed13, packed2, topk_weights, topk_ids, activation, expert_map=None,
    w13_bias=None, w2_bias=None) -> [T, H]``, for any T (``expert_map``, the biases: see
    :func:`autofp4.moe`)."""
    from ..routing import moe_routing

    tdt = getattr(torch, dtype)
    di = DTYPES.index(dtype)
    fns: dict[tuple[str, bool], Callable] = {}
    no_bias: dict[torch.device, torch.Tensor] = {}
    use_pdl = pdl.launch_flag(cfg.pdl)

    def fn(part: str, bias: torch.Tensor | None, dev: torch.device) -> tuple[Callable, torch.Tensor]:
        """The kernel for ``part`` with or without ``bias``, and the bias it reads (fp32, flat)."""
        f = fns.get((part, bias is not None))
        if f is None:
            f = fns[part, bias is not None] = _compile(cfg, n, k, fmt, dtype, part, bias is not None)
        if bias is None:
            bias = no_bias.get(dev)
            if bias is None:
                bias = no_bias[dev] = torch.zeros(1, dtype=torch.float32, device=dev)
            return f, bias
        return f, bias.reshape(-1).float().contiguous()

    def run(x: torch.Tensor, p13: GroupedPacked, p2: GroupedPacked, topk_weights: torch.Tensor,
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
        for b, shape in ((w13_bias, (p13.experts, n)), (w2_bias, (p2.experts, k))):
            if b is not None and tuple(b.shape) != shape:
                raise ValueError(f"expected a bias {list(shape)}, got {tuple(b.shape)}")
        t, top_k = topk_ids.shape
        if t == 0:
            return torch.empty(0, k, dtype=tdt, device=x.device)
        r = moe_routing(topk_ids, p13.experts, cfg.tile_m, expert_map=expert_map)
        xs = x.index_select(0, r.sorted_rows.clamp(min=0) // top_k)
        h = torch.empty(r.sorted_rows.numel(), n // 2, dtype=tdt, device=x.device)
        tw = topk_weights.reshape(-1).float().contiguous()
        (up, b13), (down, b2) = fn(activation, w13_bias, x.device), fn("down", w2_bias, x.device)
        if cfg.persistent:
            blocks = r.block_expert.numel()
            sms = _sm_count(x.device) * max(1, cfg.ctas_per_sm)
            up_ctas = min(sms, blocks * (G._pad(n) // cfg.tile_n))
            down_ctas = min(sms, blocks * (G._pad(k) // cfg.tile_n))
            up(xs, p13.data, p13.alpha, b13, h, r.block_expert, r.sorted_rows, tw, r.num_blocks, top_k, up_ctas,
               use_pdl)
            if cfg.fused_sum:  # the down GEMM adds each pair into its token's row
                out = torch.zeros(t, k, dtype=torch.float32, device=x.device)
                down(h, p2.data, p2.alpha, b2, out, r.block_expert, r.sorted_rows, tw, r.num_blocks, top_k,
                     down_ctas, use_pdl)
                return out.to(tdt)
        else:
            up(xs, p13.data, p13.alpha, b13, h, r.block_expert, r.sorted_rows, tw, use_pdl)
        alloc = torch.zeros if expert_map is not None else torch.empty  # another rank's pairs add nothing
        y = alloc(t * top_k, k, dtype=tdt, device=x.device)
        if cfg.persistent:
            down(h, p2.data, p2.alpha, b2, y, r.block_expert, r.sorted_rows, tw, r.num_blocks, top_k, down_ctas,
                 use_pdl)
        else:
            down(h, p2.data, p2.alpha, b2, y, r.block_expert, r.sorted_rows, tw, use_pdl)
        return y.view(t, top_k, k).sum(1)

    return run
