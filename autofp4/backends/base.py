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
moe: ``runner(x, prepared13, prepared2, topk_weights, topk_ids, activation, expert_map=None,
w13_bias=None, w2_bias=None) -> out``
    x: ``[T, H]``; topk_weights: ``[T, top_k]`` float32; topk_ids: ``[T, top_k]`` int32/int64
    (already range-checked); expert_map: ``None`` or int ``[E_global]`` (global expert -> local
    index, -1 elsewhere: those pairs are skipped); w13_bias / w2_bias: ``None`` or float
    ``[E, 2I]`` / ``[E, H]`` on x's device, any float dtype (added before the activation / before
    the router weight); returns ``[T, H]`` in x's dtype. The caller passes ``expert_map`` and the
    biases only when they are given.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import itertools
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping, Sequence

import torch

from .. import kernel_cache
from ..problem import ProblemKey

Runner = Callable[..., torch.Tensor]

#: a backend's config: a frozen (hashable) dataclass of scalars, one type per kernel. Stored
#: configs (DB rows, exports) are its fields as a dict (:meth:`Backend.config_dict`), plus
#: ``"kernel"`` when the backend has several kernels.
BackendConfig = Any

_SCALARS: dict[str, type] = {"int": int, "bool": bool, "str": str, "float": float}


def grid(space: Mapping[str, Sequence[Any]]) -> Iterator[dict[str, Any]]:
    """Every combination of a config space (``{field: values}``), in field order."""
    names = list(space)
    for values in itertools.product(*(space[n] for n in names)):
        yield dict(zip(names, values))


def config_from_dict(cls: type, data: Mapping[str, Any]) -> Any:
    """The frozen dataclass ``cls`` from untrusted ``data`` (a DB row, an import): every key must
    be a field, every value of the field's scalar type (a bool is not an int); missing fields
    take their defaults. Raises ``ValueError`` naming the field."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    stray = [k for k in data if k not in fields]
    if stray:
        raise ValueError(f"a {cls.__name__} takes no {', '.join(map(str, stray))}")
    for name, value in data.items():
        t = fields[name].type
        want = _SCALARS.get(t if isinstance(t, str) else getattr(t, "__name__", ""))
        ok = want is None or (isinstance(value, want) and not (want is not bool and isinstance(value, bool)))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ValueError(f"{cls.__name__}.{name} must be {want.__name__}, got {value!r}")
    try:
        return cls(**data)
    except TypeError as e:  # a required field is missing
        raise ValueError(f"{cls.__name__}: {e}") from None


class Backend(ABC):
    """One family of kernels. Subclasses are stateless apart from explicit caches."""

    name: ClassVar[str]
    ops: ClassVar[frozenset[str]]
    #: the config dataclass of each kernel, by its ``kernel`` tag (a class attribute of the
    #: dataclass); a backend of one kernel may leave the tag out (``None``): its stored configs
    #: then carry no ``"kernel"`` key
    config_types: ClassVar[Mapping[str | None, type]]

    #: what the tuner checks this backend's outputs against: ``"w4a16"`` (the reference backend:
    #: the dequantized weight times the activations as they are) or ``"w4a4"`` (the activations
    #: quantized to the weight's format first, as a W4A4 kernel computes)
    numerics: ClassVar[str] = "w4a16"

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

    def moe_routing_layout(self, config: BackendConfig) -> tuple[int, bool] | None:
        """The routing metadata a MoE runner of ``config`` builds from ``topk_ids`` (through
        :func:`autofp4.routing.moe_routing` or ``per_pair_routing``): ``(block_m, per_pair)``, or
        None when it builds none (it then routes on its own)."""
        return None

    def parse_config(self, data: Mapping[str, Any] | BackendConfig) -> BackendConfig:
        """Validate untrusted config data (from a DB row or an import); a config passes through."""
        if not isinstance(data, Mapping):
            if type(data) in self.config_types.values():
                return data
            raise ValueError(f"{self.name} configs are {self._type_names()}, got {type(data).__name__}")
        data = dict(data)
        if None in self.config_types:
            return config_from_dict(self.config_types[None], data)
        tag = data.pop("kernel", None)
        if tag not in self.config_types:
            raise ValueError(f"a {self.name} config needs 'kernel' in {sorted(self.config_types)}, got {tag!r}")
        return config_from_dict(self.config_types[tag], data)

    def config_dict(self, config: BackendConfig) -> dict[str, Any]:
        """A config as stored in DB rows and exports: ``kernel`` (for a backend of several
        kernels) and every field."""
        tag = getattr(type(config), "kernel", None) if None not in self.config_types else None
        if self.config_types.get(tag) is not type(config):
            raise ValueError(f"{self.name} configs are {self._type_names()}, got {type(config).__name__}")
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        if not all(isinstance(v, (bool, int, float, str, type(None))) for v in fields.values()):
            fields = dataclasses.asdict(config)  # nested values: asdict's deep copy
        return {**({} if tag is None else {"kernel": tag}), **fields}

    def _type_names(self) -> str:
        return " or ".join(t.__name__ for t in self.config_types.values())

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
                cfg = self.parse_config(point)
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

    def pack_all(self, prepared: Any, dtype: str, gate_up: bool | None) -> bool:
        """Build every layout in ``prepared`` (this backend's :meth:`prepare` of a weight) that
        its calls in activation dtype ``dtype`` can ask for (``gate_up``: None for a linear
        weight, True / False for a MoE layer's w13 / w2); True when, after that, no call reads
        the weight's stored tensors again, so that they can be freed
        (:func:`autofp4.ops.free_loaded`). The default: False (they are read on every call)."""
        return False

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
        return source_digest(kernel_cache.kernel_source(mod.__name__) for mod in self.source_modules(part))


def source_digest(sources: Iterable[str]) -> str:
    """The provenance hash of kernel sources (:func:`autofp4.kernel_cache.kernel_source` texts)."""
    h = hashlib.sha256()
    for text in sources:
        h.update(text.encode())
    return h.hexdigest()[:16]
