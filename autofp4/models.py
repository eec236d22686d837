"""Hugging Face ``config.json`` -> the FP4 GEMM and MoE shapes of a model.

Every weight GEMM of a decoder layer is listed as a :class:`ModelShape` with the shape one
tensor-parallel rank actually runs, so the tuner can sweep exactly the problems a deployment
will meet. Conventions (the vLLM ones):

- Linear weights are ``[N, K]``; the fused projections are ``qkv_proj`` (q, k and v stacked,
  ``N = (heads + 2 * kv_heads) * head_dim``) and ``gate_up_proj`` (``N = 2 * intermediate``).
- Column-parallel layers (qkv, gate_up, MLA ``q_b_proj`` / ``kv_b_proj`` / ``q_proj``) split
  N by ``tp``; row-parallel layers (``o_proj``, ``down_proj``) split K by ``tp``. KV heads are
  replicated when there are fewer of them than ranks: ``max(1, kv_heads // tp)`` per rank.
  DeepSeek MLA's small ``q_a_proj`` and ``kv_a_proj_with_mqa`` are replicated (not split).
- One ``moe`` shape stands for a whole MoE block: the fused gate/up weight ``w13 [E, 2I, H]``
  (``n = 2 * I``, ``k = H``) and the down weight ``w2 [E, H, I]``. With ``ep == 1`` the
  expert intermediate ``I`` is split by ``tp``; with ``ep > 1`` the experts are split by
  ``ep`` (``experts`` is then the number of local experts) and ``I`` is not split. A rank
  never sees more than ``min(topk, local experts)`` of a token's experts, so ``topk`` is
  capped at the local expert count.
- ``layout`` picks whose modules the shapes are of: ``"vllm"`` (the default) the fused
  projections above; ``"transformers"`` the unfused ones Hugging Face modules have:
  ``q_proj``, ``k_proj`` and ``v_proj`` (``N = heads * head_dim``, ``kv_heads * head_dim``),
  ``gate_proj`` and ``up_proj`` (``N = intermediate``), the same TP split and KV-head
  replication per projection; MLA projections, ``o_proj``, ``down_proj``, ``lm_head`` and the
  experts (``moe``) are the same in both. ``"both"`` is the union of the two lists: a shape in
  both keeps the larger of its two counts and the names of both.
- Shapes are deduplicated by ``(op, n, k, experts, topk)``: ``count`` is the number of
  layers (times per-layer uses) summed over the merged entries, and ``name`` joins the
  distinct names with ``+``. The order is the order of first appearance, layer by layer.

A config is checked before any shape is built: every integer field the architecture reads must
be an ``int`` (not a float, bool or string) within :data:`LIMITS`, ceilings far above any
published model; a field the architecture needs (an MoE model's expert count and top-k
included) must be there. With ``fmt`` given, every K must be a whole number of the format's
blocks (16 for NVFP4, 32 for MXFP4). Each error names the field. The number of layers only
scales counts: nothing is built per layer. :func:`load_config` reads at most
:data:`MAX_CONFIG_BYTES` and rejects nesting deeper than :data:`MAX_CONFIG_DEPTH`.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

from .problem import BLOCK_SIZE, FORMATS, OPS, ProblemKey, is_moe, op_for

__all__ = [
    "ModelShape",
    "SUPPORTED",
    "LIMITS",
    "MAX_CONFIG_BYTES",
    "check_limits",
    "check_buildable",
    "load_checked_config",
    "MAX_CONFIG_DEPTH",
    "MAX_PARALLEL",
    "LAYOUTS",
    "load_config",
    "model_shapes",
    "shapes_table",
]


@dataclass(frozen=True)
class ModelShape:
    """One GEMM (``op == "linear"``) or MoE block (``op == "moe"``) of a model, per TP rank
    (``linear_fp8`` / ``moe_fp8``: the same, run with FP8 activations).

    For ``linear``: the weight is ``[n, k]`` and ``experts == topk == 0``. For ``moe``:
    ``n == 2 * intermediate`` (fused gate/up ``w13 [experts, 2I, H]``), ``k == hidden``;
    the down projection ``w2 [experts, H, I]`` belongs to the same op. ``count`` is how many
    layers use the shape. ``experts_global``: for one rank's slice of an expert-parallel layer,
    the layer's experts, among which each token's top-k are chosen (the slice holds
    ``experts`` of them); 0 for a layer that holds all its experts.
    """

    op: str
    name: str
    n: int
    k: int
    experts: int = 0
    topk: int = 0
    count: int = 1
    intermediate: int = 0
    hidden: int = 0
    experts_global: int = 0

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op must be one of {', '.join(OPS)}, got {self.op!r}")
        if self.n <= 0 or self.k <= 0 or self.count <= 0:
            raise ValueError(
                f"{self.name}: n, k and count must be positive, "
                f"got n={self.n}, k={self.k}, count={self.count}"
            )
        if is_moe(self.op):
            if not 0 < self.topk <= self.experts:
                raise ValueError(
                    f"{self.name}: moe needs 0 < topk <= experts, "
                    f"got experts={self.experts}, topk={self.topk}"
                )
            if self.n != 2 * self.intermediate or self.k != self.hidden:
                raise ValueError(
                    f"{self.name}: moe needs n == 2 * intermediate and k == hidden, got "
                    f"n={self.n}, k={self.k}, intermediate={self.intermediate}, "
                    f"hidden={self.hidden}"
                )
            if self.experts_global and self.experts_global <= self.experts:
                raise ValueError(
                    f"{self.name}: experts_global must exceed the slice's experts (or be 0), got "
                    f"experts_global={self.experts_global}, experts={self.experts}"
                )
        elif self.experts or self.topk or self.experts_global:
            raise ValueError(f"{self.name}: linear shapes have no experts/topk")

    @property
    def dedup_key(self) -> tuple[str, int, int, int, int]:
        return (self.op, self.n, self.k, self.experts, self.topk)

    def problem_key(self, fmt: str, dtype: str) -> ProblemKey:
        """The tuner's :class:`~autofp4.problem.ProblemKey` for this shape."""
        return ProblemKey(self.op, fmt, dtype, self.n, self.k, self.experts, self.topk)


