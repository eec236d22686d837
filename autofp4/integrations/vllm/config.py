"""The ``autofp4`` quantization config for vLLM: which layers run autofp4, and how.

Two modes, told apart by what vLLM hands :meth:`AutoFP4Config.from_config`:

- **ModelOpt NVFP4 checkpoint** (``hf_quant_config.json`` or ``config.json``
  ``quantization_config`` with ``quant_algo`` ``NVFP4`` or ``W4A16_NVFP4``): vLLM's own
  ``ModelOptNvFp4Config`` parses it (exclusions, group size, KV-cache algorithm) and is kept as
  :attr:`AutoFP4Config.checkpoint`; linear layers get
  :class:`~autofp4.integrations.vllm.linear.AutoFP4ModelOptLinearMethod`, routed experts
  :class:`~autofp4.integrations.vllm.moe.AutoFP4ModelOptMoEMethod`, attention vLLM's
  ``ModelOptKVCacheMethod`` and excluded layers vLLM's unquantized methods.
- **online** (a checkpoint without a quantization config; vLLM builds the config with no
  arguments): linear and routed-expert weights are loaded in the model's dtype and quantized
  to :attr:`AutoFP4Config.fmt` after loading. The MoE router (``GateLinear``, or a layer named
  ``gate``, ``router`` or ``shared_expert_gate``), ``lm_head``, embeddings and attention stay
  as vLLM has them. ``--hf-overrides '{"quantization_config": {"quant_method": "autofp4",
  "format": "nvfp4", "ignore": ["*.o_proj"], "lm_head": true}}'`` also picks the format, skips
  layers by glob and quantizes ``lm_head``.

In both modes ``lm_head`` stays in the model's dtype unless asked (``AUTOFP4_VLLM_LM_HEAD=1`` or
``"lm_head": true``): then it is loaded in that dtype and quantized after loading, to NVFP4 for a
ModelOpt checkpoint and to :attr:`AutoFP4Config.fmt` online
(:class:`~autofp4.integrations.vllm.linear.AutoFP4LMHeadMethod`). It changes the logits, so it
is never on by default. A head tied to the embeddings is quantized as a copy (the embedding
keeps its weight).

vLLM imports are function-local where they are heavy (the linear, MoE and ModelOpt modules are
imported by the first :meth:`get_quant_method` or ModelOpt :meth:`from_config`).
"""
from __future__ import annotations

import fnmatch
import os
from typing import Any, Optional

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from ...patterns import pattern_list
from ...problem import FORMATS

__all__ = ["AutoFP4Config", "ACT_ENV", "CLAIM_ENV", "FORMAT_ENV", "KEEP_ENV", "LM_HEAD_ENV", "is_modelopt_nvfp4"]

#: ``AUTOFP4_VLLM_CLAIM=1``: run every ModelOpt NVFP4 checkpoint with autofp4 unless the user
#: names another ``--quantization``
CLAIM_ENV = "AUTOFP4_VLLM_CLAIM"
#: ``AUTOFP4_VLLM_FORMAT=mxfp4|nvfp4``: the format of online quantization (default mxfp4)
FORMAT_ENV = "AUTOFP4_VLLM_FORMAT"
#: 1: keep each FP4 weight's loaded tensors after its kernels' layouts are built (default 0: freed)
KEEP_ENV = "AUTOFP4_VLLM_KEEP_LOADED"
#: 1: quantize ``lm_head`` too (default 0: it stays in the model's dtype)
LM_HEAD_ENV = "AUTOFP4_VLLM_LM_HEAD"
#: ``fp8`` / ``fp8-prefill``: run the FP4 layers with FP8 activations (W4A8: other numerics,
#: opt-in; default: the model's dtype)
ACT_ENV = "AUTOFP4_VLLM_ACT"

_MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4")
_ROUTER_NAMES = ("gate", "router", "shared_expert_gate")
# layers of vision towers that ModelOpt exports leave unquantized without listing them
_VISION_NAMES = ("vision_tower", "vision_model", "vit_large_projector")


