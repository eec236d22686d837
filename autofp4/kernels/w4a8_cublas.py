"""W4A8 linear on cuBLAS's FP8 GEMM: the FP4 weight converted to E4M3 in a pass of its own
(:mod:`.fp4_to_e4m3`), the activations quantized per token (:mod:`.fp8_act_quant`), then
``torch._scaled_mm`` with row-wise scales (per token, and the weight's one factor per column).

The numbers multiplied are the in-kernel W4A8 GEMM's (:mod:`.sm90_w4a8_gemm`), bit for bit: the
same E4M3 activations and scales, the same E4M3 weight (:func:`.sm90_w4a8_gemm.reference_weight`),
both in the quantizer's K order within each 32-value block (a dot product does not depend on the
order of its terms). cuBLAS accumulates with fast accumulation, as the FP8 GEMMs of vLLM do on
Hopper; the in-kernel GEMM is held to the same bound.

Where it wins: at large M the conversion (read the FP4 weight once, write and read E4M3 bytes:
about 2.5 bytes a weight) is small against a GEMM that reads the weight tile once per CTA tile
of tokens, and cuBLAS's FP8 kernels run near the FP8 peak, where the in-kernel GEMM spends issue
slots on converting each weight tile once per 256 tokens. ``chunk_n`` converts that many weight
rows at a time into one scratch buffer that the next chunk overwrites (its lines stay in L2,
rarely written back), and runs cuBLAS on each chunk's columns of the output (0: the whole weight
at once).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from ..problem import DTYPES, FORMATS
from . import fp4_to_e4m3, fp8_act_quant
from ._run_args import checked_x

#: helper modules whose source is part of this path's (kernel cache key, DB provenance)
KERNEL_SOURCES = ("autofp4.kernels.fp4_to_e4m3", "autofp4.kernels.fp8_act_quant", "autofp4.kernels._ptx")
CHUNKS = (0, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class W4A8CublasConfig:
    kernel: ClassVar[str] = "cublas_fp8"  # the tag of stored configs (not a field)
    chunk_n: int = 0  # weight rows converted per cuBLAS call (0: all of them, one call)


def validate(cfg: W4A8CublasConfig, n: int, k: int, fmt: str, dtype: str) -> str | None:
    """``None`` if ``cfg`` can run (n, k, fmt, dtype), else the reason."""
    if fmt not in FORMATS:
        return f"fmt must be one of {FORMATS}, got {fmt!r}"
    if dtype not in DTYPES:
        return f"dtype must be one of {DTYPES}, got {dtype!r}"
    if n <= 0 or n % 16:
        return f"n={n} must be a positive multiple of 16 (cuBLAS FP8 GEMM)"
    if why := fp4_to_e4m3.validate(k, fmt):
        return why
    if type(cfg.chunk_n) is not int:
        return f"chunk_n must be an int, got {type(cfg.chunk_n).__name__} {cfg.chunk_n!r}"
    if cfg.chunk_n not in CHUNKS:
        return f"chunk_n must be one of {CHUNKS}, got {cfg.chunk_n!r}"
    if cfg.chunk_n >= n:
        return f"chunk_n={cfg.chunk_n} must be below n={n} (0 converts the whole weight)"
    return None


def compile_only(cfg: W4A8CublasConfig, n: int, k: int, fmt: str, dtype: str) -> None:
    """Compile the conversion and the activation quantizer without a GPU (CUTE_DSL_ARCH=sm_90a)."""
    fp4_to_e4m3.compile_only(k, fmt)
    fp8_act_quant.compile_only(k, dtype)


class _WeightState:
    """Per weight, read once (each a device-to-host copy, so never inside a CUDA graph capture):
    its codes and scales as 2-D bytes, the MXFP4 reference exponent, and cuBLAS's column scales."""

    def __init__(self, w: Any) -> None:
        n, k = int(w.shape[-2]), int(w.shape[-1])
        self.codes = w.data.view(torch.uint8).reshape(n, k // 2)
        raw = w.scale if w.scale.dtype == torch.uint8 else w.scale.view(torch.uint8)
        self.scales = raw.reshape(n, -1)
        self.emax = fp4_to_e4m3.e_max(w)
        #: whether the E4M3 conversion keeps every value (MXFP4 blocks within 14 binades)
        self.exact = w.fmt == "mxfp4" and self.emax - int(raw.min()) <= 14
        self.scale_b = torch.full((1, n), fp4_to_e4m3.factor(w, self.emax), dtype=torch.float32, device=w.data.device)


def weight_state(prep: Any) -> _WeightState:
    """The state of ``prep.weight`` (``prep``: a prepared weight that keeps it), built on first use."""
    st = getattr(prep, "_w4a8_cublas", None)
    if st is None:
        from ..graph_pools import outside_graph_pools

        w = prep.weight
        w._require_loaded("the W4A8 cuBLAS path's conversion (its stored FP4 tensors were freed)")
        # kept for every later call: not in a CUDA graph's memory pool (as the packed layouts)
        st = prep._w4a8_cublas = outside_graph_pools(lambda: _WeightState(w), w.data.device)
    return st


def compile_kernel(cfg: W4A8CublasConfig, n: int, k: int, fmt: str, dtype: str) -> Callable:
    """``run(x, prep, bias)`` for any M (``prep``: the weight's prepared object, see
    :func:`weight_state`)."""
    if why := validate(cfg, n, k, fmt, dtype):
        raise ValueError(f"W4A8 cuBLAS config {cfg} for n={n}, k={k}, {fmt}, {dtype}: {why}")
    convert = fp4_to_e4m3.compile_converter(k, fmt)
    quant = fp8_act_quant.compile_quantizer(k, dtype)
    tdt = getattr(torch, dtype)
    k32 = fp8_act_quant.padded_k(k)
    chunk = cfg.chunk_n
    e4m3 = torch.float8_e4m3fn

    def run(x: torch.Tensor, prep: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        st = weight_state(prep)
        x = checked_x(x, prep.weight, n, k, fmt, tdt)
        m = x.shape[0]
        if m == 0:
            return torch.empty(0, n, dtype=tdt, device=x.device)
        xq, sx = quant(x)
        a = xq.view(e4m3)
        sa = sx.view(m, 1)
        if chunk == 0:
            wq = convert(st.codes, st.scales, st.emax, torch.empty(n, k32, dtype=torch.uint8, device=x.device))
            return torch._scaled_mm(a, wq.view(e4m3).t(), scale_a=sa, scale_b=st.scale_b, bias=bias,
                                    out_dtype=tdt, use_fast_accum=True)
        out = torch.empty(m, n, dtype=tdt, device=x.device)
        scratch = torch.empty(chunk, k32, dtype=torch.uint8, device=x.device)
        for r0 in range(0, n, chunk):
            r1 = min(r0 + chunk, n)
            wq = convert(st.codes[r0:r1], st.scales[r0:r1], st.emax, scratch[:r1 - r0])
            torch._scaled_mm(a, wq.view(e4m3).t(), scale_a=sa, scale_b=st.scale_b[:, r0:r1],
                             bias=None if bias is None else bias[r0:r1], out_dtype=tdt, use_fast_accum=True,
                             out=out[:, r0:r1])
        return out

    return run


__all__ = ["W4A8CublasConfig", "validate", "compile_kernel", "compile_only", "weight_state", "CHUNKS"]
