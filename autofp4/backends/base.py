"""The backend interface every kernel family implements.

A backend turns an :class:`~autofp4.weights.FP4Weight` into the layout its kernel reads
(``prepare``) and compiles a *runner* for one configuration and problem (``compile``). One
runner serves every M: ``M`` is never part of the compile key.

Runner calling conventions
--------------------------
linear: ``runner(x, prepared, bias) -> out``
    x: ``[M, K]`` contiguous bf16/fp16 on the backend's device; prepared: what ``prepare``
    returned for the weight; bias: ``[N]`` in x's dtype or ``None``. Returns ``[M, N]`` in
    x's dtype.
moe: ``runner(x, prepared13, prepared2, topk_weights, topk_ids, activation) -> out``
    x: ``[T, H]``; topk_weights: ``[T, top_k]`` float32; topk_ids: ``[T, top_k]`` int32/int64
    (already range-checked); returns ``[T, H]`` in x's dtype.
"""
from __future__ import annotations

import hashlib
import itertools
import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping, Sequence

import torch
from pydantic import BaseModel, ConfigDict

OPS = ("linear", "moe")
FORMATS = ("nvfp4", "mxfp4")
DTYPES = ("bfloat16", "float16")

Runner = Callable[..., torch.Tensor]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; rejects what autofp4 does not run."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"activations must be bfloat16 or float16, got {dtype}")
    return name


