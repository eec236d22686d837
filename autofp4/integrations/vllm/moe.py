"""vLLM fused-MoE methods that run :func:`autofp4.moe` (custom op ``autofp4::moe``).

vLLM's routed experts (``RoutedExperts``) hold ``w13`` [E, 2I, H] (gate rows, then up) and
``w2`` [E, H, I] for this rank's E experts (expert parallelism: ``layer.expert_map`` maps the
global ids to them, which :func:`autofp4.moe` takes as it is); vLLM's runner does the routing,
the shared experts and the reductions across ranks around :meth:`apply`.

:class:`AutoFP4ModelOptMoEMethod` loads ModelOpt NVFP4 experts: ``w13_weight_scale_2`` [E, 2]
(gate and up each have a global scale; where they differ the experts' up or gate block scales
are re-rounded to the larger by :func:`autofp4.loaders.fuse_modelopt`), ``w2_weight_scale_2``
[E], and the W4A4 input scales, which are kept on the weights (``FP4Weight.input_scale``: the
larger of gate's and up's for w13). Its name says ``ModelOpt`` because vLLM's expert weight
loader loads ModelOpt's per-expert scales for methods so named.

:class:`AutoFP4OnlineMoEMethod` loads the experts in the model's dtype and quantizes each stack
with one vectorized :func:`autofp4.quantize` call (no loop over experts).

The activations :func:`autofp4.moe` computes: SiLU, tanh-GELU and gpt-oss's clamped SwiGLU
(``swigluoai``, whose interleaved gate/up rows are de-interleaved after loading, and
``swigluoai_uninterleave`` with gpt-oss's constants). Others raise ValueError when the layer is
built.
"""
from __future__ import annotations

from typing import Optional

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, FusedMoeWeightScaleSupported

from ...kernels._moe_act import SWIGLU_ALPHA, SWIGLU_LIMIT
from ...loaders import from_modelopt, fuse_modelopt
from ...ops import moe
from ...w4a8 import check_act_dtype
from ...weights import quantize
from ._layer import add_param, check_divisible, check_loaded, fp4_weight, free_loaded, install, tensors, warm_up

__all__ = ["AutoFP4ModelOptMoEMethod", "AutoFP4OnlineMoEMethod", "moe_activation"]

_W = ("w13_", "w2_")