# ---------------------------------------------------------------------------------------
# Bounds

#: the largest ``config.json`` :func:`load_config` reads, in bytes (real ones are a few KB; with
#: label maps, a few hundred KB)
MAX_CONFIG_BYTES = 2 * 2**20
#: the deepest nesting of JSON objects and arrays it accepts (real configs nest a few levels)
MAX_CONFIG_DEPTH = 32
_MAX_CONTAINERS = 100_000  # JSON objects and arrays in one file (real configs: tens)
#: the module layouts :func:`model_shapes` derives shapes for
LAYOUTS: tuple[str, ...] = ("vllm", "transformers", "both")
#: the largest ``tp`` and ``ep``
MAX_PARALLEL = 65536
_MAX_PATH = 4096  # characters of a path (PATH_MAX)

#: ``field: (smallest, largest)`` accepted for the integer fields the architectures read; the
#: ceilings are far above every published model's, so only a broken config meets them
LIMITS: dict[str, tuple[int, int]] = {
    "hidden_size": (1, 65536),
    "intermediate_size": (1, 262144),
    "moe_intermediate_size": (1, 262144),
    "num_hidden_layers": (1, 2048),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (0, 1024),  # 0 (or null): hidden_size / num_attention_heads
    "q_lora_rank": (0, 65536),  # 0 (or null): no q LoRA, a plain q_proj
    "kv_lora_rank": (1, 65536),
    "qk_nope_head_dim": (1, 1024),
    "qk_rope_head_dim": (1, 1024),
    "v_head_dim": (1, 1024),
    "num_local_experts": (1, 8192),
    "num_experts": (1, 8192),
    "n_routed_experts": (1, 8192),
    "num_experts_per_tok": (1, 256),
    "experts_per_token": (1, 256),
    "n_shared_experts": (0, 256),
    "first_k_dense_replace": (0, 2048),
    "moe_layer_freq": (1, 2048),
    "decoder_sparse_step": (1, 2048),
    "vocab_size": (1, 4194304),
}


def _clip(text: str, limit: int = 40) -> str:
    """``repr`` of ``text``, cut to ``limit`` characters."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def _show(value: Any) -> str:
    """A short description of a config value for an error message (never all of a big one)."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return f"{value!r} (a float)"
    if isinstance(value, str):
        return f"{_clip(value)} (a string)"
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


# ---------------------------------------------------------------------------------------
# Loading


def load_config(path_or_dict: Union[str, Path, Mapping[str, Any]]) -> dict:
    """Read a Hugging Face ``config.json``.

    Accepts a mapping (returned as a new dict), a path to a JSON file, or a directory that
    contains ``config.json``. A file is read only up to :data:`MAX_CONFIG_BYTES`, and its
    nesting is checked against :data:`MAX_CONFIG_DEPTH` before it is parsed.
    """
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    if not isinstance(path_or_dict, (str, Path)):
        raise TypeError(
            f"load_config expects a path or a dict, got {type(path_or_dict).__name__}"
        )
    path = _config_path(path_or_dict)
    text = _read_bounded(path)
    _check_depth(text, path)
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"invalid JSON in {path}: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from None
    except RecursionError:  # deep nesting the scan let through: the file is invalid JSON anyway
        raise ValueError(
            f"invalid JSON in {path}: objects and arrays nested deeper than {MAX_CONFIG_DEPTH} levels"
        ) from None
    except ValueError as exc:  # e.g. a number of more than 4300 digits
        raise ValueError(f"invalid JSON in {path}: {str(exc)[:200]}") from None
    if not isinstance(config, dict):
        raise ValueError(
            f"{path}: expected a JSON object at the top level, got {type(config).__name__}"
        )
    where = _nan_field(config)
    if where is not None:
        raise ValueError(f"{path}: {where} is NaN, which no model setting can be")
    return config


