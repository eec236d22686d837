"""Hopper (sm_90a) W4A16 backend: FP4 weights decoded to bf16/fp16 in registers.

Two CuTeDSL kernels, each with its own frozen config dataclass (the config this backend stores,
validates and runs), told apart by the dataclass's ``kernel`` tag:

* ``"decode"`` (:class:`~autofp4.kernels.w4a16_decode.DecodeConfig`): memory-bound small-M kernel,
  warp-level ``mma.sync`` with the decoded weights as the A operand, split-K; serves
  ``M <= m_max``.
* ``"gemm"`` (:class:`~autofp4.kernels.sm90_w4a16_gemm.Sm90GemmConfig`): TMA + multi-stage
  pipeline + wgmma with the weights as the register operand (``out^T = W x^T``); serves any M.
* ``"moe_decode"`` (:class:`~autofp4.kernels.w4a16_moe.MoEDecodeConfig`): the MoE layer, both
  expert GEMMs grouped over the routing's (expert, token block) list with warp-level MMA, the
  activation, the expert biases and the router weights fused; serves any T, CUDA-graph capturable.
* ``"moe_gemm"`` (:class:`~autofp4.kernels.sm90_moe_gemm.MoEGemmConfig`): the MoE layer on the
  GEMM kernel above, grouped the same way (larger batches); serves any T, CUDA-graph capturable.

A decode config asked to run ``M > m_max`` runs the GEMM's default config for that M instead,
so every config answers every M; the dispatcher does not send such calls to a decode config
(it runs this backend's default for M there).
Each kernel reads its own repacked copy of the weight, built on first use and cached on the
:class:`~autofp4.weights.FP4Weight`.
"""
from __future__ import annotations

import functools
import importlib.util
import warnings
from dataclasses import replace
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from ..problem import ProblemKey, bucket_for
from ..graph_pools import outside_graph_pools
from . import sm90_heuristics
from .base import Backend, BackendConfig, Runner, grid
from .reference import reference_linear, reference_moe


@functools.lru_cache(maxsize=None)
def _kernels():
    """The two linear kernel modules, imported on first use (they import CuTeDSL)."""
    from ..kernels import sm90_w4a16_gemm as gemm
    from ..kernels import w4a16_decode as decode

    return decode, gemm


@functools.lru_cache(maxsize=None)
def _moe():
    """The MoE kernel modules (warp-level MMA, grouped GEMM), imported on first use."""
    from ..kernels import sm90_moe_gemm, w4a16_moe

    return w4a16_moe, sm90_moe_gemm


@functools.lru_cache(maxsize=None)
def _by_tag() -> dict[str, Any]:
    """Each kernel's module by its config's ``kernel`` tag."""
    decode, gemm = _kernels()
    moe_decode, moe_gemm = _moe()
    return {"decode": decode, "gemm": gemm, "moe_decode": moe_decode, "moe_gemm": moe_gemm}


@functools.lru_cache(maxsize=None)
def _config_types() -> dict[str, type]:
    """Each kernel's config dataclass by its ``kernel`` tag."""
    m = _by_tag()
    return {"decode": m["decode"].DecodeConfig, "gemm": m["gemm"].Sm90GemmConfig,
            "moe_decode": m["moe_decode"].MoEDecodeConfig, "moe_gemm": m["moe_gemm"].MoEGemmConfig}


def _module(config: Any):
    """The kernel module that runs ``config`` (a config of one of this backend's kernels)."""
    return _by_tag()[config.kernel]


def _spaces(op: str) -> tuple[tuple[str, Any], ...]:
    """(kernel tag, its space function) of the kernels that serve ``op``."""
    if op == "moe":
        return (("moe_decode", sm90_heuristics.moe_config_space), ("moe_gemm", sm90_heuristics.moe_gemm_config_space))
    return (("decode", sm90_heuristics.decode_config_space), ("gemm", sm90_heuristics.gemm_config_space))


