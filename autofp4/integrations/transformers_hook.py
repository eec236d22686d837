"""Registers autofp4's transformers quantizer (:mod:`autofp4.integrations.hf_quantizer`) when
transformers loads its quantizer tables, without importing transformers before that.

``install()`` (run by ``import autofp4``) registers at once if ``transformers.quantizers.auto``
is already imported, and otherwise puts a finder on ``sys.meta_path`` that registers right after
that module runs. ``AUTOFP4_NO_TRANSFORMERS_HOOK=1`` (or true, yes, on) skips both; 0, false,
no, off or empty leave the hook on, another value warns naming it and leaves the hook on;
:func:`register_transformers` registers explicitly.
"""
from __future__ import annotations

import importlib.abc
import sys
import warnings

_TARGET = "transformers.quantizers.auto"


def register_transformers() -> None:
    """Register autofp4's quantization config and quantizer with transformers (imports it)."""
    from . import hf_quantizer

    hf_quantizer.register()


_QUANTIZER = "autofp4.integrations.hf_quantizer"


def _register_quietly() -> None:
    mod = sys.modules.get(_QUANTIZER)
    if mod is not None and not hasattr(mod, "register"):
        return  # transformers' tables were loaded by that module's own import, which registers at its end
    try:
        register_transformers()
    except Exception as e:  # an incompatible transformers must not break its own import
        warnings.warn(f"autofp4: could not register its transformers quantizer: {e!r}", stacklevel=3)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _register_quietly()

        spec.loader.exec_module = exec_module
        return spec


def _mark_converted(model) -> None:
    """A transformers model that now holds FP4 layers gets autofp4's quantizer as its
    ``hf_quantizer`` (see :func:`autofp4.integrations.hf_quantizer.mark_quantized`)."""
    tf = sys.modules.get("transformers")
    if tf is None or not any(c.__module__.startswith("transformers.") for c in type(model).__mro__):
        return
    from .hf_quantizer import mark_quantized

    mark_quantized(model)


#: AUTOFP4_NO_TRANSFORMERS_HOOK's spellings, as autofp4's other on/off variables read them
_FLAG = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def hook_disabled() -> bool:
    """Whether ``AUTOFP4_NO_TRANSFORMERS_HOOK`` turns the hook off (1, true, yes, on); unset, empty,
    0, false, no and off leave it on, any other value warns naming it and leaves it on."""
    from ..env import env_choice

    return env_choice("AUTOFP4_NO_TRANSFORMERS_HOOK", _FLAG, False,
                      "autofp4's transformers hook stays on (1 turns it off)")


def install() -> None:
    if hook_disabled():
        return
    from ..nn import register_converted_hook

    register_converted_hook(_mark_converted)
    if _TARGET in sys.modules:
        _register_quietly()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
