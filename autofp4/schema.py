"""Pydantic models for everything the tuning database stores, exports and imports.

Every piece of data that crosses a trust boundary (a DB row, an exported JSON file, a shipped
``tuning_db/*.json``) is validated here before use: types are strict, sizes are bounded, a
record's backend must be registered and its config must parse with that backend's config
model. Nothing read from a file is ever executed or evaluated.
"""
from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from typing import Annotated, Any, Literal, Mapping, Union

from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .backends import backend_names, get_backend
from .env import Environment
from .problem import DTYPES, FORMATS, OPS, ProblemKey, is_moe, shape_errors

#: version of the JSON export format (``ExportDoc.schema_version``) this code reads and writes.
EXPORT_SCHEMA_VERSION = 1
SUPPORTED_EXPORT_VERSIONS = frozenset({1})

#: bounds that reject absurd values in untrusted input.
MAX_DIM = 2**20  # n, k, m_bucket
MAX_M = 2**24  # the token count of one trial
MAX_EXPERTS = 2**16
MAX_SAMPLES = 10**7
MAX_US = 1e9  # 1000 s for one GEMM is not a measurement
MAX_CONFIG_KEYS = 64
MAX_CONFIG_STR = 64
MAX_CONFIG_INT = 2**31
MAX_ERROR_CHARS = 2000
MAX_RECORDS = 500_000

#: the fields that identify a tuned problem (together with the environment key).
KEY_FIELDS = ("op", "fmt", "dtype", "backend", "m_bucket", "n", "k", "experts", "topk")

Op = Literal[OPS]  # type: ignore[valid-type]
Fmt = Literal[FORMATS]  # type: ignore[valid-type]
Dtype = Literal[DTYPES]  # type: ignore[valid-type]
Outcome = Literal["ok", "compile_error", "runtime_fault", "wrong_result", "timeout", "invalid"]
OUTCOMES: tuple[str, ...] = ("ok", "compile_error", "runtime_fault", "wrong_result", "timeout", "invalid")
#: how a result was tuned: by a tuning run (``autofp4 tune``, :func:`autofp4.tune`) or just in
#: time, on a workload's first call (:class:`autofp4.autotune`). The same kind of measurement
#: either way; exports leave the field out of ``offline`` rows (as exports before it had none).
Origin = Literal["offline", "jit"]
#: how a result was tuned: by a tuning run (``autofp4 tune``, :func:`autofp4.tune`) or
#: just in time, on a workload's first call (:class:`autofp4.autotune`). The same measurement
#: either way; exports leave the field out for ``offline`` rows.
Origin = Literal["offline", "jit"]
ORIGINS: tuple[str, ...] = ("offline", "jit")

_Name = Annotated[str, Strict(), StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
_Text = Annotated[str, Strict(), StringConstraints(max_length=256)]
_Hash = Annotated[str, Strict(), StringConstraints(max_length=64, pattern=r"^[A-Za-z0-9_.\-]*$")]
EnvKey = Annotated[str, Strict(), StringConstraints(pattern=r"^[0-9a-f]{16}$")]
#: a time in microseconds: a number (an integer is taken as a float), never a string or a bool
_Micros = Annotated[float, Strict()]

ConfigValue = Union[
    Annotated[bool, Strict()],
    Annotated[int, Strict(), Field(ge=-MAX_CONFIG_INT, le=MAX_CONFIG_INT)],
    Annotated[float, Strict(), AllowInfNan(False), Field(ge=-1e18, le=1e18)],
    Annotated[str, Strict(), StringConstraints(max_length=MAX_CONFIG_STR)],
]
ConfigDict_ = Annotated[
    dict[Annotated[str, StringConstraints(min_length=1, max_length=64)], ConfigValue],
    Field(max_length=MAX_CONFIG_KEYS),
]

_STRICT = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def utc_now() -> str:
    """The current time as the ISO 8601 UTC string every record uses."""
    return format_timestamp(datetime.now(timezone.utc))


def format_timestamp(dt: datetime) -> str:
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_timestamp(value: str) -> datetime:
    """Parse an ISO 8601 timestamp that carries a UTC offset of zero; raise ``ValueError`` else."""
    if not isinstance(value, str) or len(value) > 40:
        raise ValueError(f"expected an ISO 8601 UTC timestamp string, got {value!r:.60}")
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00") if value.endswith("Z") else value)
    except ValueError:
        raise ValueError(f"expected an ISO 8601 UTC timestamp, got {value!r}") from None
    if dt.tzinfo is None or dt.utcoffset() != timezone.utc.utcoffset(None):
        raise ValueError(f"timestamp must be UTC (end in 'Z' or '+00:00'), got {value!r}")
    return dt


def config_json(config: Mapping[str, Any]) -> str:
    """The canonical JSON text of a stored config (sorted keys, no spaces): how configs are
    compared."""
    return json.dumps(dict(config), sort_keys=True, separators=(",", ":"), allow_nan=False)


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (bool, int, float, str)) and not (isinstance(v, float) and not math.isfinite(v))


