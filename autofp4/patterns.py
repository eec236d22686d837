"""The one check of a list of layer-name patterns, whoever gives it.

``quantize_model(skip=...)``, ``quantize_checkpoint(skip=...)`` / ``autofp4 quantize --skip``, the
vLLM plugin's ``ignore`` and a checkpoint config's exclusion lists (ModelOpt ``exclude_modules`` /
``ignore``, compressed-tensors ``ignore`` and ``targets``, gpt-oss ``modules_to_not_convert``) are
all lists of patterns matched against module names. :func:`pattern_list` checks them the same
way: a list (from Python, any iterable but a str, bytes or mapping, read once) of non-empty str;
the error names the argument or field, and a bad item by its index and type.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional

__all__ = ["pattern_list", "warn_unmatched"]


def _shown(value: Any) -> str:
    text = repr(value)
    if len(text) <= 80:
        return text
    return f"a {type(value).__name__} ({text[:60]}...)"


def pattern_list(value: Any, what: str, *, from_file: bool = False, option: Optional[str] = None,
                 empty: str = "which matches no layer; remove it", regex_prefix: Optional[str] = None) -> list[str]:
    """``value`` as a new list of patterns (str, none empty or blank).

    ``what``: how errors name the value (``"quantize_model: skip"``); items are named
    ``what[i]``, followed by `` (option)`` when ``option`` (a CLI flag) is given.
    ``from_file``: ``value`` was read from a JSON config: None (the field left out) is an empty
    list, only a list (JSON array) is accepted and every problem is a ValueError (the file is
    wrong, not the caller's types). Otherwise a str, bytes, mapping, None or non-iterable is a
    TypeError, a non-str item a TypeError, an empty item a ValueError.
    ``empty``: why an empty pattern is refused (the end of the message).
    ``regex_prefix``: a prefix that marks a regex (``"re:"``): that prefix alone counts as empty.
    """
    type_error = ValueError if from_file else TypeError
    if from_file:
        if value is None:
            return []
        if not isinstance(value, list):
            raise ValueError(f"{what} must be a list of glob patterns (str), got {_shown(value)}")
        patterns = list(value)
    else:
        if value is None or isinstance(value, (str, bytes, bytearray, Mapping)):
            raise TypeError(f"{what} must be a list of glob patterns (str), got {_shown(value)}")
        try:
            patterns = list(value)  # read once: a generator's items are kept, not consumed by a check
        except TypeError:
            raise TypeError(f"{what} must be a list of glob patterns (str), got {_shown(value)}") from None
    flag = f" ({option})" if option else ""
    for i, p in enumerate(patterns):
        if not isinstance(p, str):
            raise type_error(f"{what}[{i}]{flag} must be a glob pattern (str), got {p!r:.80} ({type(p).__name__})")
        bare = p.strip()
        if not bare or (regex_prefix is not None and bare == regex_prefix):
            raise ValueError(f"{what}[{i}]{flag} is an empty pattern {p!r}, {empty}")
        if bare != p:
            raise ValueError(f"{what}[{i}]{flag} {p!r} has leading or trailing whitespace, which no module name "
                             f"has; write {bare!r}")
    return patterns


#: what may follow an expert's index in a pattern meant for one expert (per-expert projection
#: names of the Hugging Face layouts, the stacked tensors' names, and their tensor suffixes)
_EXPERT_PARTS = tuple(f"{p}{s}" for p in ("", ".gate_proj", ".up_proj", ".down_proj", ".gate_up_proj", ".w1", ".w2",
                                           ".w3") for s in ("", ".weight", ".*"))


def warn_unmatched(patterns: list[str], names: list[str], experts: Mapping[str, int], what: str, *,
                   others: Iterable[str] = (), ignore: tuple[str, ...] = (), stacklevel: int = 3) -> None:
    """Warn (``RuntimeWarning``) about each skip pattern that matches none of ``names``, the names
    a pattern can keep (layers, stacked experts and their tensors): a typo, a glob such as ``[``
    that fnmatch reads literally, or the name of a module that holds layers (one of ``others``,
    the model's other modules, with a layer inside it: ``*.mlp``); the layers it was meant to keep
    are quantized. A pattern matching one of ``others`` that holds no layer (a norm, a router that
    is no Linear) says nothing: that module stays as it is anyway. ``experts`` maps each stacked
    routed-experts module to its expert count: a pattern meant for one expert of it
    (``*.experts.2.gate_proj``) is told that the experts are kept whole or not at all.
    ``ignore``: patterns every call carries (``lm_head``, ``*.lm_head``): not warned about where
    another of them matches, or where nothing any of them would match is there."""
    import fnmatch
    import warnings

    def matches(p: str, among: Iterable[str]) -> bool:
        return any(fnmatch.fnmatchcase(n, p) for n in among)

    ignored = set(ignore) if (any(matches(q, names) for q in patterns if q in ignore)
                              or not any(matches(q, names) for q in ignore)) else set()
    holders = {n.rsplit(".", i)[0] for n in names for i in range(1, n.count(".") + 1)}
    others = list(others)
    containers = sorted((o for o in others if o in holders), key=lambda n: (n.count("."), n))
    names = list(names) + [o for o in others if o not in holders]
    for p in patterns:
        if p in ignored or matches(p, names):
            continue
        inside = next((e for e, count in experts.items() if any(
            fnmatch.fnmatchcase(f"{e}.{i}{part}", p) for i in range(count) for part in _EXPERT_PARTS)), None)
        if inside is not None:
            warnings.warn(f"{what}: skip pattern {p!r} names single experts, but the routed experts of {inside!r} "
                          f"are one stacked layer, quantized or kept whole: nothing was kept (skip them all with "
                          f"the pattern {inside!r}, or '*.mlp.experts')", RuntimeWarning, stacklevel=stacklevel)
            continue
        holder = next((c for c in containers if fnmatch.fnmatchcase(c, p)), None)
        if holder is not None:
            warnings.warn(f"{what}: skip pattern {p!r} matches {holder!r}, a module that holds layers but is none: "
                          f"patterns match whole layer names, so it keeps nothing (for the layers inside it: "
                          f"{p + '.*'!r})", RuntimeWarning, stacklevel=stacklevel)
            continue
        like = next((n for n in names if n.endswith("proj")), names[-1] if names else "")
        warnings.warn(f"{what}: skip pattern {p!r} matches no layer of the model, so it keeps none in its "
                      f"original dtype (names look like {like!r}; globs match whole names: '*.mlp.*')",
                      RuntimeWarning, stacklevel=stacklevel)
