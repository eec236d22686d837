"""autofp4: fast 4-bit floating-point (NVFP4, MXFP4) weights on the NVIDIA GPU you have.

    w = autofp4.quantize(weight, "nvfp4")      # FP4Weight
    y = autofp4.linear(x, w)                   # custom op autofp4::linear
    y = autofp4.moe(x, w13, w2, *autofp4.route(logits, top_k=2))
    with autofp4.autotune(mode="blocking"): ...  # tune what the calls miss, just in time
"""
from __future__ import annotations

import os as _os

__version__ = "0.1.0"

from .weights import FP4Weight, dequantize, quantize  # noqa: E402
from .ops import explain, linear, moe, route  # noqa: E402
from .dispatch import get_dispatcher, set_db  # noqa: E402
from .nn import FP4FusedLinear, FP4Linear, FP4LinearPart, quantize_model, set_activations  # noqa: E402
from .pdl import pdl_enabled, set_pdl  # noqa: E402
from .integrations import transformers as _transformers_experts  # noqa: E402,F401  (registers the experts hook)
from .integrations.transformers_hook import install as _install_hook, register_transformers  # noqa: E402

_install_hook()  # autofp4's quantizer joins transformers' when transformers loads them

__all__ = [
    "__version__",
    "FP4Weight",
    "FP4Linear",
    "FP4FusedLinear",
    "FP4LinearPart",
    "quantize",
    "dequantize",
    "linear",
    "moe",
    "route",
    "explain",
    "quantize_model",
    "set_activations",
    "set_db",
    "get_dispatcher",
    "set_pdl",
    "pdl_enabled",
    "tune",
    "autotune",
    "from_pretrained",
    "save_pretrained",
    "quantize_checkpoint",
    "register_transformers",
    "transformers_config",
]

if _os.environ.get("AUTOFP4_LOG"):  # what each problem's first call runs, on standard error
    from .dispatch import log_from_env as _log_from_env

    _log_from_env()

_TUNER_KNOBS = ("AUTOFP4_AUTOTUNE_BUDGET_S", "AUTOFP4_AUTOTUNE_DUTY", "AUTOFP4_AUTOTUNE_OPS",
                "AUTOFP4_AUTOTUNE_WORKERS")
_unknown = sorted(v for v in _os.environ if v.startswith("AUTOFP4_AUTOTUNE") and v not in _TUNER_KNOBS
                  and v != "AUTOFP4_AUTOTUNE")
if _unknown:  # a misspelt or imagined knob: say so rather than tune as if it were not set
    import warnings as _warnings

    _warnings.warn(f"{', '.join(_unknown)}: no such setting of just-in-time tuning (it has no effect); autofp4 reads "
                   f"AUTOFP4_AUTOTUNE and {', '.join(_TUNER_KNOBS)}", stacklevel=2)
if _os.environ.get("AUTOFP4_AUTOTUNE", "").strip().lower() not in ("", "0", "off", "none"):
    # just-in-time tuning for code that cannot be edited
    from .tuning.jit import from_env as _autotune_from_env

    _autotune_from_env()
else:
    _idle = sorted(v for v in _TUNER_KNOBS if _os.environ.get(v) is not None)
    if _idle:  # set for a tuner that is off: say so rather than ignore them
        import warnings as _warnings

        _warnings.warn(f"{', '.join(_idle)} set, but AUTOFP4_AUTOTUNE is not on: just-in-time tuning is off and "
                       f"{'these have' if len(_idle) > 1 else 'it has'} no effect (set AUTOFP4_AUTOTUNE=blocking "
                       "or background)", stacklevel=2)


def __getattr__(name: str):
    # The tuner pulls in optuna; import it only when asked for.
    if name == "tune":
        from .tuning import tune

        return tune
    if name == "autotune":
        from .tuning.jit import autotune

        return autotune
    if name == "from_pretrained":  # transformers and safetensors are imported only here
        from .integrations.checkpoints import from_pretrained

        return from_pretrained
    if name == "save_pretrained":
        from .integrations.writer import save_pretrained

        return save_pretrained
    if name == "quantize_checkpoint":
        from .integrations.quantize_checkpoint import quantize_checkpoint

        return quantize_checkpoint
    if name == "transformers_config":
        from .integrations.hf_quantizer import transformers_config

        return transformers_config
    raise AttributeError(f"module 'autofp4' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
