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

from . import router, routing
from .dispatch import get_dispatcher
from .kernels._moe_act import ACTIVATIONS
from .problem import ProblemKey, dtype_name, is_moe
from .weights import FP4Weight, _describe, _values_readable

__all__ = ["explain", "free_loaded", "linear", "moe", "route"]

# (data_ptr of the packed values, data_ptr of the scales, fmt, shape) -> FP4Weight (weak)
_WEIGHTS: "weakref.WeakValueDictionary[tuple, FP4Weight]" = weakref.WeakValueDictionary()


def _registry_key(data: torch.Tensor, scale: torch.Tensor, fmt: str) -> tuple:
    return (data.data_ptr(), scale.data_ptr(), fmt, data.shape)


def _register(w: FP4Weight) -> FP4Weight:
    # An FP4Weight's tensors never change (but for free_loaded, which registers it again), so one
    # registration lasts its lifetime.
    if w.__dict__.get("_registered") is not True:
        _WEIGHTS[_registry_key(w.data, w.scale, w.fmt)] = w
        w.__dict__["_registered"] = True
    return w


def free_loaded(w: FP4Weight, dtype: torch.dtype, gate_up: Optional[bool] = None, why: str = "free_loaded") -> int:
    """Free ``w``'s stored ``data`` and ``scale`` where the kernels will not read them again: each
    backend that has packed ``w`` so far packs every layout its calls with ``dtype`` activations
    can ask for (``gate_up``: None for a linear weight, True / False for a MoE layer's w13 / w2),
    and says that none of its calls reads the stored tensors after that. Returns the bytes freed:
    0 where they are kept (nothing packed yet, or a backend that reads them, such as the
    reference backend or a fallback).

    For a server that holds each weight in its kernels' layouts and needs the memory for its
    cache (the vLLM plugin, after its load-time calls). Anything that needs the values again
    afterwards (a layout not packed, :meth:`FP4Weight.dequantize`, a copy) raises
    :class:`~autofp4.weights.LoadedTensorsFreed` naming ``why``; the weight still runs under
    ``autofp4.linear`` / ``autofp4.moe`` and their custom ops."""
    from .backends import backend_names, get_backend

    if w.freed or not w._packed:
        return 0
    for name, prepared in list(w._packed.items()):
        if name not in backend_names() or not get_backend(name).pack_all(prepared, dtype_name(dtype), gate_up):
            return 0
    key = _registry_key(w.data, w.scale, w.fmt)
    if _WEIGHTS.get(key) is w:
        del _WEIGHTS[key]
    freed = w._free_loaded(why)
    w.__dict__.pop("_registered", None)
    _register(w)
    return freed


def _weight_from_tensors(
    data: torch.Tensor, scale: torch.Tensor, global_scale: Optional[torch.Tensor], fmt: str
) -> FP4Weight:
    w = _WEIGHTS.get(_registry_key(data, scale, fmt))
    if w is not None:
        return w
    return _register(FP4Weight(fmt, data, scale, global_scale, check_values=False))


