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

ACT_DTYPES = (None, "fp8", "fp8-prefill")
#: ``act_dtype="fp8-prefill"``: FP8 activations for a linear call of at least this many rows, and
#: a MoE call whose experts get at least this many rows each on average (fewer: x's dtype). A
#: heuristic until W4A8 is tuned: below it the weight bytes, not the math, bound the time, and the
#: bf16-activation kernels read the same bytes at full precision
PREFILL_MIN_ROWS = 512
#: the largest tensor (bytes, or elements of an output) the kernels' 32-bit offsets address
MAX_ARG_BYTES = 2**31 - 1
_WARNED: set = set()


def check_act_dtype(act_dtype: Any, what: str) -> int:
    """``act_dtype`` validated (None: activations as given; ``"fp8"``; ``"fp8-prefill"``): the
    fewest rows (per expert, for MoE) that run with FP8 activations."""
    if act_dtype is not None and not isinstance(act_dtype, str):
        raise TypeError(f"{what}: act_dtype must be None, 'fp8' or 'fp8-prefill', got "
                        f"{type(act_dtype).__name__} {act_dtype!r}")
    if act_dtype not in ACT_DTYPES:
        raise ValueError(f"{what}: act_dtype must be None, 'fp8' or 'fp8-prefill', got {act_dtype!r}")
    return PREFILL_MIN_ROWS if act_dtype == "fp8-prefill" else 0


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


def moe_config(experts: int, t: int, top_k: int):
    """The grouped W4A8 GEMMs' config for T tokens: the token block (``tile_m``) near the mean
    rows per expert (each expert's run is padded to it), two warpgroups of 64 weight rows."""
    from .kernels import sm90_w4a8_gemm as g8

    mean = t * top_k / max(experts, 1)
    tile_m = 64 if mean <= 96 else (128 if mean <= 384 else 256)
    return g8.Sm90W4A8Config(tile_n=128, tile_m=tile_m, tile_k=128, stages={64: 8, 128: 6, 256: 5}[tile_m])


@functools.lru_cache(maxsize=None)
def _moe_compiled(cfg: Any, n: int, k: int, fmt: str, dtype: str):
    from .kernels import sm90_w4a8_gemm as g8

    return g8.compile_moe(cfg, n, k, fmt, dtype)


def moe(x: torch.Tensor, w13: Any, w2: Any, topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
        expert_map: Optional[torch.Tensor] = None, w13_bias: Optional[torch.Tensor] = None,
        w2_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The MoE layer with FP8 activations; arguments checked by the caller (``x`` contiguous)."""
    t, top_k = topk_ids.shape
    if t == 0:
        return torch.empty_like(x)
    ref = functools.partial(reference_moe, x, w13, w2, topk_weights, topk_ids, activation, expert_map,
                            w13_bias, w2_bias)
    if _hopper_reason(x.device) is not None:
        return ref()
    from .backends import get_backend

    from .backends.sm90_w4a16 import _moe_runner

    backend = get_backend("sm90_w4a16")
    prep13, prep2 = w13.packed(backend.name, backend.prepare), w2.packed(backend.name, backend.prepare)
    if w13.fmt == "mxfp4" and (prep13.moe("moe_gemm", True).unsupported[1] or prep2.moe("moe_gemm", False).unsupported[1]):
        _warn_once(w13, "its block exponents span more than 14 binades, beyond what E4M3 holds exactly")
        return ref()
    dtype = "bfloat16" if x.dtype == torch.bfloat16 else "float16"
    cfg = moe_config(w13.experts, _bucket(t), top_k)
    run = _moe_compiled(cfg, w13.n, w13.k, w13.fmt, dtype)
    # runs of experts whose packed weights fit the kernels' 32-bit offsets, and of tokens whose
    # rows do, as on the bf16-activation path
    return _moe_runner(run, "moe_gemm", False)(x, prep13, prep2, topk_weights, topk_ids, activation, expert_map,
                                               w13_bias, w2_bias)


def reference_moe(x: torch.Tensor, w13: Any, w2: Any, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  activation: str = "silu", expert_map: Optional[torch.Tensor] = None,
                  w13_bias: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The W4A8 MoE layer in float math on what the kernels multiply: x quantized per token,
    each expert's up product (fp32) through the activation, rounded to x's dtype (as the kernel
    stores h), quantized per row, times the expert's down weight, times the router weight, summed
    over the top-k in fp32 and rounded once. ``w13``/``w2``: stacked FP4Weight experts;
    ``expert_map``: global ids to this slice's experts (-1: another rank's, skipped)."""
    from .backends.reference import _act
    from .kernels import fp8_act_quant
    from .kernels.sm90_w4a8_gemm import reference_weight

    t, top_k = topk_ids.shape
    k = x.shape[1]
    xq, sx = fp8_act_quant.reference_quantize(x, permute=False)
    xv = xq[:, :k].view(torch.float8_e4m3fn).double() * sx.double()[:, None]
    out = torch.zeros(t, w2.n, dtype=torch.float64, device=x.device)
    if expert_map is not None:
        topk_ids = expert_map.long()[topk_ids.long()]
    for e in topk_ids.unique().tolist():
        if e < 0:
            continue
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        q13, f13 = reference_weight(w13.expert(e))
        g = xv[tok] @ q13.double().T * f13
        if w13_bias is not None:
            g = g + w13_bias[e].double()
        inter = w13.n // 2
        hv = _act(g.float(), activation).to(x.dtype)
        hq, sh = fp8_act_quant.reference_quantize(hv, permute=False)
        hd = hq[:, :inter].view(torch.float8_e4m3fn).double() * sh.double()[:, None]
        q2, f2 = reference_weight(w2.expert(e))
        y = hd @ q2.double().T * f2
        if w2_bias is not None:
            y = y + w2_bias[e].double()
        y = (y * topk_weights[tok, slot].double()[:, None]).to(x.dtype)
        out.index_add_(0, tok, y.double())
    return out.to(x.dtype)