def normalize_config(backend: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``config`` with ``backend``'s config model and return its full (dumped) form.

    Raises ``ValueError`` (unknown backend, bad config). A registered backend whose module
    cannot be imported here (e.g. CuTeDSL missing) cannot check its config: the config is
    returned as given (it is checked again by the backend before it is ever run).
    """
    if backend not in backend_names():
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(backend_names())}")
    try:
        b = get_backend(backend)
    except ImportError:
        return dict(config)
    try:
        parsed = b.parse_config(config)
    except ValueError as e:  # pydantic.ValidationError is a ValueError
        raise ValueError(f"config {dict(config)} is not valid for backend {backend!r}: {_short(e)}") from None
    dumped = b.config_dict(parsed)
    if all(_is_scalar(v) for v in dumped.values()):
        return dumped
    return dict(config)


def _short(e: Exception) -> str:
    errs = getattr(e, "errors", None)
    if callable(errs):
        try:
            return "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '<config>'}: {err['msg']}" for err in errs()
            )
        except Exception:  # pragma: no cover - defensive
            pass
    return str(e)


def _check_finite_positive(v: float | None, name: str, allow_zero: bool = False) -> float | None:
    if v is None:
        return v
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    if v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {v}")
    if v > MAX_US:
        raise ValueError(f"{name} must be <= {MAX_US:g} us, got {v}")
    return v


# --------------------------------------------------------------------------------------
# records
# --------------------------------------------------------------------------------------
class _KeyFields(BaseModel):
    model_config = _STRICT

    op: Op
    fmt: Fmt
    dtype: Dtype
    backend: _Name
    m_bucket: Annotated[int, Strict(), Field(ge=1, le=MAX_DIM)]
    n: Annotated[int, Strict(), Field(ge=1, le=MAX_DIM)]
    k: Annotated[int, Strict(), Field(ge=1, le=MAX_DIM)]
    experts: Annotated[int, Strict(), Field(ge=0, le=MAX_EXPERTS)] = 0
    topk: Annotated[int, Strict(), Field(ge=0, le=MAX_EXPERTS)] = 0

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        if v not in backend_names():
            raise ValueError(f"unknown backend {v!r}; known: {', '.join(backend_names())}")
        return v

    def problem_key(self) -> ProblemKey:
        return ProblemKey(self.op, self.fmt, self.dtype, self.n, self.k, self.experts, self.topk)

    def key_tuple(self) -> tuple:
        """``(op, fmt, dtype, backend, m_bucket, n, k, experts, topk)``."""
        return tuple(getattr(self, f) for f in KEY_FIELDS)

    def describe(self) -> str:
        s = f"{self.op} {self.fmt} {self.dtype} {self.backend} M<={self.m_bucket} N={self.n} K={self.k}"
        if is_moe(self.op):
            s += f" E={self.experts} topk={self.topk}"
        return s


class _ResultFields(_KeyFields):
    config: ConfigDict_
    median_us: _Micros
    spread_us: _Micros
    samples: Annotated[int, Strict(), Field(ge=1, le=MAX_SAMPLES)]
    default_median_us: _Micros | None = None
    backend_source: _Hash = ""
    created_at: str = Field(default_factory=utc_now)
    origin: Origin = "offline"

    @field_validator("n", "k")
    @classmethod
    def _fp4_shape(cls, v: int, info: ValidationInfo) -> int:
        # a result stands for a problem an FP4 weight can have (the misses file's rule, too)
        d = info.data
        if "op" in d and "fmt" in d:
            why = shape_errors(d["op"], d["fmt"], d.get("n", v), v).get(info.field_name or "")
            if why:
                raise ValueError(why)
        return v

    @field_validator("median_us")
    @classmethod
    def _median(cls, v: float) -> float:
        return _check_finite_positive(v, "median_us")  # type: ignore[return-value]

    @field_validator("spread_us")
    @classmethod
    def _spread(cls, v: float) -> float:
        return _check_finite_positive(v, "spread_us", allow_zero=True)  # type: ignore[return-value]

    @field_validator("default_median_us")
    @classmethod
    def _default(cls, v: float | None) -> float | None:
        return _check_finite_positive(v, "default_median_us")

    @field_validator("created_at")
    @classmethod
    def _created(cls, v: str) -> str:
        return format_timestamp(parse_timestamp(v))

    @model_validator(mode="after")
    def _consistent(self):
        try:
            key = self.problem_key()
        except ValueError as e:
            raise ValueError(f"invalid problem: {e}") from None
        self.config = normalize_config(self.backend, self.config)
        try:
            b = get_backend(self.backend)
        except ImportError:
            return self
        if self.op not in b.ops:
            raise ValueError(f"backend {self.backend!r} does not implement {self.op!r}")
        reason = b.is_valid(b.parse_config(self.config), key)
        if reason:
            raise ValueError(f"config {self.config} cannot run {self.describe()}: {reason}")
        return self

    @property
    def spread_ratio(self) -> float:
        return self.spread_us / self.median_us

    @property
    def speedup(self) -> float | None:
        """How much faster than the backend's default config (``None`` if not measured)."""
        return None if self.default_median_us is None else self.default_median_us / self.median_us


class TuningRecord(_ResultFields):
    """The winning config of one problem and M bucket in one environment."""

    env: Environment

    @property
    def env_key(self) -> str:
        return self.env.key()

    def unique_key(self) -> tuple:
        """The database's unique key: the key fields plus the environment key."""
        return (*self.key_tuple(), self.env_key)

    def to_exported(self) -> "ExportedRecord":
        data = self.model_dump(exclude={"env"})
        data["env_key"] = self.env_key
        return ExportedRecord.model_validate(data)


class ExportedRecord(_ResultFields):
    """A :class:`TuningRecord` in an export: the environment is referenced by its key."""

    env_key: EnvKey

    def to_record(self, env: Environment) -> TuningRecord:
        if env.key() != self.env_key:
            raise ValueError(f"environment key {env.key()} does not match the record's {self.env_key}")
        data = self.model_dump(exclude={"env_key"})
        data["env"] = env
        return TuningRecord.model_validate(data)


class TrialRecord(_KeyFields):
    """One measured (or failed) config of the tuner: the evidence behind a result. ``error``:
    why it failed; a MoE pick's check on the skewed routing starts it with ``skewed routing``
    (an ``ok`` one: just that), the other trials ran on the uniform routing."""

    m: Annotated[int, Strict(), Field(ge=1, le=MAX_M)]
    config: ConfigDict_
    outcome: Outcome
    median_us: float | None = None
    spread_us: float | None = None
    error: str = ""
    created_at: str = Field(default_factory=utc_now)
    env_key: EnvKey
    backend_source: _Hash = ""

    @field_validator("median_us")
    @classmethod
    def _median(cls, v: float | None) -> float | None:
        return _check_finite_positive(v, "median_us")

    @field_validator("spread_us")
    @classmethod
    def _spread(cls, v: float | None) -> float | None:
        return _check_finite_positive(v, "spread_us", allow_zero=True)

    @field_validator("error", mode="before")
    @classmethod
    def _truncate(cls, v: Any) -> Any:
        if isinstance(v, str) and len(v) > MAX_ERROR_CHARS:
            return v[: MAX_ERROR_CHARS - 3] + "..."
        return v

    @field_validator("created_at")
    @classmethod
    def _created(cls, v: str) -> str:
        return format_timestamp(parse_timestamp(v))

    @model_validator(mode="after")
    def _consistent(self):
        try:
            self.problem_key()
        except ValueError as e:
            raise ValueError(f"invalid problem: {e}") from None
        try:
            self.config = normalize_config(self.backend, self.config)
        except ValueError:
            # A failed trial may record a config its backend rejects; a successful one may not.
            if self.outcome == "ok":
                raise
        return self

    @property
    def failed(self) -> bool:
        return self.outcome != "ok"

    @property
    def config_json(self) -> str:
        return config_json(self.config)


# --------------------------------------------------------------------------------------
# export document
# --------------------------------------------------------------------------------------
class ExportDoc(BaseModel):
    """A portable, reviewable JSON export of tuning results (``tuning_db/*.json``)."""

    model_config = _STRICT

    schema_version: Annotated[int, Strict()]
    exported_at: str
    autofp4: _Text
    environments: Annotated[dict[EnvKey, Environment], Field(max_length=10_000)]
    records: Annotated[list[ExportedRecord], Field(max_length=MAX_RECORDS)]

    @field_validator("schema_version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v not in SUPPORTED_EXPORT_VERSIONS:
            raise ValueError(
                f"unsupported export schema_version {v}; this autofp4 reads "
                f"{sorted(SUPPORTED_EXPORT_VERSIONS)}"
            )
        return v

    @field_validator("exported_at")
    @classmethod
    def _at(cls, v: str) -> str:
        return format_timestamp(parse_timestamp(v))

    @model_validator(mode="after")
    def _references(self):
        for key, env in self.environments.items():
            if env.key() != key:
                raise ValueError(
                    f"environments[{key!r}]: key does not match the environment's fields "
                    f"(they hash to {env.key()!r})"
                )
        for i, r in enumerate(self.records):
            if r.env_key not in self.environments:
                raise ValueError(
                    f"record #{i} ({r.describe()}): env_key {r.env_key!r} is not in environments"
                )
        return self

    def tuning_records(self) -> list[TuningRecord]:
        return [r.to_record(self.environments[r.env_key]) for r in self.records]
