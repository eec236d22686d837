"""The model-config reader under generated bad input.

Every example config in ``examples/`` is mutated field by field (wrong types, 0, negative, huge,
not a multiple of the FP4 block), field by field dropped, nested deeply, padded into size bombs,
truncated and bit-flipped as a file. Each case must end in a ``ValueError``/``TypeError`` whose
message names the field (or the file), or in a correct result; memory stays bounded throughout.

What each architecture reads is written out here from the Hugging Face / vLLM model definitions,
independently of ``autofp4.models``: the fields a layer needs (a missing one is an error), the
optional ones with their defaults, and the rest (which must not change the result at all).
"""
from __future__ import annotations

import io
import json
import math
import os
import random
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from autofp4 import models
from autofp4.cli import main
from autofp4.problem import BLOCK_SIZE, FORMATS

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.json"))
MB = 2**20
PEAK_LIMIT = 32 * MB  # what one case may allocate, bombs included

FAMILY = {
    "llama": "dense", "mistral": "dense", "qwen2": "dense", "qwen3": "dense", "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe", "deepseek_v2": "deepseek", "deepseek_v3": "deepseek", "gpt_oss": "gpt_oss",
}
_ATTN = ("hidden_size", "num_attention_heads", "num_hidden_layers")
REQUIRED = {  # a layer of the architecture cannot be built without these
    "dense": _ATTN + ("intermediate_size",),
    "mixtral": _ATTN + ("intermediate_size", "num_local_experts", "num_experts_per_tok"),
    "qwen3_moe": _ATTN + ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    # intermediate_size: the dense layers in front (the example has first_k_dense_replace 3)
    "deepseek": _ATTN + ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                         "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                         "intermediate_size"),
    "gpt_oss": _ATTN + ("intermediate_size", "num_local_experts"),
}
_GQA = ("num_key_value_heads", "head_dim")
OPTIONAL = {  # read when present (a bad value is an error); absent or null: the default
    "dense": _GQA, "mixtral": _GQA,
    "qwen3_moe": _GQA + ("decoder_sparse_step", "mlp_only_layers"),
    "deepseek": ("q_lora_rank", "first_k_dense_replace", "moe_layer_freq", "n_shared_experts"),
    "gpt_oss": _GQA + ("num_experts_per_tok",),  # else experts_per_token
}
LENIENT = {  # not needed by the example's layers: a bad value may be an error, absence changes nothing
    "dense": (), "mixtral": (), "deepseek": (),
    "qwen3_moe": ("intermediate_size",),  # no dense layer in the example
    "gpt_oss": ("experts_per_token",),  # num_experts_per_tok comes first
}
DEFAULTS: dict[str, Callable[[dict], Any]] = {  # an explicit value equal to the field's absence
    "num_key_value_heads": lambda c: c["num_attention_heads"],
    "head_dim": lambda c: c["hidden_size"] // c["num_attention_heads"],
    "decoder_sparse_step": lambda c: 1,
    "mlp_only_layers": lambda c: [],
    "first_k_dense_replace": lambda c: 0,
    "moe_layer_freq": lambda c: 1,
    "n_shared_experts": lambda c: 0,
    "num_experts_per_tok": lambda c: c["experts_per_token"],
}
ZERO_IS_ABSENT = {"head_dim", "q_lora_rank", "n_shared_experts", "first_k_dense_replace"}


def shapes(cfg: Any, tp: int = 1, ep: int = 1, fmt: str | None = None, lm_head: bool = False):
    return models.model_shapes(cfg, tp=tp, ep=ep, include_lm_head=lm_head, fmt=fmt)


def sane(result: list, fmt: str | None) -> bool:
    """What every accepted result must be: positive int shapes, K a multiple of the format's
    block, within what a GPU can hold, each (op, n, k, experts, topk) once."""
    bs = BLOCK_SIZE[fmt] if fmt else 1
    keys = set()
    for s in result:
        for v in (s.n, s.k, s.count, s.experts, s.topk):
            if isinstance(v, bool) or not isinstance(v, int):
                return False
        if not (0 < s.n < 2**31 and 0 < s.k < 2**31 and s.k % bs == 0 and 0 < s.count < 2**20):
            return False
        if s.op == "moe" and (s.intermediate % bs or not 0 < s.topk <= s.experts):
            return False
        keys.add(s.dedup_key)
    return len(keys) == len(result)


# --------------------------------------------------------------------------------------------
# cases


@dataclass
class Case:
    name: str
    build: Callable[[Path], Any]  # tmp dir -> a config mapping, or a path to a file
    expect: str  # "reject": a clear error; "accept": a correct result; "either": one of the two
    names: tuple[str, ...] = ()  # a clear error names one of these
    want: Callable[[], list] | None = None  # the correct result, where known
    tp: int = 1
    ep: int = 1
    fmt: str | None = None
    lm_head: bool = False
    cli: bool = True  # a config the command line can be given too