def _grid_points(op: str, n: int, k: int, fmt: str, dtype: str, m: int | None = None) -> Iterator[Any]:
    """Every point of the grids of ``op``'s kernels for a problem, valid or not, in order
    (``m``: less the decode points whose ``m_max`` is below it)."""
    for tag, space_of in _spaces(op):
        cls, space = _config_types()[tag], space_of(n, k, fmt, dtype)
        if tag == "decode" and m is not None:
            space = {**space, "m_max": [v for v in space["m_max"] if v >= m]}
        for combo in grid(space):
            yield cls(**combo)


@functools.lru_cache(maxsize=64)
def _valid_grid(op: str, n: int, k: int, fmt: str, dtype: str) -> tuple[Any, ...]:
    """Every valid point of the grids of ``op``'s kernels for a problem, for every M (the tuner
    asks for each M bucket of a shape in turn; the linear grid is 10-18 thousand configs, a
    second of CPU)."""
    return tuple(cfg for cfg in _grid_points(op, n, k, fmt, dtype)
                 if _module(cfg).validate(cfg, n, k, fmt, dtype) is None)


def _left_out_at(cfg: Any, m: int | None) -> bool:
    """Is a grid point left out of the candidates of M bucket ``m``?"""
    if m is None:
        return False
    if cfg.kernel == "decode":
        return cfg.m_max < m
    # one token tile: the grouped order is the plain one
    return cfg.kernel == "gemm" and cfg.swizzle > 1 and cfg.raster == "n" and m <= cfg.tile_m


@functools.lru_cache(maxsize=None)
def _compiled(cfg: Any, n: int, k: int, fmt: str, dtype: str):
    """One compiled kernel per (config, n, k, fmt, dtype), shared by every runner."""
    return _first_call_outside_pools(_module(cfg).compile_kernel(cfg, n, k, fmt, dtype))


def _first_call_outside_pools(run: Callable) -> Callable:
    """``run`` (a kernel module's ``run(x, ...) -> tensor``), its first call on each device made
    outside CUDA graph memory pools: that call builds the kernel's per-device state (split-K
    counters, placeholder bias and workspace tensors) that every later call reuses, and state
    built during ``torch.compile(mode="reduce-overhead")``'s graph warm-up would be a live tensor
    of the graph's pool that the graph does not own (:func:`~autofp4.graph_pools.outside_graph_pools`).
    That call's result is returned as a copy made in line: the warm-up's outputs must be
    allocated in its pool."""
    seen: set[int] = set()  # x.get_device() of the devices called on (cheaper than x.device)

    def call(x: torch.Tensor, *args: Any) -> Any:
        if x.get_device() in seen:
            return run(x, *args)
        dev = x.device
        out = outside_graph_pools(lambda: run(x, *args), dev)
        seen.add(x.get_device())
        return out.clone() if dev.type == "cuda" else out

    return call


