"""The FP4 checkpoint layouts autofp4 writes: tensor names, dtypes and config keys.

Each layout is written as its own tools write it, and read back by :func:`autofp4.from_pretrained`
(docs/checkpoints.md has the tables and a minimal example of each):

``modelopt`` (NVFP4): per quantized linear ``<name>.weight`` uint8 [N, K/2],
    ``<name>.weight_scale`` float8_e4m3fn [N, K/16], ``<name>.weight_scale_2`` fp32 [] (the global
    scale); routed experts one linear per expert and projection. ``hf_quant_config.json``
    ``{"producer", "quantization": {"quant_algo": "W4A16_NVFP4", "group_size": 16,
    "kv_cache_quant_algo": null, "exclude_modules": [...]}}`` and the same in config.json's
    ``quantization_config`` (``"quant_method": "modelopt"``, ``"ignore"``). W4A16: no activation
    scales are written (autofp4 calibrates none).
``compressed-tensors`` (NVFP4 ``nvfp4-pack-quantized`` or MXFP4 ``mxfp4-pack-quantized``):
    ``<name>.weight_packed`` uint8 [N, K/2], ``<name>.weight_scale`` (NVFP4: float8_e4m3fn [N, K/16];
    MXFP4: uint8 E8M0 [N, K/32]), NVFP4 ``<name>.weight_global_scale`` fp32 [1] stored as the
    reciprocal of autofp4's global scale (compressed-tensors divides by it). config.json
    ``quantization_config`` with one config group targeting ``Linear``, weights only.
``gpt-oss`` (MXFP4, gpt-oss models): the routed experts only, stacked per projection:
    ``<experts>.gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16] (gate and up rows interleaved
    ``g0, u0, g1, u1, ...``), ``..._scales`` uint8 [E, 2I, H/32], ``gate_up_proj_bias`` [E, 2I]
    (interleaved), ``down_proj_{blocks,scales,bias}``; config.json ``{"quant_method": "mxfp4",
    "modules_to_not_convert": [...]}``. Everything else stays in high precision.

Names are the model's (transformers') module names, but Mixtral's MoE blocks, which its
checkpoints (and vLLM) call ``block_sparse_moe`` with experts ``w1`` / ``w3`` / ``w2``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from ..weights import FP4Weight

__all__ = ["LAYOUTS", "check_layout", "default_layout", "stored_name", "model_name", "routers_next_to",
           "expert_proj_names", "linear_tensors",
           "experts_tensors", "quantization_config"]

LAYOUTS = ("modelopt", "compressed-tensors", "gpt-oss")
CT_FORMATS = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
# (model name part, stored name part) by config.model_type; the reader maps them back
RENAMES = {"mixtral": ((".mlp.", ".block_sparse_moe."),)}
_PER_EXPERT = {"mixtral": ("w1", "w3", "w2")}
_DEFAULT_PROJ = ("gate_proj", "up_proj", "down_proj")


def check_layout(layout: object, fmt: str, model_type: Optional[str], what: str) -> str:
    """``layout`` checked against the format and the model kind; a clear error otherwise."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"{what}: layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "modelopt" and fmt != "nvfp4":
        raise ValueError(f"{what}: the modelopt layout stores NVFP4; for {fmt} write layout='compressed-tensors'"
                         + (" or 'gpt-oss'" if model_type == "gpt_oss" else ""))
    if layout == "gpt-oss":
        if fmt != "mxfp4":
            raise ValueError(f"{what}: the gpt-oss layout stores MXFP4 experts; for {fmt} write layout='modelopt' "
                             "or 'compressed-tensors'")
        if model_type != "gpt_oss":
            raise ValueError(f"{what}: the gpt-oss layout is gpt-oss's own (model_type 'gpt_oss'), this model is "
                             f"{model_type!r}; write layout='compressed-tensors'")
    return layout


def default_layout(fmt: str, model_type: Optional[str]) -> str:
    if fmt == "nvfp4":
        return "modelopt"
    return "gpt-oss" if model_type == "gpt_oss" else "compressed-tensors"


def stored_name(name: str, model_type: Optional[str]) -> str:
    """The name a checkpoint of ``model_type`` stores the model's tensor or module ``name`` under."""
    for model_part, stored_part in RENAMES.get(model_type or "", ()):
        name = name.replace(model_part, stored_part)
    return name


def model_name(stored: str, model_type: Optional[str]) -> str:
    """The model's name of a tensor a checkpoint of ``model_type`` stores as ``stored`` (the
    inverse of :func:`stored_name`)."""
    for model_part, stored_part in RENAMES.get(model_type or "", ()):
        stored = stored.replace(stored_part, model_part)
    return stored


def routers_next_to(model, experts: list[str]) -> list[str]:
    """The router modules (``gate`` / ``router``, any class) beside each routed-experts module
    ``experts`` names: kept in high precision, listed as excluded in a checkpoint's config."""
    out = []
    for name in experts:
        parent = name.rpartition(".")[0]
        for r in ("gate", "router"):
            full = f"{parent}.{r}" if parent else r
            try:
                model.get_submodule(full)
            except AttributeError:
                continue
            out.append(full)
    return out


def expert_proj_names(model_type: Optional[str]) -> tuple[str, str, str]:
    """The per-expert projection names (gate, up, down) of ``model_type``'s checkpoints."""
    return _PER_EXPERT.get(model_type or "", _DEFAULT_PROJ)


