"""Fused MoE experts of Hugging Face transformers (5.x) models in FP4.

transformers keeps the routed experts of a MoE layer as one module with two 3-D parameters,
``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and ``down_proj [E, H, I]``, called as
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` (Qwen3-MoE, Mixtral,
DeepSeek-V3 and others built with ``transformers.integrations.use_experts_implementation``).
gpt-oss's experts (``GptOssExperts``) store them transposed, ``gate_up_proj [E, H, 2I]`` with the
gate and up columns interleaved and ``down_proj [E, I, H]``, have biases, and gate with a clamped
SwiGLU: they are brought to the layout above (biases too) and run with ``"swigluoai"``.
:func:`convert_experts` replaces each such module by :class:`FP4Experts`, which holds the FP4
weights as buffers and runs :func:`autofp4.moe`. The module is swapped rather than registered
as an ``experts_implementation``: that setting is one per model config and would keep the
high-precision parameters in the module.

Other layouts that :func:`autofp4.moe` does not compute (transposed weights, interleaved
gate/up, biases, a custom gating function, a post-expert norm, experts without a gate,
activations other than SiLU and tanh-GELU) are left as they are and reported as skipped. The
router (the ``gate`` or ``router`` of the MoE block) is never quantized. Next to converted
experts, the routers of Qwen3-MoE, Mixtral, gpt-oss and DeepSeek-V3 become :class:`FP4Router`:
the same parameters and logits (a high-precision ``F.linear``), then the scoring and top-k of
:func:`autofp4.route` (one kernel on Hopper, where transformers runs five to fifteen).

transformers itself is imported only when a model holds modules from it.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels._moe_act import SWIGLU_ALPHA, SWIGLU_LIMIT
from ..nn import ConversionReport, FP4Buffers, TensorRecord, matches_skip, register_module_converter
from ..ops import moe
from ..problem import BLOCK_SIZE
from ..weights import FP4Weight, quantize

__all__ = ["FP4Experts", "FP4Router", "convert_experts", "experts_problem"]

_ROUTER_NAMES = ("gate", "router")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class FP4Experts(FP4Buffers):
    """Routed MoE experts with FP4 weights, a drop-in for a transformers experts module.

    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` computes
    ``sum_j w[t, j] * (down_e act(gate_e x, up_e x) + b2_e)`` with :func:`autofp4.moe`. The weights
    are buffers ``gate_up_proj_{packed,scale,global_scale}`` and ``down_proj_{...}``; the optional
    biases (``gate_up_bias [E, 2I]``: gate then up, ``down_bias [E, H]``) are kept in high precision
    as the parameters ``gate_up_proj_bias`` and ``down_proj_bias``.
    """

    _fp4_stems = ("gate_up_proj", "down_proj")

    def __init__(self, gate_up: FP4Weight, down: FP4Weight, activation: str,
                 gate_up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        if not (gate_up.experts and down.experts and gate_up.experts == down.experts):
            raise ValueError(
                f"FP4Experts: gate_up and down must be stacked experts with the same E, got "
                f"{tuple(gate_up.shape)} and {tuple(down.shape)}"
            )
        e, two_i, h = gate_up.shape
        if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2) or gate_up.fmt != down.fmt:
            raise ValueError(
                f"FP4Experts: want gate_up [E, 2I, H] and down [E, H, I] in one format, got "
                f"{tuple(gate_up.shape)} {gate_up.fmt} and {tuple(down.shape)} {down.fmt}"
            )
        for name, b, shape in (("gate_up_bias", gate_up_bias, (e, two_i)), ("down_bias", down_bias, (e, h))):
            if b is not None and (tuple(b.shape) != shape or not b.is_floating_point()):
                raise ValueError(f"FP4Experts: {name} must be a float tensor {shape}, got {tuple(b.shape)} {b.dtype}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = e, h, two_i // 2
        self.fmt = gate_up.fmt
        self.activation = activation
        for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
            self.register_buffer(f"{name}_packed", w.data)
            self.register_buffer(f"{name}_scale", w.scale)
            self.register_buffer(f"{name}_global_scale", w.global_scale)
        for name, b in (("gate_up_proj_bias", gate_up_bias), ("down_proj_bias", down_bias)):
            self.register_parameter(name, None if b is None else nn.Parameter(b.detach(), requires_grad=False))
        self._w = {"gate_up_proj": gate_up, "down_proj": down}

    def fp4_weight(self, name: str) -> FP4Weight:
        """The FP4Weight ``"gate_up_proj"`` or ``"down_proj"`` over the current buffers."""
        w = self._w[name]
        data, scale = getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale")
        gs = getattr(self, f"{name}_global_scale")
        if w.data is not data or w.scale is not scale or w.global_scale is not gs:
            w = self._w[name] = FP4Weight(self.fmt, data, scale, gs, check_values=False)
        return w

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        x = hidden_states
        if x.dtype not in (torch.bfloat16, torch.float16):
            x = x.to(torch.bfloat16)
        out = moe(
            x, self.fp4_weight("gate_up_proj"), self.fp4_weight("down_proj"),
            top_k_weights, top_k_index, self.activation,
            w13_bias=self.gate_up_proj_bias, w2_bias=self.down_proj_bias, act_dtype=self.act_dtype,
        )
        return out.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        act = "" if self.act_dtype is None else f", act_dtype={self.act_dtype!r}"
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, fmt={self.fmt}, activation={self.activation}, "
                f"bias={self.down_proj_bias is not None or self.gate_up_proj_bias is not None}{act}")


#: transformers router classes whose scoring autofp4.route computes: the class name -> the scoring
#: (``"softmax"``: softmax top-k, renormalized where the router says; gpt-oss takes the softmax of
#: its top-k logits, the same weights; ``"sigmoid"``: DeepSeek-V3's grouped sigmoid) and the dtype
#: of the weights it returns (None: the logits')
_ROUTERS: dict[str, tuple[str, Optional[torch.dtype]]] = {
    "Qwen3MoeTopKRouter": ("softmax", None),
    "MixtralTopKRouter": ("softmax", torch.float32),
    "GptOssTopKRouter": ("softmax", None),
    "DeepseekV3TopkRouter": ("sigmoid", torch.float32),
}


class FP4Router(nn.Module):
    """A transformers MoE router (see ``_ROUTERS``) whose scoring and top-k run as
    :func:`autofp4.route`: ``forward(hidden_states) -> (router_logits, weights, ids)`` as the
    router returns them (ids int32, which :class:`FP4Experts` takes). It holds the router's own
    parameters under their names (``weight``, gpt-oss's ``bias``, DeepSeek-V3's
    ``e_score_correction_bias``), so the state dict does not change; the logits are the router's
    (``F.linear`` in its dtype; DeepSeek-V3's in fp32)."""

    def __init__(self, router: nn.Module) -> None:
        super().__init__()
        from ..router import RouterSpec

        name = type(router).__name__
        if name not in _ROUTERS:
            raise TypeError(f"FP4Router: {name} is not a router autofp4 scores (known: {', '.join(_ROUTERS)})")
        self.kind = name
        scoring, self.weights_dtype = _ROUTERS[name]
        self.weight = router.weight
        self.hidden_dim = router.weight.shape[1]
        experts = router.weight.shape[0]
        self.register_parameter("bias", router.bias if name == "GptOssTopKRouter" else None)
        if scoring == "sigmoid":
            self.register_buffer("e_score_correction_bias", router.e_score_correction_bias)
            self.spec = RouterSpec.checked(experts, router.top_k, "sigmoid", bool(router.norm_topk_prob),
                                           router.num_group, router.topk_group, float(router.routed_scaling_factor))
        else:
            renorm = bool(getattr(router, "norm_topk_prob", True))
            self.spec = RouterSpec.checked(experts, router.top_k, "softmax", renorm)

    def forward(self, hidden_states: torch.Tensor):
        from ..router import route

        h = hidden_states.reshape(-1, self.hidden_dim)
        if self.spec.scoring == "sigmoid":
            logits = F.linear(h.float(), self.weight.float())
            w, ids, _ = route(logits, self.spec, self.e_score_correction_bias)
        else:
            logits = F.linear(h, self.weight, self.bias)
            w, ids, _ = route(logits, self.spec)
        return logits, w.to(self.weights_dtype or logits.dtype), ids

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.spec}"


def _is_transformers_experts(module: nn.Module) -> bool:
    if not type(module).__module__.startswith("transformers."):
        return False
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3


def _is_gpt_oss(module: nn.Module) -> bool:
    """gpt-oss's experts, with their own clamped SwiGLU gate."""
    if type(module).__module__ != "transformers.models.gpt_oss.modeling_gpt_oss":
        return False
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    return isinstance(module, GptOssExperts) and type(module)._apply_gate is GptOssExperts._apply_gate


def _activation(module: nn.Module) -> Optional[str]:
    from transformers import activations as acts

    if _is_gpt_oss(module):
        return "swigluoai"
    act = getattr(module, "act_fn", None)
    if isinstance(act, (acts.SiLUActivation, nn.SiLU)):
        return "silu"
    if isinstance(act, (acts.GELUTanh, acts.NewGELUActivation)):
        return "gelu"
    return None


def _layout_problem(module: nn.Module) -> Optional[str]:
    """Why ``module``'s experts layout is not the one :func:`autofp4.moe` computes (None if it is)."""
    from transformers.integrations import moe as hf_moe

    if not hasattr(module, "has_gate"):
        return "not built with transformers' use_experts_implementation: unknown experts layout"
    why = []
    if _is_gpt_oss(module):
        if (module.alpha, module.limit) != (SWIGLU_ALPHA, SWIGLU_LIMIT):
            why.append(f"gpt-oss's SwiGLU with alpha={module.alpha}, limit={module.limit} (autofp4.moe's "
                       f"swigluoai has alpha={SWIGLU_ALPHA}, limit={SWIGLU_LIMIT})")
    else:
        if getattr(module, "is_transposed", False):
            why.append("transposed weights ([E, H, 2I] / [E, I, H])")
        if not getattr(module, "is_concatenated", True):
            why.append("interleaved gate/up rows")
        if getattr(module, "has_bias", False) or getattr(module, "gate_up_proj_bias", None) is not None:
            why.append("biases")
        if getattr(type(module), "_apply_gate", hf_moe._default_apply_gate) is not hf_moe._default_apply_gate:
            why.append(f"a custom gating function ({type(module).__name__}._apply_gate)")
    if not module.has_gate:
        why.append("no gate projection")
    if getattr(module, "has_post_expert_norm", False):
        why.append("a post-expert norm")
    if getattr(module, "_is_expert_parallel", False):
        why.append("expert parallelism (sharded experts)")
    if why:
        return "experts layout not supported by autofp4.moe: " + ", ".join(why)
    return None


def _experts_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up_proj`` and ``down_proj`` as ``[E, 2I, H]`` and ``[E, H, I]`` (views; gpt-oss's gate
    and up rows still interleaved)."""
    gu, dn = module.gate_up_proj, module.down_proj
    return (gu.transpose(1, 2), dn.transpose(1, 2)) if _is_gpt_oss(module) else (gu, dn)


def _experts_biases(module: nn.Module) -> tuple[torch.Tensor, ...]:
    """gpt-oss's ``(gate_up_proj_bias [E, 2I] (interleaved), down_proj_bias [E, H])``; ``()`` for the others."""
    return (module.gate_up_proj_bias, module.down_proj_bias) if _is_gpt_oss(module) else ()


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate/up rows ``g0, u0, g1, u1, ...`` along dim 1 -> ``g0, g1, ..., u0, u1, ...``."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def _fp4_experts(module: nn.Module, fmt: str) -> tuple[FP4Experts, tuple[FP4Weight, FP4Weight]]:
    """``module``'s experts quantized to ``fmt`` in autofp4's layout, biases carried."""
    gu, dn = (t.detach() for t in _experts_weights(module))
    b13 = b2 = None
    if _is_gpt_oss(module):
        b13, b2 = (t.detach() for t in _experts_biases(module))
        gu, b13, b2 = _deinterleave(gu), _deinterleave(b13), b2.clone()
    with torch.no_grad():
        w13, w2 = quantize(gu.contiguous(), fmt), quantize(dn.contiguous(), fmt)
    return FP4Experts(w13, w2, _activation(module), b13, b2), (w13, w2)


def experts_problem(module: nn.Module, fmt: str) -> Optional[str]:
    """Why ``module`` (a transformers experts module) cannot be converted to ``fmt``; None if it can."""
    why = _layout_problem(module)
    if why:
        return why
    gu, dn = _experts_weights(module)
    biases = _experts_biases(module)
    e, two_i, h = gu.shape
    if two_i % 2 or tuple(dn.shape) != (e, h, two_i // 2):
        return (f"shapes gate_up_proj {tuple(module.gate_up_proj.shape)} / down_proj {tuple(module.down_proj.shape)} "
                f"are not [E, 2I, H] / [E, H, I]{' transposed' if biases else ''}")
    if biases and [tuple(b.shape) for b in biases] != [(e, two_i), (e, h)]:
        return f"bias shapes {[tuple(b.shape) for b in biases]} are not [E, 2I] and [E, H]"
    if _activation(module) is None:
        return f"activation {type(getattr(module, 'act_fn', None)).__name__} is not SiLU or tanh-GELU"
    if any(t.is_meta for t in (gu, dn, *biases)):
        return "weights are on the meta device"
    for t in (gu, dn, *biases):
        if t.dtype not in _DTYPES:
            return f"weight dtype {t.dtype} is not bf16/fp16/fp32"
    bs = BLOCK_SIZE[fmt]
    if h % bs or (two_i // 2) % bs:
        return f"hidden {h} and intermediate {two_i // 2} must be multiples of {fmt}'s block size {bs}"
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _fp4_bytes(w: FP4Weight) -> int:
    return sum(_nbytes(t) for t in (w.data, w.scale, w.global_scale) if t is not None)


def _routers(model: nn.Module, parent_name: str) -> dict[str, str]:
    """The Linear routers next to an experts module (``<block>.gate``), kept in high precision."""
    parent = model.get_submodule(parent_name) if parent_name else model
    out = {}
    for child in _ROUTER_NAMES:
        m = getattr(parent, child, None)
        if isinstance(m, nn.Linear):
            out[f"{parent_name}.{child}" if parent_name else child] = "MoE router stays in high precision"
    return out


def convert_experts(model: nn.Module, fmt: str, patterns: list[str], report: ConversionReport) -> Mapping[str, str]:
    """Replace the transformers experts modules of ``model`` by :class:`FP4Experts` in place, recording
    each expert tensor in ``report``; returns the router Linear names to leave unquantized."""
    found = [(n, m) for n, m in model.named_modules() if _is_transformers_experts(m)]
    keep: dict[str, str] = {}
    for name, mod in found:
        pnames = [f"{name}.{p}" if name else p for p in ("gate_up_proj", "down_proj")]
        params = (mod.gate_up_proj, mod.down_proj)
        parent_name, _, child = name.rpartition(".")
        keep.update(_routers(model, parent_name))
        hit = [p for p in pnames if matches_skip(p, patterns)]
        if matches_skip(name, patterns) or not hit:
            whys = ["matches a skip pattern" if matches_skip(name, patterns) else experts_problem(mod, fmt)] * 2
        else:  # one stacked tensor named: the experts are kept whole
            whys = ["matches a skip pattern" if p in hit else f"kept with {hit[0].rpartition('.')[2]} (the experts "
                    "are quantized or kept whole)" for p in pnames]
        if whys[0]:
            for pn, t, why in zip(pnames, params, whys):
                report.add(TensorRecord(pn, "experts", tuple(t.shape), False, _nbytes(t), _nbytes(t), why))
            continue
        new, fp4 = _fp4_experts(mod, fmt)
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        for rname in _ROUTER_NAMES:  # the block's router: its scoring in one kernel
            r = getattr(parent, rname, None)
            full = f"{parent_name}.{rname}" if parent_name else rname
            if type(r).__name__ in _ROUTERS and not matches_skip(full, patterns):
                setattr(parent, rname, FP4Router(r))
        for pn, t, w in zip(pnames, params, fp4):
            report.add(TensorRecord(pn, "experts", tuple(t.shape), True, _nbytes(t), _fp4_bytes(w)))
    return keep


register_module_converter(convert_experts)
