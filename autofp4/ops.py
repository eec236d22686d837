"""``autofp4::linear`` and ``autofp4::moe``: torch custom ops over the dispatcher.

The custom ops take plain tensors (what torch.compile can trace); the :class:`FP4Weight`
objects that own the backends' prepacked forms are recovered from a weak registry keyed by
the storage of the packed values, so a compiled graph reuses the same prepacked weights as
eager code. In eager mode the public functions call the implementation directly, skipping
the custom-op dispatch, to add as little host time as possible.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from .dispatch import get_dispatcher
from .problem import ProblemKey, dtype_name
from .weights import FP4Weight

__all__ = ["linear", "moe", "route"]

# (data_ptr of the packed values, data_ptr of the scales, fmt, shape) -> FP4Weight (weak)
_WEIGHTS: "weakref.WeakValueDictionary[tuple, FP4Weight]" = weakref.WeakValueDictionary()


def _register(w: FP4Weight) -> FP4Weight:
    # An FP4Weight's tensors never change, so one registration lasts its lifetime.
    if w.__dict__.get("_registered") is not True:
        _WEIGHTS[(w.data.data_ptr(), w.scale.data_ptr(), w.fmt, w.data.shape)] = w
        w.__dict__["_registered"] = True
    return w


def _weight_from_tensors(
    data: torch.Tensor, scale: torch.Tensor, global_scale: Optional[torch.Tensor], fmt: str
) -> FP4Weight:
    w = _WEIGHTS.get((data.data_ptr(), scale.data_ptr(), fmt, data.shape))
    if w is not None:
        return w
    return _register(FP4Weight(fmt, data, scale, global_scale, check_values=False))


def _check_act(x: torch.Tensor, w: FP4Weight, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{what}: x must be bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != w.k:
        raise ValueError(f"{what}: x must have last dimension K={w.k}, got shape {tuple(x.shape)}")
    if x.device != w.device:
        raise ValueError(f"{what}: x is on {x.device} but the weight is on {w.device}; move one of them")


def _problem_key(w: FP4Weight, op: str, dtype: torch.dtype, topk: int = 0) -> ProblemKey:
    """The weight's ProblemKey for ``op``/``dtype``, built once per weight (hot path)."""
    cache = w.__dict__.get("_problem_keys")
    if cache is None:
        cache = w.__dict__["_problem_keys"] = {}
    key = cache.get((op, dtype, topk))
    if key is None:
        if op == "linear":
            key = ProblemKey("linear", w.fmt, dtype_name(dtype), w.n, w.k)
        else:
            key = ProblemKey("moe", w.fmt, dtype_name(dtype), w.n, w.k, w.experts, topk)
        cache[(op, dtype, topk)] = key
    return key


# ----------------------------------------------------------------------------- linear
_FAST_MAX = 64  # (dtype, device, M) entries kept per weight


