"""Blackwell (sm_100a) W4A4 backend: FP4 weights and FP4 activations on the block-scaled tensor
cores (``tcgen05.mma.kind::mxf4nvf4``).

One call quantizes ``x`` to the weight's format (:mod:`~autofp4.kernels.fp4_act_quant`: NVFP4
with the weight's static ``input_scale`` as the global scale when it has one, else the call's
``amax``; MXFP4 with E8M0 block exponents), then runs the GEMM
(:mod:`~autofp4.kernels.sm100_blockscaled_gemm`) with ``alpha`` = activation global scale x
weight global scale and the bias in its epilogue. The weight is repacked once (scales in the
MMA's 128 x 4 atoms) and cached on the :class:`~autofp4.weights.FP4Weight`.

The numerics are W4A4 (``numerics = "w4a4"``): the tuner checks this backend against
:func:`~autofp4.backends.reference.reference_linear_w4a4`, not the W4A16 reference.

Safe on first contact: the kernels are compile-verified for sm_100a on CPU-only hosts. Before
the first use on each Blackwell device the backend runs its default configs on small random
problems (NVFP4 and MXFP4) against that reference; a mismatch or a fault disables it for the
process, with one warning, and the dispatcher runs the next backend (the reference).
``autofp4 info`` reports the state.
"""
from __future__ import annotations

import functools
import importlib.util
import warnings
from dataclasses import replace
from typing import Any, Mapping, Sequence

import torch

from ..blackwell import SM_COUNT
from ..kernels._run_args import checked_x
from ..problem import ProblemKey
from .base import Backend, BackendConfig, Runner
from .reference import reference_linear_w4a4

#: relative Frobenius error bound of the first-contact check (as the tuner's for bfloat16)
SELF_TEST_TOLERANCE = 1e-2
#: the first-contact problems: (fmt, n, k, m); m spans two token tiles and a partial one
SELF_TEST_PROBLEMS = (("nvfp4", 384, 768, 200), ("mxfp4", 256, 512, 130))


@functools.lru_cache(maxsize=None)
def _gemm():
    from ..kernels import sm100_blockscaled_gemm

    return sm100_blockscaled_gemm


@functools.lru_cache(maxsize=None)
def _quant():
    from ..kernels import fp4_act_quant

    return fp4_act_quant


@functools.lru_cache(maxsize=None)
def _config_type() -> type:
    return _gemm().Sm100BlockScaledConfig


# ------------------------------------------------------------------------------------------
# defaults and the search space
# ------------------------------------------------------------------------------------------
def _max_stages(cfg: Any, fmt: str) -> int:
    """The deepest pipeline (at most 6) that fits shared memory."""
    for s in range(6, 1, -1):
        c = replace(cfg, stages=s)
        if c.smem_bytes(fmt) <= _gemm().SMEM_PER_CTA:
            return s
    return 2


def default_config(n: int, k: int, fmt: str, dtype: str, m: int | None = None) -> Any:
    """The heuristic config: 128-token tiles on one SM; 64-row weight tiles while 128-row ones
    would leave SMs idle at small M; a CTA pair (``tile_m = 256``, cluster of 2 along M) with
    256-row weight tiles once both sides have work for every SM."""
    cls = _config_type()
    m = m or 128
    if m >= 2048 and n >= 4096:
        cfg = cls(tile_m=256, tile_n=256, cluster_m=2)
    elif m <= 128 and n // 128 < SM_COUNT:
        cfg = cls(tile_n=64)
    else:
        cfg = cls(tile_n=128)
    return replace(cfg, stages=_max_stages(cfg, fmt))


def config_space(n: int, k: int, fmt: str, dtype: str) -> dict[str, list]:
    return {
        "tile_m": [128, 256],
        "tile_n": [64, 128, 256],
        "stages": [2, 3, 4, 5, 6, 7, 8],
        "cluster_m": [1, 2, 4],
        "cluster_n": [1, 2],
        "raster": ["m", "n"],
        "swizzle": [1, 2, 4, 8],
        "pdl": [False, True],
    }


