"""Hopper (sm_90a) W4A16 backend: FP4 weights decoded to bf16/fp16 in registers.

Two CuTeDSL kernels share one config model, told apart by ``kernel``:

* ``"decode"`` (:mod:`autofp4.kernels.w4a16_decode`): memory-bound small-M kernel, warp-level
  ``mma.sync`` with the decoded weights as the A operand, split-K; serves ``M <= m_max``.
* ``"gemm"`` (:mod:`autofp4.kernels.sm90_w4a16_gemm`): TMA + multi-stage pipeline + wgmma with
  the weights as the register operand (``out^T = W x^T``); serves any M.

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
from typing import Any, Literal, Mapping, Optional, Sequence

import torch
from pydantic import Field, model_validator

from . import sm90_heuristics
from .base import Backend, BackendConfig, ProblemKey, Runner, grid
from .reference import reference_linear
from .sm90_heuristics import DECODE_MAX_M  # noqa: F401  (largest M the default runs on the decode kernel)
_DECODE_FIELDS = ("warps", "k_split", "m_max", "prefetch", "split_reduce", "tiles_per_warp")
# omitted when they have these values (configs stored before they existed)
_DECODE_OPTIONAL = {"x_smem": False, "smem_stages": 0, "pdl_early": False}
# both kernels: CTAs per SM asked of the compiler; programmatic dependent launch
_SHARED_OPTIONAL = {"ctas_per_sm": 0, "pdl": False}
_GEMM_OPTIONAL = {"swizzle": 1, "scale_select": False, "producer": False}
_GEMM_FIELDS = ("tile_n", "tile_m", "tile_k", "stages", "split_k", "cluster_n", "raster")


class SM90Config(BackendConfig):
    kernel: Literal["decode", "gemm"]
    # decode kernel
    warps: Optional[int] = Field(None, ge=1, le=32)
    k_split: Optional[int] = Field(None, ge=1, le=256)
    m_max: Optional[int] = Field(None, ge=1, le=4096)
    prefetch: Optional[bool] = None
    split_reduce: Optional[Literal["kernel", "last_warp", "cluster"]] = None
    tiles_per_warp: Optional[int] = Field(None, ge=1, le=16)
    x_smem: Optional[bool] = None
    smem_stages: Optional[int] = Field(None, ge=0, le=16)
    # the next kernel may launch right after this one's dependent wait (absent: after its main loop)
    pdl_early: Optional[bool] = None
    # both kernels: CTAs per SM the compiler must fit (0 or absent: as resources allow)
    ctas_per_sm: Optional[int] = Field(None, ge=0, le=64)
    # both kernels: launched with programmatic dependent launch (absent: no)
    pdl: Optional[bool] = None
    # gemm kernel
    tile_n: Optional[int] = Field(None, ge=1, le=1024)
    tile_m: Optional[int] = Field(None, ge=1, le=1024)
    tile_k: Optional[int] = Field(None, ge=1, le=1024)
    stages: Optional[int] = Field(None, ge=1, le=16)
    split_k: Optional[int] = Field(None, ge=1, le=64)
    cluster_n: Optional[int] = Field(None, ge=1, le=16)
    raster: Optional[Literal["n", "m"]] = None
    swizzle: Optional[int] = Field(None, ge=1, le=64)
    scale_select: Optional[bool] = None
    producer: Optional[bool] = None

    @model_validator(mode="after")
    def _fields_match_kernel(self) -> "SM90Config":
        mine, other = (_DECODE_FIELDS, _GEMM_FIELDS) if self.kernel == "decode" else (_GEMM_FIELDS, _DECODE_FIELDS)
        missing = [f for f in mine if getattr(self, f) is None]
        stray = [f for f in other if getattr(self, f) is not None]
        stray += [f for f in (_DECODE_OPTIONAL if self.kernel == "gemm" else _GEMM_OPTIONAL)
                  if getattr(self, f) is not None]
        if missing:
            raise ValueError(f"a {self.kernel} config needs {', '.join(missing)}")
        if stray:
            raise ValueError(f"a {self.kernel} config takes no {', '.join(stray)}")
        return self


@functools.lru_cache(maxsize=None)
def _kernels():
    from ..kernels import sm90_w4a16_gemm as gemm
    from ..kernels import w4a16_decode as decode

    return decode, gemm


def _optional(kernel: str) -> dict[str, Any]:
    """Fields of ``kernel``'s config that stored configs may omit, with the value that means."""
    return {**(_DECODE_OPTIONAL if kernel == "decode" else _GEMM_OPTIONAL), **_SHARED_OPTIONAL}


def _to_kernel_config(cfg: SM90Config):
    decode, gemm = _kernels()
    optional = _optional(cfg.kernel)
    opt = {f: v if getattr(cfg, f) is None else getattr(cfg, f) for f, v in optional.items()}
    if cfg.kernel == "decode":
        return decode.DecodeConfig(**{f: getattr(cfg, f) for f in _DECODE_FIELDS}, **opt)
    return gemm.Sm90GemmConfig(**{f: getattr(cfg, f) for f in _GEMM_FIELDS}, **opt)