def _linear_impl(x: torch.Tensor, w: FP4Weight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    # Fast path: a call like one already made on this weight (same dtype, device and M, 2-D
    # contiguous x) reuses its runner and prepacked weight, and counts its miss if untuned.
    # The entry is valid while the device's dispatcher is the one that made it (set_db and
    # reload replace the dispatchers).
    fast = w.__dict__.get("_linear_fast")
    if fast is not None and type(x) is torch.Tensor and x.dim() == 2:
        dev = x.device
        ent = fast.get((x.dtype, dev, x.shape[0]))
        if (
            ent is not None
            and ent[0] is get_dispatcher(dev)
            and x.shape[1] == w.k
            and x.is_contiguous()
            and (bias is None or (bias.shape == ent[3] and bias.dtype == x.dtype and bias.device == dev))
        ):
            if ent[4] is not None:
                ent[0].count_miss(ent[4])
            return ent[1](x, ent[2], bias)
    _check_act(x, w, "linear")
    if w.experts:
        raise ValueError(f"linear: expected a 2-D weight [N, K], got a stacked MoE weight {tuple(w.shape)}")
    n, k = w.n, w.k
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(
            f"linear: bias must be [{n}] {x.dtype} on {x.device}, got {tuple(bias.shape)} {bias.dtype} on {bias.device}"
        )
    flat = x.dim() == 2  # the common case skips the reshape/view round trip (host time)
    x2 = x if flat else x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    key = _problem_key(w, "linear", x.dtype)
    disp = get_dispatcher(x.device)
    backend, _cfg, runner, miss = disp.resolve_entry(key, m)
    packed = w.packed(backend.name, backend.prepare)
    if flat and type(x) is torch.Tensor:
        if fast is None or len(fast) >= _FAST_MAX:
            fast = w.__dict__["_linear_fast"] = {}
        fast[(x.dtype, x.device, m)] = (disp, runner, packed, torch.Size((n,)), miss)
    out = runner(x2, packed, bias)
    return out if flat else out.view(*x.shape[:-1], n)


@torch.library.custom_op("autofp4::linear", mutates_args=())
def _linear_op(
    x: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    global_scale: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    fmt: str,
) -> torch.Tensor:
    return _linear_impl(x, _weight_from_tensors(data, scale, global_scale, fmt), bias)


@_linear_op.register_fake
def _linear_fake(x, data, scale, global_scale, bias, fmt):
    return x.new_empty(*x.shape[:-1], data.shape[-2])


def linear(x: torch.Tensor, w: FP4Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ W^T + bias`` with an FP4 weight ``W`` [N, K]; x [..., K] bf16/fp16 -> [..., N]."""
    if not isinstance(w, FP4Weight):
        raise TypeError(f"linear: w must be an FP4Weight (see autofp4.quantize), got {type(w).__name__}")
    if torch.compiler.is_compiling():
        return torch.ops.autofp4.linear(x, w.data, w.scale, w.global_scale, bias, w.fmt)
    _register(w)
    return _linear_impl(x, w, bias)


# ----------------------------------------------------------------------------- moe
ACTIVATIONS = ("silu", "gelu")


def _check_moe(x, w13: FP4Weight, w2: FP4Weight, topk_weights, topk_ids, activation, check_ids: bool):
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, FP4Weight):
            raise TypeError(f"moe: {name} must be an FP4Weight, got {type(w).__name__}")
        if not w.experts:
            raise ValueError(f"moe: {name} must be stacked [E, N, K], got {tuple(w.shape)}")
    if x.dim() != 2:
        raise ValueError(f"moe: x must be [T, H], got shape {tuple(x.shape)}")
    _check_act(x, w13, "moe")
    e, two_i, h = w13.shape
    if two_i % 2:
        raise ValueError(f"moe: w13 must be [E, 2*I, H] with an even middle dimension, got {tuple(w13.shape)}")
    if tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"moe: w2 must be [E, H, I] = {(e, h, two_i // 2)} to match w13 {tuple(w13.shape)}, got {tuple(w2.shape)}")
    if w2.fmt != w13.fmt:
        raise ValueError(f"moe: w13 and w2 must share a format, got {w13.fmt} and {w2.fmt}")
    t = x.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe: topk_ids must be int32/int64 [T={t}, top_k], got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.is_floating_point():
        raise ValueError(
            f"moe: topk_weights must be a float tensor shaped like topk_ids {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)} {topk_weights.dtype}"
        )
    if topk_ids.shape[1] > e:
        raise ValueError(f"moe: top_k={topk_ids.shape[1]} exceeds the number of experts E={e}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if check_ids and topk_ids.numel() and not (topk_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = torch.aminmax(topk_ids)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= e:
            raise ValueError(f"moe: topk_ids must lie in [0, {e}), got values in [{lo}, {hi}]")


def _moe_impl(x, w13, w2, topk_weights, topk_ids, activation, check_ids=True):
    _check_moe(x, w13, w2, topk_weights, topk_ids, activation, check_ids)
    if x.shape[0] == 0:
        return torch.empty_like(x)
    key = _problem_key(w13, "moe", x.dtype, topk_ids.shape[1])
    backend, _cfg, runner = get_dispatcher(x.device).resolve(key, x.shape[0])
    xc = x if x.is_contiguous() else x.contiguous()
    return runner(
        xc,
        w13.packed(backend.name, backend.prepare),
        w2.packed(backend.name, backend.prepare),
        topk_weights.float(),
        topk_ids,
        activation,
    )


@torch.library.custom_op("autofp4::moe", mutates_args=())
def _moe_op(
    x: torch.Tensor,
    w13_data: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_global_scale: Optional[torch.Tensor],
    w2_data: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_global_scale: Optional[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    fmt: str,
    activation: str,
) -> torch.Tensor:
    w13 = _weight_from_tensors(w13_data, w13_scale, w13_global_scale, fmt)
    w2 = _weight_from_tensors(w2_data, w2_scale, w2_global_scale, fmt)
    return _moe_impl(x, w13, w2, topk_weights, topk_ids, activation)


@_moe_op.register_fake
def _moe_fake(x, *args):
    return torch.empty_like(x)


def moe(
    x: torch.Tensor,
    w13: FP4Weight,
    w2: FP4Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """The fused MoE layer: for each token, ``sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(x[t])``
    with ``FFN_e(x) = W2_e @ (act(W1_e x) * (W3_e x))``; ``w13`` is [E, 2I, H] (gate rows first,
    then up), ``w2`` is [E, H, I]; x is [T, H] bf16/fp16."""
    if torch.compiler.is_compiling():
        return torch.ops.autofp4.moe(
            x, w13.data, w13.scale, w13.global_scale, w2.data, w2.scale, w2.global_scale,
            topk_weights, topk_ids, w13.fmt, activation,
        )
    for w in (w13, w2):
        if isinstance(w, FP4Weight):
            _register(w)
    return _moe_impl(x, w13, w2, topk_weights, topk_ids, activation)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: ``(topk_weights fp32 [T, top_k], topk_ids int32 [T, top_k])``."""
    if router_logits.dim() != 2:
        raise ValueError(f"route: router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    e = router_logits.shape[1]
    if not 0 < top_k <= e:
        raise ValueError(f"route: top_k must be in [1, E={e}], got {top_k}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids.to(torch.int32)
