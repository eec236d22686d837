"""Hopper (sm_90a) W4A8 backend: the ``*_fp8`` ops (``act_dtype="fp8"``) on the FP8 tensor cores.

Two kernel families. ``gemm_fp8`` (:mod:`autofp4.kernels.sm90_w4a8_gemm`, config
:class:`Sm90W4A8Config`): the activation quantizer and the W4A8 GEMM for ``linear_fp8``, the
quantizers and the grouped W4A8 GEMMs for ``moe_fp8``; it reads the packed weights of the W4A16
backend (:meth:`prepare` returns that backend's prepared weight, so one packed copy serves both).
``cublas_fp8`` (:mod:`autofp4.kernels.w4a8_cublas`, ``linear_fp8`` only): the FP4 weight converted
to E4M3 in a pass of its own, then cuBLAS's FP8 GEMM; it reads the weight's stored FP4 tensors,
so a dense weight's are kept (:meth:`pack_all`). Both multiply the same E4M3 numbers; the numerics
are W4A8: the tuner checks them against the reference backend's W4A8 path.

Weights whose E4M3 conversion rounds (MXFP4 whose block exponents span more than 14 binades)
are warned about once and run as the reference computes them; a dense weight over 2 GiB packed
runs the reference backend's W4A8 path (warned); calls and layers past the kernels' 32-bit
offsets run in runs of rows, experts and tokens, as on the W4A16 backend.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Mapping, Sequence

import torch

from ..problem import ProblemKey
from .base import Backend, BackendConfig, Runner
from .reference import reference_linear_w4a8

#: the largest tensor (bytes, or elements of an output) the kernels' 32-bit offsets address
MAX_ARG_BYTES = 2**31 - 1
#: from this many tokens on, an untuned linear call runs the cuBLAS path (measured on the Llama-3.1
#: shapes: the in-kernel GEMM faster at 512 tokens, the cuBLAS path at 2048)
CUBLAS_MIN_M = 1024


def _g8():
    from ..kernels import sm90_w4a8_gemm

    return sm90_w4a8_gemm


def _cb():
    from ..kernels import w4a8_cublas

    return w4a8_cublas


def _w4a16():
    from . import get_backend

    return get_backend("sm90_w4a16")


def default_config(n: int, k: int, fmt: str, dtype: str, m: int | None):
    """The GEMM config for M = ``m`` tokens: 256-token tiles (a weight tile's decode shared by as
    many tokens as one wgmma takes) down to 64 for small M, two warpgroups of 64 weight rows, the
    deepest pipeline that fits shared memory."""
    g8 = _g8()
    m = 4096 if m is None else m
    tile_m = 256 if m > 128 else (128 if m > 64 else 64)
    for stages in range(8, 1, -1):
        cfg = g8.Sm90W4A8Config(tile_n=128, tile_m=tile_m, tile_k=128, stages=stages)
        if g8.validate(cfg, n, k, fmt, dtype) is None:
            return cfg
    raise ValueError(f"no W4A8 config fits n={n}, k={k}, {fmt}, {dtype}")


def moe_config(experts: int, t: int | None, top_k: int):
    """The grouped GEMMs' config for T tokens: the token block (``tile_m``, to which each
    expert's run is padded) near the mean rows per expert, two warpgroups of 64 weight rows."""
    g8 = _g8()
    mean = (4096 if t is None else t) * top_k / max(experts, 1)
    tile_m = 64 if mean <= 96 else (128 if mean <= 384 else 256)
    return g8.Sm90W4A8Config(tile_n=128, tile_m=tile_m, tile_k=128, stages={64: 8, 128: 6, 256: 5}[tile_m])


_WARNED: set = set()


def _warn_once(w: Any, why: str) -> None:
    key = (id(w), why)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"autofp4 sm90_w4a8: a {w.fmt} weight {list(w.shape)} runs the reference backend's W4A8 path, "
                      f"not the FP8 kernels: {why}", stacklevel=4)


_LARGE = "it packs to more than 2 GiB, beyond the kernels' 32-bit offsets"


