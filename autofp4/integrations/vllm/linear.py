"""vLLM linear methods that run :func:`autofp4.linear` (custom op ``autofp4::linear``).

:class:`AutoFP4ModelOptLinearMethod` loads a ModelOpt NVFP4 layer (``weight`` uint8 [N, K/2],
``weight_scale`` E4M3 [N, K/16], ``weight_scale_2`` one fp32 per fused part, ``input_scale``
for W4A4 checkpoints); the parts of a merged layer (q/k/v, gate/up) that carry different
``weight_scale_2`` are brought to their largest one by :func:`autofp4.loaders.fuse_modelopt`,
which re-rounds the other parts' block scales (its docstring gives the error bound). W4A4
checkpoints run W4A16: the activations stay bf16/fp16 and ``input_scale`` (the largest of the
parts') is kept on the weight as ``FP4Weight.input_scale``.

:class:`AutoFP4OnlineLinearMethod` loads the weight in the model's dtype and quantizes it with
:func:`autofp4.quantize` after loading; :class:`AutoFP4LMHeadMethod` does the same for an
``lm_head`` when asked (``AUTOFP4_VLLM_LM_HEAD=1``), and vLLM's logits processor calls it.

Both keep per-rank shapes: under tensor parallelism each rank's FP4Weight is its own shard
``[N/tp, K]`` or ``[N, K/tp]``, and the dispatcher picks kernels for those shapes.
"""
from __future__ import annotations

from typing import Optional

import torch
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
from vllm.model_executor.parameter import ModelWeightParameter, PerTensorScaleParameter

from ...loaders import from_modelopt, fuse_modelopt
from ...ops import linear
from ...w4a8 import check_act_dtype
from ...weights import quantize
from ._layer import add_param, check_divisible, check_loaded, fp4_weight, free_loaded, install, tensors, warm_up

__all__ = ["AutoFP4LMHeadMethod", "AutoFP4ModelOptLinearMethod", "AutoFP4OnlineLinearMethod", "run_linear"]


def run_linear(layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x @ W^T + bias`` with the layer's FP4 weight (FP8 activations where the config asks:
    ``layer.autofp4_act``)."""
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    act = getattr(layer, "autofp4_act", None)
    if torch.compiler.is_compiling():
        data, scale, gs = tensors(layer, "")
        if act is not None:
            return torch.ops.autofp4.linear_fp8(x, data, scale, gs, bias, layer.autofp4_fmt,
                                                check_act_dtype(act, "autofp4"))
        return torch.ops.autofp4.linear(x, data, scale, gs, bias, layer.autofp4_fmt)
    if act is not None:
        return linear(x, fp4_weight(layer, ""), bias, act_dtype=act)
    return linear(x, fp4_weight(layer, ""), bias)


class _FP4LinearMethod(LinearMethodBase):
    def __init__(self, quant_config) -> None:
        super().__init__()
        self.quant_config = quant_config

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return run_linear(layer, x, bias)

    def _install(self, layer: torch.nn.Module, w, release: list[str]) -> None:
        """``w`` installed as the layer's weight, run once for each CUDA graph size, and its loaded
        bytes freed once both kernels' layouts are built."""
        install(layer, "", w, release)
        layer.autofp4_act = self.quant_config.act
        bias = getattr(layer, "bias", None)
        dtype = warm_up(w.device, lambda m, dt: run_linear(layer, torch.randn(m, w.k, dtype=dt, device=w.device), bias))
        free_loaded(layer, {"": None}, dtype, self.quant_config.keep_loaded, getattr(layer, "prefix", ""))


@register_weight_loader_v2_supported_method
class AutoFP4ModelOptLinearMethod(_FP4LinearMethod):
    """A ModelOpt NVFP4 linear layer run by :func:`autofp4.linear` (W4A16)."""

    def __init__(self, quant_config) -> None:
        super().__init__(quant_config)
        self.w4a4 = quant_config.checkpoint.quant_method == "NVFP4"

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        k, n, parts = input_size_per_partition, sum(output_partition_sizes), len(output_partition_sizes)
        check_divisible(k, "nvfp4", "the input size per partition", getattr(layer, "prefix", ""))
        wl = extra_weight_attrs["weight_loader"]
        layer.logical_widths = list(output_partition_sizes)
        add_param(layer, "weight", ModelWeightParameter(
            data=torch.empty(n, k // 2, dtype=torch.uint8), input_dim=1, output_dim=0, weight_loader=wl))
        add_param(layer, "weight_scale", ModelWeightParameter(
            data=torch.empty(n, k // 16, dtype=torch.float8_e4m3fn), input_dim=1, output_dim=0, weight_loader=wl),
            fill=float("nan"), dummy=1.0)
        add_param(layer, "weight_scale_2", PerTensorScaleParameter(
            data=torch.empty(parts, dtype=torch.float32), weight_loader=wl), fill=float("nan"), dummy=1e-3)
        if self.w4a4:
            add_param(layer, "input_scale", PerTensorScaleParameter(
                data=torch.empty(parts, dtype=torch.float32), weight_loader=wl), fill=float("nan"), dummy=1e-2)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        prefix = getattr(layer, "prefix", "")
        names = ["weight_scale", "weight_scale_2"] + (["input_scale"] if self.w4a4 else [])
        check_loaded(layer, names, prefix)
        weight, scale, s2 = layer.weight.data, layer.weight_scale.data, layer.weight_scale_2.data
        ins = layer.input_scale.data.max() if self.w4a4 else None
        if bool((s2 == s2[0]).all()):
            w = from_modelopt(weight, scale, s2[0], ins)  # no copy
        else:
            bounds, start = [], 0
            for width in layer.logical_widths:
                bounds.append((start, start + width))
                start += width
            w = fuse_modelopt([(weight[a:b], scale[a:b], s2[i]) for i, (a, b) in enumerate(bounds)], ins)
        self._install(layer, w, ["weight", "weight_scale", "weight_scale_2", "input_scale"])


@register_weight_loader_v2_supported_method
class AutoFP4OnlineLinearMethod(_FP4LinearMethod):
    """A linear layer loaded in high precision and quantized to MXFP4 or NVFP4 after loading."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        fmt = self.quant_config.fmt
        check_divisible(input_size_per_partition, fmt, "the input size per partition", getattr(layer, "prefix", ""))
        attrs = dict(extra_weight_attrs)
        wl = attrs.pop("weight_loader")
        layer.logical_widths = list(output_partition_sizes)
        add_param(layer, "weight", ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            input_dim=1, output_dim=0, weight_loader=wl), attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._install(layer, quantize(layer.weight.data, self.quant_config.fmt), ["weight"])


class AutoFP4LMHeadMethod(AutoFP4OnlineLinearMethod):
    """An ``lm_head`` (vLLM's ``ParallelLMHead``, each rank's vocabulary shard, padded rows
    zero) loaded in the model's dtype and quantized after loading to the config's format; vLLM's
    logits processor calls :meth:`apply`. Opt-in (``AUTOFP4_VLLM_LM_HEAD=1``), since it changes
    the logits. A head the model ties to its embeddings (:meth:`tie_weights`) is quantized from
    the embedding's weight, which the embedding keeps in the model's dtype."""

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module) -> torch.nn.Module:
        layer.weight = embed_tokens.weight
        return layer
