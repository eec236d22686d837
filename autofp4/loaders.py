"""Checkpoint layouts -> :class:`~autofp4.weights.FP4Weight`.

ModelOpt / TensorRT-LLM NVFP4 (``hf_quant_config.json`` ``"quant_algo": "NVFP4"``), per linear:
    ``<prefix>.weight``          uint8 [N, K/2]   two E2M1 codes a byte, even K in the low nibble
    ``<prefix>.weight_scale``    float8_e4m3fn [N, K/16] (some exports store the bytes as uint8)
    ``<prefix>.weight_scale_2``  fp32 scalar (shape () or (1,)) = amax / (6 * 448)
    ``<prefix>.input_scale``     fp32 scalar, optional (the activations' global scale)

gpt-oss MXFP4 (stacked experts), per projection:
    ``<prefix>_blocks``          uint8 [E, N, K/32, 16]   32 E2M1 codes per 16 bytes, low nibble first
    ``<prefix>_scales``          uint8 [E, N, K/32]       E8M0 biased exponents (bias 127)

Loaders copy nothing they do not have to; the resulting weight is on the packed values' device
(scales stored elsewhere are moved there).
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from .weights import FP4Weight

__all__ = ["from_modelopt", "fuse_modelopt", "from_mxfp4_blocks", "load_state_dict_weight", "MissingKeyError"]


class MissingKeyError(KeyError, ValueError):
    """A state dict lacks a key the layout needs (a KeyError, and a ValueError of the state dict)."""


def _desc(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)}"
    if isinstance(t, (str, int, float)) and not isinstance(t, bool):
        return f"{type(t).__name__} {t!r}"
    return type(t).__name__


def _to(t: torch.Tensor, device: torch.device, label: str, what: str, **kw) -> torch.Tensor:
    """``t`` on ``device``: a meta tensor has no values to move to a real device."""
    if t.is_meta and device.type != "meta":
        raise ValueError(f"{what}: {label} is on the meta device (no values) but the weight is on {device}")
    return t.to(device=device, **kw)


def _as_e4m3(scale: object, label: str, what: str) -> torch.Tensor:
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{what}: {label} must be a float8_e4m3fn tensor (or its bytes as uint8), got {_desc(scale)}")
    if scale.dtype == torch.float8_e4m3fn:
        return scale
    if scale.dtype == torch.uint8:
        return scale.view(torch.float8_e4m3fn)
    raise TypeError(f"{what}: {label} must be float8_e4m3fn (or its bytes as uint8), got {_desc(scale)}")


def _per_tensor(
    s: object, lead: tuple[int, ...], label: str, what: str, device: torch.device, keep_scalar: bool = False
) -> torch.Tensor:
    """A checkpoint's per-tensor scale as fp32 of shape () (2-D) or (E,) (stacked experts; a
    single value is broadcast to every expert unless ``keep_scalar``), on ``device``."""
    if isinstance(s, (int, float)):
        s = torch.tensor(float(s), dtype=torch.float32)
    if (
        not isinstance(s, torch.Tensor)
        or s.dtype not in (torch.float32, torch.bfloat16, torch.float16)
    ):
        raise TypeError(f"{what}: {label} must be a float32 (or bf16/fp16) tensor, got {_desc(s)}")
    s = _to(s, device, label, what, dtype=torch.float32)
    if s.numel() == 1 and (not lead or keep_scalar):
        return s.reshape(())
    if lead and s.numel() == 1:
        return s.reshape(()).expand(lead).contiguous()
    if lead and s.numel() == lead[0] and s.dim() <= 2:
        return s.reshape(lead)
    want = "a scalar (shape () or (1,))" if not lead else f"a scalar or one per expert ({lead[0]} values)"
    raise ValueError(f"{what}: {label} must be {want}, got shape {tuple(s.shape)}")


def _check_packed(weight: object, label: str, what: str) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.uint8:
        raise TypeError(f"{what}: {label} must be uint8 packed E2M1 codes [N, K/2], got {_desc(weight)}")
    if weight.dim() not in (2, 3):
        raise ValueError(
            f"{what}: {label} must be [N, K/2] or [E, N, K/2], got {weight.dim()}-D shape {tuple(weight.shape)}"
        )
    if weight.numel() == 0:
        raise ValueError(f"{what}: {label} is empty (shape {tuple(weight.shape)})")
    return weight


_MODELOPT_ARGS = ("weight", "weight_scale", "weight_scale_2", "input_scale")


def from_modelopt(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    input_scale: Optional[torch.Tensor | float] = None,
) -> FP4Weight:
    """A ModelOpt NVFP4 linear (or stacked experts) -> FP4Weight("nvfp4").

    weight: uint8 ``[N, K/2]`` (or ``[E, N, K/2]``); weight_scale: float8_e4m3fn or uint8 bytes
    ``[N, K/16]``; weight_scale_2: fp32 scalar (``[E]`` for stacked experts); input_scale:
    optional fp32 scalar, kept as ``FP4Weight.input_scale``.
    """
    return _from_modelopt(weight, weight_scale, weight_scale_2, input_scale, "from_modelopt",
                          {a: a for a in _MODELOPT_ARGS})


def _from_modelopt(weight, weight_scale, weight_scale_2, input_scale, what: str, label: dict[str, str]) -> FP4Weight:
    weight = _check_packed(weight, label["weight"], what)
    scale = _to(_as_e4m3(weight_scale, label["weight_scale"], what), weight.device, label["weight_scale"], what)
    lead = tuple(weight.shape[:-2])
    gs = _per_tensor(weight_scale_2, lead, label["weight_scale_2"], what, weight.device)
    ins = None
    if input_scale is not None:
        ins = _per_tensor(input_scale, lead, label["input_scale"], what, weight.device, keep_scalar=True)
    labels = {"data": label["weight"], "scale": label["weight_scale"], "global_scale": label["weight_scale_2"],
              "input_scale": label["input_scale"]}
    return FP4Weight._build("nvfp4", weight, scale, gs, ins, what=what, labels=labels)


def fuse_modelopt(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | float]],
    input_scale: Optional[torch.Tensor | float] = None,
) -> FP4Weight:
    """Concatenate ModelOpt NVFP4 projections along N (q/k/v -> qkv, gate/up -> gate_up) into
    one FP4Weight whose global scale is the largest of the parts' ``weight_scale_2``.

    ``parts``: ``(weight, weight_scale, weight_scale_2)`` per projection, all with the same K
    (2-D, or stacked ``[E, N_i, K/2]`` with per-expert scales, fused per expert).

    The E2M1 codes are kept; part ``i``'s block scales become
    ``E4M3(fp32(scale) * (weight_scale_2_i / max_j weight_scale_2_j))`` (round to nearest even),
    so each block dequantizes to ``e2m1 * scale' * max`` instead of ``e2m1 * scale * s2_i``.
    That re-rounding is the only cost: a rescaled block scale that stays in E4M3's normal
    range (>= 2**-6) is within a relative 2**-4 (half an E4M3 step) of the exact rescaled
    value; below 2**-6 E4M3 is subnormal with an absolute step of 2**-9, so the error is at
    most 2**-10 and blocks whose rescaled scale is below 2**-10 flush to zero. That only
    happens for parts whose ``weight_scale_2`` is far below the largest one. Parts already
    at the largest scale are copied bit for bit. ``input_scale`` (the shared activations'
    scale, e.g. the max of the parts' input scales) is kept as given.
    """
    what = "fuse_modelopt"
    if not isinstance(parts, (list, tuple)):
        raise TypeError(
            f"{what}: parts must be a non-empty list of (weight, weight_scale, weight_scale_2), got {_desc(parts)}"
        )
    if not parts:
        raise ValueError(f"{what}: parts must be a non-empty list of (weight, weight_scale, weight_scale_2), got {parts!r}")
    weights: list[FP4Weight] = []
    scales: list[torch.Tensor] = []
    for i, part in enumerate(parts):
        if not isinstance(part, (list, tuple)) or len(part) != 3:
            size = f" of length {len(part)}" if hasattr(part, "__len__") else ""
            exc = ValueError if isinstance(part, (list, tuple)) else TypeError
            raise exc(
                f"{what}: part {i} must be (weight, weight_scale, weight_scale_2), "
                f"got {type(part).__name__}{size} (parts[{i}])"
            )
        label = {a: f"parts[{i}] {a}" for a in _MODELOPT_ARGS}
        weights.append(_from_modelopt(*part, None, what, label))  # validates the part on its own
    first = weights[0]
    for i, w in enumerate(weights[1:], 1):
        if w.k != first.k or w.experts != first.experts or w.device != first.device:
            raise ValueError(
                f"{what}: every part of parts needs the same K, experts and device as part 0 "
                f"(K={first.k}, experts={first.experts}, {first.device}); part {i} has "
                f"K={w.k}, experts={w.experts}, {w.device}"
            )
    s2 = torch.stack([w.global_scale for w in weights])  # [P] or [P, E]
    gmax = s2.amax(dim=0)
    for w in weights:
        ratio = (w.global_scale / gmax).reshape(w.global_scale.shape + (1, 1))
        if bool((w.global_scale == gmax).all()):
            scales.append(w.scale)  # exact: nothing to re-round
        else:
            rescaled = (w.scale.float() * ratio).clamp_(max=448.0)
            scales.append(rescaled.to(torch.float8_e4m3fn))
    data = torch.cat([w.data for w in weights], dim=-2)
    scale = torch.cat([s.view(torch.uint8) for s in scales], dim=-2).view(torch.float8_e4m3fn)
    ins = None
    if input_scale is not None:
        lead = (first.experts,) if first.experts else ()
        ins = _per_tensor(input_scale, lead, "input_scale", what, first.device, keep_scalar=True)
    return FP4Weight._build("nvfp4", data, scale, gmax.contiguous(), ins, what=what, labels={})


def from_mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> FP4Weight:
    """MXFP4 blocks + E8M0 scales -> FP4Weight("mxfp4").

    blocks: uint8 ``[E, N, K/2]`` / ``[N, K/2]`` or the gpt-oss layout ``[E, N, K/32, 16]`` /
    ``[N, K/32, 16]``; scales: uint8 ``[E, N, K/32]`` / ``[N, K/32]`` (biased exponents, bias
    127). The layout is told apart by ``blocks.dim() == scales.dim() + 1``. gpt-oss's fused
    ``gate_up_proj`` interleaves gate and up rows; that order is kept as stored.
    """
    return _from_mxfp4_blocks(blocks, scales, "from_mxfp4_blocks", "blocks", "scales")


def _from_mxfp4_blocks(blocks, scales, what: str, b_label: str, s_label: str) -> FP4Weight:
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8:
        raise TypeError(f"{what}: {b_label} must be uint8, got {_desc(blocks)}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8:
        raise TypeError(f"{what}: {s_label} must be uint8 E8M0 exponents, got {_desc(scales)}")
    if scales.dim() not in (2, 3):
        raise ValueError(f"{what}: {s_label} must be [N, K/32] or [E, N, K/32], got shape {tuple(scales.shape)}")
    if blocks.dim() == scales.dim() + 1:
        if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
            raise ValueError(
                f"{what}: gpt-oss {b_label} {tuple(blocks.shape)} and {s_label} {tuple(scales.shape)} do not match: "
                f"blocks [..., N, K/32, 16] take scales [..., N, K/32] (one E8M0 exponent per block of 32 values)"
                + (f", so {tuple(blocks.shape[:-1])} for these blocks" if blocks.shape[-1] == 16 else "")
            )
        blocks = blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * 16)
    elif blocks.dim() == scales.dim() + 2 and blocks.shape[-1] == 16:  # gpt-oss blocks, scales flattened
        raise ValueError(f"{what}: {s_label} must be {tuple(blocks.shape[:-1])} (one E8M0 exponent per 32 values of "
                         f"{b_label} {tuple(blocks.shape)}), got {tuple(scales.shape)}")
    elif blocks.dim() != scales.dim():
        raise ValueError(
            f"{what}: {b_label} must be [..., N, K/2] or [..., N, K/32, 16] for {s_label} {tuple(scales.shape)}, "
            f"got {tuple(blocks.shape)}"
        )
    if blocks.numel() == 0:
        raise ValueError(f"{what}: {b_label} are empty (shape {tuple(blocks.shape)})")
    scales = _to(scales, blocks.device, s_label, what)
    return FP4Weight._build("mxfp4", blocks, scales, what=what, labels={"data": b_label, "scale": s_label})


def load_state_dict_weight(state_dict: Mapping[str, torch.Tensor], prefix: str) -> FP4Weight:
    """The FP4Weight stored under ``prefix`` in a checkpoint's state dict, layout detected from
    the keys:

    - ModelOpt NVFP4: ``prefix.weight`` (uint8), ``prefix.weight_scale`` (E4M3),
      ``prefix.weight_scale_2`` and optional ``prefix.input_scale``;
    - MXFP4 with the same names (``prefix.weight`` uint8, ``prefix.weight_scale`` uint8 E8M0
      ``[N, K/32]``, no ``weight_scale_2``);
    - gpt-oss MXFP4: ``prefix_blocks`` and ``prefix_scales`` (e.g. prefix
      ``model.layers.0.mlp.experts.gate_up_proj``).

    A missing key raises :class:`MissingKeyError` (a KeyError that is also a ValueError);
    a wrong tensor raises TypeError/ValueError naming its key.
    """
    what = "load_state_dict_weight"
    if not isinstance(state_dict, Mapping) and not (hasattr(state_dict, "keys") and hasattr(state_dict, "__getitem__")):
        raise TypeError(f"{what}: state_dict must be a mapping of names to tensors, got {_desc(state_dict)}")
    if not isinstance(prefix, str):
        raise TypeError(f"{what}: prefix must be a str (the module's name in the state dict), got {_desc(prefix)}")
    prefix = prefix.rstrip(".")
    w_key, s_key, s2_key, in_key = (f"{prefix}.{n}" for n in ("weight", "weight_scale", "weight_scale_2", "input_scale"))
    b_key, e_key = f"{prefix}_blocks", f"{prefix}_scales"
    has_mo = w_key in state_dict
    has_oss = b_key in state_dict
    if has_mo and has_oss:
        raise ValueError(f"{what}: both {w_key!r} and {b_key!r} exist; cannot tell which layout {prefix!r} uses")
    if has_oss:
        if e_key not in state_dict:
            raise MissingKeyError(f"{what}: found {b_key!r} but not {e_key!r}")
        return _from_mxfp4_blocks(state_dict[b_key], state_dict[e_key], what, repr(b_key), repr(e_key))
    if not has_mo:
        near = sorted(k for k in state_dict.keys() if isinstance(k, str) and k.startswith(prefix))[:8]
        raise MissingKeyError(
            f"{what}: no FP4 weight under {prefix!r}: expected {w_key!r} (ModelOpt) or {b_key!r} (gpt-oss); "
            f"keys starting with the prefix: {near}"
        )
    weight = state_dict[w_key]
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.uint8:
        raise TypeError(
            f"{what}: {w_key!r} must be uint8 packed FP4 values, got {_desc(weight)} (not an FP4 checkpoint weight?)"
        )
    if s_key not in state_dict:
        raise MissingKeyError(f"{what}: found {w_key!r} but not {s_key!r}")
    scale = state_dict[s_key]
    if s2_key in state_dict:
        label = dict(zip(_MODELOPT_ARGS, (repr(w_key), repr(s_key), repr(s2_key), repr(in_key))))
        return _from_modelopt(weight, scale, state_dict[s2_key], state_dict.get(in_key), what, label)
    k = weight.shape[-1] * 2 if weight.dim() else 0
    if isinstance(scale, torch.Tensor) and scale.dtype == torch.uint8 and k % 32 == 0 \
            and tuple(scale.shape) == tuple(weight.shape[:-1]) + (k // 32,):
        return _from_mxfp4_blocks(weight, scale, what, repr(w_key), repr(s_key))
    raise MissingKeyError(
        f"{what}: {w_key!r} has no {s2_key!r} (needed for NVFP4) and {s_key!r} ({_desc(scale)}) "
        f"is not an MXFP4 uint8 scale of shape {tuple(weight.shape[:-1]) + (k // 32,)}"
    )