def _from_kernel_config(kernel: str, kcfg: Any) -> SM90Config:
    fields = _DECODE_FIELDS if kernel == "decode" else _GEMM_FIELDS
    optional = _optional(kernel)
    d = vars(kcfg)  # a flat dataclass of scalars: no deep copy needed
    opt = {f: d[f] for f, v in optional.items() if d[f] != v}
    return SM90Config(kernel=kernel, **{f: d[f] for f in fields}, **opt)


@functools.lru_cache(maxsize=64)
def _valid_grid(n: int, k: int, fmt: str, dtype: str) -> tuple[tuple[str, Any, SM90Config], ...]:
    """Every valid point of both kernels' grids for a problem, for every M (the tuner asks for
    each M bucket of a shape in turn; the grid is 10-18 thousand configs, a second of CPU)."""
    decode, gemm = _kernels()
    out = []
    for kernel, mod in (("decode", decode), ("gemm", gemm)):
        cls = mod.DecodeConfig if kernel == "decode" else mod.Sm90GemmConfig
        for combo in grid(mod.config_space(n, k, fmt, dtype)):
            kcfg = cls(**combo)
            if mod.validate(kcfg, n, k, fmt, dtype) is None:
                out.append((kernel, kcfg, _from_kernel_config(kernel, kcfg)))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _compiled(kernel: str, kcfg: Any, n: int, k: int, fmt: str, dtype: str):
    """One compiled kernel per (kernel, config, n, k, fmt, dtype), shared by every runner."""
    decode, gemm = _kernels()
    return (decode if kernel == "decode" else gemm).compile_kernel(kcfg, n, k, fmt, dtype)


class SM90Prepared:
    """The weight in each kernel's layout, packed lazily on first use."""

    def __init__(self, weight: Any) -> None:
        self.weight = weight
        self._decode = None
        self._gemm = None

    @property
    def decode(self):
        if self._decode is None:
            self._decode = _kernels()[0].pack_weight(self.weight)
        return self._decode

    @property
    def gemm(self):
        if self._gemm is None:
            self._gemm = _kernels()[1].pack_weight(self.weight)
        return self._gemm


def _fp16_range_problem(prep: SM90Prepared, kernel: str) -> str | None:
    """Why an mxfp4 weight cannot run with fp16 activations in ``kernel`` (None if it can)."""
    if kernel == "decode":
        return prep.decode.unsupported[1]
    return None if prep.gemm.fp16_ok else "mxfp4 scale exponents span more than fp16 can hold"