def _check_act(x: torch.Tensor, w: FP4Weight, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: x must be a torch.Tensor, got {_describe(x)}")
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
        if not is_moe(op):
            key = ProblemKey(op, w.fmt, dtype_name(dtype), w.n, w.k)
        else:
            key = ProblemKey(op, w.fmt, dtype_name(dtype), w.n, w.k, w.experts, topk)
        cache[(op, dtype, topk)] = key
    return key


def _check_tensor_args(what: str, **args) -> None:
    """Each argument is a tensor (one whose name ends in ``bias`` may be None)."""
    for name, t in args.items():
        optional = name.endswith("bias")
        if not isinstance(t, torch.Tensor) and not (optional and t is None):
            raise TypeError(f"{what}: {name} must be a torch.Tensor{' or None' if optional else ''}, got {_describe(t)}")


# ----------------------------------------------------------------------------- linear
_FAST_MAX = 64  # (dtype, device, M) entries kept per weight


def _linear_impl(x: torch.Tensor, w: FP4Weight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    # Fast path: a call like one already made on this weight (same dtype, device and M rows,
    # contiguous x of any rank >= 1, M = its elements / K) reuses its runner and prepacked weight,
    # and counts its miss if untuned; x other than 2-D goes in as a [M, K] view and the output
    # comes back as a view [..., N] (no copies). The entry is valid while the device's
    # dispatcher is the one that made it (set_db, reload and refresh replace the dispatchers).
    fast = w.__dict__.get("_linear_fast")
    if fast is not None and type(x) is torch.Tensor:
        shape = x.shape
        nd = len(shape)
        dev = x.device
        m = shape[0] if nd == 2 else (x.numel() // shape[-1] if nd and shape[-1] else -1)
        ent = fast.get((x.dtype, dev, m))
        if (
            ent is not None
            and ent[0] is get_dispatcher(dev)
            and shape[-1] == w.k
            and x.is_contiguous()
            and (
                bias is None
                or (
                    isinstance(bias, torch.Tensor)
                    and bias.shape == ent[3]
                    and bias.dtype == x.dtype
                    and bias.device == dev
                    and bias.is_contiguous()
                )
            )
        ):
            if ent[4] is not None and ent[0].count_miss(ent[4]) is not None:
                return _linear_impl(x, w, bias)  # a row was stored for this call just now
            if nd == 2:
                return ent[1](x, ent[2], bias)
            out = ent[1](x.view(m, shape[-1]), ent[2], bias)
            return out.view(shape[0], shape[1], ent[5]) if nd == 3 else out.view(*shape[:-1], ent[5])
    x2, bias = _check_linear(x, w, bias)
    n = w.n
    flat = x2 is x
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    key = _problem_key(w, "linear", x.dtype)
    disp = get_dispatcher(x.device)
    backend, _cfg, runner, miss = disp.resolve_entry(key, m)
    packed = w.packed(backend.name, backend.prepare)
    if type(x) is torch.Tensor and disp is get_dispatcher(x.device):  # not renewed meanwhile
        if fast is None or len(fast) >= _FAST_MAX:
            fast = w.__dict__["_linear_fast"] = {}
        fast[(x.dtype, x.device, m)] = (disp, runner, packed, torch.Size((n,)), miss, n)
    out = runner(x2, packed, bias)
    return out if flat else out.view(*x.shape[:-1], n)


def _check_linear(x: torch.Tensor, w: FP4Weight, bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A linear call's arguments checked: x as a contiguous [M, K] (x itself when it is one),
    and the bias (contiguous)."""
    _check_act(x, w, "linear")
    if w.experts:
        raise ValueError(f"linear: w must be a 2-D weight [N, K], got a stacked MoE weight {tuple(w.shape)}")
    n, k = w.n, w.k
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"linear: bias must be a torch.Tensor [{n}] or None, got {_describe(bias)}")
        if bias.shape != (n,) or bias.dtype != x.dtype or bias.device != x.device:
            raise ValueError(
                f"linear: bias must be [{n}] {x.dtype} on {x.device}, got {tuple(bias.shape)} {bias.dtype} on {bias.device}"
            )
        if not bias.is_contiguous():
            bias = bias.contiguous()
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # the common case skips the reshape (host time)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    return x2, bias


def _linear_fp8_impl(x: torch.Tensor, w: FP4Weight, bias: Optional[torch.Tensor], min_m: int = 0) -> torch.Tensor:
    """The linear call with FP8 activations (problem ``linear_fp8``); with fewer than ``min_m``
    rows, with x's dtype."""
    x2, bias = _check_linear(x, w, bias)
    m = x2.shape[0]
    if m < min_m:
        return _linear_impl(x, w, bias)
    if m == 0:
        return x.new_empty(*x.shape[:-1], w.n)
    disp = get_dispatcher(x.device)
    backend, _cfg, runner, _ = disp.resolve_entry(_problem_key(w, "linear_fp8", x.dtype), m)
    out = runner(x2, w.packed(backend.name, backend.prepare), bias)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], w.n)


@torch.library.custom_op("autofp4::linear_fp8", mutates_args=())
def _linear_fp8_op(
    x: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    global_scale: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    fmt: str,
    min_m: int,
) -> torch.Tensor:
    return _linear_fp8_impl(x, _weight_from_tensors(data, scale, global_scale, fmt), bias, min_m)


@_linear_fp8_op.register_fake
def _linear_fp8_fake(x, data, scale, global_scale, bias, fmt, min_m):
    return x.new_empty(*x.shape[:-1], data.shape[-2])


# Gradients (the weights are frozen): x, the bias (and a MoE layer's router weights and biases)
# get the gradient of the call with x's dtype on the dequantized weight, ``grad_x = grad_out @
# dequantize(W)`` (in float32), the bias ``grad_out`` summed over the rows; the FP8 calls' the
# same, straight through their FP8 quantizations (taken as the identity, as quantization-aware
# training does; their own derivative is 0 almost everywhere). Eager calls that need one run
# under _LinearGrad / _MoeGrad (a call without gradients runs as before); the custom ops have the
# same backward (register_autograd), for torch.compile.
def _linear_grad_x(grad: torch.Tensor, w: FP4Weight) -> torch.Tensor:
    """``grad [..., N] @ dequantize(w) [N, K]`` in float32, returned in grad's dtype."""
    g2 = grad.reshape(-1, w.n).float()
    return (g2 @ w.dequantize(torch.float32)).to(grad.dtype).reshape(*grad.shape[:-1], w.k)


def _bias_grad(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bias's gradient: ``grad [..., N]`` summed over its rows (in float32), in the bias's dtype."""
    return grad.reshape(-1, grad.shape[-1]).sum(0, dtype=torch.float32).to(dtype)


@torch.library.custom_op("autofp4::linear_grad_x", mutates_args=())
def _linear_grad_x_op(
    grad: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, global_scale: Optional[torch.Tensor], fmt: str
) -> torch.Tensor:
    return _linear_grad_x(grad, _weight_from_tensors(data, scale, global_scale, fmt))


@_linear_grad_x_op.register_fake
def _linear_grad_x_fake(grad, data, scale, global_scale, fmt):
    return grad.new_empty(*grad.shape[:-1], data.shape[-1] * 2)


def _linear_fp8_setup(ctx, inputs, output):
    x, data, scale, global_scale, bias, fmt, _min_m = inputs
    ctx.save_for_backward(data, scale, global_scale)
    ctx.fmt = fmt
    ctx.bias_dtype = None if bias is None else bias.dtype


def _linear_fp8_backward(ctx, grad):
    data, scale, global_scale = ctx.saved_tensors
    gx = torch.ops.autofp4.linear_grad_x(grad, data, scale, global_scale, ctx.fmt) if ctx.needs_input_grad[0] else None
    gb = _bias_grad(grad, ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[4] else None
    return gx, None, None, None, gb, None, None


_linear_fp8_op.register_autograd(_linear_fp8_backward, setup_context=_linear_fp8_setup)


class _LinearGrad(torch.autograd.Function):
    """An eager linear call under differentiation (above): reverse mode (backward, torch.func.grad
    / vjp) and forward mode (torch.func.jvp, forward_ad: the tangent ``x_t @ dequantize(W)^T +
    bias_t``); ``min_m`` None: x's dtype, else the FP8 call's."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, bias, w, min_m):
        return _linear_impl(x, w, bias) if min_m is None else _linear_fp8_impl(x, w, bias, min_m)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _x, bias, w, _min_m = inputs
        ctx.w = w
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx, grad):
        gx = _linear_grad_x(grad, ctx.w) if ctx.needs_input_grad[0] else None
        gb = _bias_grad(grad, ctx.bias_dtype) if ctx.needs_input_grad[1] else None
        return gx, gb, None, None

    @staticmethod
    def jvp(ctx, x_t, bias_t, _w_t, _min_m_t):
        w = ctx.w
        out = (x_t.reshape(-1, w.k).float() @ w.dequantize(torch.float32).T).to(x_t.dtype)
        out = out.reshape(*x_t.shape[:-1], w.n)
        return out if bias_t is None else out + bias_t


def _vmapped() -> bool:
    """Whether a torch.vmap transform (also inside jacrev, jacfwd, hessian) is active."""
    stack = torch._C._functorch.get_interpreter_stack()
    return bool(stack) and any(str(i.key()).endswith("Vmap") for i in stack)


_NO_VMAP = ("autofp4.moe: torch.vmap is not supported (nor jacrev, jacfwd or hessian, which batch the layer or "
            "its gradient with it): which rows each expert gets depends on the values; call the layer once per "
            "batch element, or differentiate with backward(), torch.func.grad or torch.func.vjp")


def _transformed() -> bool:
    """Whether a torch.func transform or a forward-mode AD level is active (under torch.compile the
    custom ops carry no forward-mode rule nor functorch support: such calls run eagerly)."""
    return (torch._C._functorch.maybe_current_level() is not None
            or getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0)


def _traced_as_op() -> bool:
    """Whether a call is being traced by torch.compile as its custom op: not inside a torch.func
    transform or forward-mode AD level (the ops carry a backward, no forward-mode rule nor
    functorch support: such calls run eagerly, a graph break)."""
    return torch.compiler.is_compiling() and not _transformed()


def _needs_grad(*tensors) -> bool:
    """Whether a call is differentiated: a tensor requiring grad with grad mode on, or inside a
    torch.func transform or a forward-mode AD level (whose tangents autograd does not show)."""
    return _transformed() or (torch.is_grad_enabled()
                              and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors))


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


_linear_op.register_autograd(lambda ctx, grad: _linear_fp8_backward(ctx, grad)[:6],
                             setup_context=lambda ctx, inputs, output: _linear_fp8_setup(ctx, (*inputs, 0), output))


def linear(x: torch.Tensor, w: FP4Weight, bias: Optional[torch.Tensor] = None, *,
           act_dtype: Optional[str] = None) -> torch.Tensor:
    """``x @ W^T + bias`` with an FP4 weight ``W`` [N, K]; x [..., K] bf16/fp16 -> [..., N].

    ``bias`` is None or [N] in x's dtype on x's device. Any strides work (non-contiguous
    inputs are copied). The values of ``x`` are not inspected: NaN or inf in a row of x gives
    NaN/inf in that row of the output, as a dense matmul would. Wrong types, shapes, dtypes
    and devices raise TypeError/ValueError naming the argument; these checks are attribute
    reads only (no device sync), so the call stays capturable in a CUDA graph.

    ``act_dtype="fp8"`` (opt-in, it changes the numerics) quantizes x to FP8 E4M3 per token and
    runs the product on FP8 tensor cores (W4A8, :mod:`autofp4.w4a8`); ``"fp8-prefill"`` does so
    from :data:`autofp4.w4a8.PREFILL_MIN_ROWS` rows of x and keeps x's dtype below; None (the
    default) keeps x's dtype. Its gradient (x or bias requiring grad) goes straight through the
    FP8 quantization: ``grad_x = grad_out @ dequantize(W)``, as with x's dtype (the rounding
    itself has derivative 0 almost everywhere, which would leave x without a useful gradient)."""
    if not isinstance(w, FP4Weight):
        raise TypeError(f"linear: w must be an FP4Weight (see autofp4.quantize), got {_describe(w)}")
    if act_dtype is not None:
        from .w4a8 import check_act_dtype

        min_m = check_act_dtype(act_dtype, "linear")
        if not torch.compiler.is_compiling() and _vmapped():
            raise NotImplementedError(f"autofp4.linear: torch.vmap of a call with act_dtype={act_dtype!r} is not "
                                      "supported (its per-token FP8 quantization is not batched); call it on the "
                                      "stacked rows (x of shape [..., K] takes any leading dimensions), or vmap the "
                                      "act_dtype=None call")
        if _traced_as_op():
            _check_tensor_args("linear", x=x, bias=bias)
            return torch.ops.autofp4.linear_fp8(x, w.data, w.scale, w.global_scale, bias, w.fmt, min_m)
        _register(w)
        if _needs_grad(x, bias):
            return _LinearGrad.apply(x, bias, w, min_m)
        return _linear_fp8_impl(x, w, bias, min_m)
    if _traced_as_op():
        # traced once: the Python types here, the shapes in the op when it runs
        _check_tensor_args("linear", x=x, bias=bias)
        return torch.ops.autofp4.linear(x, w.data, w.scale, w.global_scale, bias, w.fmt)
    _register(w)
    if _needs_grad(x, bias):
        return _LinearGrad.apply(x, bias, w, None)
    return _linear_impl(x, w, bias)


# ----------------------------------------------------------------------------- moe
def _check_bias(bias, name: str, what: str, shape: tuple[int, int], device) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"moe: {name} must be a torch.Tensor {what} or None, got {_describe(bias)}")
    if tuple(bias.shape) != shape:
        raise ValueError(f"moe: {name} must be {what} = {shape}, got {tuple(bias.shape)}")
    if not bias.is_floating_point():
        raise ValueError(f"moe: {name} must be a floating-point tensor, got {bias.dtype}")
    if bias.device != device:
        raise ValueError(f"moe: {name} is on {bias.device} but x is on {device}; move one of them")