class SM100BlockScaledBackend(Backend):
    name = "sm100_blockscaled"
    ops = frozenset({"linear"})
    numerics = "w4a4"

    def __init__(self) -> None:
        #: device -> None (checked and good) or why it was disabled
        self._contact: dict[str, str | None] = {}

    @property
    def config_types(self) -> Mapping[str | None, type]:  # type: ignore[override]
        return {"blockscaled": _config_type()}

    # -- where it runs ------------------------------------------------------------------
    def hardware_reason(self, device: torch.device) -> str | None:
        """Why this process cannot run the kernels on ``device`` at all (``None``: it can)."""
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return "needs a CUDA device" if device.type != "cuda" else "CUDA is not available"
        major, minor = torch.cuda.get_device_capability(device)
        cute = importlib.util.find_spec("cutlass") is not None
        return (None if major == 10 and cute
                else f"needs compute capability 10.x (Blackwell B200/GB200), this GPU has {major}.{minor}"
                if major != 10 else "nvidia-cutlass-dsl is not installed (pip install 'autofp4[cute]')")

    def unavailable_reason(self, device: torch.device) -> str | None:
        why = self.hardware_reason(device)
        return why if why is not None else self.first_contact(device)

    def applies_to(self, device: torch.device) -> bool:
        return self.unavailable_reason(device) is None

    def first_contact(self, device: torch.device) -> str | None:
        """Run the self-test on ``device`` once per process; ``None`` when it passed, else why
        this backend is disabled there. Not run (and not remembered) while a CUDA graph is
        being captured: the backend does not apply until it has been checked."""
        dev = str(torch.device(device))
        if dev in self._contact:
            return self._contact[dev]
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            return "not checked yet on this device (its first use was inside a CUDA graph capture)"
        why = self.self_test(torch.device(device))
        self._contact[dev] = None if why is None else f"disabled for this process: {why}"
        if why is not None:
            warnings.warn(f"autofp4 {self.name}: the first-contact check on {dev} failed ({why}); "
                          "this backend is disabled for the process and the next one runs instead",
                          RuntimeWarning, stacklevel=3)
        return self._contact[dev]

    def self_test(self, device: torch.device) -> str | None:
        """The default config of each problem of :data:`SELF_TEST_PROBLEMS` against the W4A4
        reference on small random data (bias included); ``None`` when all match, else what
        went wrong."""
        from ..weights import quantize

        gen = torch.Generator().manual_seed(1234)
        for fmt, n, k, m in SELF_TEST_PROBLEMS:
            key = ProblemKey("linear", fmt, "bfloat16", n, k)
            try:
                w = quantize(torch.randn(n, k, generator=gen).to(device), fmt)
                x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
                bias = torch.randn(n, generator=gen).to(device=device, dtype=torch.bfloat16)
                runner = self.compile(self.default(key, m), key)
                out = runner(x, self.prepare(w), bias)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                ref = reference_linear_w4a4(x, w, bias)
            except Exception as e:  # a compile error, a launch failure, a fault
                return f"{fmt} n={n} k={k} m={m} raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            why = _mismatch(out, ref)
            if why:
                return f"{fmt} n={n} k={k} m={m}: {why}"
        return None

    # -- the search space -----------------------------------------------------------------
    def config_space(self, key: ProblemKey) -> Mapping[str, Sequence[Any]]:
        return {"kernel": ["blockscaled"], **config_space(key.n, key.k, key.fmt, key.dtype)}

    def is_valid(self, config: BackendConfig, key: ProblemKey) -> str | None:
        if type(config) is not _config_type():
            return f"expected a {_config_type().__name__}, got {type(config).__name__}"
        if key.op != "linear":
            return f"{self.name} runs linear layers only, not {key.op}"
        return _gemm().validate(config, key.n, key.k, key.fmt, key.dtype)

    def supports(self, key: ProblemKey) -> str | None:
        if key.op not in self.ops:
            return f"{self.name} does not implement {key.op}"
        return self.is_valid(self.default(key), key)

    def default(self, key: ProblemKey, m: int | None = None) -> BackendConfig:
        return default_config(key.n, key.k, key.fmt, key.dtype, m)

    def variants(self, config: BackendConfig, key: ProblemKey, m: int | None = None) -> list[BackendConfig]:
        """The same config with dependent launch the other way."""
        if type(config) is not _config_type():
            return []
        return [replace(config, pdl=not config.pdl)]

    # -- running ------------------------------------------------------------------------
    def prepare(self, weight: Any) -> Any:
        return _gemm().pack_weight(weight)

    def compile(self, config: BackendConfig, key: ProblemKey) -> Runner:
        reason = self.is_valid(config, key)
        if reason:
            raise ValueError(f"invalid {self.name} config {config}: {reason}")
        return _runner(config, key.n, key.k, key.fmt, key.dtype)

    def compile_only(self, config: BackendConfig, key: ProblemKey) -> None:
        """Compile the GEMM and the activation quantizer without a GPU (``CUTE_DSL_ARCH=sm_100a``)."""
        reason = self.is_valid(config, key)
        if reason:
            raise ValueError(f"invalid {self.name} config: {reason}")
        _gemm().compile_only(config, key.n, key.k, key.fmt, key.dtype)
        _quant().compile_only(key.k, key.fmt, key.dtype, "sm_100a")

    source_parts = ("blockscaled",)

    def source_part(self, config: Mapping[str, Any] | BackendConfig | None) -> str | None:
        return "blockscaled"

    def source_modules(self, part: str | None = None) -> list[Any]:
        return [_gemm()]


