"""vLLM plugin: vLLM's linear and fused-MoE layers run autofp4's FP4 kernels, no fork of vLLM.

``pip install autofp4[vllm]`` installs the entry point ``vllm.general_plugins: autofp4``, which
vLLM calls in each of its processes; :func:`register` then adds the quantization method
``autofp4`` (:class:`~autofp4.integrations.vllm.config.AutoFP4Config`):

- a ModelOpt NVFP4 checkpoint served with ``--quantization autofp4`` (or with any
  ``--quantization`` left out when ``AUTOFP4_VLLM_CLAIM=1``): the stored E2M1 values and scales
  run :func:`autofp4.linear` and :func:`autofp4.moe` (W4A16: activations stay bf16/fp16);
- a bf16/fp16 checkpoint served with ``--quantization autofp4``: linear and MoE weights are
  quantized at load, MXFP4 by default, NVFP4 with ``AUTOFP4_VLLM_FORMAT=nvfp4``.

Attention, the KV cache and the layers a checkpoint excludes keep vLLM's own methods.
Importing this package imports nothing of vLLM; :func:`register` does.
"""
from __future__ import annotations

__all__ = ["register"]

_registered = False


def register() -> None:
    """Register the ``autofp4`` quantization config with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    from .config import AutoFP4Config

    register_quantization_config(AutoFP4Config.NAME)(AutoFP4Config)
    _registered = True