def _params(rng: random.Random, family: str) -> dict:
    moe = family != "dense"
    return dict(tp=rng.choice((1, 2)), ep=rng.choice((1, 2)) if moe else 1,
                fmt=rng.choice(FORMATS + (None,)), lm_head=rng.random() < 0.3)


def _bad_values(v: Any, rng: random.Random) -> Iterator[tuple[str, Any]]:
    """Values no integer field of a model config may hold."""
    base = v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 4096
    yield "str", str(base)
    yield "float", float(base)
    yield "frac", base + 0.5
    yield "1e9", 1e9
    yield "nan", math.nan
    yield "inf", math.inf
    yield "true", True
    yield "false", False
    yield "list", [base]
    yield "dict", {"value": base}
    yield "negative", -base
    yield "neg-random", -rng.randint(1, 2**40)
    yield "int-1e9", 10**9
    yield "2**63", 2**63
    yield "10**5000", 10**5000
    yield "str-random", "".join(rng.choice("0123456789abc ") for _ in range(rng.randint(0, 12)))


def _other_values(v: Any, fmt: str | None, rng: random.Random) -> Iterator[tuple[str, Any]]:
    """Values that may or may not make a valid model: off the block grid, random ones."""
    base = v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 64
    bs = BLOCK_SIZE[fmt or "nvfp4"]
    yield "half-block", base + bs // 2
    yield "off-block", base + rng.randint(1, bs - 1)
    yield "random", rng.randint(1, 2 * base + 2)
    yield "random-block", bs * rng.randint(1, max(1, 2 * base // bs))


def _numeric_paths(cfg: dict) -> Iterator[tuple[str, ...]]:
    for k, v in cfg.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            yield (k,)
        elif isinstance(v, dict):
            for k2, v2 in v.items():
                if isinstance(v2, (int, float)) and not isinstance(v2, bool):
                    yield (k, k2)


def _with(cfg: dict, path: tuple[str, ...], value: Any, drop: bool = False) -> dict:
    out = dict(cfg)
    if len(path) == 2:
        out[path[0]] = _with(out[path[0]], path[1:], value, drop)
    elif drop:
        out.pop(path[0], None)
    else:
        out[path[0]] = value
    return out


def _role(family: str, key: str, lm_head: bool) -> str:
    if key == "model_type" or key in REQUIRED[family] or (key == "vocab_size" and lm_head):
        return "required"
    if key in OPTIONAL[family]:
        return "optional"
    if key in LENIENT[family] or key == "vocab_size":
        return "lenient"
    return "unused"


def example_cases(path: Path, rng: random.Random) -> Iterator[Case]:
    """Every numeric field of one example mutated, every field dropped, absent optional fields set."""
    base = json.loads(path.read_text())
    family = FAMILY[base["model_type"]]
    paths = list(_numeric_paths(base))
    paths += [(k,) for k in OPTIONAL[family] if k not in base]
    for p in paths:
        key = p[0] if len(p) == 1 else p[0] + "." + p[1]
        old = base.get(p[0]) if len(p) == 1 else base[p[0]][p[1]]
        for label, value in list(_bad_values(old, rng)) + [("null", None), ("zero", 0)]:
            yield _mutation(f"{path.stem}:{key}={label}", base, family, p, value, rng)
        for label, value in _other_values(old, rng.choice(FORMATS), rng):
            yield _mutation(f"{path.stem}:{key}={label}", base, family, p, value, rng, maybe=True)
    for k in list(base):
        yield _mutation(f"{path.stem}:-{k}", base, family, (k,), None, rng, drop=True)
    if family == "qwen3_moe":
        yield from _mlp_only_cases(path.stem, base, rng)
    if family == "gpt_oss":  # neither spelling of top-k
        cfg = {k: v for k, v in base.items() if k not in ("num_experts_per_tok", "experts_per_token")}
        yield Case(f"{path.stem}:-topk", lambda _t, c=cfg: c, "reject",
                   ("num_experts_per_tok", "experts_per_token"), **_params(rng, family))


def _mutation(name: str, base: dict, family: str, p: tuple[str, ...], value: Any, rng: random.Random,
              drop: bool = False, maybe: bool = False) -> Case:
    kw = _params(rng, family)
    cfg = _with(base, p, value, drop)
    role = _role(family, p[0], kw["lm_head"]) if len(p) == 1 else "unused"
    same = _want(base, kw)
    if role == "unused":
        return Case(name, lambda _t: cfg, "accept", (), same, **kw)
    if role == "lenient":
        return Case(name, lambda _t: cfg, "either", (p[0],), same, **kw)
    absent = drop or value is None or (value == 0 and p[0] in ZERO_IS_ABSENT and type(value) is int)
    if role == "optional" and absent:
        return Case(name, lambda _t: cfg, "either" if maybe else "accept", (p[0],), _default_want(cfg, p[0], kw), **kw)
    if absent or not maybe:
        return Case(name, lambda _t: cfg, "reject", (p[0],), None, **kw)
    return Case(name, lambda _t: cfg, "either", (p[0],), None, **kw)


def _want(cfg: dict, kw: dict) -> Callable[[], list]:
    return lambda: shapes(cfg, kw["tp"], kw["ep"], kw["fmt"], kw["lm_head"])


def _default_want(cfg: dict, key: str, kw: dict) -> Callable[[], list] | None:
    dropped = {k: v for k, v in cfg.items() if k != key}
    if key not in DEFAULTS:
        return _want(dropped, kw)
    try:
        explicit = dict(dropped, **{key: DEFAULTS[key](dropped)})
    except KeyError:
        return None
    return _want(explicit, kw)


def _mlp_only_cases(stem: str, base: dict, rng: random.Random) -> Iterator[Case]:
    layers = base["num_hidden_layers"]
    bad = [["0"], [True], [-1], [layers], [10**9], [2**63], [[0]], [0.0], "0,1", {"0": 1}, 5, 1.5]
    for i, value in enumerate(bad):
        cfg = dict(base, mlp_only_layers=value)
        yield Case(f"{stem}:mlp_only_layers=bad{i}", lambda _t, c=cfg: c, "reject", ("mlp_only_layers",),
                   **_params(rng, "qwen3_moe"))
    for i in range(8):  # valid ones: that many dense layers, the rest MoE
        dense = sorted(rng.sample(range(layers), rng.randint(1, layers - 1)))
        cfg = dict(base, mlp_only_layers=dense)
        yield Case(f"{stem}:mlp_only_layers=random{i}", lambda _t, c=cfg: c, "accept", (),
                   _Counts(dense=len(dense), moe=layers - len(dense)), **_params(rng, "qwen3_moe"))


@dataclass
class _Counts:
    """A 'want' that checks how many layers are dense and how many MoE, not a whole list."""

    dense: int
    moe: int

    def __call__(self) -> "_Counts":
        return self

    def matches(self, result: list) -> bool:
        by = {name: s.count for s in result for name in s.name.split("+")}
        return by.get("experts") == self.moe and by.get("gate_up_proj") == self.dense


def model_type_cases(rng: random.Random) -> Iterator[Case]:
    base = json.loads(EXAMPLES[0].read_text())
    values = ["gpt2", "", "LLAMA", " llama", "llama\n", 7, None, ["llama"], {"llama": 1}, True, 1.5,
              "".join(rng.choice("abcdefghijklmnop_0123") for _ in range(rng.randint(1, 40)))]
    for i, v in enumerate(values):
        cfg = dict(base, model_type=v)
        yield Case(f"model_type={i}", lambda _t, c=cfg: c, "reject", ("model_type",))
    for i, v in enumerate([[], "config", 42, None, ("model_type", "llama")]):
        yield Case(f"config-not-a-dict={i}", lambda _t, c=v: c, "reject", ("config",), cli=False)


def parallel_cases(rng: random.Random) -> Iterator[Case]:
    for path in EXAMPLES:
        cfg = json.loads(path.read_text())
        for name in ("tp", "ep"):
            values = {"0": 0, "-1": -1, "neg-random": -rng.randint(2, 2**40), "2.0": 2.0, "True": True,
                      "'2'": "2", "None": None, "2**63": 2**63, "10**5000": 10**5000, "[2]": [2]}
            for label, v in values.items():
                kw = {"tp": 1, "ep": 1, name: v}
                yield Case(f"{path.stem}:{name}={label}", lambda _t, c=cfg: c, "reject",
                           (f"{name} must", f"{name}="), cli=False, **kw)


def _deep(depth: int, seed: float) -> str:
    """``depth`` levels of objects and arrays, mixed at random."""
    rng = random.Random(seed)
    opens, closes = [], []
    for _ in range(depth):
        if rng.random() < 0.5:
            opens.append('{"a":')
            closes.append("}")
        else:
            opens.append("[")
            closes.append("]")
    return "".join(opens) + "1" + "".join(reversed(closes))


def file_cases(rng: random.Random) -> Iterator[Case]:
    """Config files: deep nesting, size bombs, truncations, flipped bytes, non-UTF-8."""
    limit = models.MAX_CONFIG_BYTES
    for path in EXAMPLES:
        text = path.read_text()
        cfg = json.loads(text)
        same = _want(cfg, dict(tp=1, ep=1, fmt=None, lm_head=False))
        head = text.rstrip()[:-1] + ', "extra": '

        for depth in (rng.randint(40, 100), rng.randint(1000, 5000), rng.randint(50_000, 150_000)):
            yield Case(f"{path.stem}:deep{depth}", _writer(lambda h=head, d=depth, s=rng.random(): h + _deep(d, s) + "}"),
                       "reject", ("nest", "deep", "depth"))
        top = rng.randint(10_000, 900_000)
        yield Case(f"{path.stem}:top-deep", _writer(lambda n=top: "[" * n), "reject", ("nest", "deep", "depth"))
        yield Case(f"{path.stem}:deep-unterminated", _writer(lambda n=top: "[" * n + '"'), "reject",
                   ("nest", "deep", "depth"))
        wide = rng.randint(100_001, 300_000)  # shallow, but more objects and arrays than any config
        yield Case(f"{path.stem}:wide{wide}", _writer(lambda h=head, n=wide: h + "[" + "[]," * n + "[]]}"),
                   "reject", ("objects and arrays",))
        tricky = [json.dumps("".join(rng.choice('[[[{{{]}"\\ab') for _ in range(rng.randint(0, 300))))
                  for _ in range(20)]  # brackets, quotes and backslashes inside strings count for nothing
        yield Case(f"{path.stem}:bracket-strings", _writer(lambda h=head, t=tricky: h + "[" + ",".join(t) + "]}"),
                   "accept", (), same)
        shallow = rng.randint(1, 8)
        yield Case(f"{path.stem}:shallow{shallow}", _writer(lambda h=head, d=shallow, s=rng.random(): h + _deep(d, s) + "}"),
                   "accept", (), same)
        for i in range(6):  # truncated
            cut = rng.randint(0, len(text) - 2)
            yield Case(f"{path.stem}:cut{cut}", _writer(lambda t=text[:cut]: t), "reject", ("JSON", "config.json"))
        for i in range(6):  # a flipped byte: invalid JSON, or a changed value
            data = bytearray(text.encode())
            at = rng.randrange(len(data))
            data[at] = rng.choice(b'{}[]":,0123456789.e-xn ')
            flipped = bytes(data)
            if flipped != text.encode():
                yield Case(f"{path.stem}:flip{at}", _bytes_writer(flipped), "either",
                           ("JSON", "config.json", *cfg))
        yield Case(f"{path.stem}:not-utf8", _bytes_writer(text.encode()[:200] + bytes([0xff, 0xfe]) + b"}"),
                   "reject", ("config.json",))
        pad = limit - len(text.encode()) - 64  # just under the limit: read, and correct
        yield Case(f"{path.stem}:pad-under-limit", _writer(lambda h=head, n=pad: h + '"' + "x" * n + '"}'),
                   "accept", (), same)
        yield Case(f"{path.stem}:pad-over-limit", _padded_writer(head, limit + 1 + rng.randint(0, 4096)),
                   "reject", ("bytes", "config.json"))
    yield Case("sparse-100MB", _sparse_writer(100 * MB), "reject", ("bytes", "config.json"))
    yield Case("long-number", _bytes_writer(b'{"model_type": "llama", "hidden_size": ' + b"9" * 5000 + b"}"),
               "reject", ("JSON", "config.json", "hidden_size"))
    yield Case("nan-in-file", _bytes_writer(
        json.dumps(dict(json.loads(EXAMPLES[0].read_text()), hidden_size=math.nan)).encode()),
        "reject", ("hidden_size",))
    yield Case("1e9-layers-file", _bytes_writer(
        json.dumps(dict(json.loads(EXAMPLES[0].read_text()), num_hidden_layers=1e9)).encode()),
        "reject", ("num_hidden_layers",))


def _writer(content: Callable[[], str]):
    """Writes ``content()`` (made only when the case runs) to ``config.json``."""
    def build(tmp: Path) -> Path:
        p = tmp / "config.json"
        p.write_text(content())
        return p
    return build


def _bytes_writer(data: bytes):
    def build(tmp: Path) -> Path:
        p = tmp / "config.json"
        p.write_bytes(data)
        return p
    return build


def _padded_writer(head: str, size: int):
    """A valid JSON file of ``size`` bytes, written in pieces (never held in memory whole)."""
    def build(tmp: Path) -> Path:
        p = tmp / "config.json"
        with p.open("w") as f:
            f.write(head + '"')
            left = size - len(head.encode()) - 3
            while left > 0:
                f.write("x" * min(left, MB))
                left -= MB
            f.write('"}')
        return p
    return build


def _sparse_writer(size: int):
    def build(tmp: Path) -> Path:
        p = tmp / "config.json"
        with p.open("wb") as f:
            f.write(b'{"model_type": "llama", "pad": "')
            f.truncate(size)  # the rest reads as zero bytes, never written
        return p
    return build


def bomb_cases(rng: random.Random) -> Iterator[Case]:
    """Values that would drive memory or time: a billion layers, 100 MB strings."""
    for path in EXAMPLES:
        cfg = json.loads(path.read_text())
        for layers in (10**9, 2**40, 10**18, rng.randint(10**6, 10**12)):
            c = dict(cfg, num_hidden_layers=layers)
            yield Case(f"{path.stem}:layers={layers}", lambda _t, c=c: c, "reject", ("num_hidden_layers",))
    base = json.loads(EXAMPLES[0].read_text())
    big = 100 * MB
    yield Case("model_type-100MB", lambda _t: dict(base, model_type="x" * big), "reject", ("model_type",),
               cli=False)
    yield Case("hidden_size-100MB", lambda _t: dict(base, hidden_size="4" * big), "reject", ("hidden_size",),
               cli=False)
    yield Case("architectures-100MB", lambda _t: dict(base, model_type="nope", architectures=["A" * big]),
               "reject", ("model_type",), cli=False)
    yield Case("path-100MB", lambda _t: "c" * big, "reject", ("path",), cli=False)
    yield Case("mlp_only_layers-1e6", lambda _t: dict(_qwen3(), mlp_only_layers=list(range(10**6))),
               "reject", ("mlp_only_layers",), cli=False)


def _qwen3() -> dict:
    return json.loads(next(p for p in EXAMPLES if p.stem.startswith("qwen3")).read_text())


def all_cases(seed: int) -> list[Case]:
    rng = random.Random(seed)
    out: list[Case] = []
    for path in EXAMPLES:
        out += example_cases(path, rng)
    out += model_type_cases(rng)
    out += parallel_cases(rng)
    out += file_cases(rng)
    out += bomb_cases(rng)
    return out


# --------------------------------------------------------------------------------------------
# running one case


@dataclass
class Outcome:
    case: Case
    kind: str  # clear / correct / crashed / silent / rejected-valid
    detail: str = ""
    peak: int = 0


def _clear(case: Case, e: BaseException) -> bool:
    if not isinstance(e, (ValueError, TypeError, FileNotFoundError)):
        return False
    msg = str(e)
    return len(msg) < 2000 and "\n" not in msg and any(n in msg for n in case.names)


def run_case(case: Case, tmp: Path) -> Outcome:
    x = case.build(tmp)
    tracemalloc.start()
    try:
        try:
            cfg = models.load_config(x) if isinstance(x, (str, Path)) else x
            result = shapes(cfg, case.tp, case.ep, case.fmt, case.lm_head)
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    except Exception as e:  # classified below: RecursionError, MemoryError, ... count as crashes
        detail = f"{type(e).__name__}: {str(e)[:300]}"
        if peak > PEAK_LIMIT:
            return Outcome(case, "crashed", f"peak {peak / MB:.0f} MB; {detail}", peak)
        if case.expect == "accept":
            return Outcome(case, "rejected-valid", detail, peak)
        return Outcome(case, "clear" if _clear(case, e) else "crashed", detail, peak)
    if peak > PEAK_LIMIT:
        return Outcome(case, "crashed", f"accepted, peak {peak / MB:.0f} MB", peak)
    if case.expect == "reject":
        return Outcome(case, "silent", f"accepted: {_brief(result)}", peak)
    ok = sane(result, case.fmt)
    if ok and case.want is not None:
        want = case.want()
        ok = want.matches(result) if isinstance(want, _Counts) else result == want
    return Outcome(case, "correct" if ok else "silent", "" if ok else "wrong result", peak)


def _brief(result: list) -> str:
    def num(x: int) -> str:
        return str(x) if abs(x) < 10**18 else f"<{x.bit_length()} bits>"
    return ", ".join(f"{s.name} {num(s.n)}x{num(s.k)} count {num(s.count)}" for s in result[:4])


def tally(outcomes: list[Outcome]) -> dict[str, int]:
    counts = {"tried": len(outcomes)}
    for kind in ("clear", "correct", "crashed", "silent", "rejected-valid"):
        counts[kind] = sum(o.kind == kind for o in outcomes)
    return counts


def _failures(outcomes: list[Outcome]) -> list[str]:
    return [f"{o.kind}: {o.case.name}: {o.detail}" for o in outcomes if o.kind not in ("clear", "correct")]


# --------------------------------------------------------------------------------------------
# tests


@pytest.fixture
def seed():
    s = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {s}")
    return s


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_mutated_example_fields(path, seed, tmp_path):
    outcomes = [run_case(c, tmp_path) for c in example_cases(path, random.Random(seed))]
    assert len(outcomes) > 300
    assert not _failures(outcomes), "\n".join(_failures(outcomes)[:20])
    counts = tally(outcomes)
    assert counts["clear"] > 100 and counts["correct"] > 100


def test_model_type_config_and_parallel_sizes(seed, tmp_path):
    rng = random.Random(seed)
    outcomes = [run_case(c, tmp_path) for c in [*model_type_cases(rng), *parallel_cases(rng)]]
    assert not _failures(outcomes), "\n".join(_failures(outcomes)[:20])
    assert tally(outcomes)["clear"] == len(outcomes)


def test_files_nesting_and_size_bombs(seed, tmp_path):
    outcomes = []
    for i, c in enumerate(file_cases(random.Random(seed))):
        d = tmp_path / str(i)
        d.mkdir()
        outcomes.append(run_case(c, d))
    assert not _failures(outcomes), "\n".join(_failures(outcomes)[:20])
    assert max(o.peak for o in outcomes) < PEAK_LIMIT


def test_layer_counts_and_big_strings_never_drive_memory(seed, tmp_path):
    outcomes = [run_case(c, tmp_path) for c in bomb_cases(random.Random(seed))]
    assert not _failures(outcomes), "\n".join(_failures(outcomes)[:20])
    assert all(o.peak < 4 * MB for o in outcomes), [(o.case.name, o.peak) for o in outcomes]


def test_the_reported_cases():
    llama = json.loads(EXAMPLES[0].read_text())
    with pytest.raises(ValueError, match="num_hidden_layers"):
        shapes(dict(llama, num_hidden_layers=1e9))
    qwen = _qwen3()
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        with pytest.raises(ValueError, match=rf"lacks (all of \[)?'{key}'"):
            shapes({k: v for k, v in qwen.items() if k != key})
    for fmt in FORMATS:
        with pytest.raises(ValueError, match=f"hidden_size.*{fmt}") as info:
            shapes(dict(llama, hidden_size=200, num_attention_heads=8, num_key_value_heads=8), fmt=fmt)
        assert str(BLOCK_SIZE[fmt]) in str(info.value)


def test_off_block_sizes_name_the_field_and_format(seed):
    rng = random.Random(seed)
    cases = [("llama-3.1-8b", "hidden_size", 128), ("llama-3.1-8b", "intermediate_size", 8),
             ("qwen3-30b-a3b", "moe_intermediate_size", 8), ("deepseek-v3", "kv_lora_rank", 1),
             ("deepseek-v3", "q_lora_rank", 1), ("deepseek-v3", "moe_intermediate_size", 1),
             ("gpt-oss-20b", "intermediate_size", 1), ("deepseek-v3", "hidden_size", 1)]
    for stem, key, step in cases:
        base = json.loads((EXAMPLES[0].parent / f"{stem}.json").read_text())
        for fmt in FORMATS:
            bs = BLOCK_SIZE[fmt]
            for _ in range(5):
                value = step * rng.randint(1, 4096 // step)
                if value % bs == 0:
                    value += step if step % bs else 1
                cfg = dict(base, **{key: value})
                if key == "hidden_size" and "num_key_value_heads" in cfg and stem != "deepseek-v3":
                    cfg.update(num_attention_heads=1, num_key_value_heads=1)
                with pytest.raises(ValueError) as info:
                    shapes(cfg, fmt=fmt)
                msg = str(info.value)
                assert key in msg, msg
                if "divisible" not in msg:
                    assert fmt in msg and str(bs) in msg, msg


def test_valid_examples_unchanged_by_the_format_check():
    for path in EXAMPLES:
        cfg = models.load_config(path)
        moe = FAMILY[cfg["model_type"]] != "dense"
        for tp in (1, 2, 4, 8):
            for ep in ((1, 2, 4, 8) if moe else (1,)):
                for lm_head in (False, True):
                    try:
                        plain = shapes(cfg, tp, ep, None, lm_head)
                    except ValueError:
                        continue  # e.g. 28 heads over 8 ranks
                    for fmt in FORMATS:
                        bs = BLOCK_SIZE[fmt]
                        if all(s.k % bs == 0 and s.intermediate % bs == 0 for s in plain):
                            assert shapes(cfg, tp, ep, fmt, lm_head) == plain
                        else:  # e.g. gpt-oss at tp=8: an expert's 2880 / 8 = 360 is no whole block
                            with pytest.raises(ValueError, match=f"{fmt} block size"):
                                shapes(cfg, tp, ep, fmt, lm_head)


def _random_config(rng: random.Random, family: str) -> dict:
    """A plausible config of the family."""
    heads = rng.choice((8, 16, 32, 64))
    head_dim = rng.choice((64, 128))
    cfg = {"architectures": ["X"], "num_hidden_layers": rng.randint(1, 1000),
           "hidden_size": heads * head_dim, "num_attention_heads": heads,
           "num_key_value_heads": heads // rng.choice((1, 2, 4, 8)), "vocab_size": rng.randint(1000, 300_000),
           "intermediate_size": 256 * rng.randint(4, 100)}
    if family == "dense":
        cfg["model_type"] = rng.choice(("llama", "mistral", "qwen2", "qwen3"))
    elif family == "mixtral":
        cfg.update(model_type="mixtral", num_local_experts=8 * rng.randint(1, 8), num_experts_per_tok=2)
    elif family == "gpt_oss":
        cfg.update(model_type="gpt_oss", num_local_experts=8 * rng.randint(1, 16), experts_per_token=4,
                   head_dim=64)
    elif family == "qwen3_moe":
        cfg.update(model_type="qwen3_moe", num_experts=64 * rng.randint(1, 4), num_experts_per_tok=8,
                   moe_intermediate_size=128 * rng.randint(2, 12), head_dim=128)
    return cfg


@pytest.mark.parametrize("family", ["dense", "mixtral", "gpt_oss", "qwen3_moe"])
def test_random_valid_configs_count_layers_without_listing_them(family, seed):
    rng = random.Random(seed)
    for _ in range(40):
        cfg = _random_config(rng, family)
        fmt = rng.choice(FORMATS)
        one = shapes(dict(cfg, num_hidden_layers=1), fmt=fmt)
        layers = cfg["num_hidden_layers"]
        tracemalloc.start()
        try:
            many = shapes(cfg, fmt=fmt)
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < 1 * MB
        assert sane(many, fmt)
        assert [(s.name, s.n, s.k) for s in many] == [(s.name, s.n, s.k) for s in one]
        assert [s.count for s in many] == [s.count * layers for s in one]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek"])
def test_mixed_layer_counts_match_a_layer_by_layer_count(family, seed):
    """Which layers are MoE, counted layer by layer here, against the reader's counts."""
    rng = random.Random(seed)
    base = _qwen3() if family == "qwen3_moe" else json.loads((EXAMPLES[0].parent / "deepseek-v3.json").read_text())
    for _ in range(200):
        layers = rng.randint(1, 200)
        if family == "qwen3_moe":
            step = rng.randint(1, 6)
            only = sorted(rng.sample(range(layers), rng.randint(0, min(layers, 10))))
            cfg = dict(base, num_hidden_layers=layers, decoder_sparse_step=step, mlp_only_layers=only)
            n_moe = sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
        else:
            first, freq = rng.randint(0, 2 * layers), rng.randint(1, 6)
            cfg = dict(base, num_hidden_layers=layers, first_k_dense_replace=first, moe_layer_freq=freq)
            n_moe = sum(1 for i in range(layers) if i >= first and i % freq == 0)
        by = {name: s.count for s in shapes(cfg) for name in s.name.split("+")}
        assert by.get("experts", 0) == n_moe
        assert by.get("gate_up_proj", 0) == layers - n_moe
        assert by["o_proj"] == layers
        names = [s.name for s in shapes(cfg)]
        if 0 < n_moe < layers:  # the kind of layer 0 is listed first
            first_moe = names.index("experts") < names.index("gate_up_proj")
            assert first_moe == (family == "qwen3_moe" and step == 1 and 0 not in only
                                 or family == "deepseek" and first == 0)


def test_moe_architectures_without_experts_are_not_dense():
    for path in EXAMPLES:
        cfg = json.loads(path.read_text())
        family = FAMILY[cfg["model_type"]]
        if family == "dense":
            continue
        for key in REQUIRED[family]:
            if "expert" in key or key == "num_experts_per_tok":
                for value in (None, 0):
                    with pytest.raises(ValueError, match=key):
                        shapes(dict(cfg, **{key: value}))


def test_unknown_model_type_lists_the_supported(seed):
    rng = random.Random(seed)
    base = json.loads(EXAMPLES[0].read_text())
    for _ in range(20):
        name = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz_0123456789") for _ in range(rng.randint(1, 30)))
        if name in models.SUPPORTED:
            continue
        with pytest.raises(ValueError) as info:
            shapes(dict(base, model_type=name))
        msg = str(info.value)
        assert "model_type" in msg and repr(name) in msg
        assert all(t in msg for t in models.SUPPORTED)


@pytest.mark.parametrize("fmt", ["fp8", "NVFP4", 16, True])
def test_unknown_format(fmt):
    with pytest.raises((ValueError, TypeError), match="fmt"):
        shapes(json.loads(EXAMPLES[0].read_text()), fmt=fmt)


# --------------------------------------------------------------------------------------------
# the command line


def run_cli(argv: list) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main([str(a) for a in argv], out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


def cli_outcome(case: Case, tmp: Path, dry_run: bool = True) -> Outcome:
    """The case through ``autofp4 tune --model FILE``: exit 2 with one 'error:' line naming the
    field, or exit 0 for a valid config."""
    x = case.build(tmp)
    if isinstance(x, dict):
        p = tmp / "case.json"
        p.write_text(json.dumps(x))
        x = p
    argv = ["tune", "--model", x, "--fmt", case.fmt or "nvfp4", "--tp", case.tp, "--ep", case.ep,
            "--device", "cpu", "--db", tmp / "t.db", "--no-progress"]
    try:
        rc, out, err = run_cli(argv + (["--dry-run"] if dry_run else ["--m", "1", "--budget", "1"]))
    except BaseException as e:  # noqa: BLE001 -- anything escaping main() is a crash
        return Outcome(case, "crashed", f"{type(e).__name__}: {str(e)[:200]}")
    if case.expect == "accept":
        return Outcome(case, "correct" if rc == 0 else "rejected-valid", err[-300:])
    lines = err.strip().splitlines()
    if rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err:
        if any(n in lines[0] for n in case.names):
            return Outcome(case, "clear")
        return Outcome(case, "crashed", "unclear: " + lines[0][:300])
    if rc == 0 and case.expect == "either":
        return Outcome(case, "correct")
    return Outcome(case, "silent" if rc == 0 else "crashed", f"rc={rc} {err[-300:]}")


def cli_cases(seed: int) -> list[Case]:
    rng = random.Random(seed)
    pool = [c for c in all_cases(seed) if c.cli and not c.lm_head and c.expect in ("reject", "either")
            and "10**5000" not in c.name]  # not writable as JSON
    for c in pool:
        if c.fmt is None:
            c.fmt = "nvfp4"  # what the command line defaults to
    return rng.sample(pool, 60) + [c for c in pool if c.name.endswith(("1e9-layers-file", "sparse-100MB"))]


def _reported(tmp: Path) -> list[Case]:
    llama = json.loads(EXAMPLES[0].read_text())
    qwen = _qwen3()
    return [
        Case("1e9", lambda _t: dict(llama, num_hidden_layers=1e9), "reject", ("num_hidden_layers",)),
        Case("nested", lambda t: _deep_file(t, llama), "reject", ("nest", "deep", "depth")),
        Case("qwen3_moe-no-experts", lambda _t: {k: v for k, v in qwen.items() if k != "num_experts"},
             "reject", ("num_experts",)),
        Case("hidden-200", lambda _t: dict(llama, hidden_size=200, num_attention_heads=8, num_key_value_heads=8),
             "reject", ("hidden_size",), fmt="nvfp4"),
        Case("hidden-208-mxfp4", lambda _t: dict(llama, hidden_size=208, num_attention_heads=8,
                                                 num_key_value_heads=8), "reject", ("hidden_size",), fmt="mxfp4"),
    ]


def _deep_file(tmp: Path, cfg: dict) -> Path:
    p = tmp / "deep.json"
    p.write_text(json.dumps(cfg)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    return p


def test_cli_sampled_cases_exit_2_with_one_line(seed, tmp_path):
    outcomes = []
    for i, c in enumerate(cli_cases(seed)):
        d = tmp_path / str(i)
        d.mkdir()
        outcomes.append(cli_outcome(c, d))
    assert not _failures(outcomes), "\n".join(_failures(outcomes)[:20])


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "tune"])
def test_cli_reported_cases(dry_run, tmp_path):
    for i, c in enumerate(_reported(tmp_path)):
        d = tmp_path / str(i)
        d.mkdir()
        o = cli_outcome(c, d, dry_run=dry_run)
        assert o.kind == "clear", (c.name, o.detail)
        assert not (d / "t.db").exists()  # nothing tuned


def test_cli_cache_warm_reports_config_errors(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(dict(json.loads(EXAMPLES[0].read_text()), hidden_size=200)))
    rc, _, err = run_cli(["cache", "--warm", p, "--arch", "sm_90a"])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "hidden_size" in err


if __name__ == "__main__":  # the tally of every generated case: python tests/test_models_hardening.py [SEED]
    import sys
    import tempfile

    run_seed = int(sys.argv[1]) if len(sys.argv) > 1 else 12345
    with tempfile.TemporaryDirectory() as d:
        results, cli_results = [], []
        for i, c in enumerate(all_cases(run_seed)):
            (Path(d) / str(i)).mkdir()
            results.append(run_case(c, Path(d) / str(i)))
        for i, c in enumerate(cli_cases(run_seed) + _reported(Path(d))):
            (Path(d) / f"cli{i}").mkdir()
            cli_results.append(cli_outcome(c, Path(d) / f"cli{i}"))
    print("reader:", tally(results))
    print("command line:", tally(cli_results))
    print("\n".join(_failures(results + cli_results)[:50]))
