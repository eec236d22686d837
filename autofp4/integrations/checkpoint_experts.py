"""The routed experts of a MoE checkpoint -> :class:`~autofp4.integrations.transformers.FP4Experts`.

Used by :func:`autofp4.from_pretrained`. transformers (5.x) holds each MoE layer's routed experts as
one module (``<block>.experts``) with stacked parameters; checkpoints store them in one of these
layouts, read straight into the stacked FP4 buffers (no high-precision copy is made):

ModelOpt NVFP4 / compressed-tensors NVFP4 or MXFP4, one linear per expert and projection:
    ``<block>.experts.<e>.{gate_proj,up_proj,down_proj}.<tensors>`` (Qwen3-MoE, DeepSeek-V3) or
    ``<block>.experts.<e>.{w1,w3,w2}.<tensors>`` (Mixtral; its blocks are stored as
    ``block_sparse_moe``), with the tensors of one NVFP4 linear of the format (see
    :mod:`autofp4.integrations.checkpoints`). Each expert's gate and up become the rows of its
    ``gate_up_proj`` (gate first) with one global scale, the larger of the two:
    :func:`autofp4.loaders.fuse_modelopt` re-rounds the block scales of the projection with the
    smaller one (within half an E4M3 step, 2**-4 relative, while the rescaled scale stays >= 2**-6).
    The experts' ``input_scale`` / ``input_global_scale`` are read but not kept: ``autofp4.moe``
    computes in bf16 activations.

gpt-oss MXFP4 (``quant_method: mxfp4``), per projection, stacked:
    ``<block>.experts.gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16], ``..._scales`` uint8 E8M0
    [E, 2I, H/32], ``gate_up_proj_bias`` [E, 2I] with gate and up rows interleaved
    (``g0, u0, g1, u1, ...``), and ``down_proj_{blocks,scales,bias}`` [E, H, I/32, 16] / [E, H, I/32]
    / [E, H]. The rows are reordered gate first (a copy of the FP4 bytes) and run with
    ``"swigluoai"``.

Experts that the checkpoint's exclusions cover are loaded dense, stacked into the module's own
parameters.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn

from ..loaders import fuse_modelopt, load_state_dict_weight
from ..problem import BLOCK_SIZE
from ..weights import FP4Weight
from .transformers import (
    FP4Experts, _activation, _deinterleave, _is_gpt_oss, _is_transformers_experts, _layout_problem,
)

_Tensors = _Scheme = Any  # autofp4.integrations.checkpoints's stored tensors and quantization scheme

_WHAT = "autofp4.from_pretrained"


class Readers(NamedTuple):
    fp4_weight: Callable[..., FP4Weight]
    dense: Callable[..., torch.Tensor]


# per-expert projection names: (gate, up, down)
_PROJ_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The transformers routed-experts modules of ``model`` by name."""
    return [(n, m) for n, m in model.named_modules() if _is_transformers_experts(m)]


def _proj_names(t: "_Tensors", scheme: "_Scheme", name: str) -> Optional[tuple[str, str, str]]:
    """The per-expert projection names stored under ``name`` (None if there are none)."""
    for names in _PROJ_NAMES:
        if any(f"{name}.0.{p}.{s}" in t for p in names for s in ("weight", "weight_packed")):
            return names
    return None


def _check(w: FP4Weight, want: tuple[int, ...], label: str) -> FP4Weight:
    if tuple(w.shape) != want:
        raise ValueError(
            f"{_WHAT}: {label} is stored as FP4 of shape {tuple(w.shape)} but the model's config wants {want}; "
            "checkpoint and config.json do not match"
        )
    return w


def _stack(ws: list[FP4Weight]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.stack([w.data for w in ws]), torch.stack([w.scale for w in ws]),
            torch.stack([w.global_scale.reshape(()) for w in ws]))


def _per_expert_experts(read: "Readers", t: "_Tensors", scheme: "_Scheme", name: str, names: tuple[str, str, str],
                   e: int, two_i: int, h: int) -> tuple[FP4Weight, FP4Weight]:
    i = two_i // 2
    per = [[_check(read.fp4_weight(t, scheme, f"{name}.{x}.{p}"), shape, f"{name}.{x}.{p}") for x in range(e)]
           for p, shape in zip(names, ((i, h), (i, h), (h, i)))]
    for p, ws in zip(names, per):  # the activations' scales: read, not kept
        for x in range(e):
            for k in ("input_scale", "input_global_scale"):
                if f"{name}.{x}.{p}.{k}" in t:
                    t.used.add(f"{name}.{x}.{p}.{k}")
    if scheme.fmt == "mxfp4":  # compressed-tensors MXFP4: no global scales to reconcile
        gate, up, down = ([torch.stack([getattr(w, f) for w in ws]) for f in ("data", "scale")] for ws in per)
        w13 = FP4Weight("mxfp4", torch.cat((gate[0], up[0]), 1), torch.cat((gate[1], up[1]), 1), check_values=False)
        return w13, FP4Weight("mxfp4", down[0], down[1], check_values=False)
    w13 = fuse_modelopt([_stack(per[0]), _stack(per[1])])
    d, s, g = _stack(per[2])
    w2 = FP4Weight("nvfp4", d, s, g, check_values=False)
    return w13, w2