def _linear_runner(run: Runner, n: int) -> Runner:
    def runner(x: torch.Tensor, prep: Any, bias: torch.Tensor | None) -> torch.Tensor:
        w = prep.weight
        if w.n * w.k // 2 + w.scale.numel() > MAX_ARG_BYTES:
            _warn_once(w, _LARGE)
            return reference_linear_w4a8(x, w, bias)
        packed = prep.gemm
        _g8().warn_if_rounded(w, packed.fp16_ok)
        m = x.shape[0]
        if m * n <= MAX_ARG_BYTES:
            return run(x, packed, bias)
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        step = max(MAX_ARG_BYTES // n // 256 * 256, 256)
        for r0 in range(0, m, step):
            out[r0:r0 + step] = run(x[r0:r0 + step], packed, bias)
        return out

    return runner


def _cublas_runner(run: Runner) -> Runner:
    def runner(x: torch.Tensor, prep: Any, bias: torch.Tensor | None) -> torch.Tensor:
        _g8().warn_if_rounded(prep.weight, _cb().weight_state(prep).exact)
        return run(x, prep, bias)

    return runner


def _moe_runner(run: Runner) -> Runner:
    from .sm90_w4a16 import _moe_runner as runs

    in_runs = runs(run, "moe_gemm", False)

    def runner(x, p13, p2, topk_weights, topk_ids, activation, expert_map=None, w13_bias=None, w2_bias=None):
        g8 = _g8()
        g8.warn_if_rounded(p13.weight, not p13.moe("moe_gemm", True).unsupported[1])
        g8.warn_if_rounded(p2.weight, not p2.moe("moe_gemm", False).unsupported[1])
        return in_runs(x, p13, p2, topk_weights, topk_ids, activation, expert_map, w13_bias, w2_bias)

    return runner


class SM90W4A8Backend(Backend):
    name = "sm90_w4a8"
    ops = frozenset({"linear_fp8", "moe_fp8"})
    numerics = "w4a8"

    @property
    def config_types(self) -> Mapping[str | None, type]:  # type: ignore[override]
        return {"gemm_fp8": _g8().Sm90W4A8Config, "cublas_fp8": _cb().W4A8CublasConfig}

    # -- where it runs ------------------------------------------------------------------
    def unavailable_reason(self, device: torch.device) -> str | None:
        return _w4a16().unavailable_reason(device)

    def applies_to(self, device: torch.device) -> bool:
        return self.unavailable_reason(device) is None

    # -- the search space ---------------------------------------------------------------
    def config_space(self, key: ProblemKey) -> Mapping[str, Sequence[Any]]:
        """The in-kernel GEMM's grid (:meth:`candidates` adds the cuBLAS path's few configs)."""
        return {"kernel": ["gemm_fp8"], "tile_n": [64, 128, 256], "tile_m": [64, 128, 192, 256],
                "tile_k": [128, 256], "stages": [2, 3, 4, 5, 6, 7, 8], "raster": ["n", "m"],
                "swizzle": [1, 2, 4, 8] if key.op == "linear_fp8" else [1], "producer": [False, True],
                "pdl": [False, True]}

    def _cublas_configs(self, key: ProblemKey) -> list[BackendConfig]:
        cb = _cb()
        if key.op != "linear_fp8":
            return []
        return [c for c in (cb.W4A8CublasConfig(chunk_n=n) for n in cb.CHUNKS) if self.is_valid(c, key) is None]

    def candidates(self, key: ProblemKey, m: int | None = None) -> list[BackendConfig]:
        """The in-kernel GEMM's grid (the default first, then the seeds) and the cuBLAS path's."""
        out = super().candidates(key, m)
        first = [c for c in self.seeds(key, m) if c in out or type(c) is not _g8().Sm90W4A8Config]
        rest = [c for c in out if c not in first]
        return list(dict.fromkeys(rest[:1] + first + rest[1:] + self._cublas_configs(key)))

    def is_valid(self, config: BackendConfig, key: ProblemKey) -> str | None:
        g8 = _g8()
        if key.op not in self.ops:
            return f"{self.name} runs {sorted(self.ops)}, not {key.op}"
        if type(config) is _cb().W4A8CublasConfig:
            if key.op != "linear_fp8":
                return "the cuBLAS path runs linear_fp8 only"
            return _cb().validate(config, key.n, key.k, key.fmt, key.dtype)
        if type(config) is not g8.Sm90W4A8Config:
            return f"expected a Sm90W4A8Config or W4A8CublasConfig, got {type(config).__name__}"
        if key.op == "moe_fp8":
            if config.swizzle != 1:
                return "the grouped GEMMs walk (weight tile, block) pairs: swizzle must be 1"
            inter = key.n // 2
            if inter % 8:
                return f"the intermediate size {inter} must be a multiple of 8"
            return g8.validate(config, key.n, key.k, key.fmt, key.dtype) or g8.validate(
                config, key.k, inter, key.fmt, key.dtype)
        return g8.validate(config, key.n, key.k, key.fmt, key.dtype)

    def _gemm_default(self, key: ProblemKey, m: int | None) -> BackendConfig:
        if key.op == "moe_fp8":
            return moe_config(key.experts, m, key.topk)
        return default_config(key.n, key.k, key.fmt, key.dtype, m)

    def default(self, key: ProblemKey, m: int | None = None) -> BackendConfig:
        """The in-kernel GEMM's heuristic config; for a linear call of at least
        :data:`CUBLAS_MIN_M` tokens, the cuBLAS path (the whole weight converted at once), which
        measured faster there on every Llama-3.1 shape."""
        if key.op == "linear_fp8" and m is not None and m >= CUBLAS_MIN_M:
            cfg = _cb().W4A8CublasConfig()
            if self.is_valid(cfg, key) is None:
                return cfg
        return self._gemm_default(key, m)

    def seeds(self, key: ProblemKey, m: int | None = None) -> list[BackendConfig]:
        """Neighbours of the in-kernel GEMM's default: the token tile one step either way, banded
        CTA order, a producer warp with a smaller tile, the other raster; from 512 tokens on, the
        cuBLAS path first (the whole weight converted at once, then in chunks of 4096 rows)."""
        default = self.default(key, m)
        base = self._gemm_default(key, m)
        out: list[BackendConfig] = [] if base == default else [base]
        if m is None or m >= 512:
            out += [c for c in self._cublas_configs(key) if c.chunk_n in (0, 4096) and c != default]
        for change in (dict(tile_m=192), dict(tile_m=128), dict(tile_m=64), dict(swizzle=4), dict(raster="m"),
                       dict(tile_n=256, tile_m=128), dict(tile_m=128, producer=True), dict(tile_k=256, tile_m=128)):
            for stages in range(8, 1, -1):
                cfg = dataclasses.replace(base, stages=stages, **change)
                if self.is_valid(cfg, key) is None:
                    if cfg != base and cfg not in out:
                        out.append(cfg)
                    break
        return out

    # -- running ------------------------------------------------------------------------
    def prepare(self, weight: Any) -> Any:
        """The W4A16 backend's prepared weight (its packed layouts are what these kernels read)."""
        w4a16 = _w4a16()
        return weight.packed(w4a16.name, w4a16.prepare)

    def pack_all(self, prepared: Any, dtype: str, gate_up: bool | None) -> bool:
        """The W4A16 backend's layouts (a superset of the in-kernel GEMMs'); a dense weight's
        stored tensors are kept: the cuBLAS path converts from them on every call."""
        return gate_up is not None and _w4a16().pack_all(prepared, dtype, gate_up)

    def compile(self, config: BackendConfig, key: ProblemKey) -> Runner:
        reason = self.is_valid(config, key)
        if reason:
            raise ValueError(f"invalid {self.name} config {config}: {reason}")
        return _compiled(config, key)

    def compile_only(self, config: BackendConfig, key: ProblemKey) -> None:
        """Compile without a GPU (``CUTE_DSL_ARCH=sm_90a``)."""
        reason = self.is_valid(config, key)
        if reason:
            raise ValueError(f"invalid {self.name} config: {reason}")
        g8 = _g8()
        if type(config) is _cb().W4A8CublasConfig:
            _cb().compile_only(config, key.n, key.k, key.fmt, key.dtype)
        elif key.op == "moe_fp8":
            g8.compile_moe_only(config, key.n, key.k, key.fmt, key.dtype)
        else:
            g8.compile_only(config, key.n, key.k, key.fmt, key.dtype)

    source_parts = ("gemm_fp8", "cublas_fp8")

    def source_part(self, config: Mapping[str, Any] | BackendConfig | None) -> str | None:
        tag = config.get("kernel") if isinstance(config, Mapping) else getattr(type(config), "kernel", None)
        return "cublas_fp8" if tag == "cublas_fp8" else "gemm_fp8"

    def source_modules(self, part: str | None = None) -> list[Any]:
        if part is None:
            return [_g8(), _cb()]
        return [_cb()] if part == "cublas_fp8" else [_g8()]


@functools.lru_cache(maxsize=None)
def _compiled(config: Any, key: ProblemKey) -> Runner:
    """The runner of ``config`` for ``key``; its kernels' first call on each device made outside
    CUDA graph memory pools (the per-device state it builds outlives any graph), as on the W4A16
    backend."""
    from .sm90_w4a16 import _first_call_outside_pools

    g8 = _g8()
    if type(config) is _cb().W4A8CublasConfig:
        return _cublas_runner(_first_call_outside_pools(_cb().compile_kernel(config, key.n, key.k, key.fmt,
                                                                              key.dtype)))
    if key.op == "moe_fp8":
        return _moe_runner(_first_call_outside_pools(g8.compile_moe(config, key.n, key.k, key.fmt, key.dtype)))
    return _linear_runner(_first_call_outside_pools(g8.compile_kernel(config, key.n, key.k, key.fmt, key.dtype)),
                          key.n)