@dataclass(frozen=True)
class ProblemKey:
    """Everything a compiled kernel depends on, except M (one kernel serves every M).

    For ``op == "moe"``: ``n`` is the gate/up width ``2 * intermediate``, ``k`` the hidden
    size, ``experts`` the number of experts and ``topk`` the experts per token.
    """

    op: str
    fmt: str
    dtype: str
    n: int
    k: int
    experts: int = 0
    topk: int = 0

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        if self.fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {self.fmt!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.n <= 0 or self.k <= 0:
            raise ValueError(f"n and k must be positive, got n={self.n}, k={self.k}")
        if self.op == "moe" and (self.experts <= 0 or self.topk <= 0 or self.topk > self.experts):
            raise ValueError(
                f"moe needs 0 < topk <= experts, got experts={self.experts}, topk={self.topk}"
            )
        if self.op == "linear" and (self.experts or self.topk):
            raise ValueError("linear problems have no experts/topk")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def grid(space: Mapping[str, Sequence[Any]]) -> Iterator[dict[str, Any]]:
    """Every combination of a config space (``{field: values}``), in field order."""
    names = list(space)
    for values in itertools.product(*(space[n] for n in names)):
        yield dict(zip(names, values))


class BackendConfig(BaseModel):
    """Base of every backend's config model: frozen (hashable, a cache key), no extra keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        # Unused optional fields are left out of stored configs (DB rows, exports).
        kwargs.setdefault("exclude_none", True)
        return super().model_dump(**kwargs)


class Backend(ABC):
    """One family of kernels. Subclasses are stateless apart from explicit caches."""

    name: ClassVar[str]
    ops: ClassVar[frozenset[str]]
    config_model: ClassVar[type[BackendConfig]]

    # -- where it runs -------------------------------------------------------------
    @abstractmethod
    def applies_to(self, device: torch.device) -> bool:
        """Can this backend run on ``device`` in this process (hardware and packages)?"""

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why it does not apply (``None`` when it does); shown by ``autofp4 info``."""
        return None if self.applies_to(device) else f"{self.name} does not run on {device}"

    # -- the search space ---------------------------------------------------------
    @abstractmethod
    def config_space(self, key: ProblemKey) -> Mapping[str, Sequence[Any]]:
        """Each config field and the values worth trying for ``key``."""

    @abstractmethod
    def is_valid(self, config: BackendConfig, key: ProblemKey) -> str | None:
        """``None`` if ``config`` can run ``key``, else the reason it cannot (one rule each)."""

    @abstractmethod
    def default(self, key: ProblemKey, m: int | None = None) -> BackendConfig:
        """The heuristic config used when nothing is tuned (``m``: token count, if known)."""

    def supports(self, key: ProblemKey) -> str | None:
        """``None`` if some config of this backend can run ``key``, else why not."""
        if key.op not in self.ops:
            return f"{self.name} does not implement {key.op}"
        return self.is_valid(self.default(key), key)

    def parse_config(self, data: Mapping[str, Any] | BackendConfig) -> BackendConfig:
        """Validate untrusted config data (from a DB row or an import)."""
        if isinstance(data, self.config_model):
            return data
        return self.config_model.model_validate(dict(data))

    def seeds(self, key: ProblemKey, m: int | None = None) -> list[BackendConfig]:
        """Valid configs worth trying right after the default for ``m`` (what won measurements
        near this shape), most promising first. The tuner runs them before it samples the rest
        of the grid, so a short run still reaches them. None by default."""
        return []

    def variants(self, config: BackendConfig, key: ProblemKey, m: int | None = None) -> list[BackendConfig]:
        """Configs next to ``config``, a winner stored by an earlier run, that a re-tune should try
        right after it: settings whose best value may have moved with the code that retired the
        row (the tuner checks their validity). None by default."""
        return []

    def candidates(self, key: ProblemKey, m: int | None = None) -> list[BackendConfig]:
        """Every valid point of the config space (the grid), the default for ``m`` first.

        ``m`` (the token bucket being tuned) lets a backend leave out configs that cannot
        serve that many tokens well; the base grid ignores it.
        """
        out: list[BackendConfig] = []
        seen: set[BackendConfig] = set()
        default = self.default(key, m)
        if self.is_valid(default, key) is None:
            out.append(default)
            seen.add(default)
        for point in grid(self.config_space(key)):
            try:
                cfg = self.config_model(**point)
            except ValueError:
                continue
            if cfg not in seen and self.is_valid(cfg, key) is None:
                seen.add(cfg)
                out.append(cfg)
        return out

    # -- running ------------------------------------------------------------------
    @abstractmethod
    def prepare(self, weight: "FP4Weight") -> Any:  # noqa: F821
        """The weight in the layout this backend's kernels read (callers cache it)."""

    @abstractmethod
    def compile(self, config: BackendConfig, key: ProblemKey) -> Runner:
        """Build (or load) the runner for ``config`` and ``key``; raises on invalid configs."""

    # -- provenance -----------------------------------------------------------------
    #: the kernels of this backend whose sources are hashed apart (``None``: one hash for all);
    #: a row's provenance covers only the kernel its config runs, so changing one kernel does
    #: not retire the rows of the others
    source_parts: ClassVar[tuple[str | None, ...]] = (None,)

    def source_part(self, config: Mapping[str, Any] | BackendConfig | None) -> str | None:
        """Which of :attr:`source_parts` runs ``config`` (a config or its stored dict)."""
        return None

    def source_modules(self, part: str | None = None) -> list[Any]:
        """The modules whose code defines ``part``'s kernel (``None``: every kernel)."""
        return [inspect.getmodule(type(self))]

    def source_hash(self, config: Mapping[str, Any] | BackendConfig | None = None) -> str:
        """Hash of the source of the kernel that runs ``config`` (part of a row's provenance);
        without a config, of every kernel of this backend."""
        return self.part_source_hash(None if config is None else self.source_part(config))

    def part_source_hash(self, part: str | None) -> str:
        from ..kernel_cache import kernel_source

        return source_digest(kernel_source(mod.__name__) for mod in self.source_modules(part))


def source_digest(sources: Iterable[str]) -> str:
    """The provenance hash of kernel sources (:func:`autofp4.kernel_cache.kernel_source` texts)."""
    h = hashlib.sha256()
    for text in sources:
        h.update(text.encode())
    return h.hexdigest()[:16]
