"""Backend registry. Kernel backends are imported lazily (CuTeDSL is heavy and optional)."""
from __future__ import annotations

import importlib

import torch

from .base import Backend

# name -> "module:Class"; order is preference order when several apply.
_REGISTRY: dict[str, str] = {
    "sm90_w4a16": "autofp4.backends.sm90_w4a16:SM90W4A16Backend",
    "sm90_w4a8": "autofp4.backends.sm90_w4a8:SM90W4A8Backend",
    "sm100_blockscaled": "autofp4.backends.sm100_blockscaled:SM100BlockScaledBackend",
    "reference": "autofp4.backends.reference:ReferenceBackend",
}
_INSTANCES: dict[str, Backend] = {}


def backend_names() -> list[str]:
    return list(_REGISTRY)


def register(name: str, spec: str) -> None:
    """Register the backend class ``spec`` (``"module:Class"``) as ``name``, after the others (a
    plug-in, or a process rebuilding its parent's backends); a name already registered keeps its
    class."""
    _REGISTRY.setdefault(name, spec)


def get_backend(name: str) -> Backend:
    """The backend instance called ``name`` (imports its module on first use)."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown backend {name!r}; known: {', '.join(_REGISTRY)}")
    inst = _INSTANCES.get(name)
    if inst is None:
        mod, cls = _REGISTRY[name].split(":")
        inst = getattr(importlib.import_module(mod), cls)()
        _INSTANCES[name] = inst
    return inst


def available_backends(device: torch.device) -> list[Backend]:
    """Backends that run on ``device``, preferred first (the reference backend is always last)."""
    out = []
    for name in _REGISTRY:
        try:
            b = get_backend(name)
        except (ImportError, AttributeError, ModuleNotFoundError):
            continue
        if b.applies_to(device):
            out.append(b)
    return out
