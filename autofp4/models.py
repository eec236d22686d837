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
- Shapes are deduplicated by ``(op, n, k, experts, topk)``: ``count`` is the number of
  layers (times per-layer uses) summed over the merged entries, and ``name`` joins the
  distinct names with ``+``. The order is the order of first appearance, layer by layer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

from .problem import ProblemKey

__all__ = [
    "ModelShape",
    "SUPPORTED",
    "load_config",
    "model_shapes",
    "shapes_table",
]


@dataclass(frozen=True)
class ModelShape:
    """One GEMM (``op == "linear"``) or MoE block (``op == "moe"``) of a model, per TP rank.

    For ``linear``: the weight is ``[n, k]`` and ``experts == topk == 0``. For ``moe``:
    ``n == 2 * intermediate`` (fused gate/up ``w13 [experts, 2I, H]``), ``k == hidden``;
    the down projection ``w2 [experts, H, I]`` belongs to the same op. ``count`` is how many
    layers use the shape.
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

    def __post_init__(self) -> None:
        if self.op not in ("linear", "moe"):
            raise ValueError(f"op must be 'linear' or 'moe', got {self.op!r}")
        if self.n <= 0 or self.k <= 0 or self.count <= 0:
            raise ValueError(
                f"{self.name}: n, k and count must be positive, "
                f"got n={self.n}, k={self.k}, count={self.count}"
            )
        if self.op == "moe":
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
        elif self.experts or self.topk:
            raise ValueError(f"{self.name}: linear shapes have no experts/topk")

    @property
    def dedup_key(self) -> tuple[str, int, int, int, int]:
        return (self.op, self.n, self.k, self.experts, self.topk)

    def problem_key(self, fmt: str, dtype: str) -> ProblemKey:
        """The tuner's :class:`~autofp4.problem.ProblemKey` for this shape."""
        return ProblemKey(self.op, fmt, dtype, self.n, self.k, self.experts, self.topk)


# ---------------------------------------------------------------------------------------
# Loading


def load_config(path_or_dict: Union[str, Path, Mapping[str, Any]]) -> dict:
    """Read a Hugging Face ``config.json``.

    Accepts a mapping (returned as a new dict), a path to a JSON file, or a directory that
    contains ``config.json``.
    """
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    if not isinstance(path_or_dict, (str, Path)):
        raise TypeError(
            f"load_config expects a path or a dict, got {type(path_or_dict).__name__}"
        )
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"model config not found: {path} "
            "(expected a config.json file or a directory containing one)"
        )
    text = path.read_text(encoding="utf-8")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"invalid JSON in {path}: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"{path}: expected a JSON object at the top level, got {type(config).__name__}"
        )
    return config


# ---------------------------------------------------------------------------------------
# Config field access


def _get_int(cfg: Mapping[str, Any], key: str, *, default: Any = ...,
             allow_zero: bool = False) -> int:
    value = cfg.get(key, None)
    if value is None:
        if default is ...:
            raise ValueError(f"config (model_type={cfg.get('model_type')!r}) lacks {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValueError(f"config field {key!r} must be an integer, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"config field {key!r} must be positive, got {value}")
    return value


def _first_int(cfg: Mapping[str, Any], keys: Sequence[str]) -> int:
    for key in keys:
        if cfg.get(key) is not None:
            return _get_int(cfg, key)
    raise ValueError(
        f"config (model_type={cfg.get('model_type')!r}) lacks all of {list(keys)}"
    )


def _split(value: int, parts: int, what: str, by: str) -> int:
    if value % parts:
        raise ValueError(f"{what}={value} is not divisible by {by}={parts}")
    return value // parts


# ---------------------------------------------------------------------------------------
# Building blocks (each returns the shapes of one layer, count 1)


def _attention(cfg: Mapping[str, Any], tp: int) -> list[ModelShape]:
    hidden = _get_int(cfg, "hidden_size")
    heads = _get_int(cfg, "num_attention_heads")
    kv_heads = _get_int(cfg, "num_key_value_heads", default=heads)
    head_dim = _get_int(cfg, "head_dim", default=0, allow_zero=True) or _split(
        hidden, heads, "hidden_size", "num_attention_heads"
    )
    local_heads = _split(heads, tp, "num_attention_heads", "tp")
    if kv_heads >= tp:
        local_kv = _split(kv_heads, tp, "num_key_value_heads", "tp")
    else:  # replicated: every rank holds one kv head, tp must be a multiple of kv_heads
        _split(tp, kv_heads, "tp", "num_key_value_heads")
        local_kv = 1
    return [
        ModelShape("linear", "qkv_proj", (local_heads + 2 * local_kv) * head_dim, hidden),
        ModelShape("linear", "o_proj", hidden, local_heads * head_dim),
    ]


