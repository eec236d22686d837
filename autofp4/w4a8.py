"""FP8 activations with FP4 weights (W4A8): ``autofp4.linear(x, w, act_dtype="fp8")``,
``autofp4.moe(..., act_dtype="fp8")``.

Opt-in: the activations are quantized to E4M3 per token and the FP4 weights converted to E4M3
(exactly for MXFP4, rounded once for NVFP4: :mod:`autofp4.kernels.sm90_w4a8_gemm`), so results
differ from the bf16-activation path by about the FP8 rounding of x (a few percent of the
output's norm). Nothing switches to it by itself, and it never switches back silently. Gradients
(x, a bias or the router weights requiring grad) go straight through the FP8 quantizations: those
of the call with x's dtype, on the dequantized weights (see :func:`autofp4.linear`).

The calls are their own problems (ops ``linear_fp8`` and ``moe_fp8`` in the tuning DB's keys),
dispatched like the others: on a Hopper GPU with CuTeDSL the ``sm90_w4a8`` backend (the
activation quantizer and the W4A8 GEMMs, on the packed weights the W4A16 kernels read: no second
copy), elsewhere the reference backend's W4A8 path (the same numerics in torch). An MXFP4 weight
whose block exponents span more than 14 binades has its smallest blocks rounded in E4M3 (by less
than 2**-18 of its largest weight), warned once; a dense weight too large for the kernels' 32-bit
offsets runs the reference path, warned once.
"""
from __future__ import annotations

from typing import Any

from .backends.reference import reference_linear_w4a8, reference_moe_w4a8
from .backends.sm90_w4a8 import default_config, moe_config

__all__ = ["ACT_DTYPES", "PREFILL_MIN_ROWS", "check_act_dtype", "default_config", "moe_config", "reference_linear",
           "reference_moe"]

ACT_DTYPES = (None, "fp8", "fp8-prefill")
#: ``act_dtype="fp8-prefill"``: FP8 activations for a linear call of at least this many rows, and
#: a MoE call whose experts get at least this many rows each on average (fewer: x's dtype). A
#: heuristic until W4A8 is tuned: below it the weight bytes, not the math, bound the time, and the
#: bf16-activation kernels read the same bytes at full precision
PREFILL_MIN_ROWS = 512


def check_act_dtype(act_dtype: Any, what: str) -> int:
    """``act_dtype`` validated (None: activations as given; ``"fp8"``; ``"fp8-prefill"``): the
    fewest rows (per expert, for MoE) that run with FP8 activations."""
    if act_dtype is not None and not isinstance(act_dtype, str):
        raise TypeError(f"{what}: act_dtype must be None, 'fp8' or 'fp8-prefill', got "
                        f"{type(act_dtype).__name__} {act_dtype!r}")
    if act_dtype not in ACT_DTYPES:
        raise ValueError(f"{what}: act_dtype must be None, 'fp8' or 'fp8-prefill', got {act_dtype!r}")
    return PREFILL_MIN_ROWS if act_dtype == "fp8-prefill" else 0


#: the W4A8 numerics in torch (what the kernels compute; the tuner's oracle)
reference_linear = reference_linear_w4a8
reference_moe = reference_moe_w4a8