def _mismatch(out: Any, ref: torch.Tensor) -> str | None:
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape or out.dtype != ref.dtype:
        return f"returned {getattr(out, 'shape', type(out).__name__)}, expected {tuple(ref.shape)} {ref.dtype}"
    o, r = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(o).all():
        return f"{int((~torch.isfinite(o)).sum())} non-finite outputs"
    err = float(torch.linalg.vector_norm(o - r)) / (float(torch.linalg.vector_norm(r)) or 1.0)
    if not err <= SELF_TEST_TOLERANCE:
        return f"relative error {err:.3e} against the W4A4 reference exceeds {SELF_TEST_TOLERANCE:.0e}"
    return None


@functools.lru_cache(maxsize=None)
def _runner(cfg: Any, n: int, k: int, fmt: str, dtype: str) -> Runner:
    """The runner of one config: quantize x, then the GEMM (both compiled once, serve any M)."""
    from .. import pdl

    gemm, quant = _gemm(), _quant()
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    fn = gemm._compile(cfg, n, k, fmt, dtype, sms)
    qfn = quant.compile_quantizer(k, fmt, dtype, "sm_100a")
    tdt = getattr(torch, dtype)
    zeros: dict[torch.device, torch.Tensor] = {}
    use_pdl = cfg.pdl

    def runner(x: torch.Tensor, packed: Any, bias: torch.Tensor | None) -> torch.Tensor:
        x = checked_x(x, packed, n, k, fmt, tdt)
        m = x.shape[0]
        out = torch.empty(m, n, dtype=tdt, device=x.device)
        if m == 0:
            return out
        if fmt == "nvfp4":
            gx = packed.input_scale if packed.input_scale is not None else quant.dynamic_global_scale(x)
            alpha = gx * packed.global_scale
        else:
            gx, alpha = None, packed.global_scale
        xq, sfx = qfn(x, gx)
        b = bias
        if b is None:
            b = zeros.get(x.device)
            if b is None:
                b = zeros[x.device] = torch.zeros(n, dtype=tdt, device=x.device)
        fn(xq, packed.data, sfx, packed.scale, alpha, b, out, pdl.launch_flag(use_pdl))
        return out

    return runner