def _nan_field(value: Any, where: str = "") -> str | None:
    """The path of the first NaN in a parsed config (None: there is none)."""
    if isinstance(value, float) and math.isnan(value):
        return where or "the value"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = _nan_field(v, f"{where}.{k}" if where and isinstance(k, str) else f"{where}[{k}]" if where else str(k))
        if found is not None:
            return found
    return None


def _config_path(path_or_dir: Union[str, Path]) -> Path:
    text = str(path_or_dir)
    if len(text) > _MAX_PATH:
        raise ValueError(
            f"config path of {len(text)} characters is longer than a path can be "
            f"({_MAX_PATH}): {_clip(text)}"
        )
    if "\0" in text:
        raise ValueError(f"config path contains a NUL character: {_clip(text)}")
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        if path.exists():
            raise ValueError(f"model config {path} is not a regular file")
        raise FileNotFoundError(
            f"model config not found: {path} "
            "(expected a config.json file or a directory containing one)"
        )
    return path


def _read_bounded(path: Path) -> str:
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ValueError(
            f"{path} is {size} bytes, more than a model config can be "
            f"(at most {MAX_CONFIG_BYTES} bytes)"
        )
    with path.open("rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:  # it grew since stat()
        raise ValueError(f"{path} is more than {MAX_CONFIG_BYTES} bytes, more than a model config can be")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


_JSON_STRING = re.compile(r'"[^"]*"')  # once escaped quotes are gone
_BRACKET = re.compile(r"[\[\]{}]")


def _check_depth(text: str, where: Path) -> None:
    """Reject nesting deeper than :data:`MAX_CONFIG_DEPTH`, and more objects and arrays than a
    config has, before parsing: strings dropped, then a walk over the brackets that are left."""
    bare = text.replace("\\\\", "").replace('\\"', "")  # escaped backslashes, escaped quotes
    if bare.count('"') % 2:
        return  # a string that never ends: json.loads says where
    depth = containers = 0
    for match in _BRACKET.finditer(_JSON_STRING.sub("", bare)):
        if match.group() in "]}":
            depth -= 1
            if depth < 0:
                return  # more closed than opened: json.loads says where
            continue
        depth += 1
        containers += 1
        if depth > MAX_CONFIG_DEPTH:
            raise ValueError(
                f"{where}: objects and arrays nested deeper than {MAX_CONFIG_DEPTH} levels; "
                "a model config nests a few"
            )
        if containers > _MAX_CONTAINERS:
            raise ValueError(
                f"{where}: more than {_MAX_CONTAINERS} JSON objects and arrays; a model config has tens"
            )


# ---------------------------------------------------------------------------------------
# Config fields

_ATTENTION = {"hidden_size": True, "num_attention_heads": True, "num_key_value_heads": False,
              "head_dim": False}  # field: required
_MLA = {"hidden_size": True, "num_attention_heads": True, "q_lora_rank": False,
        "kv_lora_rank": True, "qk_nope_head_dim": True, "qk_rope_head_dim": True,
        "v_head_dim": True}
_LAYERS = {"num_hidden_layers": True, "vocab_size": False}
_DENSE = {**_ATTENTION, **_LAYERS, "intermediate_size": True}
_MIXTRAL = {**_DENSE, "num_local_experts": True, "num_experts_per_tok": True}
_QWEN3_MOE = {**_ATTENTION, **_LAYERS, "intermediate_size": False, "num_experts": False,
              "num_local_experts": False,  # the expert count under either name (transformers 5 writes the second)
              "num_experts_per_tok": True, "moe_intermediate_size": True,
              "decoder_sparse_step": False}
_DEEPSEEK = {**_MLA, **_LAYERS, "intermediate_size": False, "n_routed_experts": True,
             "num_experts_per_tok": True, "moe_intermediate_size": True,
             "n_shared_experts": False, "first_k_dense_replace": False, "moe_layer_freq": False}
_GPT_OSS = {**_DENSE, "num_local_experts": True, "num_experts_per_tok": False,
            "experts_per_token": False}  # one of the two spellings of top-k


def _check_field(key: str, value: Any) -> int:
    lo, hi = LIMITS[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config field {key!r} must be an integer, got {_show(value)}")
    if not lo <= value <= hi:
        expected = f"a positive integer up to {hi}" if lo == 1 else f"an integer from {lo} to {hi}"
        raise ValueError(
            f"config field {key!r} must be {expected} (real models stay far below), "
            f"got {_show(value)}"
        )
    return value


def check_limits(config: Mapping[str, Any]) -> None:
    """Every integer size field of :data:`LIMITS` that ``config`` (or its ``text_config``) sets is
    an integer within its bounds; ``ValueError`` naming the field otherwise (what a loader checks
    before a framework builds anything from the config)."""
    for part in (config, config.get("text_config")):
        if isinstance(part, Mapping):
            for key in LIMITS:
                if part.get(key) is not None:
                    _check_field(key, part[key])
            for key in ("rope_scaling", "rope_parameters"):
                _check_rope(key, part.get(key))


def _check_rope(key: str, rope: Any) -> None:
    """``rope_scaling`` / ``rope_parameters``: an object of numbers and flags (its ``rope_type`` /
    ``type`` a name), which transformers computes with as it builds the model."""
    if rope is None:
        return
    if not isinstance(rope, Mapping):
        raise ValueError(f"{key} must be an object (or null), got {type(rope).__name__} {rope!r:.60}")
    for k, v in rope.items():
        if k in ("rope_type", "type"):
            if not isinstance(v, str):
                raise ValueError(f"{key}.{k} must be a name such as 'llama3', got {v!r:.60}")
            continue
        numbers = v if isinstance(v, list) else [v]
        if isinstance(v, Mapping) or not all(x is None or isinstance(x, (int, float)) for x in numbers):
            raise ValueError(f"{key}.{k} must be a number (or true / false), got {v!r:.60}")


#: size fields whose 0 :func:`model_shapes` reads as "derive it" (``head_dim``: hidden_size /
#: num_attention_heads) but that transformers uses as they are when it builds the model
_POSITIVE_TO_BUILD = ("head_dim",)
#: the fields of the number of routed experts, and of the experts each token is routed to
_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_TOPK_KEYS = ("num_experts_per_tok", "experts_per_token")


def _expert_counts(part: Mapping[str, Any]) -> list[tuple[str, int]]:
    """The fields of ``part`` that set the number of routed experts; ``ValueError`` where two of
    them disagree (which one a model reads depends on its class)."""
    counts = [(k, part[k]) for k in _EXPERTS_KEYS if isinstance(part.get(k), int) and not isinstance(part[k], bool)]
    if len({v for _, v in counts}) > 1:
        raise ValueError("the number of experts is set twice, differently: "
                         + ", ".join(f"{k} = {v}" for k, v in counts) + "; keep the one this model type reads")
    return counts


def _check_topk(topk_key: str, topk: int, experts_key: str, experts: int) -> None:
    if topk > experts:
        raise ValueError(
            f"{topk_key}={topk} (experts per token) exceeds {experts_key}={experts} "
            "(the number of experts)"
        )


#: the fields of the dtype a config was saved in (transformers reads them as ``getattr(torch, value)``)
_DTYPE_KEYS = ("torch_dtype", "dtype")


def _check_dtype_field(key: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, str) and not value.startswith("_"):
        import torch

        dt = getattr(torch, value, None)
        if isinstance(dt, torch.dtype):
            if dt.is_floating_point and dt.itemsize >= 2:
                return
            raise ValueError(
                f"config field {key!r} must name a floating-point torch dtype a model is built in (bfloat16, "
                f"float16 or float32), got {_show(value)}"
            )
    raise ValueError(
        f"config field {key!r} must name a torch dtype (such as 'bfloat16' or 'float16'), got {_show(value)}"
    )


#: float fields transformers computes with when it builds or runs a model: where set, a finite
#: number, positive (or, for the dropout, in [0, 1])
_POSITIVE_FLOATS = ("rope_theta", "rms_norm_eps", "layer_norm_eps", "norm_epsilon", "routed_scaling_factor")
_UNIT_FLOATS = ("attention_dropout", "hidden_dropout", "partial_rotary_factor")


def _check_float_field(key: str, value: Any) -> None:
    import math

    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and key in _POSITIVE_FLOATS:
        ok = value > 0
    elif ok:
        ok = 0 <= value <= 1
    if not ok:
        want = "a positive number" if key in _POSITIVE_FLOATS else "a number in [0, 1]"
        raise ValueError(f"config field {key!r} must be {want}, got {_show(value)}")


def check_buildable(config: Mapping[str, Any]) -> None:
    """What a loader checks beyond :func:`check_limits` before transformers builds a model from
    ``config`` (or its ``text_config``): ``head_dim``, where set, is positive, no MoE routes a
    token to more experts than it has (``num_experts_per_tok`` <= ``num_local_experts`` /
    ``num_experts`` / ``n_routed_experts``), ``torch_dtype`` / ``dtype``, where set, name a
    torch dtype, and the float fields transformers computes with (``rope_theta``, the norm
    epsilons, dropouts: :data:`_POSITIVE_FLOATS`, :data:`_UNIT_FLOATS`) are finite numbers in
    range; ``ValueError`` naming the fields otherwise."""
    def ints(part: Mapping[str, Any], keys: Sequence[str]) -> list[tuple[str, int]]:
        return [(k, part[k]) for k in keys if isinstance(part.get(k), int) and not isinstance(part[k], bool)]

    for part in (config, config.get("text_config")):
        if not isinstance(part, Mapping):
            continue
        for key in _DTYPE_KEYS:
            _check_dtype_field(key, part.get(key))
        for key in _POSITIVE_FLOATS + _UNIT_FLOATS:
            _check_float_field(key, part.get(key))
        for key, value in ints(part, _POSITIVE_TO_BUILD):
            if value <= 0:
                raise ValueError(
                    f"config field {key!r} must be a positive integer to build the model (leave it out, or null, "
                    f"for hidden_size / num_attention_heads), got {_show(value)}"
                )
        counts = _expert_counts(part)
        for topk_key, topk in ints(part, _TOPK_KEYS)[:1]:
            for experts_key, experts in counts:
                _check_topk(topk_key, topk, experts_key, experts)


def load_checked_config(path_or_dict: Union[str, Path, Mapping[str, Any]]) -> dict:
    """:func:`load_config` then :func:`check_limits` and :func:`check_buildable`: a config read
    bounded and depth-checked, its size fields within bounds and buildable (what every loader
    checks before a framework builds anything). A file's errors name it."""
    config = load_config(path_or_dict)
    try:
        check_limits(config)
        check_buildable(config)
    except ValueError as e:
        if isinstance(path_or_dict, Mapping):
            raise
        raise ValueError(f"{_config_path(path_or_dict)}: {e}") from None
    return config


def _validate(config: Mapping[str, Any], model_type: str, fields: Mapping[str, bool]) -> dict[str, int]:
    """The integer fields of ``fields`` present in ``config`` (null counts as absent), checked."""
    values = {}
    for key, required in fields.items():
        value = config.get(key)
        if value is None:
            if required:
                raise ValueError(
                    f"config (model_type={model_type!r}) lacks {key!r}, "
                    f"which a {model_type} model needs"
                )
            continue
        values[key] = _check_field(key, value)
    return values


def _layer_set(value: Any, key: str, layers: int) -> frozenset[int]:
    """A list of layer indices (``mlp_only_layers``), each in ``[0, layers)``."""
    if value is None:
        return frozenset()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"config field {key!r} must be a list of layer indices, got {_show(value)}")
    if len(value) > layers:
        raise ValueError(
            f"config field {key!r} lists {len(value)} layers, more than "
            f"num_hidden_layers={layers}"
        )
    for i, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < layers:
            raise ValueError(
                f"config field {key!r} must hold layer indices from 0 to {layers - 1} "
                f"(num_hidden_layers={layers}), got {_show(x)} at position {i}"
            )
    return frozenset(value)


def _split(value: int, parts: int, what: str, by: str, key: str = "") -> int:
    if value % parts:
        named = f" (config field {key!r})" if key else ""
        raise ValueError(f"{what}={value} is not divisible by {by}={parts}{named}")
    return value // parts


def _per(tp: int) -> str:
    return " / tp" if tp > 1 else ""


@dataclass
class _Model:
    """A config being turned into shapes: its checked integer fields, and the K of every shape
    built (with the fields it comes from) for the block-size check."""

    config: Mapping[str, Any]
    model_type: str
    v: dict[str, int]
    tp: int
    ep: int
    layout: str = "vllm"  # "vllm" (fused qkv / gate_up) or "transformers" (unfused)
    ks: list[tuple[int, str, str]] = field(default_factory=list)  # (K, its fields, of what)

    def need(self, key: str, why: str) -> int:
        """A field needed by part of the model only (checked already where present)."""
        if key not in self.v:
            raise ValueError(f"config (model_type={self.model_type!r}) lacks {key!r}, {why}")
        return self.v[key]

    def linear(self, name: str, n: int, k: int, k_from: str) -> ModelShape:
        self.ks.append((k, k_from, name))
        return ModelShape("linear", name, n, k)


def _check_blocks(m: _Model, fmt: str) -> None:
    bs = BLOCK_SIZE[fmt]
    for k, k_from, of in m.ks:
        if k % bs:
            tp = f", tp={m.tp}" if "/ tp" in k_from else ""
            raise ValueError(
                f"{k_from} = {k} (K of {of}{tp}) is not a multiple of {bs}, the {fmt} block "
                f"size: {fmt} weights need K in whole blocks"
            )


# ---------------------------------------------------------------------------------------
# Building blocks (each returns the shapes of one layer, count 1)


def _attention(m: _Model) -> list[ModelShape]:
    v, tp = m.v, m.tp
    hidden, heads = v["hidden_size"], v["num_attention_heads"]
    kv_heads = v.get("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    head_dim, head_dim_from = v.get("head_dim", 0), "head_dim"
    if not head_dim:
        head_dim = _split(hidden, heads, "hidden_size", "num_attention_heads")
        head_dim_from = "(hidden_size / num_attention_heads)"
    local_heads = _split(heads, tp, "num_attention_heads", "tp")
    if kv_heads >= tp:
        local_kv = _split(kv_heads, tp, "num_key_value_heads", "tp")
    else:  # replicated: every rank holds one kv head, tp must be a multiple of kv_heads
        _split(tp, kv_heads, "tp", "num_key_value_heads")
        local_kv = 1
    if m.layout == "transformers":
        qkv = [
            m.linear("q_proj", local_heads * head_dim, hidden, "hidden_size"),
            m.linear("k_proj", local_kv * head_dim, hidden, "hidden_size"),
            m.linear("v_proj", local_kv * head_dim, hidden, "hidden_size"),
        ]
    else:
        qkv = [m.linear("qkv_proj", (local_heads + 2 * local_kv) * head_dim, hidden, "hidden_size")]
    return qkv + [
        m.linear("o_proj", hidden, local_heads * head_dim,
                 f"num_attention_heads{_per(tp)} * {head_dim_from}"),
    ]


def _mla_attention(m: _Model) -> list[ModelShape]:
    v = m.v
    hidden, heads = v["hidden_size"], v["num_attention_heads"]
    q_lora = v.get("q_lora_rank", 0)
    kv_lora, nope, rope = v["kv_lora_rank"], v["qk_nope_head_dim"], v["qk_rope_head_dim"]
    v_dim = v["v_head_dim"]
    local_heads = _split(heads, m.tp, "num_attention_heads", "tp")
    shapes = []
    if q_lora:
        shapes.append(m.linear("q_a_proj", q_lora, hidden, "hidden_size"))
        shapes.append(m.linear("q_b_proj", local_heads * (nope + rope), q_lora, "q_lora_rank"))
    else:
        shapes.append(m.linear("q_proj", local_heads * (nope + rope), hidden, "hidden_size"))
    shapes += [
        m.linear("kv_a_proj_with_mqa", kv_lora + rope, hidden, "hidden_size"),
        m.linear("kv_b_proj", local_heads * (nope + v_dim), kv_lora, "kv_lora_rank"),
        m.linear("o_proj", hidden, local_heads * v_dim, f"num_attention_heads{_per(m.tp)} * v_head_dim"),
    ]
    return shapes


def _mlp(m: _Model, intermediate: int, prefix: str = "",
         what: str = "intermediate_size") -> list[ModelShape]:
    local = _split(intermediate, m.tp, what, "tp")
    hidden = m.v["hidden_size"]
    if m.layout == "transformers":
        gate_up = [
            m.linear(prefix + "gate_proj", local, hidden, "hidden_size"),
            m.linear(prefix + "up_proj", local, hidden, "hidden_size"),
        ]
    else:
        gate_up = [m.linear(prefix + "gate_up_proj", 2 * local, hidden, "hidden_size")]
    return gate_up + [
        m.linear(prefix + "down_proj", hidden, local, what + _per(m.tp)),
    ]


def _moe(m: _Model, inter_key: str, experts_key: str, topk_key: str) -> ModelShape:
    v = m.v
    hidden, intermediate = v["hidden_size"], v[inter_key]
    experts, topk = v[experts_key], v[topk_key]
    _check_topk(topk_key, topk, experts_key, experts)
    if m.ep > 1:
        local_experts = _split(experts, m.ep, "number of experts", "ep", experts_key)
        local_inter, inter_from = intermediate, inter_key
    else:
        local_experts = experts
        local_inter, inter_from = _split(intermediate, m.tp, inter_key, "tp"), inter_key + _per(m.tp)
    m.ks.append((hidden, "hidden_size", "the experts' gate/up projection"))
    m.ks.append((local_inter, inter_from, "the experts' down projection"))
    return ModelShape(
        "moe", "experts", 2 * local_inter, hidden,
        experts=local_experts, topk=min(topk, local_experts),
        intermediate=local_inter, hidden=hidden, experts_global=experts if m.ep > 1 else 0,
    )


# ---------------------------------------------------------------------------------------
# Architectures (each returns its kinds of layer: (the shapes of one layer, how many layers))

_Groups = list[tuple[list[ModelShape], int]]


def _dense_layers(m: _Model) -> _Groups:
    layer = _attention(m) + _mlp(m, m.v["intermediate_size"])
    return [(layer, m.v["num_hidden_layers"])]


def _mixtral_layers(m: _Model) -> _Groups:
    moe = _moe(m, "intermediate_size", "num_local_experts", "num_experts_per_tok")
    return [(_attention(m) + [moe], m.v["num_hidden_layers"])]


def _mixed_layers(m: _Model, attention: list[ModelShape], n_moe: int, first_is_moe: bool,
                  make_moe: Callable[[], list[ModelShape]]) -> _Groups:
    """``n_moe`` MoE layers and a dense MLP of ``intermediate_size`` in the others (each kind's
    shapes built once, only if a layer has it, so a config without dense layers needs no
    ``intermediate_size``); the kind of layer 0 comes first."""
    layers = m.v["num_hidden_layers"]
    kinds = [("moe", n_moe), ("dense", layers - n_moe)]
    if not first_is_moe:
        kinds.reverse()
    groups = []
    for kind, count in kinds:
        if not count:
            continue
        if kind == "moe":
            body = make_moe()
        else:
            body = _mlp(m, m.need("intermediate_size", "the size of its dense layers' MLP"))
        groups.append((attention + body, count))
    return groups


def _qwen3_moe_layers(m: _Model) -> _Groups:
    layers, step = m.v["num_hidden_layers"], m.v.get("decoder_sparse_step", 1)
    mlp_only = _layer_set(m.config.get("mlp_only_layers"), "mlp_only_layers", layers)
    # MoE: layers i with (i + 1) % step == 0, except those listed in mlp_only_layers
    n_moe = layers // step - sum(1 for i in mlp_only if (i + 1) % step == 0)
    return _mixed_layers(
        m, _attention(m), n_moe, step == 1 and 0 not in mlp_only,
        lambda: [_moe(m, "moe_intermediate_size", _one_of(m, ("num_experts", "num_local_experts")),
                      "num_experts_per_tok")],
    )


def _one_of(m: _Model, keys: tuple[str, ...]) -> str:
    """The first of ``keys`` the config sets (two spellings of one field); ValueError naming all."""
    key = next((k for k in keys if k in m.v), None)
    if key is None:
        raise ValueError(f"config (model_type={m.model_type!r}) lacks all of {list(keys)}")
    return key


def _deepseek_layers(m: _Model) -> _Groups:
    first_dense = m.v.get("first_k_dense_replace", 0)
    freq = m.v.get("moe_layer_freq", 1)
    shared = m.v.get("n_shared_experts", 0)

    def make_moe() -> list[ModelShape]:
        shapes = [_moe(m, "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")]
        if shared:
            shapes += _mlp(m, shared * m.v["moe_intermediate_size"], prefix="shared_experts.",
                           what="n_shared_experts * moe_intermediate_size")
        return shapes

    # MoE: layers i >= first_k_dense_replace with i % moe_layer_freq == 0
    layers = m.v["num_hidden_layers"]
    n_moe = (layers - 1) // freq - (first_dense - 1) // freq if first_dense < layers else 0
    return _mixed_layers(m, _mla_attention(m), n_moe, first_dense == 0, make_moe)


def _gpt_oss_layers(m: _Model) -> _Groups:
    moe = _moe(m, "intermediate_size", "num_local_experts", _one_of(m, ("num_experts_per_tok", "experts_per_token")))
    return [(_attention(m) + [moe], m.v["num_hidden_layers"])]


_ARCHS: dict[str, tuple[dict[str, bool], Callable[[_Model], _Groups]]] = {
    "llama": (_DENSE, _dense_layers),
    "mistral": (_DENSE, _dense_layers),
    "qwen2": (_DENSE, _dense_layers),
    "qwen3": (_DENSE, _dense_layers),
    "mixtral": (_MIXTRAL, _mixtral_layers),
    "qwen3_moe": (_QWEN3_MOE, _qwen3_moe_layers),
    "deepseek_v2": (_DEEPSEEK, _deepseek_layers),
    "deepseek_v3": (_DEEPSEEK, _deepseek_layers),
    "gpt_oss": (_GPT_OSS, _gpt_oss_layers),
}

SUPPORTED: tuple[str, ...] = tuple(_ARCHS)


# ---------------------------------------------------------------------------------------
# Public entry points


def _check_parallel(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PARALLEL:
        raise ValueError(
            f"{name} must be a positive integer (at most {MAX_PARALLEL}), got {_show(value)}"
        )
    return value


def _check_fmt(fmt: Any) -> None:
    if fmt is None:
        return
    if not isinstance(fmt, str):
        raise TypeError(f"fmt must be one of {FORMATS} or None, got {_show(fmt)}")
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS} or None, got {_clip(fmt)}")


def _unsupported(config: Mapping[str, Any], model_type: Any) -> str:
    arch = config.get("architectures")
    if isinstance(arch, list) and len(arch) <= 8 and all(isinstance(a, str) for a in arch):
        arch_text = "[" + ", ".join(_clip(a) for a in arch) + "]"
    else:
        arch_text = _clip(arch) if isinstance(arch, str) else _show(arch)
    if model_type is None:
        what = "config lacks 'model_type'"
    elif isinstance(model_type, str):
        what = f"unsupported model_type {_clip(model_type)}"
    else:
        what = f"model_type must be a string, got {_show(model_type)}"
    return f"{what} (architectures={arch_text}); supported model types: {', '.join(SUPPORTED)}"


def _dedup(groups: _Groups) -> list[ModelShape]:
    merged: dict[tuple, ModelShape] = {}
    for layer, count in groups:
        for s in layer:
            prev = merged.get(s.dedup_key)
            if prev is None:
                merged[s.dedup_key] = replace(s, count=count)
                continue
            names = prev.name.split("+")
            name = prev.name if s.name in names else f"{prev.name}+{s.name}"
            merged[s.dedup_key] = replace(prev, name=name, count=prev.count + count)
    return list(merged.values())


def _check_layout(layout: Any) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        shown = _clip(layout) if isinstance(layout, str) else _show(layout)
        raise ValueError(f"layout must be one of {LAYOUTS}, got {shown}")
    return layout


def _union(first: list[ModelShape], second: list[ModelShape]) -> list[ModelShape]:
    """The shapes of ``first`` and then those of ``second`` it lacks; a shape in both keeps the
    larger count and the distinct names of both."""
    merged = {s.dedup_key: s for s in first}
    for s in second:
        prev = merged.get(s.dedup_key)
        if prev is None:
            merged[s.dedup_key] = s
            continue
        names = prev.name.split("+")
        name = "+".join(names + [x for x in s.name.split("+") if x not in names])
        merged[s.dedup_key] = replace(prev, name=name, count=max(prev.count, s.count))
    return list(merged.values())


def _layout_shapes(config: Mapping[str, Any], model_type: str, values: dict[str, int], tp: int,
                   ep: int, include_lm_head: bool, fmt: str | None, layout: str) -> list[ModelShape]:
    """The deduplicated shapes of one layout (``"vllm"`` or ``"transformers"``)."""
    build = _ARCHS[model_type][1]
    m = _Model(config, model_type, values, tp, ep, layout)
    groups = build(m)
    if include_lm_head:
        vocab = m.need("vocab_size", "the size of the lm_head")
        hidden = m.v["hidden_size"]
        groups.append(([m.linear("lm_head", -(-vocab // tp), hidden, "hidden_size")], 1))
    if fmt is not None:
        _check_blocks(m, fmt)
    return _dedup(groups)


def model_shapes(config: Mapping[str, Any], tp: int = 1, ep: int = 1,
                 include_lm_head: bool = False, fmt: str | None = None,
                 layout: str = "vllm", act: str | None = None) -> list[ModelShape]:
    """Every FP4 GEMM / MoE shape one rank of the model runs, deduplicated with counts.

    ``config`` is a Hugging Face ``config.json`` dict (see :func:`load_config`); ``tp`` the
    tensor-parallel size, ``ep`` the expert-parallel size (MoE experts split across ``ep``
    ranks instead of splitting each expert by ``tp``). ``include_lm_head`` adds the output
    projection (column-parallel, ``ceil(vocab_size / tp)`` rows per rank, as with a padded
    vocabulary). ``fmt`` (``"nvfp4"`` or ``"mxfp4"``) also checks that every K is a whole
    number of the format's blocks. ``layout`` (one of :data:`LAYOUTS`) picks the modules:
    ``"vllm"`` fused ``qkv_proj`` / ``gate_up_proj``, ``"transformers"`` the unfused Hugging
    Face projections, ``"both"`` the union of the two. ``act="fp8"``: the shapes of a model run
    with FP8 activations (ops ``linear_fp8`` / ``moe_fp8``, other problems than the bf16 ones).
    A config that breaks any of this raises ``ValueError`` naming the field (``TypeError`` for a
    ``config`` that is not a mapping).
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    tp = _check_parallel("tp", tp)
    ep = _check_parallel("ep", ep)
    if not isinstance(include_lm_head, bool):
        raise TypeError(f"include_lm_head must be True or False, got {_show(include_lm_head)}")
    _check_fmt(fmt)
    layout = _check_layout(layout)
    if act is not None and act != "fp8":
        raise ValueError(f"act must be None or 'fp8', got {_show(act)}")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in _ARCHS:
        raise ValueError(_unsupported(config, model_type))
    values = _validate(config, model_type, _ARCHS[model_type][0])
    for part in (config, config.get("text_config")):
        if isinstance(part, Mapping):
            _expert_counts(part)
    layouts = ("vllm", "transformers") if layout == "both" else (layout,)
    shapes: list[ModelShape] = []
    for one in layouts:
        shapes = _union(shapes, _layout_shapes(config, model_type, values, tp, ep,
                                               include_lm_head, fmt, one))
    if act is not None:
        shapes = [replace(s, op=op_for(s.op, act)) for s in shapes]
    return shapes


_COLUMNS = ("op", "name", "N", "K", "experts", "topk", "I", "H", "count")


def shapes_table(shapes: Sequence[ModelShape]) -> str:
    """A fixed-width text table of ``shapes`` (one row each), for ``tune --dry-run``."""
    rows = [_COLUMNS]
    for s in shapes:
        moe = is_moe(s.op)
        rows.append((
            s.op, s.name, str(s.n), str(s.k),
            (f"{s.experts} of {s.experts_global}" if s.experts_global else str(s.experts)) if moe else "-",
            str(s.topk) if moe else "-",
            str(s.intermediate) if moe else "-", str(s.hidden) if moe else "-",
            str(s.count),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]

    def fmt(row: Sequence[str]) -> str:
        cells = [
            cell.ljust(w) if i < 2 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ]
        return "  ".join(cells).rstrip()

    lines = [fmt(rows[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt(row) for row in rows[1:]]
    return "\n".join(lines) + "\n"
