"""Checks of the tuner's Python arguments (:func:`~autofp4.tuning.tune`, ``tune_jobs``,
``autotune``): a value of the wrong type (a bool where a count goes, a float where an int goes,
a str where a list goes) or out of range is a TypeError / ValueError naming the argument, never
coerced (``int(1.5)``, ``bool("no")``) or replaced by a default (``0 or default``)."""
from __future__ import annotations

import math
import numbers
import operator
import os
from collections.abc import Mapping
from typing import Any, Optional

import torch


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def count(value: Any, name: str, lo: int) -> Optional[int]:
    """None, or an int (not a bool, not a float) >= ``lo``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= {lo} or None, got the bool {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int >= {lo} or None, got {_shown(value)}") from None
    if n < lo:
        raise ValueError(f"{name} must be an int >= {lo} or None, got {n}")
    return n


#: compile processes per CPU core at most: each holds a compiler (about half a GB while it works),
#: and those beyond the cores only wait for them
WORKERS_PER_CORE = 4


def max_workers() -> int:
    """The most compile processes this machine takes (4 per CPU core)."""
    return WORKERS_PER_CORE * (os.cpu_count() or 1)


def workers(value: Any, name: str, lo: int = 0) -> Optional[int]:
    """None, or a count of compile processes: an int >= ``lo`` and at most :func:`max_workers`."""
    n = count(value, name, lo)
    if n is not None and n > max_workers():
        raise ValueError(f"{name}={n} is more compile processes than this machine takes: at most "
                         f"{max_workers()} ({WORKERS_PER_CORE} per CPU core, {os.cpu_count() or 1} cores); each "
                         "holds a compiler, and those beyond the cores only wait for them")
    return n


def seconds(value: Any, name: str, *, inf_ok: bool = True) -> Optional[float]:
    """None, or a real number of seconds > 0 (not a bool, not a str; ``math.inf`` where ``inf_ok``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds > 0 or None, got {_shown(value)}")
    v = float(value)
    if math.isnan(v) or not v > 0 or (math.isinf(v) and not inf_ok):
        raise ValueError(f"{name} must be a {'' if inf_ok else 'finite '}number of seconds > 0"
                         f"{' (math.inf: no limit)' if inf_ok else ''} or None, got {value!r}")
    return v


def flag(value: Any, name: str, none_ok: bool = False) -> Optional[bool]:
    """True or False (or None where ``none_ok``): ``"no"`` or ``1`` are not read as a flag."""
    if value is None and none_ok:
        return None
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False{' or None' if none_ok else ''}, got {_shown(value)}")
    return value


def names(value: Any, name: str, example: str = "['reference']") -> Optional[list[str]]:
    """None, or a list (any iterable but a str or a mapping, read once) of non-empty str."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)):
        raise TypeError(f"{name} must be a list of names such as {example}, got {_shown(value)}")
    try:
        items = list(value)
    except TypeError:
        raise TypeError(f"{name} must be a list of names such as {example}, got {_shown(value)}") from None
    for i, v in enumerate(items):
        if not isinstance(v, str):
            raise TypeError(f"{name}[{i}] must be a str, got {_shown(v)}")
        if not v.strip():
            raise ValueError(f"{name}[{i}] is an empty name {v!r}")
    return items


def m_values(value: Any, name: str = "m_buckets") -> list[int]:
    """A non-empty list (any iterable but a str or a mapping, read once) of ints >= 1."""
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a list of token counts (int >= 1) such as [1, 16, 128], got {_shown(value)}")
    items = list(value)
    if not items:
        raise ValueError(f"{name} is empty: give at least one M (or None for the default buckets)")
    for i, m in enumerate(items):
        count(m, f"{name}[{i}]", 1)
    return [operator.index(m) for m in items]


def device(value: Any, name: str = "device") -> Any:
    """None, a torch.device, or a str torch can read as one (its error named), of a kind the tuner
    times on: a CUDA GPU or the CPU."""
    if value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, (torch.device, str, int)):
        raise TypeError(f"{name} must be a torch.device, a str such as 'cuda:0' or None, got {_shown(value)}")
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{name} {value!r} is not a device: {str(e).splitlines()[0][:200]}") from None
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"{name} {str(dev)!r}: the tuner times kernels on a CUDA GPU or the CPU, not on {dev.type!r}")
    from ..weights import missing_device

    why = missing_device(dev)
    if why is not None:
        raise ValueError(f"{name} {str(dev)!r}: {why}; tune on 'cpu' (the reference backend) or on a machine with "
                         "the GPU")
    return value


def progress(value: Any) -> Any:
    """True, False, or a tqdm-like object (``update`` and ``close``)."""
    if isinstance(value, bool) or (hasattr(value, "update") and hasattr(value, "close")):
        return value
    raise TypeError(f"progress must be True, False or a tqdm-like bar (update, close), got {_shown(value)}")


def db(value: Any) -> Any:
    """None, a path (str or os.PathLike, not empty), or an open TuningDB (anything with ``path``)."""
    if value is None or hasattr(value, "path"):
        return value
    if isinstance(value, (str, os.PathLike)):
        if not os.fspath(value).strip():
            raise ValueError("db must be a tuning DB path, an open TuningDB or None, got an empty path")
        return value
    raise TypeError(f"db must be a tuning DB path, an open TuningDB or None, got {_shown(value)}")
