"""FP8 activations with FP4 weights (W4A8): ``autofp4.linear(x, w, act_dtype="fp8")``.

Opt-in: the activations are quantized to E4M3 per token and the FP4 weights converted to E4M3
(exactly for MXFP4, rounded once for NVFP4: :mod:`autofp4.kernels.sm90_w4a8_gemm`), so results
differ from the bf16-activation path by about the FP8 rounding of x (a few percent of the
output's norm). Nothing switches to it by itself, and it never switches back silently:

* on a Hopper GPU with CuTeDSL: the activation quantizer and the W4A8 GEMM, on the same packed
  weight the W4A16 kernels read (no second copy);
* elsewhere (CPU, other GPUs): the same numerics in torch (:func:`~autofp4.kernels.sm90_w4a8_gemm.reference`);
* an MXFP4 weight whose block exponents span more than 14 binades (its smallest blocks would be
  rounded in E4M3), or a weight too large for the kernels' 32-bit offsets: the torch path, with a
  warning naming the weight once.

The GEMM config comes from :func:`default_config` (a heuristic; W4A8 rows are not tuned yet).
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Optional

import torch

ACT_DTYPES = (None, "fp8")
#: the largest tensor (bytes, or elements of an output) the kernels' 32-bit offsets address
MAX_ARG_BYTES = 2**31 - 1
_WARNED: set = set()


def check_act_dtype(act_dtype: Any, what: str) -> Optional[str]:
    """``act_dtype`` validated: None (activations as given) or ``"fp8"``."""
    if act_dtype is not None and not isinstance(act_dtype, str):
        raise TypeError(f"{what}: act_dtype must be None or 'fp8', got {type(act_dtype).__name__} {act_dtype!r}")
    if act_dtype not in ACT_DTYPES:
        raise ValueError(f"{what}: act_dtype must be None or 'fp8', got {act_dtype!r}")
    return act_dtype


def default_config(n: int, k: int, fmt: str, dtype: str, m: int):
    """The W4A8 GEMM config for M = ``m`` tokens: 256-token tiles (the decode of a weight tile is
    shared by as many tokens as one wgmma takes) down to 64 for small M, two warpgroups of 64
    weight rows, the deepest pipeline that fits shared memory."""
    from .kernels import sm90_w4a8_gemm as g8

    tile_m = 256 if m > 128 else (128 if m > 64 else 64)
    for stages in range(8, 1, -1):
        cfg = g8.Sm90W4A8Config(tile_n=128, tile_m=tile_m, tile_k=128, stages=stages)
        if g8.validate(cfg, n, k, fmt, dtype) is None:
            return cfg
    raise ValueError(f"no W4A8 config fits n={n}, k={k}, {fmt}, {dtype}")


@functools.lru_cache(maxsize=None)
def _compiled(cfg: Any, n: int, k: int, fmt: str, dtype: str):
    from .kernels import sm90_w4a8_gemm as g8

    return g8.compile_kernel(cfg, n, k, fmt, dtype)


def _bucket(m: int) -> int:
    """Tile choice buckets (powers of two), so a new M seldom compiles a new kernel."""
    return 1 << max(m - 1, 0).bit_length()


def _warn_once(w: Any, why: str) -> None:
    key = (id(w), why)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"autofp4 W4A8: a {w.fmt} weight [{w.n}, {w.k}] runs in torch, not the FP8 kernel: {why}",
                      stacklevel=4)


def _hopper_reason(device: torch.device) -> Optional[str]:
    from .backends import get_backend

    return get_backend("sm90_w4a16").unavailable_reason(device)


def linear(x2: torch.Tensor, w: Any, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x2 [M, K] @ W^T (+ bias)`` with FP8 activations; ``x2`` contiguous, checked by the caller."""
    from .kernels import sm90_w4a8_gemm as g8

    m, n = x2.shape[0], w.n
    if m == 0:
        return x2.new_empty(0, n)
    if _hopper_reason(x2.device) is not None:
        return g8.reference(x2, w, bias)
    from .backends import get_backend

    backend = get_backend("sm90_w4a16")
    prep = w.packed(backend.name, backend.prepare)
    if w.n * w.k // 2 + w.scale.numel() > MAX_ARG_BYTES:
        _warn_once(w, "it packs to more than 2 GiB")
        return g8.reference(x2, w, bias)
    packed = prep.gemm
    if w.fmt == "mxfp4" and not packed.fp16_ok:
        _warn_once(w, "its block exponents span more than 14 binades, beyond what E4M3 holds exactly")
        return g8.reference(x2, w, bias)
    dtype = "bfloat16" if x2.dtype == torch.bfloat16 else "float16"
    run = _compiled(default_config(n, w.k, w.fmt, dtype, _bucket(m)), n, w.k, w.fmt, dtype)
    if m * n <= MAX_ARG_BYTES:
        return run(x2, packed, bias)
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    step = max(MAX_ARG_BYTES // n // 256 * 256, 256)
    for r0 in range(0, m, step):
        out[r0:r0 + step] = run(x2[r0:r0 + step], packed, bias)
    return out