class SM90Prepared:
    """The weight in each kernel's layout, packed lazily on first use."""

    def __init__(self, weight: Any) -> None:
        self.weight = weight
        self._decode = None
        self._gemm = None
        self._moe: dict[tuple[str, bool], Any] = {}

    def moe(self, kernel: str, gate_up: bool):
        """Stacked experts in MoE kernel ``kernel``'s layout (``gate_up``: w13, gate and up rows
        interleaved)."""
        packed = self._moe.get((kernel, gate_up))
        if packed is None:
            packed = self._moe[kernel, gate_up] = self._pack(lambda: _by_tag()[kernel].pack_experts(self.weight, gate_up))
        return packed

    @property
    def decode(self):
        if self._decode is None:
            self._decode = self._pack(lambda: _kernels()[0].pack_weight(self.weight))
        return self._decode

    @property
    def gemm(self):
        if self._gemm is None:
            self._gemm = self._pack(lambda: _kernels()[1].pack_weight(self.weight))
        return self._gemm

    def _pack(self, fn):
        self.weight._require_loaded("a layout of the sm90_w4a16 kernels not built before they were freed")
        return outside_graph_pools(fn, self.weight.data.device)

    def pack_all(self, dtype: str, gate_up: bool | None) -> bool:
        """Every layout a call can ask for, built: both dense kernels' (``gate_up`` None), or both
        MoE kernels' for this weight's role (w13: True, w2: False). False where a call may still
        read the stored tensors (the reference fallback of a dense weight over 2 GiB, of MXFP4
        weights with fp16 activations that fp16 cannot hold)."""
        w = self.weight
        fp16 = w.fmt == "mxfp4" and dtype == "float16"
        if gate_up is None:
            if w.experts or _too_large(self):
                return False
            self.decode, self.gemm  # noqa: B018 - built on first read
            return not (fp16 and (_fp16_range_problem(self, "decode") or _fp16_range_problem(self, "gemm")))
        if not w.experts:
            return False
        for kernel in ("moe_decode", "moe_gemm"):
            self.moe_groups(kernel, gate_up)
            if fp16 and self.moe(kernel, gate_up).unsupported[1]:
                return False
        return True

    def moe_groups(self, kernel: str, gate_up: bool) -> list[tuple[int, int, Any]]:
        """The experts in ``kernel``'s layout as ``(first, end, packed)`` runs of consecutive
        experts whose packed tensors each hold at most ``MAX_ARG_BYTES`` (one run for all but the
        largest layers): views of :meth:`moe`'s tensors, no copies."""
        key = ("groups", kernel, gate_up)
        groups = self._moe.get(key)
        if groups is None:
            groups = self._moe[key] = expert_groups(self.moe(kernel, gate_up))
        return groups


#: the largest tensor (bytes, or elements of an output) a kernel argument or its in-kernel 32-bit
#: offsets can address; larger calls run in pieces that each fit (see ``expert_groups``,
#: ``_row_chunks``), a larger dense weight on the reference backend
MAX_ARG_BYTES = 2**31 - 1
_FLAT = ("data", "scales")  # a packed MoE layout's per-expert tensors, one expert after the other
_PER_EXPERT = ("alpha", "scale_add")  # ... and its tensors with one row per expert


