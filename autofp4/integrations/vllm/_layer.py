"""FP4 weights on vLLM layers: parameters for loading, buffers for running.

After loading, a layer holds each FP4 weight as three non-persistent buffers
``autofp4_<stem>packed`` (uint8 E2M1 codes), ``autofp4_<stem>scale`` (block scales) and
``autofp4_<stem>global_scale`` (NVFP4's fp32 global scale; None for MXFP4), with ``stem`` ``""``
for a linear layer and ``"w13_"`` / ``"w2_"`` for routed experts. The loaded parameters are
deleted; each weight parameter is left as a 0-element tensor of its dtype on its device, for
code that reads ``layer.weight.dtype`` or ``.device``.

On a GPU each layer then runs once eagerly for every token count vLLM will capture a CUDA graph
for (:func:`warm_up`), so that no weight is packed during capture, and, with every layout its
kernels read built, the loaded bytes are freed (:func:`free_loaded`): the buffers ``packed`` and
``scale`` become one-element placeholders of the same shape (unless ``AUTOFP4_VLLM_KEEP_LOADED=1``).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from ...ops import free_loaded as _free_weight
from ...problem import BLOCK_SIZE
from ...weights import FP4Weight

_E4M3_NAN = 0x7F


def check_divisible(size: int, fmt: str, what: str, prefix: str) -> None:
    """A ValueError unless ``size`` (a per-rank K) is a multiple of ``fmt``'s block size."""
    bs = BLOCK_SIZE[fmt]
    if size % bs:
        raise ValueError(
            f"autofp4 {fmt.upper()} requires {what} ({size}) to be divisible by {bs} "
            f"(layer {prefix or '?'}); serve this model without --quantization autofp4, "
            "or with a tensor-parallel size that keeps the shards divisible"
        )


def add_param(layer: torch.nn.Module, name: str, param: torch.nn.Parameter, attrs: Optional[dict[str, Any]] = None,
              fill: Optional[float] = None, dummy: Optional[float] = None) -> torch.nn.Parameter:
    """Register ``param`` as ``name`` with the vLLM weight attributes ``attrs`` (weight loader,
    ...). ``fill`` pre-fills it (NaN marks a scale the checkpoint never provided); ``dummy`` is the
    value vLLM's dummy loader (``--load-format dummy``) writes instead of random bytes."""
    from vllm.model_executor.utils import set_weight_attrs

    if fill is not None:
        param.data.fill_(fill)
    layer.register_parameter(name, param)
    attrs = dict(attrs or {})
    if dummy is not None:
        attrs["dummy_weight_value"] = dummy
    set_weight_attrs(param, attrs)
    return param


def _dummy_load() -> bool:
    """Whether vLLM is loading dummy weights (``--load-format dummy``)."""
    from vllm.config import get_current_vllm_config

    try:
        return str(get_current_vllm_config().load_config.load_format) == "dummy"
    except Exception:  # no config set (a layer built outside a vLLM engine)
        return False


def check_loaded(layer: torch.nn.Module, names: Iterable[str], prefix: str) -> None:
    """A RuntimeError if a scale still holds the NaN it was created with (never loaded).

    Under ``--load-format dummy`` the scales get their ``dummy_weight_value`` here first: vLLM
    before 0.27 fills every float parameter with uniform(-1e-3, 1e-3) (negative scales), later
    releases write the value themselves."""
    if _dummy_load():
        for name in names:
            value = getattr(getattr(layer, name), "dummy_weight_value", None)
            if value is not None:
                getattr(layer, name).data.fill_(value)
    for name in names:
        t = getattr(layer, name)
        bad = (t.view(torch.uint8) == _E4M3_NAN) if t.dtype == torch.float8_e4m3fn else torch.isnan(t)
        if bool(bad.any()):
            raise RuntimeError(
                f"autofp4: {prefix or 'a layer'}.{name} was never loaded (still NaN): the checkpoint likely "
                "stores this layer unquantized; list it in the checkpoint's exclude_modules"
            )


