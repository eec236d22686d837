"""The one check of a list of layer-name patterns, whoever gives it.

``quantize_model(skip=...)``, ``quantize_checkpoint(skip=...)`` / ``autofp4 quantize --skip``, the
vLLM plugin's ``ignore`` and a checkpoint config's exclusion lists (ModelOpt ``exclude_modules`` /
``ignore``, compressed-tensors ``ignore`` and ``targets``, gpt-oss ``modules_to_not_convert``) are
all lists of patterns matched against module names. :func:`pattern_list` checks them the same
way: a list (from Python, any iterable but a str, bytes or mapping, read once) of non-empty str;
the error names the argument or field, and a bad item by its index and type.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

__all__ = ["pattern_list"]


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