def expert_groups(packed: Any, limit: int | None = None) -> list[tuple[int, int, Any]]:
    """``packed`` (a MoE kernel's stacked layout) as runs ``(first, end, packed view)`` of
    consecutive experts whose flat tensors hold at most ``limit`` bytes each (``MAX_ARG_BYTES``)."""
    limit = MAX_ARG_BYTES if limit is None else limit
    e = packed.experts
    per = max(getattr(packed, f).numel() // e for f in _FLAT if hasattr(packed, f))
    step = max(1, limit // per)
    if step >= e:
        return [(0, e, packed)]
    return [(e0, min(e, e0 + step), expert_slice(packed, e0, min(e, e0 + step))) for e0 in range(0, e, step)]


def expert_slice(packed: Any, e0: int, e1: int) -> Any:
    """Experts ``[e0, e1)`` of a packed MoE layout, as views of its tensors."""
    e = packed.experts
    parts = {f: getattr(packed, f)[e0 * (getattr(packed, f).numel() // e):e1 * (getattr(packed, f).numel() // e)]
             for f in _FLAT if hasattr(packed, f)}
    parts.update({f: getattr(packed, f)[e0:e1] for f in _PER_EXPERT if hasattr(packed, f)})
    return replace(packed, experts=e1 - e0, **parts)


def _group_map(expert_map: torch.Tensor | None, experts: int, e0: int, e1: int, device) -> torch.Tensor:
    """The expert map of the run of local experts ``[e0, e1)``: their index in the run, -1 for
    every other expert (fixed-size ops: CUDA-graph capturable)."""
    local = (torch.arange(experts, device=device) if expert_map is None
             else expert_map.to(device=device, dtype=torch.long))
    inside = (local >= e0) & (local < e1)
    return torch.where(inside, local - e0, torch.full_like(local, -1)).to(torch.int32)


def _row_chunks(rows: int, per_row: int, limit: int | None = None, align: int = 256) -> list[tuple[int, int]]:
    """``[(start, end)]`` runs of ``rows`` rows of ``per_row`` elements each, every run at most
    ``limit`` elements (``MAX_ARG_BYTES``; a multiple of ``align`` rows); one run when all fit."""
    limit = MAX_ARG_BYTES if limit is None else limit
    if rows * per_row <= limit:
        return [(0, rows)]
    step = max(align, limit // per_row // align * align)
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _token_runs(t: int, top_k: int, experts: int, width: int, limit: int | None = None) -> list[tuple[int, int]]:
    """``[(start, end)]`` runs of a MoE call's ``t`` tokens whose rows fit the kernels' 32-bit
    offsets (``MAX_ARG_BYTES``): the sorted rows (pairs plus at most 255 padding rows per expert)
    times the wider of H and I (``width``)."""
    limit = MAX_ARG_BYTES if limit is None else limit
    fixed, per = experts * 256 * width, top_k * width
    if t * per + fixed <= limit:
        return [(0, t)]
    step = max(1, (limit - fixed) // per)
    return [(a, min(t, a + step)) for a in range(0, t, step)]


def _too_large(prep: SM90Prepared) -> str | None:
    """Why a dense weight is too large for the linear kernels' 32-bit offsets (None if it fits;
    decided once per weight)."""
    why = prep.__dict__.get("_too_large", False)
    if why is False:
        w = prep.weight
        packed = w.n * w.k // 2 + w.scale.numel()  # at least what either layout holds
        why = prep.__dict__["_too_large"] = (
            f"a {w.n} x {w.k} weight packs to more than 2 GiB, beyond the linear kernels' 32-bit offsets"
            if packed > MAX_ARG_BYTES else None)
    return why


def _fp16_range_problem(prep: SM90Prepared, kernel: str) -> str | None:
    """Why an mxfp4 weight cannot run with fp16 activations in ``kernel`` (None if it can)."""
    if kernel == "decode":
        return prep.decode.unsupported[1]
    return None if prep.gemm.fp16_ok else "mxfp4 scale exponents span more than fp16 can hold"


class SM90W4A16Backend(Backend):
    name = "sm90_w4a16"
    ops = frozenset({"linear", "moe"})

    @property
    def config_types(self) -> Mapping[str | None, type]:  # type: ignore[override]
        return _config_types()

    # -- where it runs ------------------------------------------------------------------
    def unavailable_reason(self, device: torch.device) -> str | None:
        device = torch.device(device)
        if device.type != "cuda":
            return "needs a CUDA device"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        cc = torch.cuda.get_device_capability(device)
        if cc != (9, 0):
            return f"needs compute capability 9.0 (Hopper), this GPU has {cc[0]}.{cc[1]}"
        if importlib.util.find_spec("cutlass") is None:
            return "nvidia-cutlass-dsl is not installed (pip install 'autofp4[cute]')"
        return None

    def applies_to(self, device: torch.device) -> bool:
        return self.unavailable_reason(device) is None

    # -- the search space -------------------------------------------------------------------
    def config_space(self, key: ProblemKey) -> Mapping[str, Sequence[Any]]:
        """The fields and values of the kernels serving ``key.op`` (``sm90_heuristics``),
        ``kernel`` first; a field two kernels share lists the union of their values."""
        spaces = _spaces(key.op)
        space: dict[str, list] = {"kernel": [tag for tag, _ in spaces]}
        for _, fn in spaces:
            for name, values in fn(key.n, key.k, key.fmt, key.dtype).items():
                space[name] = list(dict.fromkeys(space.get(name, []) + list(values)))
        return space

    def is_valid(self, config: BackendConfig, key: ProblemKey) -> str | None:
        if type(config) not in self.config_types.values():
            return f"expected a config of {self._type_names()}, got {type(config).__name__}"
        if config.kernel.startswith("moe_") != (key.op == "moe"):
            return f"a {config.kernel} config cannot run a {key.op} problem"
        return _module(config).validate(config, key.n, key.k, key.fmt, key.dtype)

    def default(self, key: ProblemKey, m: int | None = None) -> BackendConfig:
        if key.op == "moe":
            return sm90_heuristics.moe_default(key.n, key.k, key.fmt, key.dtype, key.experts, key.topk, m)
        return sm90_heuristics.default(key.n, key.k, key.fmt, key.dtype, m)

    def seeds(self, key: ProblemKey, m: int | None = None) -> list[BackendConfig]:
        """Valid configs worth trying right after the default (``sm90_heuristics.seeds``)."""
        if key.op == "moe":
            seeds = sm90_heuristics.moe_seeds(key.n, key.k, key.fmt, key.dtype, key.experts, key.topk, m)
            return [c for c in dict.fromkeys(seeds) if c != self.default(key, m) and self.is_valid(c, key) is None]
        out: list[BackendConfig] = []
        default = self.default(key, m)
        for cfg in sm90_heuristics.seeds(key.n, key.k, key.fmt, key.dtype, m):
            if cfg.kernel == "decode" and m is not None and cfg.m_max < m:
                continue
            if cfg != default and cfg not in out and self.is_valid(cfg, key) is None:
                out.append(cfg)
        return out

    def variants(self, config: BackendConfig, key: ProblemKey, m: int | None = None) -> list[BackendConfig]:
        """A GEMM config with ``scale_select`` the other way (how the kernel broadcasts block
        scales), then with ``producer`` the other way (a dedicated producer warp), then with x
        multicast over a cluster of two turned on (in N-raster order, unbanded: what a cluster
        needs) or off; a decode config with dependent launch on and its trigger early (``pdl_early``)
        and late, less itself; winners stored before these settings existed have them off. The
        tuner drops the invalid ones."""
        if type(config) not in self.config_types.values() or config.kernel.startswith("moe_"):
            return []
        if config.kernel == "decode":
            return [c for c in (replace(config, pdl=True, pdl_early=True), replace(config, pdl=True, pdl_early=False))
                    if c != config]
        cluster = (replace(config, cluster_n=2, raster="n", swizzle=1) if config.cluster_n == 1
                   else replace(config, cluster_n=1))
        return [replace(config, scale_select=not config.scale_select),
                replace(config, producer=not config.producer), cluster]

    def candidates(self, key: ProblemKey, m: int | None = None) -> list[BackendConfig]:
        """Both kernels' grids (decode only where ``m <= m_max``): the default first, then the
        seeds, then the rest.

        The GEMM grid is large; the tuner samples it (optuna TPE) when it exceeds its budget.
        """
        return list(self._candidates(key, m, _valid_grid(key.op, key.n, key.k, key.fmt, key.dtype)))

    def iter_candidates(self, key: ProblemKey, m: int | None = None) -> Iterator[BackendConfig]:
        """:meth:`candidates` one at a time, each grid point checked as it comes: a caller that
        needs only the first few (or whether there are more than a few) does not check the whole
        grid (about a second of CPU per shape)."""
        return self._candidates(key, m, None)

    def _candidates(self, key: ProblemKey, m: int | None, valid: Sequence[Any] | None) -> Iterator[BackendConfig]:
        """The candidates from the grid's ``valid`` points (None: the grid's points, checked here)."""
        first: list[BackendConfig] = [self.default(key, m)]
        first += [c for c in self.seeds(key, m) if c not in first]
        yield from first
        seen = set(first)
        n, k, fmt, dtype = key.n, key.k, key.fmt, key.dtype
        for cfg in _grid_points(key.op, n, k, fmt, dtype, m) if valid is None else valid:
            if _left_out_at(cfg, m) or cfg in seen:
                continue
            if valid is None and _module(cfg).validate(cfg, n, k, fmt, dtype) is not None:
                continue
            seen.add(cfg)
            yield cfg

    # -- running ------------------------------------------------------------------------------
    def prepare(self, weight: Any) -> SM90Prepared:
        return SM90Prepared(weight)

    def pack_all(self, prepared: Any, dtype: str, gate_up: bool | None) -> bool:
        return isinstance(prepared, SM90Prepared) and prepared.pack_all(dtype, gate_up)

    def moe_routing_layout(self, config: BackendConfig) -> tuple[int, bool] | None:
        """The warp-level kernel's ``(m_block, per_pair)``; the grouped GEMM's sorted ``tile_m`` blocks."""
        kernel = getattr(config, "kernel", None)
        if kernel == "moe_decode":
            return config.m_block, config.per_pair
        if kernel == "moe_gemm":
            return config.tile_m, False
        return None

    def compile(self, config: BackendConfig, key: ProblemKey) -> Runner:
        reason = self.is_valid(config, key)
        if reason:
            raise ValueError(f"invalid {self.name} config {config}: {reason}")
        n, k, fmt, dtype = key.n, key.k, key.fmt, key.dtype
        run = _compiled(config, n, k, fmt, dtype)
        check_fp16 = fmt == "mxfp4" and dtype == "float16"
        if config.kernel.startswith("moe_"):
            return _moe_runner(run, config.kernel, check_fp16)
        if config.kernel == "gemm":

            def runner(x: torch.Tensor, prep: SM90Prepared, bias: torch.Tensor | None) -> torch.Tensor:
                if check_fp16 and (why := _fp16_range_problem(prep, "gemm")):
                    return _reference_fallback(x, prep, bias, why)
                return _gemm_rows(run, x, prep, bias, n)

            return runner

        m_max = config.m_max

        def runner(x: torch.Tensor, prep: SM90Prepared, bias: torch.Tensor | None) -> torch.Tensor:
            if x.shape[0] > m_max:
                if check_fp16 and (why := _fp16_range_problem(prep, "gemm")):
                    return _reference_fallback(x, prep, bias, why)
                return _gemm_rows(_gemm_default(n, k, fmt, dtype, bucket_for(x.shape[0])), x, prep, bias, n)
            if check_fp16 and (why := _fp16_range_problem(prep, "decode")):
                return _reference_fallback(x, prep, bias, why)
            if why := _too_large(prep):
                return _reference_fallback(x, prep, bias, why)
            return run(x, prep.decode, bias)

        return runner

    def compile_only(self, config: BackendConfig, key: ProblemKey) -> None:
        """Compile without a GPU (``CUTE_DSL_ARCH=sm_90a``): the CI check of every kernel config."""
        reason = self.is_valid(config, key)
        if reason:
            raise ValueError(f"invalid {self.name} config: {reason}")
        _module(config).compile_only(config, key.n, key.k, key.fmt, key.dtype)

    # a row's provenance: its config's kernel module (and the helpers it names), which holds the
    # config dataclass too. This module is plumbing (dispatch to the kernels, fallbacks), so
    # editing it keeps the rows
    source_parts = ("decode", "gemm", "moe_decode", "moe_gemm")

    def source_part(self, config: Mapping[str, Any] | BackendConfig | None) -> str | None:
        kernel = config.get("kernel") if isinstance(config, Mapping) else getattr(config, "kernel", None)
        return kernel if kernel in self.source_parts else None

    def source_modules(self, part: str | None = None) -> list[Any]:
        by_part = _by_tag()
        return list(by_part.values()) if part is None else [by_part[part]]


def _gemm_rows(run: Runner, x: torch.Tensor, prep: SM90Prepared, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """The GEMM kernel's ``run`` over ``x``, in runs of rows whose output fits its 32-bit
    offsets (one run but for the largest calls, e.g. an lm_head over 16k tokens)."""
    if why := _too_large(prep):
        return _reference_fallback(x, prep, bias, why)
    if x.shape[0] * n <= MAX_ARG_BYTES:
        return run(x, prep.gemm, bias)
    chunks = _row_chunks(x.shape[0], n)
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for r0, r1 in chunks:
        out[r0:r1] = run(x[r0:r1], prep.gemm, bias)
    return out


@functools.lru_cache(maxsize=None)
def _gemm_default(n: int, k: int, fmt: str, dtype: str, m: int):
    """The GEMM's default config for ``(n, k, fmt, dtype)`` at M = ``m``, compiled."""
    return _compiled(sm90_heuristics.gemm_default(n, k, fmt, dtype, m), n, k, fmt, dtype)


def _moe_runner(run: Runner, kernel: str, check_fp16: bool) -> Runner:
    """The MoE runner: both GEMMs on the experts in ``kernel``'s layout (fp16 with MXFP4 experts
    whose exponents span too much for fp16 runs on the reference backend, as the linear kernels do).

    A layer whose packed experts exceed ``MAX_ARG_BYTES`` runs as runs of experts that fit (each
    with the expert map of its run; their outputs add up, in fp32), and a call whose tokens'
    rows would exceed it (``T * top_k`` pairs times ``max(H, I)``) in runs of tokens."""

    def runner(x, p13: SM90Prepared, p2: SM90Prepared, topk_weights, topk_ids, activation, expert_map=None,
               w13_bias=None, w2_bias=None):
        m13, m2 = p13.moe(kernel, True), p2.moe(kernel, False)
        if check_fp16 and (why := m13.unsupported[1] or m2.unsupported[1]):
            _warn_once(why)
            return reference_moe(x, p13.weight, p2.weight, topk_weights, topk_ids, activation, expert_map=expert_map,
                                 w13_bias=w13_bias, w2_bias=w2_bias)
        rows = _token_runs(topk_ids.shape[0], topk_ids.shape[1], m13.experts, max(m13.k, m2.k))
        if len(rows) > 1:
            return torch.cat([runner(x[a:b], p13, p2, topk_weights[a:b], topk_ids[a:b], activation, expert_map,
                                     w13_bias, w2_bias) for a, b in rows])
        g13, g2 = p13.moe_groups(kernel, True), p2.moe_groups(kernel, False)
        if len(g13) == 1 and len(g2) == 1:
            return run(x, m13, m2, topk_weights, topk_ids, activation, expert_map, w13_bias, w2_bias)
        bounds = sorted({e for g in (g13, g2) for a, b, _ in g for e in (a, b)})
        out = None
        for e0, e1 in zip(bounds, bounds[1:]):
            sub13 = _sub_experts(g13, e0, e1)
            sub2 = _sub_experts(g2, e0, e1)
            y = run(x, sub13, sub2, topk_weights, topk_ids, activation,
                    _group_map(expert_map, m13.experts, e0, e1, x.device),
                    None if w13_bias is None else w13_bias[e0:e1], None if w2_bias is None else w2_bias[e0:e1])
            out = y.float() if out is None else out + y.float()
        return out.to(x.dtype)

    return runner


def _sub_experts(groups: list[tuple[int, int, Any]], e0: int, e1: int) -> Any:
    """Experts ``[e0, e1)`` (inside one run of ``groups``) as a packed view."""
    for a, b, packed in groups:
        if a <= e0 and e1 <= b:
            if (a, b) == (e0, e1):
                return packed
            return expert_slice(packed, e0 - a, e1 - a)
    raise AssertionError(f"experts [{e0}, {e1}) span runs of {[(a, b) for a, b, _ in groups]}")


_WARNED: set[str] = set()


def _warn_once(why: str) -> None:
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"autofp4 sm90_w4a16: {why}; running these weights with the reference backend", stacklevel=4)


def _reference_fallback(x, prep: SM90Prepared, bias, why: str | None) -> torch.Tensor:
    _warn_once(why or "")
    return reference_linear(x, prep.weight, bias)