def _check_expert_map(expert_map, e: int, device) -> int:
    """The number of global experts an expert map routes over (``e``: the local experts)."""
    if not isinstance(expert_map, torch.Tensor):
        raise TypeError(f"moe: expert_map must be a torch.Tensor [E_global] or None, got {_describe(expert_map)}")
    if expert_map.dim() != 1 or expert_map.dtype not in (torch.int32, torch.int64) or expert_map.numel() < e:
        raise ValueError(f"moe: expert_map must be an int32/int64 [E_global >= E={e}] tensor (the local index of "
                         f"each global expert, -1 where another rank holds it), got {tuple(expert_map.shape)} "
                         f"{expert_map.dtype}")
    if expert_map.device != device:
        raise ValueError(f"moe: expert_map is on {expert_map.device} but x is on {device}; move one of them")
    if expert_map.numel() and _values_readable(expert_map):
        lo, hi = torch.aminmax(expert_map)
        if int(lo) < -1 or int(hi) >= e:
            raise ValueError(f"moe: expert_map values must lie in [-1, {e}), got [{int(lo)}, {int(hi)}]")
    return expert_map.numel()


def _check_moe(x, w13: FP4Weight, w2: FP4Weight, topk_weights, topk_ids, activation, check_ids: bool,
               expert_map=None, w13_bias=None, w2_bias=None):
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, FP4Weight):
            raise TypeError(f"moe: {name} must be an FP4Weight, got {_describe(w)}")
        if not w.experts:
            raise ValueError(f"moe: {name} must be stacked [E, N, K], got {tuple(w.shape)}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"moe: x must be a torch.Tensor [T, H], got {_describe(x)}")
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
    if w2.device != w13.device:
        raise ValueError(f"moe: w2 is on {w2.device} but w13 is on {w13.device}; move one of them")
    _check_bias(w13_bias, "w13_bias", "[E, 2I]", (e, two_i), x.device)
    _check_bias(w2_bias, "w2_bias", "[E, H]", (e, h), x.device)
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"moe: {name} must be a torch.Tensor [T, top_k], got {_describe(t)}")
    t = x.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe: topk_ids must be int32/int64 [T={t}, top_k], got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.is_floating_point():
        raise ValueError(
            f"moe: topk_weights must be a float tensor shaped like topk_ids {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)} {topk_weights.dtype}"
        )
    e_ids = e if expert_map is None else _check_expert_map(expert_map, e, x.device)
    if not 0 < topk_ids.shape[1] <= e_ids:
        raise ValueError(
            f"moe: topk_ids must have top_k columns with 1 <= top_k <= E={e_ids} (the number of experts), "
            f"got top_k={topk_ids.shape[1]} (shape {tuple(topk_ids.shape)})"
        )
    for name, tt in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if tt.device != x.device:
            raise ValueError(f"moe: {name} is on {tt.device} but x is on {x.device}; move one of them")
    if x.is_meta:
        raise ValueError("moe: x is on the meta device; moe routes by the values of topk_ids, which meta tensors lack")
    if not isinstance(activation, str):
        raise TypeError(f"moe: activation must be a str, one of {ACTIVATIONS}, got {_describe(activation)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if check_ids and topk_ids.numel() and _values_readable(topk_ids):
        lo, hi = torch.aminmax(topk_ids)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= e_ids:
            raise ValueError(f"moe: topk_ids must lie in [0, {e_ids}), got values in [{lo}, {hi}]")


def _moe_impl(x, w13, w2, topk_weights, topk_ids, activation, check_ids=True, expert_map=None, w13_bias=None,
              w2_bias=None, router_logits=None, spec=None, correction_bias=None):
    """The MoE layer (``spec``: a checked :class:`~autofp4.router.RouterSpec` when routing from
    ``router_logits``, which replace ``topk_weights`` and ``topk_ids``)."""
    prebuilt = backend = runner = None
    if router_logits is not None:
        _check_moe_router(x, w13, router_logits, topk_weights, topk_ids, expert_map, correction_bias)
        if x.shape[0] == 0:
            return torch.empty_like(x)
        topk_weights, topk_ids, prebuilt, per_pair, backend, runner = _route_for(
            x, w13, router_logits, spec, correction_bias, expert_map)
        check_ids = False  # valid by construction
        _refuse_bad_logits(router_logits, topk_weights, "moe", correction_bias)
    _check_moe(x, w13, w2, topk_weights, topk_ids, activation, check_ids, expert_map, w13_bias, w2_bias)
    if x.shape[0] == 0:
        return torch.empty_like(x)
    if runner is None:
        key = _problem_key(w13, "moe", x.dtype, topk_ids.shape[1])
        eg = 0 if expert_map is None else expert_map.shape[0]  # a slice: its misses tune it as one
        backend, _cfg, runner, _ = get_dispatcher(x.device).resolve_entry(key, x.shape[0], eg)
    xc = x if x.is_contiguous() else x.contiguous()
    args = (xc, w13.packed(backend.name, backend.prepare), w2.packed(backend.name, backend.prepare),
            topk_weights.float(), topk_ids, activation)
    # a runner takes expert_map and the biases only where they are given (backends without them
    # still serve the rest)
    opt = {k: v for k, v in (("expert_map", expert_map), ("w13_bias", w13_bias), ("w2_bias", w2_bias))
           if v is not None}
    if prebuilt is None:
        return runner(*args, **opt)
    with routing.prebuilt(topk_ids, prebuilt, w13.experts, per_pair, expert_map):
        return runner(*args, **opt)


def _moe_fp8_impl(x, w13, w2, topk_weights, topk_ids, activation, expert_map=None, w13_bias=None, w2_bias=None,
                  min_rows=0):
    """The MoE layer with FP8 activations (problem ``moe_fp8``), from given routing; with fewer
    than ``min_rows`` rows per expert on average, with x's dtype."""
    _check_moe(x, w13, w2, topk_weights, topk_ids, activation, True, expert_map, w13_bias, w2_bias)
    if x.shape[0] == 0:
        return torch.empty_like(x)
    if topk_ids.numel() < min_rows * w13.experts:
        return _moe_impl(x, w13, w2, topk_weights, topk_ids, activation, False, expert_map, w13_bias, w2_bias)
    key = _problem_key(w13, "moe_fp8", x.dtype, topk_ids.shape[1])
    eg = 0 if expert_map is None else expert_map.shape[0]
    backend, _cfg, runner, _ = get_dispatcher(x.device).resolve_entry(key, x.shape[0], eg)
    xc = x if x.is_contiguous() else x.contiguous()
    opt = {k: v for k, v in (("expert_map", expert_map), ("w13_bias", w13_bias), ("w2_bias", w2_bias))
           if v is not None}
    return runner(xc, w13.packed(backend.name, backend.prepare), w2.packed(backend.name, backend.prepare),
                  topk_weights.float(), topk_ids, activation, **opt)


@torch.library.custom_op("autofp4::moe_fp8", mutates_args=())
def _moe_fp8_op(
    x: torch.Tensor, w13_data: torch.Tensor, w13_scale: torch.Tensor, w13_gs: Optional[torch.Tensor],
    w2_data: torch.Tensor, w2_scale: torch.Tensor, w2_gs: Optional[torch.Tensor], topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, fmt: str, activation: str, expert_map: Optional[torch.Tensor],
    w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor], min_rows: int,
) -> torch.Tensor:
    w13 = _weight_from_tensors(w13_data, w13_scale, w13_gs, fmt)
    w2 = _weight_from_tensors(w2_data, w2_scale, w2_gs, fmt)
    return _moe_fp8_impl(x, w13, w2, topk_weights, topk_ids, activation, expert_map, w13_bias, w2_bias, min_rows)