def _mla_attention(cfg: Mapping[str, Any], tp: int) -> list[ModelShape]:
    hidden = _get_int(cfg, "hidden_size")
    heads = _get_int(cfg, "num_attention_heads")
    q_lora = _get_int(cfg, "q_lora_rank", default=0, allow_zero=True)
    kv_lora = _get_int(cfg, "kv_lora_rank")
    nope = _get_int(cfg, "qk_nope_head_dim")
    rope = _get_int(cfg, "qk_rope_head_dim")
    v_dim = _get_int(cfg, "v_head_dim")
    local_heads = _split(heads, tp, "num_attention_heads", "tp")
    shapes = []
    if q_lora:
        shapes.append(ModelShape("linear", "q_a_proj", q_lora, hidden))
        shapes.append(ModelShape("linear", "q_b_proj", local_heads * (nope + rope), q_lora))
    else:
        shapes.append(ModelShape("linear", "q_proj", local_heads * (nope + rope), hidden))
    shapes += [
        ModelShape("linear", "kv_a_proj_with_mqa", kv_lora + rope, hidden),
        ModelShape("linear", "kv_b_proj", local_heads * (nope + v_dim), kv_lora),
        ModelShape("linear", "o_proj", hidden, local_heads * v_dim),
    ]
    return shapes


def _mlp(hidden: int, intermediate: int, tp: int, prefix: str = "",
         what: str = "intermediate_size") -> list[ModelShape]:
    local = _split(intermediate, tp, what, "tp")
    return [
        ModelShape("linear", prefix + "gate_up_proj", 2 * local, hidden),
        ModelShape("linear", prefix + "down_proj", hidden, local),
    ]


def _moe(hidden: int, intermediate: int, experts: int, topk: int, tp: int, ep: int,
         what: str) -> ModelShape:
    if topk > experts:
        raise ValueError(f"experts per token ({topk}) exceeds the number of experts ({experts})")
    if ep > 1:
        local_experts = _split(experts, ep, "number of experts", "ep")
        local_inter = intermediate
    else:
        local_experts = experts
        local_inter = _split(intermediate, tp, what, "tp")
    return ModelShape(
        "moe", "experts", 2 * local_inter, hidden,
        experts=local_experts, topk=min(topk, local_experts),
        intermediate=local_inter, hidden=hidden,
    )


# ---------------------------------------------------------------------------------------
# Architectures (each returns the list of per-layer shape lists)


def _dense_layers(cfg: Mapping[str, Any], tp: int, ep: int) -> list[list[ModelShape]]:
    layers = _get_int(cfg, "num_hidden_layers")
    hidden = _get_int(cfg, "hidden_size")
    layer = _attention(cfg, tp) + _mlp(hidden, _get_int(cfg, "intermediate_size"), tp)
    return [layer] * layers


def _mixtral_layers(cfg: Mapping[str, Any], tp: int, ep: int) -> list[list[ModelShape]]:
    layers = _get_int(cfg, "num_hidden_layers")
    hidden = _get_int(cfg, "hidden_size")
    moe = _moe(hidden, _get_int(cfg, "intermediate_size"), _get_int(cfg, "num_local_experts"),
               _get_int(cfg, "num_experts_per_tok"), tp, ep, "intermediate_size")
    return [_attention(cfg, tp) + [moe]] * layers


def _mixed_layers(
    cfg: Mapping[str, Any], tp: int, layers: int, hidden: int, attention: list[ModelShape],
    is_moe: Callable[[int], bool], make_moe: Callable[[], list[ModelShape]],
) -> list[list[ModelShape]]:
    """Layers that are MoE where ``is_moe(i)`` and a dense MLP of ``intermediate_size`` elsewhere
    (each kind's shapes built once, on first use, so a config without dense layers needs no
    ``intermediate_size``)."""
    moe = dense = None
    out = []
    for i in range(layers):
        if is_moe(i):
            if moe is None:
                moe = make_moe()
            out.append(attention + moe)
        else:
            if dense is None:
                dense = _mlp(hidden, _get_int(cfg, "intermediate_size"), tp)
            out.append(attention + dense)
    return out


def _qwen3_moe_layers(cfg: Mapping[str, Any], tp: int, ep: int) -> list[list[ModelShape]]:
    layers = _get_int(cfg, "num_hidden_layers")
    hidden = _get_int(cfg, "hidden_size")
    experts = _get_int(cfg, "num_experts", default=0, allow_zero=True)
    step = _get_int(cfg, "decoder_sparse_step", default=1)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    return _mixed_layers(
        cfg, tp, layers, hidden, _attention(cfg, tp),
        lambda i: experts > 0 and i not in mlp_only and (i + 1) % step == 0,
        lambda: [_moe(hidden, _get_int(cfg, "moe_intermediate_size"), experts,
                      _get_int(cfg, "num_experts_per_tok"), tp, ep, "moe_intermediate_size")],
    )