class SM90W4A16Backend(Backend):
    name = "sm90_w4a16"
    ops = frozenset({"linear"})
    config_model = SM90Config

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
        decode, gemm = _kernels()
        space: dict[str, list] = {"kernel": ["decode", "gemm"]}
        for mod in (decode, gemm):
            for name, values in mod.config_space(key.n, key.k, key.fmt, key.dtype).items():
                space[name] = list(dict.fromkeys(space.get(name, []) + list(values)))  # shared: union
        return space

    def is_valid(self, config: BackendConfig, key: ProblemKey) -> str | None:
        if not isinstance(config, SM90Config):
            return f"expected an SM90Config, got {type(config).__name__}"
        if key.op != "linear":
            return f"{self.name} implements linear only, not {key.op}"
        decode, gemm = _kernels()
        mod = decode if config.kernel == "decode" else gemm
        return mod.validate(_to_kernel_config(config), key.n, key.k, key.fmt, key.dtype)

    def default(self, key: ProblemKey, m: int | None = None) -> SM90Config:
        return _from_kernel_config(*sm90_heuristics.default(key.n, key.k, key.fmt, key.dtype, m))

    def seeds(self, key: ProblemKey, m: int | None = None) -> list[BackendConfig]:
        """Valid configs worth trying right after the default (``sm90_heuristics.seeds``)."""
        decode, gemm = _kernels()
        out: list[BackendConfig] = []
        default = self.default(key, m)
        for kernel, kcfg in sm90_heuristics.seeds(key.n, key.k, key.fmt, key.dtype, m):
            mod = decode if kernel == "decode" else gemm
            if kernel == "decode" and m is not None and kcfg.m_max < m:
                continue
            if mod.validate(kcfg, key.n, key.k, key.fmt, key.dtype) is None:
                cfg = _from_kernel_config(kernel, kcfg)
                if cfg != default and cfg not in out:
                    out.append(cfg)
        return out

    def variants(self, config: BackendConfig, key: ProblemKey, m: int | None = None) -> list[BackendConfig]:
        """A GEMM config with ``scale_select`` the other way (how the kernel broadcasts block
        scales), then with ``producer`` the other way (a dedicated producer warp), then with x
        multicast over a cluster of two turned on (in N-raster order, unbanded: what a cluster
        needs) or off; a decode config with dependent launch on and its trigger early (``pdl_early``)
        and late, less itself; winners stored before these settings existed have them off. The
        tuner drops the invalid ones."""
        if not isinstance(config, SM90Config):
            return []
        kcfg = _to_kernel_config(config)
        if config.kernel == "decode":
            return [_from_kernel_config("decode", c) for c in
                    (replace(kcfg, pdl=True, pdl_early=True), replace(kcfg, pdl=True, pdl_early=False)) if c != kcfg]
        cluster = (replace(kcfg, cluster_n=2, raster="n", swizzle=1) if kcfg.cluster_n == 1
                   else replace(kcfg, cluster_n=1))
        return [_from_kernel_config("gemm", replace(kcfg, scale_select=not kcfg.scale_select)),
                _from_kernel_config("gemm", replace(kcfg, producer=not kcfg.producer)),
                _from_kernel_config("gemm", cluster)]

    def candidates(self, key: ProblemKey, m: int | None = None) -> list[BackendConfig]:
        """Both kernels' grids (decode only where ``m <= m_max``): the default first, then the
        seeds, then the rest.

        The GEMM grid is large; the tuner samples it (optuna TPE) when it exceeds its budget.
        """
        out: list[BackendConfig] = [self.default(key, m)]
        out += [c for c in self.seeds(key, m) if c not in out]
        seen = set(out)
        for kernel, kcfg, cfg in _valid_grid(key.n, key.k, key.fmt, key.dtype):
            if kernel == "decode" and m is not None and kcfg.m_max < m:
                continue
            if kernel == "gemm" and m is not None and kcfg.swizzle > 1 and (kcfg.raster == "n" and m <= kcfg.tile_m):
                continue  # one token tile: the grouped order is the plain one
            if cfg not in seen:
                seen.add(cfg)
                out.append(cfg)
        return out

    # -- running ------------------------------------------------------------------------------
    def prepare(self, weight: Any) -> SM90Prepared:
        return SM90Prepared(weight)

    def compile(self, config: BackendConfig, key: ProblemKey) -> Runner:
        reason = self.is_valid(config, key)
        if reason:
            raise ValueError(f"invalid {self.name} config {config.model_dump(exclude_none=True)}: {reason}")
        assert isinstance(config, SM90Config)
        n, k, fmt, dtype = key.n, key.k, key.fmt, key.dtype
        kcfg = _to_kernel_config(config)
        run = _compiled(config.kernel, kcfg, n, k, fmt, dtype)
        check_fp16 = fmt == "mxfp4" and dtype == "float16"
        if config.kernel == "gemm":

            def runner(x: torch.Tensor, prep: SM90Prepared, bias: torch.Tensor | None) -> torch.Tensor:
                if check_fp16 and (why := _fp16_range_problem(prep, "gemm")):
                    return _reference_fallback(x, prep, bias, why)
                return run(x, prep.gemm, bias)

            return runner

        from ..dispatch import bucket_for

        m_max = config.m_max

        def runner(x: torch.Tensor, prep: SM90Prepared, bias: torch.Tensor | None) -> torch.Tensor:
            if x.shape[0] > m_max:
                if check_fp16 and (why := _fp16_range_problem(prep, "gemm")):
                    return _reference_fallback(x, prep, bias, why)
                return _gemm_default(n, k, fmt, dtype, bucket_for(x.shape[0]))(x, prep.gemm, bias)
            if check_fp16 and (why := _fp16_range_problem(prep, "decode")):
                return _reference_fallback(x, prep, bias, why)
            return run(x, prep.decode, bias)

        return runner

    def compile_only(self, config: SM90Config, key: ProblemKey) -> None:
        """Compile without a GPU (``CUTE_DSL_ARCH=sm_90a``): the CI check of every kernel config."""
        reason = self.is_valid(config, key)
        if reason:
            raise ValueError(f"invalid {self.name} config: {reason}")
        decode, gemm = _kernels()
        mod = decode if config.kernel == "decode" else gemm
        mod.compile_only(_to_kernel_config(config), key.n, key.k, key.fmt, key.dtype)

    # a row's provenance: its config's kernel module (and the helpers it names). This module is
    # plumbing (config model, dispatch to the kernels, fallbacks); what a stored config means is
    # pinned by tests to the kernels' config dataclasses, so editing it keeps the rows
    source_parts = ("decode", "gemm")

    def source_part(self, config: Mapping[str, Any] | BackendConfig | None) -> str | None:
        kernel = config.get("kernel") if isinstance(config, Mapping) else getattr(config, "kernel", None)
        return kernel if kernel in self.source_parts else None

    def source_modules(self, part: str | None = None) -> list[Any]:
        decode, gemm = _kernels()
        return [decode, gemm] if part is None else [decode if part == "decode" else gemm]


@functools.lru_cache(maxsize=None)
def _gemm_default(n: int, k: int, fmt: str, dtype: str, m: int):
    """The GEMM's default config for ``(n, k, fmt, dtype)`` at M = ``m``, compiled."""
    return _compiled("gemm", _kernels()[1].default_config(n, k, fmt, dtype, m), n, k, fmt, dtype)


_WARNED: set[str] = set()


def _reference_fallback(x, prep: SM90Prepared, bias, why: str | None) -> torch.Tensor:
    if why not in _WARNED:
        _WARNED.add(why or "")
        warnings.warn(f"autofp4 sm90_w4a16: {why}; running this weight with the reference backend", stacklevel=3)
    return reference_linear(x, prep.weight, bias)