@_moe_fp8_op.register_fake
def _moe_fp8_fake(x, *args):
    return torch.empty_like(x)


def _act_and_grad(g: torch.Tensor, dh: Optional[torch.Tensor], activation: str):
    """``h = act(gate, up)`` of the up product ``g = [gate, up]`` (float32, as
    :mod:`autofp4.kernels._moe_act` defines the activations), and with ``dh`` (the gradient of h)
    the gradient of g; written out, so the backward of a custom op needs no autograd."""
    gate, up = g.chunk(2, dim=-1)
    if activation == "swigluoai":
        from .kernels._moe_act import SWIGLU_ALPHA as alpha, SWIGLU_LIMIT as lim

        gc, uc = gate.clamp(max=lim), up.clamp(-lim, lim)
        s = torch.sigmoid(alpha * gc)
        a, da = gc * s, (s + alpha * gc * s * (1 - s)) * (gate <= lim)
        b, db = uc + 1, ((up >= -lim) & (up <= lim)).float()
    elif activation == "gelu":
        c = 0.7978845608028654  # sqrt(2 / pi), the tanh-GELU's
        t = torch.tanh(c * (gate + 0.044715 * gate ** 3))
        a, da = 0.5 * gate * (1 + t), 0.5 * (1 + t) + 0.5 * gate * (1 - t * t) * c * (1 + 3 * 0.044715 * gate * gate)
        b, db = up, None
    elif activation == "silu":
        s = torch.sigmoid(gate)
        a, da = gate * s, s * (1 + gate * (1 - s))
        b, db = up, None
    else:
        raise ValueError(f"moe: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if dh is None:
        return a * b, None
    return a * b, torch.cat((dh * b * da, dh * a if db is None else dh * a * db), dim=-1)


def _moe_grads(grad, x, w13, w2, topk_weights, topk_ids, activation, expert_map, w13_bias, w2_bias, needs):
    """The gradients of a MoE call (see :func:`_linear_grad_x`): those of the layer with x's
    dtype on the dequantized weights in float32, one expert at a time (an FP8 call's: its FP8
    quantizations of x and of the activations between the GEMMs taken as the identity).
    ``needs``: for (x, topk_weights, w13_bias, w2_bias), whether each needs one; returns the four
    (None where not needed)."""
    gf = grad.float()
    gx = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if needs[0] else None
    gtw = torch.zeros(topk_ids.shape, dtype=torch.float32, device=x.device) if needs[1] else None
    g13 = torch.zeros(w13_bias.shape, dtype=torch.float32, device=x.device) if needs[2] and w13_bias is not None else None
    g2 = torch.zeros(w2_bias.shape, dtype=torch.float32, device=x.device) if needs[3] and w2_bias is not None else None
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.to(device=x.device, dtype=torch.long)[ids]
    for e in ids.unique().tolist():
        if e < 0:
            continue  # another rank's expert
        tok, slot = (ids == e).nonzero(as_tuple=True)
        q13, q2 = w13.expert(e).dequantize(torch.float32), w2.expert(e).dequantize(torch.float32)
        up = x[tok].float() @ q13.T
        if w13_bias is not None:
            up = up + w13_bias[e].float()
        tw = topk_weights[tok, slot].float()[:, None]
        dy = gf[tok] * tw  # the gradient of the expert's output y
        h, dup = _act_and_grad(up, dy @ q2, activation)
        if gtw is not None:
            y = h @ q2.T
            if w2_bias is not None:
                y = y + w2_bias[e].float()
            gtw[tok, slot] = (gf[tok] * y).sum(-1)
        if g2 is not None:
            g2[e] = dy.sum(0)
        if g13 is not None:
            g13[e] = dup.sum(0)
        if gx is not None:
            gx.index_add_(0, tok, dup @ q13)
    return tuple(None if g is None else g.to(ref.dtype)
                 for g, ref in zip((gx, gtw, g13, g2), (x, topk_weights, w13_bias, w2_bias)))


@torch.library.custom_op("autofp4::moe_grad", mutates_args=())
def _moe_grad_op(
    grad: torch.Tensor, x: torch.Tensor, w13_data: torch.Tensor, w13_scale: torch.Tensor,
    w13_gs: Optional[torch.Tensor], w2_data: torch.Tensor, w2_scale: torch.Tensor, w2_gs: Optional[torch.Tensor],
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, fmt: str, activation: str,
    expert_map: Optional[torch.Tensor], w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor],
) -> list[torch.Tensor]:
    """The gradients of x, topk_weights, w13_bias and w2_bias (an absent bias: an empty tensor)."""
    w13 = _weight_from_tensors(w13_data, w13_scale, w13_gs, fmt)
    w2 = _weight_from_tensors(w2_data, w2_scale, w2_gs, fmt)
    needs = (True, True, w13_bias is not None, w2_bias is not None)
    got = _moe_grads(grad, x, w13, w2, topk_weights, topk_ids, activation, expert_map, w13_bias, w2_bias, needs)
    return [x.new_empty(0) if g is None else g for g in got]