def _deepseek_layers(cfg: Mapping[str, Any], tp: int, ep: int) -> list[list[ModelShape]]:
    layers = _get_int(cfg, "num_hidden_layers")
    hidden = _get_int(cfg, "hidden_size")
    experts = _get_int(cfg, "n_routed_experts", default=0, allow_zero=True)
    first_dense = _get_int(cfg, "first_k_dense_replace", default=0, allow_zero=True)
    freq = _get_int(cfg, "moe_layer_freq", default=1)
    shared = _get_int(cfg, "n_shared_experts", default=0, allow_zero=True)

    def make_moe() -> list[ModelShape]:
        moe_inter = _get_int(cfg, "moe_intermediate_size")
        shapes = [_moe(hidden, moe_inter, experts, _get_int(cfg, "num_experts_per_tok"),
                       tp, ep, "moe_intermediate_size")]
        if shared:
            shapes += _mlp(hidden, shared * moe_inter, tp, prefix="shared_experts.",
                           what="n_shared_experts * moe_intermediate_size")
        return shapes

    return _mixed_layers(
        cfg, tp, layers, hidden, _mla_attention(cfg, tp),
        lambda i: experts > 0 and i >= first_dense and i % freq == 0, make_moe,
    )


def _gpt_oss_layers(cfg: Mapping[str, Any], tp: int, ep: int) -> list[list[ModelShape]]:
    layers = _get_int(cfg, "num_hidden_layers")
    hidden = _get_int(cfg, "hidden_size")
    moe = _moe(hidden, _get_int(cfg, "intermediate_size"), _get_int(cfg, "num_local_experts"),
               _first_int(cfg, ("num_experts_per_tok", "experts_per_token")), tp, ep,
               "intermediate_size")
    return [_attention(cfg, tp) + [moe]] * layers


_ARCHS: dict[str, Callable[[Mapping[str, Any], int, int], list[list[ModelShape]]]] = {
    "llama": _dense_layers,
    "mistral": _dense_layers,
    "qwen2": _dense_layers,
    "qwen3": _dense_layers,
    "mixtral": _mixtral_layers,
    "qwen3_moe": _qwen3_moe_layers,
    "deepseek_v2": _deepseek_layers,
    "deepseek_v3": _deepseek_layers,
    "gpt_oss": _gpt_oss_layers,
}

SUPPORTED: tuple[str, ...] = tuple(_ARCHS)


# ---------------------------------------------------------------------------------------
# Public entry points


def _check_parallel(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _dedup(shapes: Sequence[ModelShape]) -> list[ModelShape]:
    merged: dict[tuple, ModelShape] = {}
    for s in shapes:
        prev = merged.get(s.dedup_key)
        if prev is None:
            merged[s.dedup_key] = s
            continue
        names = prev.name.split("+")
        name = prev.name if s.name in names else f"{prev.name}+{s.name}"
        merged[s.dedup_key] = ModelShape(
            prev.op, name, prev.n, prev.k, prev.experts, prev.topk,
            prev.count + s.count, prev.intermediate, prev.hidden,
        )
    return list(merged.values())


def model_shapes(config: Mapping[str, Any], tp: int = 1, ep: int = 1,
                 include_lm_head: bool = False) -> list[ModelShape]:
    """Every FP4 GEMM / MoE shape one rank of the model runs, deduplicated with counts.

    ``config`` is a Hugging Face ``config.json`` dict (see :func:`load_config`); ``tp`` the
    tensor-parallel size, ``ep`` the expert-parallel size (MoE experts split across ``ep``
    ranks instead of splitting each expert by ``tp``). ``include_lm_head`` adds the output
    projection (column-parallel, ``ceil(vocab_size / tp)`` rows per rank, as with a padded
    vocabulary).
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    tp = _check_parallel("tp", tp)
    ep = _check_parallel("ep", ep)
    model_type = config.get("model_type")
    if model_type not in _ARCHS:
        raise ValueError(
            f"unsupported model_type {model_type!r} "
            f"(architectures={config.get('architectures')!r}); "
            f"supported model types: {', '.join(SUPPORTED)}"
        )
    flat = [shape for layer in _ARCHS[model_type](config, tp, ep) for shape in layer]
    if include_lm_head:
        vocab = _get_int(config, "vocab_size")
        hidden = _get_int(config, "hidden_size")
        flat.append(ModelShape("linear", "lm_head", -(-vocab // tp), hidden))
    return _dedup(flat)


_COLUMNS = ("op", "name", "N", "K", "experts", "topk", "I", "H", "count")


def shapes_table(shapes: Sequence[ModelShape]) -> str:
    """A fixed-width text table of ``shapes`` (one row each), for ``tune --dry-run``."""
    rows = [_COLUMNS]
    for s in shapes:
        moe = s.op == "moe"
        rows.append((
            s.op, s.name, str(s.n), str(s.k),
            str(s.experts) if moe else "-", str(s.topk) if moe else "-",
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