def _mxfp4_experts(read: "Readers", t: "_Tensors", name: str, e: int, two_i: int, h: int,
                   dtype: torch.dtype) -> tuple[FP4Weight, FP4Weight, torch.Tensor, torch.Tensor]:
    gu = _check(load_state_dict_weight(t, f"{name}.gate_up_proj"), (e, two_i, h), f"{name}.gate_up_proj_blocks")
    dn = _check(load_state_dict_weight(t, f"{name}.down_proj"), (e, h, two_i // 2), f"{name}.down_proj_blocks")
    b13 = read.dense(t, f"{name}.gate_up_proj_bias", (e, two_i), dtype)
    b2 = read.dense(t, f"{name}.down_proj_bias", (e, h), dtype)
    w13 = FP4Weight("mxfp4", _deinterleave(gu.data).contiguous(), _deinterleave(gu.scale).contiguous(),
                    check_values=False)
    return w13, dn, _deinterleave(b13).contiguous(), b2


def _dense_experts(read: "Readers", t: "_Tensors", name: str, module: nn.Module, names: Optional[tuple[str, str, str]],
                   dtype: torch.dtype) -> None:
    """Excluded experts stored dense: per expert (stacked here) or already stacked (gpt-oss)."""
    if names is None:
        return  # stored under the module's own parameter names: filled with the other dense tensors
    e, two_i, h = module.gate_up_proj.shape
    i = two_i // 2
    g, u, d = ([read.dense(t, f"{name}.{x}.{p}.weight", shape, dtype) for x in range(e)]
               for p, shape in zip(names, ((i, h), (i, h), (h, i))))
    module.gate_up_proj = nn.Parameter(torch.cat((torch.stack(g), torch.stack(u)), dim=1), requires_grad=False)
    module.down_proj = nn.Parameter(torch.stack(d), requires_grad=False)


#: the config fields of a MoE layer's number of routed experts
_EXPERTS_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


def _check_no_more_experts(model: nn.Module, t: "_Tensors", scheme: "_Scheme", name: str,
                           names: Optional[tuple[str, str, str]], e: int) -> None:
    """A checkpoint that stores one linear per expert holds no expert ``e`` (or beyond) of a
    layer whose config says ``e`` experts (stacked layouts have their shape checked)."""
    if names is None:
        return
    extra = f"{name}.{e}.{names[0]}"
    key = next((k for k in (scheme.packed_key(extra), f"{extra}.weight", f"{extra}.weight_packed") if k in t), None)
    if key is not None:
        config = getattr(model, "config", None)
        field = next((f for f in _EXPERTS_FIELDS if getattr(config, f, None) == e), "its experts count")
        raise ValueError(f"{_WHAT}: {name!r}: the checkpoint stores expert {e} ({key!r}) but config.json gives the "
                         f"layer {e} experts ({field} = {e}); checkpoint and config.json do not match")


def load_experts(model: nn.Module, t: "_Tensors", scheme: "_Scheme", dtype: torch.dtype, read: "Readers") -> list[str]:
    """Replace each experts module of ``model`` stored in FP4 by an FP4Experts over the stored
    tensors; returns the names of the experts modules that are not excluded but stored dense.
    ``read``: the checkpoint reader's ``fp4_weight(t, scheme, name)`` and ``dense(t, key, shape, dtype)``."""
    dense = []
    for name, module in experts_modules(model):
        gpt_oss = _is_gpt_oss(module)
        e = module.gate_up_proj.shape[0]
        two_i, h = module.gate_up_proj.shape[1:] if not gpt_oss else module.gate_up_proj.shape[:0:-1]
        names = None if scheme.method == "mxfp4" else _proj_names(t, scheme, name)
        stored_fp4 = (f"{name}.gate_up_proj_blocks" in t) if scheme.method == "mxfp4" else (
            names is not None and scheme.packed_key(f"{name}.0.{names[0]}") in t)
        cls = "Linear" if names is not None else type(module).__name__
        excluded = scheme.excluded(name, type(module).__name__) or (
            names is not None and scheme.excluded(f"{name}.0.{names[0]}", cls))
        if excluded or not stored_fp4:
            if stored_fp4:
                raise ValueError(f"{_WHAT}: the experts {name!r} are excluded by {scheme.source} but stored quantized")
            _dense_experts(read, t, name, module, names, dtype)
            if not excluded:
                dense.append(name)
            continue
        if names is not None and not (scheme.targeted(name, type(module).__name__)
                                      or scheme.targeted(f"{name}.0.{names[0]}", cls)):
            first = f"{name}.0.{names[0]}"
            scheme.check_stored_quantized(first, cls, scheme.packed_key(first), what=f"the experts {name!r}")
        _check_no_more_experts(model, t, scheme, name, names, e)
        why = _layout_problem(module)
        if why:
            raise NotImplementedError(f"{_WHAT}: {name!r} ({type(module).__name__}): {why}")
        fmt = scheme.fmt
        if h % BLOCK_SIZE[fmt] or (two_i // 2) % BLOCK_SIZE[fmt]:
            raise ValueError(f"{_WHAT}: {name!r}: hidden {h} and intermediate {two_i // 2} must be multiples of "
                             f"{fmt}'s block size {BLOCK_SIZE[fmt]}")
        if scheme.method == "mxfp4":
            w13, w2, b13, b2 = _mxfp4_experts(read, t, name, e, two_i, h, dtype)
        else:
            (w13, w2), b13, b2 = _per_expert_experts(read, t, scheme, name, names, e, two_i, h), None, None
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FP4Experts(w13, w2, _activation(module), b13, b2))
    return dense