@_moe_grad_op.register_fake
def _moe_grad_fake(grad, x, w13_data, w13_scale, w13_gs, w2_data, w2_scale, w2_gs, topk_weights, topk_ids,
                       fmt, activation, expert_map, w13_bias, w2_bias):
    return [torch.empty_like(x), torch.empty_like(topk_weights)] + [
        x.new_empty(0) if b is None else torch.empty_like(b) for b in (w13_bias, w2_bias)]


def _moe_fp8_setup(ctx, inputs, output):
    (x, w13_data, w13_scale, w13_gs, w2_data, w2_scale, w2_gs, topk_weights, topk_ids, fmt, activation, expert_map,
     w13_bias, w2_bias, _min_rows) = inputs
    ctx.save_for_backward(x, w13_data, w13_scale, w13_gs, w2_data, w2_scale, w2_gs, topk_weights, topk_ids,
                          expert_map, w13_bias, w2_bias)
    ctx.fmt, ctx.activation = fmt, activation


def _moe_fp8_backward(ctx, grad):
    (x, w13_data, w13_scale, w13_gs, w2_data, w2_scale, w2_gs, topk_weights, topk_ids, expert_map, w13_bias,
     w2_bias) = ctx.saved_tensors
    gx, gtw, g13, g2 = torch.ops.autofp4.moe_grad(grad, x, w13_data, w13_scale, w13_gs, w2_data, w2_scale, w2_gs,
                                                  topk_weights, topk_ids, ctx.fmt, ctx.activation, expert_map,
                                                  w13_bias, w2_bias)
    n = ctx.needs_input_grad
    return (gx if n[0] else None, None, None, None, None, None, None, gtw if n[7] else None, None, None, None, None,
            g13 if w13_bias is not None and n[12] else None, g2 if w2_bias is not None and n[13] else None, None)


_moe_fp8_op.register_autograd(_moe_fp8_backward, setup_context=_moe_fp8_setup)


class _MoeGrad(torch.autograd.Function):
    """An eager MoE call from given routing under differentiation: reverse mode (backward,
    torch.func.grad / vjp: :func:`_moe_grads`); forward mode is refused by name. ``min_rows``
    None: x's dtype, else the FP8 call's."""

    @staticmethod
    def forward(x, topk_weights, w13_bias, w2_bias, w13, w2, topk_ids, activation, expert_map, min_rows):
        if min_rows is None:
            return _moe_impl(x, w13, w2, topk_weights, topk_ids, activation, expert_map=expert_map,
                             w13_bias=w13_bias, w2_bias=w2_bias)
        return _moe_fp8_impl(x, w13, w2, topk_weights, topk_ids, activation, expert_map, w13_bias, w2_bias, min_rows)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, topk_weights, w13_bias, w2_bias, w13, w2, topk_ids, activation, expert_map, _min_rows = inputs
        ctx.save_for_backward(x, topk_weights, w13_bias, w2_bias, topk_ids, expert_map)
        ctx.w13, ctx.w2, ctx.activation = w13, w2, activation

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError("autofp4.moe: forward-mode differentiation (torch.func.jvp, torch.autograd."
                                  "forward_ad) is not supported; reverse mode is (backward(), torch.func.grad, "
                                  "torch.func.vjp)")

    @staticmethod
    def backward(ctx, grad):
        if _vmapped():
            raise NotImplementedError(_NO_VMAP)
        x, topk_weights, w13_bias, w2_bias, topk_ids, expert_map = ctx.saved_tensors
        grads = _moe_grads(grad, x, ctx.w13, ctx.w2, topk_weights, topk_ids, ctx.activation, expert_map, w13_bias,
                           w2_bias, ctx.needs_input_grad[:4])
        return (*grads, None, None, None, None, None, None)