def moe_activation(moe_config, prefix: str = "") -> tuple[str, bool]:
    """``(autofp4 activation, w13 rows interleaved)`` for a vLLM ``FusedMoEConfig``."""
    name = moe_config.activation.value
    if name == "silu":
        return "silu", False
    if name == "gelu_tanh":
        return "gelu", False
    if name == "swigluoai":  # vLLM's fixed gpt-oss constants, gate/up rows interleaved
        return "swigluoai", True
    if name == "swigluoai_uninterleave":
        got = (moe_config.swiglu_limit, moe_config.swiglu_alpha, moe_config.swiglu_beta)
        if got == (SWIGLU_LIMIT, SWIGLU_ALPHA, 1.0):
            return "swigluoai", False
        raise ValueError(
            f"autofp4: {prefix or 'a MoE layer'} uses swigluoai_uninterleave with (limit, alpha, beta) = {got}; "
            f"autofp4.moe computes only gpt-oss's ({SWIGLU_LIMIT}, {SWIGLU_ALPHA}, 1.0)"
        )
    raise ValueError(
        f"autofp4: {prefix or 'a MoE layer'} uses the MoE activation {name!r}; autofp4.moe computes silu, "
        "gelu_tanh and gpt-oss's swigluoai. Serve this model without --quantization autofp4"
    )


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Rows ``[g0, u0, g1, u1, ...]`` along dim 1 -> ``[g0, g1, ..., u0, u1, ...]``."""
    e, two_i = t.shape[:2]
    return t.reshape(e, two_i // 2, 2, *t.shape[2:]).transpose(1, 2).reshape(t.shape).contiguous()


class _FP4MoEMethod(FusedMoEMethodBase):
    def __init__(self, quant_config, moe_config, prefix: str = "") -> None:
        super().__init__(moe_config)
        self.quant_config = quant_config
        self.prefix = prefix
        self.activation, self.interleaved = moe_activation(moe_config, prefix)

    def _add_biases(self, layer, e: int, two_i: int, h: int, dtype: torch.dtype, attrs: dict) -> None:
        if self.moe.has_bias:
            add_param(layer, "w13_bias", torch.nn.Parameter(torch.zeros(e, two_i, dtype=dtype), requires_grad=False), attrs)
            add_param(layer, "w2_bias", torch.nn.Parameter(torch.zeros(e, h, dtype=dtype), requires_grad=False), attrs)

    def _finish(self, layer, w13, w2, release: list[str]) -> None:
        if self.interleaved and getattr(layer, "w13_bias", None) is not None:
            layer.w13_bias.data = _deinterleave(layer.w13_bias.data)
        install(layer, "w13_", w13, release)
        install(layer, "w2_", w2, [])
        layer.autofp4_act = self.quant_config.act
        dtype = warm_up(w13.device, lambda t, dt: self._run_random(layer, t, dt))
        free_loaded(layer, {"w13_": True, "w2_": False}, dtype, self.quant_config.keep_loaded, self.prefix)

    def _run_random(self, layer, t: int, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`apply` on ``t`` random tokens routed to ``top_k`` distinct random experts of
        all ranks' (under expert parallelism some are other ranks', as in real traffic)."""
        dev = layer.autofp4_w13_packed.device
        emap = layer.expert_map
        e = emap.numel() if emap is not None else layer.autofp4_w13_packed.shape[0]
        k = self.moe.experts_per_token
        ids = torch.rand(t, e, device=dev).topk(k, dim=1).indices.to(torch.int32)
        weights = torch.rand(t, k, device=dev).softmax(dim=1)
        x = torch.randn(t, layer.autofp4_w13_packed.shape[-1] * 2, dtype=dtype, device=dev)
        return self.apply(layer, x, weights, ids)

    def get_fused_moe_quant_config(self, layer):
        return None  # autofp4.moe reads the weights off the layer; no vLLM kernel to configure

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input: Optional[torch.Tensor] = None) -> torch.Tensor:
        if layer.apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError(
                    f"autofp4: apply_router_weight_on_input needs top_k = 1, got top_k = {topk_ids.shape[1]}"
                )
            x = x * topk_weights.to(x.dtype)
            topk_weights = torch.ones_like(topk_weights)
        b13, b2 = getattr(layer, "w13_bias", None), getattr(layer, "w2_bias", None)
        expert_map = layer.expert_map
        act = getattr(layer, "autofp4_act", None)
        if torch.compiler.is_compiling():
            d13, s13, g13 = tensors(layer, "w13_")
            d2, s2, g2 = tensors(layer, "w2_")
            if act is not None:
                return torch.ops.autofp4.moe_fp8(x, d13, s13, g13, d2, s2, g2, topk_weights, topk_ids,
                                                 layer.autofp4_fmt, self.activation, expert_map, b13, b2,
                                                 check_act_dtype(act, "autofp4"))
            return torch.ops.autofp4.moe(x, d13, s13, g13, d2, s2, g2, topk_weights, topk_ids, layer.autofp4_fmt,
                                         self.activation, expert_map, b13, b2)
        return moe(x, fp4_weight(layer, "w13_"), fp4_weight(layer, "w2_"), topk_weights, topk_ids,
                   self.activation, expert_map, w13_bias=b13, w2_bias=b2, act_dtype=act)