def linear_tensors(layout: str, name: str, w: FP4Weight) -> dict[str, torch.Tensor]:
    """The stored tensors of one quantized linear ``name`` (2-D ``w``) in ``layout``."""
    if layout == "modelopt":
        return {f"{name}.weight": w.data, f"{name}.weight_scale": w.scale,
                f"{name}.weight_scale_2": w.global_scale.reshape(())}
    if layout == "compressed-tensors":
        out = {f"{name}.weight_packed": w.data, f"{name}.weight_scale": w.scale}
        if w.fmt == "nvfp4":
            out[f"{name}.weight_global_scale"] = torch.reciprocal(w.global_scale.reshape(1))
        return out
    raise ValueError(f"the {layout} layout stores no quantized linear layers ({name!r} is one)")


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """Gate rows then up rows along dim 1 -> ``g0, u0, g1, u1, ...`` (gpt-oss's order)."""
    i = t.shape[1] // 2
    return torch.stack((t[:, :i], t[:, i:]), dim=2).reshape(t.shape)


def experts_tensors(layout: str, name: str, w13: FP4Weight, w2: FP4Weight, b13: Optional[torch.Tensor],
                    b2: Optional[torch.Tensor], model_type: Optional[str],
                    first: int = 0) -> dict[str, torch.Tensor]:
    """The stored tensors of routed experts ``name`` (stored name of the experts module):
    ``w13`` [E, 2I, H] gate rows first, ``w2`` [E, H, I], optional biases [E, 2I] / [E, H].
    ``first``: the index of ``w13``'s expert 0 in the layer (the per-expert layouts' names; a
    streaming writer passes the experts a few at a time)."""
    e, two_i, h = w13.shape
    if layout == "gpt-oss":
        out = {f"{name}.gate_up_proj_blocks": _interleave(w13.data).reshape(e, two_i, h // 32, 16),
               f"{name}.gate_up_proj_scales": _interleave(w13.scale)}
        if b13 is not None:
            out[f"{name}.gate_up_proj_bias"] = _interleave(b13)
        out[f"{name}.down_proj_blocks"] = w2.data.reshape(e, h, two_i // 64, 16)
        out[f"{name}.down_proj_scales"] = w2.scale
        if b2 is not None:
            out[f"{name}.down_proj_bias"] = b2
        return out
    if b13 is not None or b2 is not None:
        raise ValueError(f"the {layout} layout has no expert biases ({name!r} has them); gpt-oss's experts are "
                         "written in the gpt-oss layout")
    g, u, d = expert_proj_names(model_type)
    i = two_i // 2
    out = {}
    for x in range(e):
        gu = w13.expert(x)
        out.update(linear_tensors(layout, f"{name}.{first + x}.{g}", gu.slice_rows(0, i)))
        out.update(linear_tensors(layout, f"{name}.{first + x}.{u}", gu.slice_rows(i, two_i)))
        out.update(linear_tensors(layout, f"{name}.{first + x}.{d}", w2.expert(x)))
    return out


_GPT_OSS_KEEP = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantization_config(layout: str, fmt: str, excluded: list[str]) -> tuple[dict, dict[str, dict]]:
    """(config.json's ``quantization_config``, other JSON files by name) for ``layout``;
    ``excluded``: the stored names of the modules kept in high precision that a serving engine
    could take for quantized ones (linears, routers)."""
    from .. import __version__

    producer = {"name": "autofp4", "version": __version__}
    if layout == "modelopt":
        q = {"quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
             "exclude_modules": list(excluded)}
        flat = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16,
                "kv_cache_quant_algo": None, "ignore": list(excluded), "producer": producer}
        return flat, {"hf_quant_config.json": {"producer": producer, "quantization": q}}
    if layout == "compressed-tensors":
        bs = 16 if fmt == "nvfp4" else 32
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": bs,
                   "strategy": "tensor_group" if fmt == "nvfp4" else "group", "block_structure": None,
                   "dynamic": False, "actorder": None,
                   "scale_dtype": "torch.float8_e4m3fn" if fmt == "nvfp4" else "torch.uint8", "zp_dtype": None,
                   "observer": "memoryless_minmax", "observer_kwargs": {}}
        group = {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None,
                 "format": CT_FORMATS[fmt]}
        return {"quant_method": "compressed-tensors", "format": CT_FORMATS[fmt], "quantization_status": "compressed",
                "config_groups": {"group_0": group}, "ignore": list(excluded), "kv_cache_scheme": None,
                "global_compression_ratio": None, "sparsity_config": {}, "producer": producer}, {}
    return {"quant_method": "mxfp4", "modules_to_not_convert": list(_GPT_OSS_KEEP)}, {}


#: config fields that set tensor shapes, whose transformers defaults (hidden_size 4096, ...) are
#: another model's sizes
_SIZE_FIELDS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "num_hidden_layers", "vocab_size", "num_experts",
                "num_local_experts")


def unset_size_fields(root: Path, config: Any) -> str:
    """Where a shape does not match: the size fields config.json leaves out (transformers filled
    them in with its defaults), as a sentence to add to the error ("" where it sets them all)."""
    try:
        given = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(given, dict):
        return ""
    aliases = getattr(config, "attribute_map", {}) or {}  # e.g. gpt-oss: num_experts -> num_local_experts

    def set_in_file(f: str) -> bool:
        return f in given or aliases.get(f) in given or any(a in given for a, real in aliases.items() if real == f)

    unset = [f"{f} (transformers' default: {getattr(config, f)})" for f in _SIZE_FIELDS
             if not set_in_file(f) and isinstance(getattr(config, f, None), int)]
    return f" (config.json does not set {', '.join(unset)})" if unset else ""
