"""What autofp4 computes, named once: the formats, activation dtypes and ops, the key of one
tuned problem, and the token-count (M) buckets tuning rows are stored under.

A leaf module: it imports nothing of autofp4, so every layer (formats, kernels, backends, the DB,
the dispatcher, the tuner) can share these definitions without import loops.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "OPS",
    "MOE_OPS",
    "FP8_OPS",
    "is_moe",
    "op_for",
    "FORMATS",
    "DTYPES",
    "BLOCK_SIZE",
    "DEFAULT_M_BUCKETS",
    "standard_bucket",
    "shape_errors",
    "ProblemKey",
    "dtype_name",
    "bucket_for",
]

#: the ops: a linear layer and a MoE layer, each with the activations as given (bf16/fp16) or
#: quantized to FP8 (``*_fp8``, W4A8: other numerics, so other problems; never swapped for one another)
OPS = ("linear", "moe", "linear_fp8", "moe_fp8")
MOE_OPS = ("moe", "moe_fp8")
FP8_OPS = ("linear_fp8", "moe_fp8")
FORMATS = ("nvfp4", "mxfp4")
#: activation dtypes, by their torch names
DTYPES = ("bfloat16", "float16")
#: FP4 values per block scale along K
BLOCK_SIZE: dict[str, int] = {"nvfp4": 16, "mxfp4": 32}
#: the M buckets the dispatcher looks tuned rows up by (a call with M tokens uses the smallest
#: bucket >= M; the largest bucket also serves every larger M)
DEFAULT_M_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def is_moe(op: str) -> bool:
    """Whether ``op`` is a MoE layer's (experts and top-k in its key)."""
    return op in MOE_OPS


def op_for(layer: str, act: str | None) -> str:
    """The op of a ``layer`` (``"linear"`` or ``"moe"``) run with activations ``act`` (None: as
    given; ``"fp8"``: quantized to FP8)."""
    if layer not in ("linear", "moe"):
        raise ValueError(f"layer must be 'linear' or 'moe', got {layer!r}")
    if act is None:
        return layer
    if act != "fp8":
        raise ValueError(f"act must be None or 'fp8', got {act!r}")
    return f"{layer}_fp8"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; rejects what autofp4 does not run."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"activations must be bfloat16 or float16, got {dtype}")
    return name


def bucket_for(m: int, buckets: Sequence[int] = DEFAULT_M_BUCKETS) -> int:
    """The smallest bucket ``>= m``; the largest bucket when ``m`` exceeds all of them.

    ``buckets`` must be sorted ascending and non-empty; ``m`` must be ``>= 1``.
    """
    if m < 1:
        raise ValueError(f"m (the token count) must be >= 1, got {m}")
    if not buckets:
        raise ValueError("bucket_for needs at least one bucket, got none")
    i = bisect_left(buckets, m)
    return buckets[i] if i < len(buckets) else buckets[-1]


def standard_bucket(m: int) -> int:
    """The M bucket whose calls ``m`` tokens fall in: the power of two at or above ``m``, at most
    8192 (``bucket_for(m, DEFAULT_M_BUCKETS)``). The tuner tunes at these buckets (a requested M
    is rounded up to its bucket), and the dispatcher counts misses by them."""
    return bucket_for(int(m), DEFAULT_M_BUCKETS)


def shape_errors(op: str, fmt: str, n: int, k: int) -> dict[str, str]:
    """The key fields no FP4 weight of ``fmt`` can have, and why: ``{"k": why, "n": why}`` (empty
    when the shape is one). K must be a multiple of the format's block (16 for NVFP4, 32 for
    MXFP4); a MoE key's N (2 x the intermediate size) also needs N/2 a multiple of the block.
    The one rule for every check of a stored or recorded problem (the tuning DB's records, the
    misses file); an unknown ``fmt`` is left to the format check."""
    block = BLOCK_SIZE.get(fmt)
    if block is None:
        return {}
    out = {}
    if k % block:
        out["k"] = f"{k} is not a multiple of {fmt}'s block of {block}: no FP4 weight has K={k}"
    if is_moe(op) and n % (2 * block):
        out["n"] = (f"{n} is not twice a multiple of {block}: a MoE layer's N is 2 x its intermediate size, "
                    f"which must be a multiple of {fmt}'s block of {block} (no FP4 weight has this shape)")
    return out


@dataclass(frozen=True)
class ProblemKey:
    """Everything a compiled kernel depends on, except M (one kernel serves every M).

    For a MoE op (``"moe"``, ``"moe_fp8"``): ``n`` is the gate/up width ``2 * intermediate``,
    ``k`` the hidden size, ``experts`` the number of experts and ``topk`` the experts per token.
    ``dtype`` is the dtype of the activations given (and of the output); the ``*_fp8`` ops
    quantize them to FP8 inside.
    """

    op: str
    fmt: str
    dtype: str
    n: int
    k: int
    experts: int = 0
    topk: int = 0

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        if self.fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {self.fmt!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.n <= 0 or self.k <= 0:
            raise ValueError(f"n and k must be positive, got n={self.n}, k={self.k}")
        if is_moe(self.op) and (self.experts <= 0 or self.topk <= 0 or self.topk > self.experts):
            raise ValueError(
                f"{self.op} needs 0 < topk <= experts, got experts={self.experts}, topk={self.topk}"
            )
        if not is_moe(self.op) and (self.experts or self.topk):
            raise ValueError(f"{self.op} problems have no experts/topk")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)