class AutoFP4ModelOptMoEMethod(_FP4MoEMethod):
    """ModelOpt NVFP4 routed experts run by :func:`autofp4.moe` (W4A16)."""

    def __init__(self, quant_config, moe_config, prefix: str = "") -> None:
        super().__init__(quant_config, moe_config, prefix)
        self.w4a4 = quant_config.checkpoint.quant_method == "NVFP4"

    def uses_weight_scale_2_pattern(self) -> bool:
        return True  # the experts' per-tensor scales are ModelOpt's weight_scale_2

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        check_divisible(h, "nvfp4", "the hidden size", self.prefix)
        check_divisible(i, "nvfp4", "the intermediate size per partition", self.prefix)
        attrs = {"weight_loader": extra_weight_attrs["weight_loader"]}
        block = dict(attrs, quant_method=FusedMoeWeightScaleSupported.BLOCK.value)
        tensor = dict(attrs, quant_method=FusedMoeWeightScaleSupported.TENSOR.value)
        nan = float("nan")

        def param(shape, dtype):
            return torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)

        add_param(layer, "w13_weight", param((e, 2 * i, h // 2), torch.uint8), attrs)
        add_param(layer, "w2_weight", param((e, h, i // 2), torch.uint8), attrs)
        add_param(layer, "w13_weight_scale", param((e, 2 * i, h // 16), torch.float8_e4m3fn), block, nan, 1.0)
        add_param(layer, "w2_weight_scale", param((e, h, i // 16), torch.float8_e4m3fn), block, nan, 1.0)
        add_param(layer, "w13_weight_scale_2", param((e, 2), torch.float32), tensor, nan, 1e-3)
        add_param(layer, "w2_weight_scale_2", param((e,), torch.float32), tensor, nan, 1e-3)
        # the loader expects the input scales whether or not they are used (W4A16 checkpoints have none)
        add_param(layer, "w13_input_scale", param((e, 2), torch.float32), tensor, nan, 1e-2)
        add_param(layer, "w2_input_scale", param((e,), torch.float32), tensor, nan, 1e-2)
        self._add_biases(layer, e, 2 * i, h, params_dtype, attrs)

    def process_weights_after_loading(self, layer) -> None:
        scales = ["w13_weight_scale", "w2_weight_scale", "w13_weight_scale_2", "w2_weight_scale_2"]
        check_loaded(layer, scales + (["w13_input_scale", "w2_input_scale"] if self.w4a4 else []), self.prefix)
        w13, s13, g13 = layer.w13_weight.data, layer.w13_weight_scale.data, layer.w13_weight_scale_2.data
        if self.interleaved:
            if not bool((g13[:, 0] == g13[:, 1]).all()):
                raise ValueError(
                    f"autofp4: {self.prefix or 'a MoE layer'} has interleaved gate/up rows (swigluoai) with "
                    "different gate and up global scales, which autofp4 cannot fold"
                )
            w13, s13 = _deinterleave(w13), _deinterleave(s13)
        in13 = layer.w13_input_scale.data.amax(dim=1) if self.w4a4 else None
        in2 = layer.w2_input_scale.data if self.w4a4 else None
        if bool((g13[:, 0] == g13[:, 1]).all()):
            q13 = from_modelopt(w13, s13, g13[:, 0].contiguous(), in13)  # no copy
        else:
            i = w13.shape[1] // 2
            q13 = fuse_modelopt([(w13[:, :i], s13[:, :i], g13[:, 0]), (w13[:, i:], s13[:, i:], g13[:, 1])], in13)
        q2 = from_modelopt(layer.w2_weight.data, layer.w2_weight_scale.data, layer.w2_weight_scale_2.data, in2)
        self._finish(layer, q13, q2, ["w13_weight", "w2_weight"] + scales + ["w13_input_scale", "w2_input_scale"])


class AutoFP4OnlineMoEMethod(_FP4MoEMethod):
    """Routed experts loaded in high precision and quantized to MXFP4 or NVFP4 after loading."""

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        fmt = self.quant_config.fmt
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        check_divisible(h, fmt, "the hidden size", self.prefix)
        check_divisible(i, fmt, "the intermediate size per partition", self.prefix)
        attrs = {"weight_loader": extra_weight_attrs["weight_loader"]}
        for name, shape in (("w13_weight", (e, 2 * i, h)), ("w2_weight", (e, h, i))):
            add_param(layer, name, torch.nn.Parameter(torch.empty(shape, dtype=params_dtype), requires_grad=False), attrs)
        self._add_biases(layer, e, 2 * i, h, params_dtype, attrs)

    def process_weights_after_loading(self, layer) -> None:
        fmt = self.quant_config.fmt
        w13 = layer.w13_weight.data
        if self.interleaved:
            w13 = _deinterleave(w13)
        self._finish(layer, quantize(w13, fmt), quantize(layer.w2_weight.data, fmt), ["w13_weight", "w2_weight"])
