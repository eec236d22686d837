"""The argument check of a compiled dense GEMM's ``run(x, packed, bias)`` (pure torch)."""
from __future__ import annotations

from typing import Any

import torch


def checked_x(x: torch.Tensor, packed: Any, n: int, k: int, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the kernel compiled for ``(n, k, fmt, dtype)`` reads it (contiguous, 16-byte aligned:
    a copy where it is not); ``ValueError`` for a packed weight (or an FP4Weight: anything with
    ``n``, ``k``, ``fmt``) of another shape or format, or an ``x`` that is not ``[M, k]`` of ``dtype``."""
    if packed.n != n or packed.k != k or packed.fmt != fmt:
        raise ValueError(f"kernel compiled for n={n}, k={k}, {fmt}; got a packed weight n={packed.n}, "
                         f"k={packed.k}, {packed.fmt}")
    if x.dtype != dtype or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"expected x [M, {k}] {dtype}, got {tuple(x.shape)} {x.dtype}")
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.contiguous() if not x.is_contiguous() else x.clone()
    return x
