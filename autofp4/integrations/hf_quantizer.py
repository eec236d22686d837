"""autofp4 as a transformers quantizer: ``AutoModelForCausalLM.from_pretrained`` on FP4 checkpoints.

Importing this module imports transformers and registers, in transformers' quantizer tables:

- ``"autofp4"``: :class:`AutoFP4Config` / :class:`AutoFP4Quantizer`;
- ``"modelopt"`` (the ``quant_method`` ModelOpt writes into ``config.json``), which transformers
  5.x does not handle itself, unless something else already registered it.

``import autofp4`` does not import it: it installs an import hook that imports this module
right after transformers imports ``transformers.quantizers.auto`` (or at once, if transformers
is already imported), so after ``import autofp4`` a ModelOpt NVFP4 checkpoint whose config.json
says ``"quant_method": "modelopt"`` loads with ``AutoModelForCausalLM.from_pretrained(path)``.
:func:`autofp4.register_transformers` registers explicitly; ``AUTOFP4_NO_TRANSFORMERS_HOOK=1``
turns the hook off.

transformers' own quantizers keep the checkpoints they know (``"compressed-tensors"``,
``"mxfp4"``); to load one of those with autofp4, pass a config naming autofp4::

    config = autofp4.transformers_config(path)     # config.json, quantization_config -> autofp4
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.bfloat16)

and for a ModelOpt checkpoint with only ``hf_quant_config.json``,
``from_pretrained(path, quantization_config=AutoFP4Config())`` also works.

The quantizer reads the FP4 tensors itself while the model is being built (the same code as
:func:`autofp4.from_pretrained`: FP4Linear and FP4Experts over the stored tensors) and leaves
the dense tensors to transformers. One device only (``device_map`` None, a device, ``"auto"``
or ``{"": device}``).
"""
from __future__ import annotations

from collections.abc import Mapping

import os
import re
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING, register_quantization_config, register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..nn import FP4Buffers, fuse_projections
from . import checkpoints as _ckpt

__all__ = ["AutoFP4Config", "AutoFP4Quantizer", "transformers_config", "register", "mark_quantized"]

METHOD = "autofp4"
SAVE_MESSAGE = (
    "autofp4: transformers' save_pretrained cannot write this model's FP4 layers (it would store them under "
    "names that load back as random weights); write the checkpoint with autofp4.save_pretrained(model, path, "
    "layout='modelopt' | 'compressed-tensors' | 'gpt-oss'), which transformers, vLLM and autofp4.from_pretrained load"
)


class AutoFP4Config(QuantizationConfigMixin):
    """transformers quantization config for autofp4. ``checkpoint_config``: the checkpoint's own
    ``quantization_config`` (ModelOpt, compressed-tensors or mxfp4); None reads the checkpoint
    directory's ``hf_quant_config.json``."""

    def __init__(self, checkpoint_config: Optional[dict] = None, **kwargs: Any) -> None:
        self.quant_method = METHOD
        if checkpoint_config is not None and not isinstance(checkpoint_config, Mapping):
            raise TypeError(f"AutoFP4Config: checkpoint_config must be a dict (the checkpoint's quantization_config) "
                            f"or None, got {type(checkpoint_config).__name__} {checkpoint_config!r:.80}")
        self.checkpoint_config = None if checkpoint_config is None else dict(checkpoint_config)

    @classmethod
    def from_dict(cls, config_dict: dict, return_unused_kwargs: bool = False, **kwargs: Any):
        d = dict(config_dict)
        # a checkpoint's own config (registered under "modelopt"), or autofp4's
        config = cls(d.get("checkpoint_config")) if d.get("quant_method") == METHOD else cls(d)
        return (config, kwargs) if return_unused_kwargs else config

    def to_dict(self) -> dict:
        return {"quant_method": METHOD, "checkpoint_config": self.checkpoint_config}


class AutoFP4Quantizer(HfQuantizer):
    """Loads FP4 checkpoints into FP4Linear / FP4Experts (see the module's docstring)."""

    requires_calibration = False

    def validate_environment(self, device_map: Any = None, **kwargs: Any) -> None:
        _ckpt._device(device_map)  # one device only

    def update_dtype(self, dtype: Any) -> torch.dtype:
        """The model's dtype, checked before anything is built: the FP4 kernels' activation dtypes
        only (what :func:`autofp4.from_pretrained` accepts); transformers' default (None) is bf16."""
        if dtype is None:
            return torch.bfloat16
        if dtype not in _ckpt._DTYPES:
            raise ValueError(f"{METHOD}: dtype must be torch.bfloat16 or torch.float16 (the activation dtypes of the "
                             f"FP4 kernels), got {dtype} (from_pretrained's dtype, or config.json's for dtype='auto'); "
                             "pass dtype=torch.bfloat16 to from_pretrained")
        return dtype

    def param_needs_quantization(self, model, param_name: str, **kwargs: Any) -> bool:
        return False

    def _process_model_before_weight_loading(self, model, checkpoint_files: Optional[list] = None,
                                             device_map: Any = None, dtype: Optional[torch.dtype] = None,
                                             **kwargs: Any):
        if not checkpoint_files:
            raise ValueError(f"{METHOD}: loading needs the checkpoint's safetensors files")
        root = Path(checkpoint_files[0]).parent
        conf = _ckpt._read_config(root / "config.json")
        conf.pop("quantization_config", None)
        if self.quantization_config.checkpoint_config is not None:
            conf["quantization_config"] = self.quantization_config.checkpoint_config
        dtype = dtype or torch.bfloat16
        scheme, t = _ckpt._open(root, conf, model.config.model_type, _ckpt._device(device_map))
        dense = _ckpt.load_quantized_modules(model, t, scheme, dtype)
        _ckpt.check_dense_linears(model, t, scheme)  # transformers would load packed bytes as a dense weight
        _ckpt.check_dense_stored(model, t, dense)  # transformers would initialize them at random
        _ckpt._warn_dense(dense, scheme, dtype)
        # transformers replaces the tensors it does not find in the checkpoint by empty ones: the FP4
        # modules wait outside the model until the dense tensors are loaded, their stored tensors
        # are not reported as unexpected
        self._pending = {}
        patterns = set()
        for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, FP4Buffers)]:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, torch.nn.Module())
            self._pending[name] = module
            patterns.update(rf"^{re.escape(v)}[._]" for v in scheme._names(name))
        model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | patterns
        return model

    def _process_model_after_weight_loading(self, model, **kwargs: Any):
        for name, module in getattr(self, "_pending", {}).items():
            model.set_submodule(name, module)
        self._pending = {}
        fuse_projections(model)  # q/k/v and gate/up stored with shared scales: one stacked weight each
        return model

    @property
    def is_trainable(self) -> bool:
        return False

    def is_serializable(self, safe_serialization: Any = None) -> bool:
        # transformers calls this before it writes anything: its own writer would store the FP4
        # buffers under names no loader reads (a checkpoint that loads as random weights)
        raise ValueError(SAVE_MESSAGE)

    @property
    def is_compileable(self) -> bool:
        return True