def _routed(x, w13, router_logits, topk_weights, topk_ids, expert_map, correction_bias, top_k, renormalize, scoring,
            n_group, topk_group, routed_scaling_factor):
    """``(topk_weights, topk_ids)`` of a MoE call from ``router_logits``, checked as such, by
    :func:`route` (a call that routes apart from its layer: FP8 activations, or under gradients)."""
    _check_moe_router(x, w13, router_logits, topk_weights, topk_ids, expert_map, correction_bias)
    return route(router_logits, top_k, renormalize, scoring=scoring, correction_bias=correction_bias,
                 n_group=n_group, topk_group=topk_group, routed_scaling_factor=routed_scaling_factor)


def _check_moe_router(x, w13, router_logits, topk_weights, topk_ids, expert_map, correction_bias) -> None:
    """A MoE call that routes from ``router_logits``: the weights and the logits' shape."""
    if topk_weights is not None or topk_ids is not None:
        raise ValueError("moe: pass either topk_weights and topk_ids or router_logits (and top_k), not both")
    if not isinstance(w13, FP4Weight) or not w13.experts:
        raise TypeError(f"moe: w13 must be a stacked FP4Weight [E, 2I, H], got {_describe(w13)}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"moe: x must be a torch.Tensor [T, H], got {_describe(x)}")
    _check_logits(router_logits, "moe")
    e_ids = w13.experts if expert_map is None else _check_expert_map(expert_map, w13.experts, x.device)
    if tuple(router_logits.shape) != (x.shape[0], e_ids):
        raise ValueError(f"moe: router_logits must be [T={x.shape[0]}, E={e_ids}] (one logit per "
                         f"{'global ' if expert_map is not None else ''}expert), got {tuple(router_logits.shape)}")
    if router_logits.device != x.device:
        raise ValueError(f"moe: router_logits is on {router_logits.device} but x is on {x.device}; move one of them")
    router.check_bias(correction_bias, e_ids, x.device, "moe")


def _route_for(x, w13, router_logits, spec, correction_bias, expert_map):
    """The routing of a MoE call from its logits, with the metadata the picked kernel reads
    (one launch on Hopper): ``(topk_weights, topk_ids, metadata or None, per_pair, backend,
    runner)``."""
    key = _problem_key(w13, "moe", x.dtype, spec.top_k)
    eg = 0 if expert_map is None else expert_map.shape[0]
    backend, cfg, runner, _ = get_dispatcher(x.device).resolve_entry(key, x.shape[0], eg)
    layout = backend.moe_routing_layout(cfg)
    tw, ids, meta = router.route(router_logits, spec, correction_bias, layout=layout, experts=w13.experts,
                                 expert_map=expert_map)
    return tw, ids, meta, layout is not None and layout[1], backend, runner


@torch.library.custom_op("autofp4::moe", mutates_args=())
def _moe_op(
    x: torch.Tensor,
    w13_data: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_global_scale: Optional[torch.Tensor],
    w2_data: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_global_scale: Optional[torch.Tensor],
    topk_weights: Optional[torch.Tensor],
    topk_ids: Optional[torch.Tensor],
    fmt: str,
    activation: str,
    expert_map: Optional[torch.Tensor] = None,
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    router_logits: Optional[torch.Tensor] = None,
    correction_bias: Optional[torch.Tensor] = None,
    top_k: int = 0,
    scoring: str = "softmax",
    renormalize: bool = True,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
) -> torch.Tensor:
    w13 = _weight_from_tensors(w13_data, w13_scale, w13_global_scale, fmt)
    w2 = _weight_from_tensors(w2_data, w2_scale, w2_global_scale, fmt)
    spec = None
    if router_logits is not None:
        spec = _router_spec(router_logits, top_k, scoring, renormalize, n_group, topk_group, routed_scaling_factor)
    return _moe_impl(x, w13, w2, topk_weights, topk_ids, activation, expert_map=expert_map, w13_bias=w13_bias,
                     w2_bias=w2_bias, router_logits=router_logits, spec=spec, correction_bias=correction_bias)


@_moe_op.register_fake
def _moe_fake(x, *args, **kwargs):
    return torch.empty_like(x)


def _moe_setup(ctx, inputs, output):
    (x, w13_data, w13_scale, w13_gs, w2_data, w2_scale, w2_gs, topk_weights, topk_ids, fmt, activation, expert_map,
     w13_bias, w2_bias, router_logits, correction_bias, *route_args) = inputs
    ctx.save_for_backward(x, w13_data, w13_scale, w13_gs, w2_data, w2_scale, w2_gs, topk_weights, topk_ids,
                          expert_map, w13_bias, w2_bias, router_logits, correction_bias)
    ctx.fmt, ctx.activation, ctx.route_args = fmt, activation, route_args


def _moe_backward(ctx, grad):
    """The op's backward (:func:`_moe_grads`); from router logits, the routing computed again (no
    gradient reaches the logits through the compiled op)."""
    (x, w13_data, w13_scale, w13_gs, w2_data, w2_scale, w2_gs, topk_weights, topk_ids, expert_map, w13_bias,
     w2_bias, router_logits, correction_bias) = ctx.saved_tensors
    if router_logits is not None:
        top_k, scoring, renormalize, n_group, topk_group, scaling = ctx.route_args
        topk_weights, topk_ids = route(router_logits, top_k, renormalize, scoring=scoring,
                                       correction_bias=correction_bias, n_group=n_group, topk_group=topk_group,
                                       routed_scaling_factor=scaling)
    gx, gtw, g13, g2 = torch.ops.autofp4.moe_grad(grad, x, w13_data, w13_scale, w13_gs, w2_data, w2_scale, w2_gs,
                                                  topk_weights, topk_ids, ctx.fmt, ctx.activation, expert_map,
                                                  w13_bias, w2_bias)
    n = ctx.needs_input_grad
    return (gx if n[0] else None, *[None] * 6, gtw if router_logits is None and n[7] else None, *[None] * 4,
            g13 if w13_bias is not None and n[12] else None, g2 if w2_bias is not None and n[13] else None,
            *[None] * 8)


_moe_op.register_autograd(_moe_backward, setup_context=_moe_setup)


#: moe()'s routing arguments (used with router_logits) and their defaults, in signature order
_ROUTING_DEFAULTS = (("top_k", None), ("renormalize", True), ("scoring", "softmax"), ("n_group", 1),
                     ("topk_group", 1), ("routed_scaling_factor", 1.0))


def _refuse_routing_args(values: tuple, correction_bias) -> None:
    """moe() given topk_weights and topk_ids: TypeError naming each routing argument set to other
    than its default (it would be ignored: the routing is given)."""
    given = {k: v for (k, unset), v in zip(_ROUTING_DEFAULTS, values)
             if not (v is unset or (isinstance(v, bool) == isinstance(unset, bool) and v == unset))}
    if correction_bias is not None:
        given["correction_bias"] = "a tensor"
    if given:
        raise TypeError(f"moe: {', '.join(f'{k}={v!r}' for k, v in given.items())}: routing arguments, used only "
                        "with router_logits=; with topk_weights and topk_ids the routing is given (scale the "
                        "weights yourself, or pass the logits)")


def _refuse_bias_without_sigmoid(correction_bias, scoring, what: str) -> None:
    """DeepSeek-V3's ``correction_bias`` steers the sigmoid scoring's choice; softmax scoring has
    none to steer (it would be ignored)."""
    if correction_bias is not None and scoring != "sigmoid":
        raise ValueError(f"{what}: correction_bias is used by scoring='sigmoid' (DeepSeek-V3's routing), not by "
                         f"scoring={scoring!r}, which would ignore it")


def _router_spec(router_logits, top_k, scoring, renormalize, n_group, topk_group, scale) -> "router.RouterSpec":
    """The checked routing of a MoE call from ``router_logits``."""
    _check_logits(router_logits, "moe")
    return router.RouterSpec.checked(router_logits.shape[1], top_k, scoring, renormalize, n_group, topk_group,
                                     scale, what="moe")


def moe(
    x: torch.Tensor,
    w13: FP4Weight,
    w2: FP4Weight,
    topk_weights: Optional[torch.Tensor] = None,
    topk_ids: Optional[torch.Tensor] = None,
    activation: str = "silu",
    expert_map: Optional[torch.Tensor] = None,
    *,
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    router_logits: Optional[torch.Tensor] = None,
    top_k: Optional[int] = None,
    renormalize: bool = True,
    scoring: str = "softmax",
    correction_bias: Optional[torch.Tensor] = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    act_dtype: Optional[str] = None,
) -> torch.Tensor:
    """The fused MoE layer: for each token, ``sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(x[t])``
    with ``FFN_e(x) = W2_e @ act(gate, up) + b2_e``, ``[gate; up] = W13_e x + b13_e``; ``w13`` is
    [E, 2I, H] (gate rows first, then up), ``w2`` is [E, H, I]; ``activation`` one of
    :data:`ACTIVATIONS`: ``"silu"`` (``silu(gate) * up``), ``"gelu"`` (tanh-GELU: ``gelu(gate) * up``)
    or ``"swigluoai"`` (gpt-oss: ``gate`` clamped above at 7, ``up`` to [-7, 7],
    ``(up + 1) * gate * sigmoid(1.702 * gate)``). The biases ``w13_bias`` [E, 2I] (gate biases,
    then up) and ``w2_bias`` [E, H] are optional float tensors of any float dtype on x's device
    (the Hopper kernels add them in fp32, the reference backend in x's dtype). x is [T, H] bf16/fp16; ``topk_ids`` int32/int64 [T, top_k]
    with values in [0, E) (checked with one device sync, skipped during CUDA graph capture) and
    ``topk_weights`` a float tensor of the same shape, both on x's device. The values of x and
    topk_weights are not inspected: a NaN there gives NaN in that token's output row.

    Routing from the router's logits instead: ``router_logits`` (a float tensor [T, E], or
    [T, E_global] with an expert map) and ``top_k``, with the other routing arguments of
    :func:`route` (``renormalize``, ``scoring``, ``correction_bias``, ``n_group``,
    ``topk_group``, ``routed_scaling_factor``), in place of ``topk_weights`` and ``topk_ids``. On
    Hopper the routing and the metadata the MoE kernels read are then one kernel.

    Expert parallelism: with ``expert_map`` (int32/int64 [E_global], the index into this rank's
    ``E`` experts of each global expert, -1 where another rank holds it) ``topk_ids`` holds global
    ids in [0, E_global), pairs routed to other ranks are skipped, and the result is this rank's
    share of the sum (the ranks' results add up to the whole layer).

    ``act_dtype="fp8"`` (opt-in, it changes the numerics) quantizes x, and the activations
    between the two GEMMs, to FP8 E4M3 per row and runs both GEMMs on FP8 tensor cores (W4A8,
    :mod:`autofp4.w4a8`); ``"fp8-prefill"`` does so where the experts get
    :data:`autofp4.w4a8.PREFILL_MIN_ROWS` rows each on average and keeps x's dtype below; None
    (the default) keeps x's dtype. Its gradients (x, topk_weights or a bias requiring grad) go
    straight through both FP8 quantizations: those of the layer with x's dtype, computed on the
    dequantized weights in float32 (as :func:`linear`'s)."""
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, FP4Weight):
            raise TypeError(f"moe: {name} must be an FP4Weight, got {_describe(w)}")
    if not torch.compiler.is_compiling() and _vmapped():
        raise NotImplementedError(_NO_VMAP)
    if router_logits is None and (topk_weights is None or topk_ids is None):
        raise TypeError("moe: needs topk_weights and topk_ids, or router_logits and top_k")
    if router_logits is not None and top_k is None:
        raise TypeError("moe: router_logits needs top_k (the experts per token)")
    if router_logits is None:
        _refuse_routing_args((top_k, renormalize, scoring, n_group, topk_group, routed_scaling_factor), correction_bias)
    _refuse_bias_without_sigmoid(correction_bias, scoring, "moe")
    if act_dtype is not None:
        from .w4a8 import check_act_dtype

        min_rows = check_act_dtype(act_dtype, "moe")
        if router_logits is not None:
            topk_weights, topk_ids = _routed(x, w13, router_logits, topk_weights, topk_ids, expert_map, correction_bias,
                                             top_k, renormalize, scoring, n_group, topk_group, routed_scaling_factor)
        if _traced_as_op():
            _check_tensor_args("moe", x=x, w13_bias=w13_bias, w2_bias=w2_bias, topk_weights=topk_weights,
                               topk_ids=topk_ids)
            return torch.ops.autofp4.moe_fp8(
                x, w13.data, w13.scale, w13.global_scale, w2.data, w2.scale, w2.global_scale, topk_weights,
                topk_ids, w13.fmt, activation, expert_map, w13_bias, w2_bias, min_rows)
        _register(w13)
        _register(w2)
        if _needs_grad(x, topk_weights, w13_bias, w2_bias):
            return _MoeGrad.apply(x, topk_weights, w13_bias, w2_bias, w13, w2, topk_ids, activation, expert_map,
                                  min_rows)
        return _moe_fp8_impl(x, w13, w2, topk_weights, topk_ids, activation, expert_map, w13_bias, w2_bias,
                             min_rows)
    if _traced_as_op():
        _check_tensor_args("moe", x=x, w13_bias=w13_bias, w2_bias=w2_bias, correction_bias=correction_bias,
                           **({"router_logits": router_logits} if router_logits is not None
                              else {"topk_weights": topk_weights, "topk_ids": topk_ids}))
        if not isinstance(activation, str):
            raise TypeError(f"moe: activation must be a str, one of {ACTIVATIONS}, got {_describe(activation)}")
        return torch.ops.autofp4.moe(
            x, w13.data, w13.scale, w13.global_scale, w2.data, w2.scale, w2.global_scale,
            topk_weights, topk_ids, w13.fmt, activation, expert_map, w13_bias, w2_bias,
            router_logits, correction_bias, 0 if top_k is None else top_k, scoring, renormalize, n_group,
            topk_group, float(routed_scaling_factor),
        )
    _register(w13)
    _register(w2)
    if _needs_grad(x, topk_weights, w13_bias, w2_bias, router_logits):
        if router_logits is not None:  # routed first: the router weights' gradient flows where route's does
            topk_weights, topk_ids = _routed(x, w13, router_logits, topk_weights, topk_ids, expert_map, correction_bias,
                                             top_k, renormalize, scoring, n_group, topk_group, routed_scaling_factor)
        return _MoeGrad.apply(x, topk_weights, w13_bias, w2_bias, w13, w2, topk_ids, activation, expert_map, None)
    spec = None
    if router_logits is not None:
        spec = _router_spec(router_logits, top_k, scoring, renormalize, n_group, topk_group, routed_scaling_factor)
    return _moe_impl(x, w13, w2, topk_weights, topk_ids, activation, expert_map=expert_map, w13_bias=w13_bias,
                     w2_bias=w2_bias, router_logits=router_logits, spec=spec, correction_bias=correction_bias)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True, *, scoring: str = "softmax",
          correction_bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
          routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE routing: ``(topk_weights fp32 [T, top_k], topk_ids int32 [T, top_k])``, the ids in
    descending order of score (ties: the lower id first).

    ``scoring="softmax"`` (Qwen3-MoE, Mixtral, gpt-oss): the softmax of ``router_logits`` (a float
    tensor [T, E]), its ``top_k`` largest, renormalized to sum to 1 (``renormalize``); ``-inf``
    masks an expert out (it gets weight 0), so every row needs at least one finite logit.
    ``scoring="sigmoid"`` (DeepSeek-V3): ``s = sigmoid(logits)``, the experts chosen by ``s +
    correction_bias`` (float [E] or None) among the ``topk_group`` best of ``n_group`` groups of
    consecutive experts (a group's score is the sum of its two best), weighted by ``s``
    (``renormalize``: divided by their sum + 1e-20). Both are multiplied by
    ``routed_scaling_factor``. On a Hopper GPU this is one kernel (:mod:`autofp4.router`).

    NaN, or for softmax ``+inf`` or a row of ``-inf``, has no meaningful routing (NaN weights)
    and raises ValueError. That check reads the result on the host (one device sync on CUDA);
    it is skipped while a CUDA graph is being captured, under torch.compile and for meta
    tensors, where such rows give NaN weights instead."""
    _check_logits(router_logits, "route")
    _refuse_bias_without_sigmoid(correction_bias, scoring, "route")
    spec = router.RouterSpec.checked(router_logits.shape[1], top_k, scoring, renormalize, n_group, topk_group,
                                     routed_scaling_factor)
    router.check_bias(correction_bias, router_logits.shape[1], router_logits.device)
    w, ids, _ = router.route(router_logits, spec, correction_bias)
    _refuse_bad_logits(router_logits, w, "route", correction_bias)
    return w, ids


def explain(x: torch.Tensor, w: FP4Weight, *, top_k: Optional[int] = None):
    """What ``linear(x, w)`` (a 2-D ``w``) or ``moe(x, w13=w, ...)`` with ``top_k`` experts per
    token (a stacked ``w``) would run on x's device, and why: an
    :class:`~autofp4.dispatch.Explanation` (backend, config, tuned row or default, the DB layer
    of the row); ``print`` it. Counts no miss and compiles nothing."""
    if not isinstance(w, FP4Weight):
        raise TypeError(f"explain: w must be an FP4Weight, got {_describe(w)}")
    _check_act(x, w, "explain")
    m = x.numel() // w.k
    if w.experts:
        k = router.as_int(top_k)
        if k is None or not 0 < k <= w.experts:
            raise ValueError(f"explain: a stacked MoE weight needs top_k in [1, E={w.experts}], got {top_k!r}")
        key = _problem_key(w, "moe", x.dtype, k)
    else:
        key = _problem_key(w, "linear", x.dtype)
    return get_dispatcher(x.device).explain(key, max(m, 1))


def _check_logits(router_logits, what: str) -> None:
    if not isinstance(router_logits, torch.Tensor):
        raise TypeError(f"{what}: router_logits must be a torch.Tensor [T, E], got {_describe(router_logits)}")
    if router_logits.dim() != 2:
        raise ValueError(f"{what}: router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    if not router_logits.is_floating_point():
        raise ValueError(f"{what}: router_logits must be a floating-point tensor, got {router_logits.dtype}")


def _refuse_bad_logits(router_logits: torch.Tensor, w: torch.Tensor, what: str,
                       bias: Optional[torch.Tensor] = None) -> None:
    """ValueError naming the rows of ``router_logits`` that route to NaN weights ``w``: a row is NaN
    in ``w`` exactly when it has a NaN (softmax: or +inf) logit or, for softmax, no finite one;
    and naming a non-finite entry of the correction ``bias`` (NaN or inf would pick, or never pick,
    its expert for every token). One read of the device; eager calls only (a CUDA graph capture,
    torch.compile or meta tensors read no values)."""
    if not (w.numel() and _values_readable(w)):
        return
    bad = torch.isnan(w).any()
    if bias is not None:
        bad = bad | ~torch.isfinite(bias).all()
    if not bool(bad):
        return
    if bias is not None and not bool(torch.isfinite(bias).all()):
        i = int((~torch.isfinite(bias)).nonzero()[0])
        raise ValueError(f"{what}: correction_bias must be finite: entry {i} (expert {i}) is {float(bias[i])} "
                         "(NaN or inf would pick, or never pick, that expert for every token)")
    rows = torch.isnan(w).any(dim=-1).nonzero().flatten().tolist()
    r = rows[0]
    vals = router_logits[r].float().tolist()
    shown = ", ".join(f"{v:g}" for v in vals[:8]) + (", ..." if len(vals) > 8 else "")
    raise ValueError(
        f"{what}: router_logits must be finite (-inf masks an expert, but each row needs a finite logit); "
        f"{len(rows)} of {router_logits.shape[0]} rows are not, the first is row {r} (in float32): [{shown}]"
    )