def install(layer: torch.nn.Module, stem: str, w: FP4Weight, release: Iterable[str]) -> None:
    """Make ``w`` the layer's FP4 weight ``stem`` and delete the parameters ``release``."""
    for name in release:
        old = getattr(layer, name, None)
        if name in layer._parameters:
            del layer._parameters[name]
        elif hasattr(layer, name):
            delattr(layer, name)
        if name.endswith("weight") and isinstance(old, torch.Tensor):
            setattr(layer, name, torch.empty(0, dtype=old.dtype, device=w.device))
    layer.register_buffer(f"autofp4_{stem}packed", w.data, persistent=False)
    layer.register_buffer(f"autofp4_{stem}scale", w.scale, persistent=False)
    layer.register_buffer(f"autofp4_{stem}global_scale", w.global_scale, persistent=False)
    if w.input_scale is not None:
        layer.register_buffer(f"autofp4_{stem}input_scale", w.input_scale, persistent=False)
    layer.autofp4_fmt = w.fmt
    layer.__dict__.setdefault("_autofp4_weights", {})[stem] = w


def tensors(layer: torch.nn.Module, stem: str) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(packed, scale, global_scale)`` of the layer's FP4 weight ``stem``."""
    return (getattr(layer, f"autofp4_{stem}packed"), getattr(layer, f"autofp4_{stem}scale"),
            getattr(layer, f"autofp4_{stem}global_scale"))


def fp4_weight(layer: torch.nn.Module, stem: str) -> FP4Weight:
    """The FP4Weight ``stem`` over the layer's current buffers (rebuilt after ``.to()``)."""
    w = layer.__dict__["_autofp4_weights"][stem]
    data, scale, gs = tensors(layer, stem)
    if w.data is not data or w.scale is not scale or w.global_scale is not gs:
        ins = getattr(layer, f"autofp4_{stem}input_scale", None)
        w = FP4Weight(layer.autofp4_fmt, data, scale, gs, ins, check_values=False)
        layer.__dict__["_autofp4_weights"][stem] = w
    return w


def graph_sizes() -> tuple[list[int], torch.dtype]:
    """The token counts vLLM will capture CUDA graphs for (none when it captures none) and the
    model's dtype (bf16 when unknown), from the vLLM config being loaded; none without one (a
    layer built outside vLLM's loader)."""
    try:
        from vllm.config import get_current_vllm_config

        vc = get_current_vllm_config()
    except Exception:  # noqa: BLE001 - no current config
        return [], torch.bfloat16
    dtype = getattr(vc.model_config, "dtype", None)
    dtype = dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
    cc = vc.compilation_config
    mode = getattr(cc, "cudagraph_mode", None)
    if mode is None or getattr(mode, "name", "") == "NONE":
        return [], dtype
    return sorted({int(s) for s in getattr(cc, "cudagraph_capture_sizes", None) or ()}), dtype


def warm_up(device: torch.device, call: Callable[[int, torch.dtype], Any]) -> Optional[torch.dtype]:
    """``call(m, dtype)`` for each token count ``m`` vLLM will capture a CUDA graph for.

    The first call that picks a kernel packs the weight into that kernel's layout and builds the
    kernel's per-device state; during CUDA graph capture neither can happen (host-to-device copies
    are refused there, and what is built would live in the graph's memory pool), and vLLM's model
    runner captures some sizes with no eager call before. Calls at load time also make the packed
    weights part of the memory vLLM measures for the model, before it sizes the KV cache.
    Returns the activation dtype the calls ran in (None where none ran)."""
    if device.type != "cuda":
        return None
    sizes, dtype = graph_sizes()
    with torch.inference_mode():
        for m in sizes:
            call(m, dtype)
    return dtype if sizes else None


def free_loaded(layer: torch.nn.Module, roles: dict[str, Optional[bool]], dtype: Optional[torch.dtype],
                keep: bool, prefix: str) -> int:
    """Free the loaded tensors of the layer's FP4 weights ``roles`` (stem -> None for a linear
    weight, True / False for w13 / w2) once their kernels' layouts are all built
    (:func:`autofp4.ops.free_loaded`), after the load-time calls of :func:`warm_up` (``dtype``:
    theirs; None: none ran, nothing is freed) unless ``keep``. Each weight's ``packed`` and
    ``scale`` buffers become its placeholders. Returns the bytes freed."""
    if keep or dtype is None:
        return 0
    why = (f"the vLLM plugin freed them once {prefix or 'the layer'}'s kernel layouts were built; "
           f"set AUTOFP4_VLLM_KEEP_LOADED=1 to keep them")
    freed = 0
    for stem, gate_up in roles.items():
        w = fp4_weight(layer, stem)
        n = _free_weight(w, dtype, gate_up, why)
        if n:
            layer.register_buffer(f"autofp4_{stem}packed", w.data, persistent=False)
            layer.register_buffer(f"autofp4_{stem}scale", w.scale, persistent=False)
            freed += n
    return freed