def _hub_id(text: str) -> bool:
    """Whether ``text`` can be a Hugging Face Hub model id (``name`` or ``org/name``)."""
    try:
        from huggingface_hub.utils import validate_repo_id

        validate_repo_id(text)
    except ImportError:  # no validator: the shape transformers accepts
        return re.fullmatch(r"[\w.-]+(/[\w.-]+)?", text) is not None and ".." not in text
    except ValueError:  # HFValidationError
        return False
    return True


def transformers_config(path: Union[str, Path], **kwargs: Any):
    """``AutoConfig.from_pretrained(path)`` with its quantization_config handed to autofp4
    (pass it as ``from_pretrained(path, config=...)``). ``path``: a checkpoint folder (or its
    config.json), or a Hugging Face Hub model id (``org/name``). A path that can only be local (a
    Path, one starting with / . ~, with more than one /, or whose first folder exists here) and
    does not exist is refused at once; a bare ``name`` that is no folder here is looked up on
    the Hub with a warning saying so."""
    what = "transformers_config"
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what}: path must be a checkpoint folder or a Hub model id (a str or a Path), got "
                        f"{type(path).__name__}")
    text = os.fsdecode(os.fspath(path))
    local = Path(text)
    conf = None
    if local.is_dir() or local.suffix == ".json":  # a local checkpoint: its config checked first
        from ..models import load_checked_config

        try:
            conf = load_checked_config(path)
        except (ValueError, OSError) as e:
            raise ValueError(f"{what}: {e}") from None
    elif local.exists():
        raise NotADirectoryError(f"{what}: {text} is a file, not a checkpoint folder (a directory with config.json)")
    else:
        first = Path(text.split("/", 1)[0]) if "/" in text else None
        if isinstance(path, os.PathLike) or not _hub_id(text) or (first is not None and first.is_dir()):
            where = "" if local.is_absolute() else f" in {os.getcwd()}"
            hint = "; a leading ~ is not expanded" if text.startswith("~") else ""
            raise FileNotFoundError(f"{what}: no such folder: {text}{where} (a checkpoint folder with config.json"
                                    f"{hint}); it is a local path, not a Hugging Face Hub model id")
        if "/" not in text:
            warnings.warn(f"{what}: no folder {text!r} in {os.getcwd()}; looking {text!r} up as a Hugging Face Hub "
                          "model id", UserWarning, stacklevel=2)
    try:
        config = _ckpt.auto_config(path, what, conf, **kwargs)
    except OSError as e:
        if conf is not None:
            raise
        reason = " ".join(str(e).split("\n", 1)[0].split())[:300]
        raise OSError(f"{what}: {text!r} is neither a checkpoint folder here ({os.getcwd()}) nor a Hugging Face Hub "
                      f"model id that could be read: {reason}") from None
    own = getattr(config, "quantization_config", None)
    if isinstance(own, QuantizationConfigMixin):
        own = own.to_dict()
    if isinstance(own, dict) and own.get("quant_method") == METHOD:
        own = own.get("checkpoint_config")
    config.quantization_config = {"quant_method": METHOD, "checkpoint_config": own}
    return config


def mark_quantized(model: Any) -> None:
    """Give a transformers model that holds autofp4 layers (converted by ``quantize_model`` or
    loaded by ``autofp4.from_pretrained``) autofp4's quantizer as ``model.hf_quantizer``, as a
    model loaded through the quantizer has: transformers then treats it as quantized, and its
    ``save_pretrained`` refuses with :data:`SAVE_MESSAGE` instead of writing a checkpoint that
    loads as random weights."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel) and getattr(model, "hf_quantizer", None) is None:
        model.hf_quantizer = AutoFP4Quantizer(AutoFP4Config())


def register() -> None:
    """Register autofp4's config and quantizer (and ``"modelopt"`` if free) with transformers; idempotent."""
    for method in (METHOD, "modelopt"):
        if method in AUTO_QUANTIZER_MAPPING or method in AUTO_QUANTIZATION_CONFIG_MAPPING:
            continue
        register_quantization_config(method)(AutoFP4Config)
        register_quantizer(method)(AutoFP4Quantizer)


register()
