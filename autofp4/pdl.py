"""Programmatic dependent launch (PDL) for the FP4 kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still
finishing. Until it has waited for that kernel (``griddepcontrol.wait``) it only sets itself up
and prefetches its first weight bytes into L2; it reads activations and writes outputs only after
the wait. Back to back layers then overlap one kernel's tail with the next one's launch and first
HBM reads, which is a large part of the cost of a small GEMM.

Whether a kernel config uses it is part of the config (``pdl``; the tuner measures both, the
defaults use it where it measured faster, see ``autofp4.backends.sm90_heuristics.with_pdl``). It does
not change any result. This module is the global switch over all of them: ``AUTOFP4_PDL=0`` in
the environment or ``autofp4.set_pdl(False)`` turns it off everywhere (for the next launch; a
CUDA graph keeps what was set when it was captured). ``AUTOFP4_PDL`` is read once, at import:
``1``/``true``/``on``/``yes`` or ``0``/``false``/``off``/``no``; another value warns and leaves it on.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator, TypeVar

from .env import env_choice

T = TypeVar("T")

#: ``AUTOFP4_PDL``'s accepted values (read once, at import); any other value warns and leaves PDL on
PDL_CHOICES = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}
_enabled = env_choice("AUTOFP4_PDL", PDL_CHOICES, True, "dependent launch stays on")


def pdl_enabled() -> bool:
    """Whether configs that ask for programmatic dependent launch get it."""
    return _enabled


def set_pdl(enabled: bool) -> bool:
    """Turn programmatic dependent launch on or off for later launches; returns the old value.
    ``enabled`` must be a bool (a string such as ``"no"`` would be truthy: TypeError)."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_pdl takes True or False, got {enabled!r} ({type(enabled).__name__})")
    old, _enabled = _enabled, bool(enabled)
    return old


@contextmanager
def pdl(enabled: bool) -> Iterator[None]:
    """``with autofp4.pdl.pdl(False): ...`` runs a block with PDL set, then restores it."""
    old = set_pdl(enabled)
    try:
        yield
    finally:
        set_pdl(old)


def launch_flag(asked: bool) -> int:
    """The value the compiled launchers take for their ``use_pdl`` argument: 1 when the config
    ``asked`` for programmatic dependent launch and it is switched on."""
    return 1 if asked and _enabled else 0


def binary_config(cfg: T) -> T:
    """The kernel config a compile is keyed by: ``pdl`` is a launch argument, so the configs
    with and without it share one binary (``cfg`` is a dataclass with a ``pdl`` field)."""
    return replace(cfg, pdl=False)