def _modelopt_algo(hf_quant_cfg: Any) -> Optional[str]:
    """The upper-cased ModelOpt ``quant_algo`` of a checkpoint's quantization config, or None
    if it is not a ModelOpt config."""
    if not isinstance(hf_quant_cfg, dict):
        return None
    if not str(hf_quant_cfg.get("quant_method", "")).lower().startswith("modelopt"):
        return None
    section = hf_quant_cfg.get("quantization", hf_quant_cfg)
    if not isinstance(section, dict):
        return None
    return str(section.get("quant_algo", "")).upper()


def is_modelopt_nvfp4(hf_quant_cfg: Any) -> bool:
    """Whether ``hf_quant_cfg`` (as vLLM reads it from ``config.json`` or
    ``hf_quant_config.json``) is a ModelOpt NVFP4 (W4A4 or W4A16) checkpoint."""
    return _modelopt_algo(hf_quant_cfg) in _MODELOPT_ALGOS


def _flag(env: str) -> bool:
    value = os.environ.get(env, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{env} must be 1 or 0, got {os.environ[env]!r}")


def _act(act: Any) -> Optional[str]:
    """The activations setting: ``act`` (the config's), else ``$AUTOFP4_VLLM_ACT``; checked."""
    from ...w4a8 import check_act_dtype

    if act is None:
        raw = os.environ.get(ACT_ENV, "").strip().lower()
        if raw in ("", "none", "0", "off"):
            return None
        try:
            check_act_dtype(raw, ACT_ENV)
        except ValueError:
            raise ValueError(f"{ACT_ENV} must be fp8, fp8-prefill or unset, got {os.environ[ACT_ENV]!r}") from None
        return raw
    try:
        check_act_dtype(act, "autofp4")
    except (TypeError, ValueError):
        raise ValueError(f"autofp4: quantization_config act must be fp8, fp8-prefill or null, got {act!r}") from None
    return act


def _claim_enabled() -> bool:
    return _flag(CLAIM_ENV)


def _patterns(value: Any, what: str) -> list[str]:
    """``value`` as a list of glob patterns of layer names (see :func:`autofp4.patterns.pattern_list`)."""
    return pattern_list(value, f"autofp4: {what}")


def _format(fmt: Any, source: str) -> str:
    if not isinstance(fmt, str) or fmt.strip().lower() not in FORMATS:
        raise ValueError(f"autofp4: {source} must be one of {FORMATS}, got {fmt!r}")
    return fmt.strip().lower()


class AutoFP4Config(QuantizationConfig):
    """vLLM quantization config ``autofp4`` (see the module docstring for the two modes).

    ``fmt``: the format of online quantization (None: ``$AUTOFP4_VLLM_FORMAT``, default
    ``"mxfp4"``); a checkpoint is always NVFP4. ``checkpoint``: vLLM's ``ModelOptNvFp4Config``
    of a ModelOpt checkpoint, or None for online quantization. ``ignore``: glob patterns of
    layer names that online quantization leaves in high precision. ``lm_head``: quantize an
    ``lm_head`` stored in the model's dtype at load too (None: ``$AUTOFP4_VLLM_LM_HEAD``, default off).
    ``act``: the FP4 layers' activations, ``"fp8"`` or ``"fp8-prefill"`` (W4A8, see
    :func:`autofp4.linear`; None: ``$AUTOFP4_VLLM_ACT``, default the model's dtype).
    """

    NAME = "autofp4"

    def __init__(self, fmt: Optional[str] = None, checkpoint: Any = None, ignore: Any = (),
                 lm_head: Optional[bool] = None, act: Optional[str] = None) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        if checkpoint is not None:
            self.fmt = "nvfp4"
        elif fmt is None:
            self.fmt = _format(os.environ.get(FORMAT_ENV) or "mxfp4", FORMAT_ENV)
        else:
            self.fmt = _format(fmt, "fmt")
        if checkpoint is not None and not hasattr(checkpoint, "is_layer_excluded"):
            raise TypeError(f"autofp4: checkpoint must be vLLM's ModelOptNvFp4Config, got {type(checkpoint).__name__}")
        self.ignore = _patterns(ignore, "ignore")
        self.keep_loaded = _flag(KEEP_ENV)
        if lm_head is not None and not isinstance(lm_head, bool):
            raise TypeError(f"autofp4: lm_head must be true or false, got {lm_head!r}")
        self.lm_head = _flag(LM_HEAD_ENV) if lm_head is None else lm_head
        self.act = _act(act)

    def __repr__(self) -> str:
        mode = f"ModelOpt {self.checkpoint.quant_method}" if self.checkpoint is not None else "online"
        act = "" if self.act is None else f", act={self.act!r}"
        return f"AutoFP4Config({mode}, fmt={self.fmt!r}{act})"

    # -- what vLLM asks of a config ---------------------------------------------------------
    def get_name(self) -> str:
        return self.NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # bf16 activations; the fast kernels need sm_90, elsewhere the reference backend runs

    @staticmethod
    def get_config_filenames() -> list[str]:
        # vLLM reads hf_quant_config.json into the model config itself; with no file to look
        # for, a checkpoint without a quantization config builds AutoFP4Config() (online).
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AutoFP4Config":
        """A ModelOpt NVFP4 checkpoint's config, or ``{"quant_method": "autofp4", "format":
        ..., "ignore": [...], "lm_head": bool, "act": "fp8"}`` for online quantization."""
        if not isinstance(config, dict):
            raise TypeError(f"autofp4: a quantization config must be a dict, got {type(config).__name__}")
        if str(config.get("quant_method", "")).lower() == cls.NAME:
            unknown = sorted(set(config) - {"quant_method", "format", "ignore", "lm_head", "act"})
            if unknown:
                raise ValueError(f"autofp4: unknown quantization_config keys {unknown} "
                                 "(known: format, ignore, lm_head, act)")
            fmt = config.get("format")
            return cls(fmt=None if fmt is None else _format(fmt, "quantization_config format"),
                       ignore=config.get("ignore", ()), lm_head=config.get("lm_head"), act=config.get("act"))
        algo = _modelopt_algo(config)
        if algo not in _MODELOPT_ALGOS:
            raise ValueError(
                f"autofp4 runs ModelOpt NVFP4 checkpoints (quant_algo {' or '.join(_MODELOPT_ALGOS)}) and "
                f"unquantized ones; this checkpoint's quantization config is {config!r}"
            )
        from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

        section = config.get("quantization", config)
        if "act" in config or (isinstance(section, dict) and "act" in section):
            raise ValueError(f"autofp4: 'act' in a ModelOpt checkpoint's quantization config is not read (the file is "
                             f"ModelOpt's); set {ACT_ENV}=fp8 to run the checkpoint with FP8 activations")
        for field in ("exclude_modules", "ignore"):  # layer names or globs, as autofp4's own loader requires
            if section.get(field) is not None:
                _patterns(section[field], f"the checkpoint's {field}")
        checkpoint = ModelOptNvFp4Config.from_config(config)
        if checkpoint.group_size != 16:
            raise ValueError(f"autofp4: NVFP4 needs a group_size of 16, the checkpoint has {checkpoint.group_size}")
        return cls(checkpoint=checkpoint)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> Optional[str]:
        """Claim a ModelOpt NVFP4 checkpoint when the user asks for ``--quantization autofp4``,
        or, with ``AUTOFP4_VLLM_CLAIM=1``, when the user names no quantization method."""
        if not is_modelopt_nvfp4(hf_quant_cfg):
            return None
        if user_quant == cls.NAME or (user_quant is None and _claim_enabled()):
            return cls.NAME
        return None

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        if self.checkpoint is not None:
            self.checkpoint.apply_vllm_mapper(hf_to_vllm_mapper)
        if self.ignore:
            self.ignore = hf_to_vllm_mapper.apply_list(self.ignore)

    # -- which method each layer gets --------------------------------------------------------
    def _skipped(self, layer: torch.nn.Module, prefix: str) -> bool:
        """Whether ``layer`` stays in high precision (or as vLLM runs it)."""
        if self.checkpoint is not None:
            self.checkpoint.packed_modules_mapping = self.packed_modules_mapping
            return self.checkpoint.is_layer_excluded(prefix) or any(v in prefix for v in _VISION_NAMES)
        from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

        if isinstance(layer, GateLinear) or prefix.rsplit(".", 1)[-1] in _ROUTER_NAMES:
            return True
        return any(fnmatch.fnmatchcase(prefix, p) for p in self.ignore)

    def hash_factors(self) -> dict:
        """What the layers this config builds depend on, beyond the checkpoint: the format, the
        checkpoint kind, the layers left unquantized, whether loaded bytes are kept, ``lm_head``,
        the activations."""
        return {"fmt": self.fmt, "checkpoint": None if self.checkpoint is None else self.checkpoint.quant_method,
                "ignore": self.ignore, "keep_loaded": self.keep_loaded, "lm_head": self.lm_head, "act": self.act}

    def _key_compiled_graphs(self) -> None:
        """Put :meth:`hash_factors` in the current vLLM config's ``additional_config``.

        vLLM keys its torch.compile cache on a hash of its config in which a quantization
        method's own settings do not appear (only its name); the format of online quantization
        comes from the environment, so a checkpoint served in MXFP4 and then in NVFP4 would reuse
        the first run's compiled graph, whose ``autofp4`` ops carry the format as a constant.
        ``additional_config`` is in that hash (a dict there; a platform's own object is left as
        it is)."""
        try:
            from vllm.config import get_current_vllm_config

            extra = get_current_vllm_config().additional_config
        except Exception:  # noqa: BLE001 - no current config (a layer built outside vLLM's loader)
            return
        if isinstance(extra, dict) and extra.get("autofp4") != self.hash_factors():
            extra["autofp4"] = self.hash_factors()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        from vllm.model_executor.layers.attention import Attention, MLAAttention
        from vllm.model_executor.layers.fused_moe import RoutedExperts
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        self._key_compiled_graphs()
        if isinstance(layer, (Attention, MLAAttention)):
            if self.checkpoint is None:
                return None
            from vllm.model_executor.layers.quantization.modelopt import ModelOptKVCacheMethod

            return ModelOptKVCacheMethod(self.checkpoint)
        if not isinstance(layer, (LinearBase, RoutedExperts, ParallelLMHead)):
            return None
        skipped = self._skipped(layer, prefix)
        if isinstance(layer, ParallelLMHead):
            if self.checkpoint is not None and not skipped:
                raise NotImplementedError(
                    f"autofp4: the checkpoint quantizes {prefix!r} (an lm_head), which autofp4 does not run; "
                    "serve it with --quantization modelopt_fp4"
                )
            if self.lm_head and (self.checkpoint is not None or not skipped):  # stored in the model's dtype
                from .linear import AutoFP4LMHeadMethod

                return AutoFP4LMHeadMethod(self)
            return UnquantizedLinearMethod() if skipped else None  # None: vLLM's embedding method
        if skipped:
            return None if isinstance(layer, RoutedExperts) else UnquantizedLinearMethod()
        if isinstance(layer, LinearBase):
            from .linear import AutoFP4ModelOptLinearMethod, AutoFP4OnlineLinearMethod

            if self.checkpoint is not None:
                return AutoFP4ModelOptLinearMethod(self)
            return AutoFP4OnlineLinearMethod(self)
        from .moe import AutoFP4ModelOptMoEMethod, AutoFP4OnlineMoEMethod

        if self.checkpoint is not None:
            return AutoFP4ModelOptMoEMethod(self, layer.moe_config, prefix)
        return AutoFP4OnlineMoEMethod(self, layer.moe_config, prefix)
