"""Hugging Face checkpoints quantized to NVFP4 -> transformers models with FP4Linear layers.

    model = autofp4.from_pretrained("path/to/checkpoint", device_map="cuda")

A checkpoint is a directory with ``config.json`` and safetensors files (one file, several files,
or shards listed in ``model.safetensors.index.json``). Two layouts are read, per quantized linear
``<name>``:

ModelOpt NVFP4 (``hf_quant_config.json`` ``{"quantization": {"quant_algo": "NVFP4", "exclude_modules": [...]}}``, or ``W4A16_NVFP4``,
or ``config.json`` ``quantization_config`` with ``"quant_method": "modelopt"``, ``"quant_algo": "NVFP4"``):
    ``<name>.weight`` uint8 [N, K/2] (two E2M1 codes a byte, even K in the low nibble),
    ``<name>.weight_scale`` float8_e4m3fn [N, K/16], ``<name>.weight_scale_2`` fp32 scalar
    (value = e2m1 * weight_scale * weight_scale_2), ``<name>.input_scale`` fp32 scalar (optional).
    ``exclude_modules`` (or ``ignore``) holds glob patterns (``"lm_head"``, ``"*.mlp.gate"``); a
    pattern also covers the modules below the one it names. Module names are looked up (any
    number of them); at most :data:`MAX_GLOBS` patterns may have wildcards.

compressed-tensors ``nvfp4-pack-quantized`` or ``mxfp4-pack-quantized`` (``quantization_config`` with ``"quant_method": "compressed-tensors"``):
    ``<name>.weight_packed`` uint8 [N, K/2] (same packing), ``<name>.weight_scale`` float8_e4m3fn
    [N, K/16], ``<name>.weight_global_scale`` fp32 scalar in the reciprocal convention
    (value = e2m1 * weight_scale / weight_global_scale), ``<name>.input_global_scale`` (optional,
    also a reciprocal). ``config_groups[*].targets`` and ``ignore`` entries are module names,
    class names (``"Linear"``) or ``"re:<regex>"`` (matched from the start of the name). MXFP4:
    ``<name>.weight_packed`` and ``<name>.weight_scale`` uint8 E8M0 [N, K/32], no global scale.

gpt-oss MXFP4 (``quantization_config`` with ``"quant_method": "mxfp4"``): the routed experts only
    (``<block>.experts.{gate_up,down}_proj_{blocks,scales}``); ``modules_to_not_convert`` entries are
    matched from the start of a name at a module boundary, as regexes (``"model.layers.*.self_attn"``),
    or as a suffix (``"lm_head"``).

The model is the transformers model of ``config.json`` built with its parameters on the meta
device; quantized linears become :class:`~autofp4.nn.FP4Linear` and the routed experts of MoE
layers :class:`~autofp4.integrations.transformers.FP4Experts`, both over the stored tensors (no
dense copy of them is made; the experts' layouts are in
:mod:`autofp4.integrations.checkpoint_experts`); everything else (embeddings, norms, routers,
``lm_head``, excluded modules) is loaded in ``dtype``. Mixtral checkpoints name their MoE blocks
``block_sparse_moe``; transformers' module is ``mlp``: stored names are mapped, exclusions
match either.
"""
from __future__ import annotations

import fnmatch
import json
import re
import warnings
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from torch import nn

from ..loaders import MissingKeyError, load_state_dict_weight
from ..nn import FP4Buffers, FP4Linear, fuse_projections, keep_in_fp32_entries, notify_converted
from ..patterns import pattern_list
from ..weights import FP4Weight, _describe, missing_device
from .checkpoint_experts import Readers, load_experts
from .layouts import RENAMES, unset_size_fields
from .safetensors_io import INDEX, path_arg, present_file, read_header, shard_files

__all__ = ["from_pretrained", "from_compressed_tensors"]

_WHAT = "autofp4.from_pretrained"
_CT_FORMATS = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4"}
#: the weights.strategy compressed-tensors writes for each format (its NVFP4 / MXFP4 presets)
_CT_STRATEGY = {"nvfp4-pack-quantized": "tensor_group", "mxfp4-pack-quantized": "group"}


# -- the stored tensors ------------------------------------------------------------------------
def _read_config(path: Path) -> dict:
    """A checkpoint's small JSON file (config.json, hf_quant_config.json): read bounded and
    depth-checked (:func:`autofp4.models.load_config`), its size fields within bounds."""
    from ..models import load_checked_config

    try:
        config = load_checked_config(path)
    except ValueError as e:
        raise ValueError(f"{_WHAT}: {e}") from None
    qc = config.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ValueError(f"{_WHAT}: {path}: quantization_config must be an object, got {type(qc).__name__}")
    return config


def auto_config(path: Union[str, Path], what: str, conf: Optional[Mapping] = None, **kwargs: Any) -> Any:
    """``transformers.AutoConfig.from_pretrained(path, **kwargs)``, its field validation errors
    (huggingface_hub's ``StrictDataclassError``: a null or mistyped field) raised as one-line
    ``ValueError`` naming config.json and the field. ``conf``: config.json's contents, when
    read already: two fields of it that transformers reads as one (the config class's
    ``attribute_map``: ``num_experts`` and ``num_local_experts``) set to different values are
    refused, naming both (transformers would silently keep one)."""
    from transformers import AutoConfig

    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: no strict dataclasses, nothing of the kind to catch
        StrictDataclassError = ()  # type: ignore[assignment,misc]
    where = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        config, unused = AutoConfig.from_pretrained(str(path), return_unused_kwargs=True, **kwargs)
    except StrictDataclassError as e:
        raise ValueError(f"{what}: {where}: {' '.join(str(e).split())}") from None
    if unused:  # transformers would drop them without a word
        raise TypeError(f"{what}: unknown keyword argument{'s' if len(unused) > 1 else ''} "
                        f"{', '.join(sorted(map(str, unused)))}: not a field of {type(config).__name__} nor an "
                        "argument of AutoConfig.from_pretrained")
    aliases = getattr(type(config), "attribute_map", None)
    if isinstance(conf, Mapping) and isinstance(aliases, Mapping):
        for alias, field_name in aliases.items():
            if alias in conf and field_name in conf and conf[alias] != conf[field_name]:
                raise ValueError(f"{what}: {where}: {alias} = {conf[alias]!r} but {field_name} = {conf[field_name]!r}; "
                                 f"transformers reads both as {field_name} ({type(config).__name__}), so the config "
                                 "contradicts itself: keep one")
    return config


def _safe_open(path: Path, device: str) -> Any:
    """The safetensors handle of ``path``; a file safetensors cannot read is named."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device=device)
    except Exception as e:  # safetensors' own error types (header, offsets, ...) and OSError
        read_header(path, _WHAT)  # names the tensor at fault where safetensors' message does not
        raise ValueError(f"{_WHAT}: {path} is not a readable safetensors file: {e}") from None


class _Tensors(Mapping):
    """The tensors of a checkpoint directory by name, each read from its file onto ``device``
    when asked for (a Mapping, so :func:`autofp4.loaders.load_state_dict_weight` reads it)."""

    def __init__(self, root: Path, device: torch.device, renames: tuple[tuple[str, str], ...] = ()) -> None:
        files, listed = shard_files(root, _WHAT)
        self.root = root
        index = root / INDEX
        dev = "cpu" if device.type == "cpu" else str(device)
        self._files = {f.name: _safe_open(f, dev) for f in files}
        self._where: dict[str, str] = {}
        for fname, handle in self._files.items():
            for key in handle.keys():
                if key in self._where:
                    raise ValueError(f"{_WHAT}: tensor {key!r} is stored in both {self._where[key]} and {fname}")
                self._where[key] = fname
        for key, fname in (listed or {}).items():
            if self._where.get(key) != Path(fname).name:
                raise ValueError(f"{_WHAT}: {index.name} puts {key!r} in {fname}, but that file does not hold it")
        self.stored: dict[str, str] = {}  # the model's name -> the stored name, where they differ
        for key in list(self._where):
            new = key
            for model_part, stored_part in renames:
                new = new.replace(stored_part, model_part)
            if new != key:
                self._where[new] = self._where.pop(key)
                self.stored[new] = key
        self.used: set[str] = set()

    def __getitem__(self, key: str) -> torch.Tensor:
        fname = self._where[key]  # KeyError for a missing tensor
        self.used.add(key)
        try:
            return self._files[fname].get_tensor(self.stored.get(key, key))
        except Exception as e:  # safetensors' errors (data out of the file's range, ...) and OSError
            raise ValueError(f"{_WHAT}: cannot read tensor {key!r} from {fname}: {e}") from None

    def stored_dtype(self, key: str) -> str:
        """The safetensors dtype of tensor ``key`` as stored (``"F8_E4M3"``, ``"U8"``, ...), read from
        its file's header (the tensor is not read)."""
        fname = self._where[key]
        try:
            return str(self._files[fname].get_slice(self.stored.get(key, key)).get_dtype())
        except Exception as e:  # safetensors' errors and OSError
            raise ValueError(f"{_WHAT}: cannot read the header entry of tensor {key!r} in {fname}: {e}") from None

    def stored_shape(self, key: str) -> tuple[int, ...]:
        """The shape of tensor ``key`` as stored, read from its file's header."""
        fname = self._where[key]
        try:
            return tuple(self._files[fname].get_slice(self.stored.get(key, key)).get_shape())
        except Exception as e:  # safetensors' errors and OSError
            raise ValueError(f"{_WHAT}: cannot read the header entry of tensor {key!r} in {fname}: {e}") from None

    def file_of(self, key: str) -> str:
        return self._where[key]

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


# -- the quantization scheme -------------------------------------------------------------------
#: the longest a checkpoint's pattern may take to match one module name
_MATCH_S = 0.5
_PATTERNS: dict[str, Any] = {}


def _regex_match(regex_text: str, entry: str, name: str, source: str) -> bool:
    """Whether the checkpoint's pattern ``entry`` (as the regex ``regex_text``) matches ``name``
    from its start, in bounded time (the ``regex`` engine's timeout: a pattern that backtracks
    without end is refused, naming it, instead of hanging the load)."""
    import regex

    compiled = _PATTERNS.get(regex_text)
    if compiled is None:
        try:
            compiled = _PATTERNS[regex_text] = regex.compile(regex_text)
        except regex.error as e:
            raise ValueError(f"{_WHAT}: {source}: the pattern {entry!r} is not a valid regular expression: {e}") from None
    try:
        return compiled.match(name, timeout=_MATCH_S) is not None
    except TimeoutError:
        raise ValueError(f"{_WHAT}: {source}: the pattern {entry!r} took over {_MATCH_S} s to match the module "
                         f"name {name!r} (it backtracks without bound); write it without nested repetition") from None


_GLOB = re.compile(r"[*?[]")
#: the most ModelOpt patterns with wildcards (``*``, ``?``, ``[``) a checkpoint may list; plain
#: module names are looked up, any number of them (real configs list tens of patterns)
MAX_GLOBS = 4096


class _Patterns:
    """One list of a checkpoint's module patterns (``exclude_modules``, ``ignore``, ``targets``),
    matched against module names at a cost that does not grow with the number of plain names in
    it: ModelOpt's and compressed-tensors' plain names (no wildcard, not ``re:``) are a set, each
    name's module boundaries looked up in it; ModelOpt's glob patterns are grouped by the literal
    text before their first wildcard, each group one compiled regex, tried only on the names that
    start with that text; regexes (compressed-tensors ``re:``, gpt-oss) are matched one by one."""

    def __init__(self, scheme: "_Scheme", patterns: list[str], label: str) -> None:
        self.scheme = scheme
        self.names: set[str] = set()
        self.globs: dict[str, list[str]] = {}  # literal prefix -> ModelOpt glob patterns
        self.regexes: list[str] = []
        self._compiled: dict[str, Any] = {}
        n_globs = 0
        for p in patterns:
            if scheme.method == "modelopt" and _GLOB.search(p):
                self.globs.setdefault(p[:_GLOB.search(p).start()], []).append(p)
                n_globs += 1
            elif scheme.method == "modelopt" or (scheme.method == "compressed-tensors" and not p.startswith("re:")):
                self.names.add(p)
            else:
                self.regexes.append(p)
        if n_globs > MAX_GLOBS:
            raise ValueError(f"{_WHAT}: {label} holds {n_globs} patterns with wildcards (*, ?, [...]), more than "
                             f"the {MAX_GLOBS} autofp4 matches; list module names (each also covers the modules "
                             "below it) or fewer patterns")
        self._prefix_lengths = sorted({len(k) for k in self.globs})

    def _glob_regex(self, prefix: str) -> Any:
        rx = self._compiled.get(prefix)
        if rx is None:  # a pattern also covers the modules below the one it names: p and p + ".*"
            rx = self._compiled[prefix] = re.compile("|".join(
                fnmatch.translate(q) for p in self.globs[prefix] for q in (p, p + ".*")))
        return rx

    def match(self, name: str, cls: str) -> bool:
        if self.names:
            if self.scheme.method == "compressed-tensors" and cls in self.names:
                return True
            if name in self.names:
                return True
            at = name.find(".")
            while at >= 0:  # the modules above: "a", "a.b" of "a.b.c"
                if name[:at] in self.names:
                    return True
                at = name.find(".", at + 1)
        for n in self._prefix_lengths:
            if n > len(name):
                break
            if name[:n] in self.globs and self._glob_regex(name[:n]).match(name):
                return True
        return any(self.scheme._match(p, name, cls) for p in self.regexes)


@dataclass
class _Scheme:
    method: str  # "modelopt" | "compressed-tensors" | "mxfp4"
    exclude: list[str] = field(default_factory=list)
    targets: Optional[list[str]] = None  # None: every linear
    source: str = ""
    renames: tuple[tuple[str, str], ...] = ()  # (model name part, stored name part)
    fmt: str = "nvfp4"  # the FP4 format of the quantized tensors
    labels: tuple[str, str] = ("", "")  # where exclude and targets come from, for errors
    _matchers: dict[str, _Patterns] = field(default_factory=dict, repr=False, compare=False)

    def _match(self, pattern: str, name: str, cls: str) -> bool:
        if self.method == "modelopt":
            return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*")
        if self.method == "mxfp4":  # from the start to a module boundary (a regex), or a suffix
            return (_regex_match(f"(?:{pattern})(?:$|\\.)", pattern, name, self.source)
                    or name.endswith(pattern))
        if pattern.startswith("re:"):
            return _regex_match(pattern[3:], pattern, name, self.source)
        return pattern in (name, cls) or name.startswith(pattern + ".")

    def _matcher(self, which: str) -> _Patterns:
        m = self._matchers.get(which)
        if m is None:
            patterns = self.exclude if which == "exclude" else self.targets or []
            label = self.labels[0 if which == "exclude" else 1] or f"{self.source} {which}"
            m = self._matchers[which] = _Patterns(self, patterns, label)
        return m

    def _names(self, name: str) -> list[str]:
        """``name`` and the name the checkpoint stores it under."""
        out = [name]
        for model_part, stored_part in self.renames:
            if model_part in name:
                out.append(name.replace(model_part, stored_part))
        return out

    def excluded(self, name: str, cls: str) -> bool:
        m = self._matcher("exclude")
        return any(m.match(n, cls) for n in self._names(name))

    def targeted(self, name: str, cls: str) -> bool:
        if self.excluded(name, cls):
            return False
        if self.targets is None:
            return True
        m = self._matcher("targets")
        return any(m.match(n, cls) for n in self._names(name))

    def check_stored_quantized(self, name: str, cls: str, key: str, what: str = "") -> None:
        """``name`` (a module of class ``cls``) is stored quantized (``key``): refused where the
        checkpoint's config excludes it or (compressed-tensors) none of its config groups targets it,
        as the config and the tensors then disagree on what the module is."""
        label = what or repr(name)
        if self.excluded(name, cls):
            raise ValueError(
                f"{_WHAT}: {label} is excluded by {self.source} but stored quantized "
                f"({key!r}); the exclusion list and the tensors disagree"
            )
        if self.method == "compressed-tensors" and not self.targeted(name, cls):
            raise ValueError(
                f"{_WHAT}: {label} is stored quantized ({key!r}) but no entry of {self.labels[1] or self.source} "
                f"({(self.targets or [])[:8]}) targets it; the config's targets and the tensors disagree"
            )

    def packed_key(self, name: str) -> str:
        return {"compressed-tensors": f"{name}.weight_packed", "mxfp4": f"{name}_blocks"}.get(
            self.method, f"{name}.weight_scale")


def _str_list(value: Any, label: str) -> list[str]:
    """A config field that lists module names or patterns (None: left out, no entry)."""
    return pattern_list(value, f"{_WHAT}: {label}", from_file=True, regex_prefix="re:",
                        empty="which would match every module; remove it")


#: ModelOpt's quant_algo values of NVFP4 weights (W4A16_NVFP4: activations left unquantized, as
#: the Hopper kernels run every NVFP4 checkpoint)
_MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4")


def _modelopt_scheme(q: Mapping, source: str) -> _Scheme:
    algo = q.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() not in _MODELOPT_ALGOS:
        raise ValueError(f"{_WHAT}: {source}: quant_algo {algo!r} is not supported (only "
                         f"{' or '.join(repr(a) for a in _MODELOPT_ALGOS)})")
    if q.get("group_size", 16) != 16:
        raise ValueError(f"{_WHAT}: {source}: NVFP4 needs group_size 16, got {q.get('group_size')!r}")
    key = "exclude_modules" if "exclude_modules" in q else "ignore"
    scheme = _Scheme("modelopt", _str_list(q.get(key), f"{source} {key}"), None, source,
                     labels=(f"{source} {key}", ""))
    scheme._matcher("exclude")  # the patterns checked (their number bounded) before anything is built
    return scheme


def _ct_scheme(q: Mapping, source: str) -> _Scheme:
    sparsity = q.get("sparsity_config")
    if sparsity is not None and not isinstance(sparsity, dict):
        raise ValueError(f"{_WHAT}: {source}: sparsity_config must be an object or null, got {sparsity!r:.80}")
    if sparsity and sparsity.get("format", "dense") not in (None, "dense"):
        raise ValueError(f"{_WHAT}: {source}: sparsity_config format {sparsity.get('format')!r:.80} stores the weights "
                         "compressed for sparsity, which autofp4 does not read (only 'dense'); use a checkpoint "
                         "without sparsity compression")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{_WHAT}: {source}: compressed-tensors needs 'config_groups', got {groups!r}")
    targets: list[str] = []
    fmts = set()
    for gname, g in groups.items():
        if not isinstance(g, dict):
            raise ValueError(f"{_WHAT}: {source}: config_groups[{gname!r}] must be an object, got {g!r}")
        fmt = g.get("format") or q.get("format")
        if g.get("format") and q.get("format") and g.get("format") != q.get("format"):
            raise ValueError(f"{_WHAT}: {source}: format {q.get('format')!r} and config_groups[{gname!r}].format "
                             f"{g.get('format')!r} disagree; the tensors are stored in one format")
        if fmt not in _CT_FORMATS:
            raise ValueError(
                f"{_WHAT}: {source}: compressed-tensors format {fmt!r} (group {gname!r}) is not supported "
                f"(only {' or '.join(repr(f) for f in _CT_FORMATS)})"
            )
        fmts.add(_CT_FORMATS[fmt])
        w = g.get("weights")
        if w is None:  # compressed-tensors reads a missing or null weights as no weight quantization
            raise ValueError(f"{_WHAT}: {source}: config_groups[{gname!r}].weights is "
                             f"{'null' if 'weights' in g else 'missing'}: the group quantizes no weights, yet its "
                             f"format {fmt!r} stores them packed in FP4; give it the weights' scheme (num_bits 4, "
                             "type float, ...) or leave its layers out of the checkpoint's quantized ones")
        if not isinstance(w, dict):
            shown = repr(w) if len(repr(w)) <= 80 else f"a {type(w).__name__}"
            raise ValueError(f"{_WHAT}: {source}: config_groups[{gname!r}].weights must be an object (num_bits, "
                             f"type, group_size, ...), got {shown}")
        bs = 16 if _CT_FORMATS[fmt] == "nvfp4" else 32
        for k, want in (("num_bits", 4), ("type", "float"), ("group_size", bs), ("strategy", _CT_STRATEGY[fmt]),
                        ("symmetric", True)):  # FP4 weights are symmetric: no zero points
            if k in w and w[k] != want:
                why = " (an asymmetric scheme has zero points, which FP4 weights have not)" if k == "symmetric" else ""
                raise ValueError(f"{_WHAT}: {source}: config_groups[{gname!r}].weights.{k} is {w[k]!r}, "
                                 f"{_CT_FORMATS[fmt]} ({fmt}) needs {want!r}{why}")
        for side in ("input", "output"):
            _warn_activations(g.get(f"{side}_activations"), f"{source} config_groups[{gname!r}]", side)
        group_targets = _str_list(g.get("targets"), f"{source} config_groups[{gname!r}].targets")
        if "targets" in g and not group_targets:
            raise ValueError(f"{_WHAT}: {source}: config_groups[{gname!r}].targets is empty: the group quantizes no "
                             "module, yet it is the checkpoint's quantization scheme; list the modules it targets "
                             "(compressed-tensors writes [\"Linear\"])")
        targets += group_targets
    if len(fmts) > 1:
        raise ValueError(f"{_WHAT}: {source}: config groups in both NVFP4 and MXFP4; autofp4 reads one format a checkpoint")
    scheme = _Scheme("compressed-tensors", _str_list(q.get("ignore"), f"{source} ignore"), targets, source,
                     fmt=fmts.pop(), labels=(f"{source} ignore", f"{source} config_groups targets"))
    return scheme


def _warn_activations(acts: Any, where: str, side: str) -> None:
    """A compressed-tensors group that quantizes its input activations (a W4A8 or W4A4 scheme):
    the model loads with the activations in its dtype, said once (FP8 activations are a switch:
    :func:`autofp4.set_activations`). ``side="output"``: its ``output_activations`` (quantized
    layer outputs), said the same way: nothing in autofp4 quantizes a layer's output."""
    if acts is None:
        return
    if not isinstance(acts, Mapping):
        raise ValueError(f"{_WHAT}: {where}.{side}_activations must be an object or null, got {acts!r:.80}")
    noun = "activations" if side == "input" else "output activations"
    what = (f"{acts['num_bits']}-bit {acts['type']} {noun}" if "num_bits" in acts and "type" in acts
            else f"quantized {noun} ({json.dumps(acts, sort_keys=True, default=str)[:80]})")
    if side == "input":
        then = ("the layers run with the model's dtype; autofp4.set_activations(model, 'fp8') runs them with FP8 "
                "activations (per token)")
    else:
        then = "the layers' outputs stay in the model's dtype (autofp4 has no output quantization)"
    warnings.warn(f"autofp4: {where}.{side}_activations asks for {what}, which loading does not apply: {then}",
                  UserWarning, stacklevel=3)


def _warn_kv_cache(q: Mapping, source: str) -> None:
    """A ModelOpt config asking for a quantized KV cache (``kv_cache_quant_algo``, e.g. ``"FP8"``):
    autofp4's models keep the KV cache in the model's dtype (vLLM's plugin applies it); said once."""
    algo = q.get("kv_cache_quant_algo")
    if algo is None or (isinstance(algo, str) and algo.strip().upper() in ("", "NONE")):
        return
    warnings.warn(f"autofp4: {source}: kv_cache_quant_algo is {algo!r}, which autofp4 does not apply: the model's KV "
                  "cache stays in the model's dtype (the checkpoint's KV cache scales are not used; autofp4's vLLM "
                  "plugin applies it)", UserWarning, stacklevel=5)


def _warn_ct_kv_cache(q: Mapping, source: str) -> None:
    """A compressed-tensors config asking for a quantized KV cache (``kv_cache_scheme``, e.g.
    ``{"num_bits": 8, "type": "float"}``: an FP8 KV cache): autofp4's models keep the KV cache in
    the model's dtype; said once, as ModelOpt's ``kv_cache_quant_algo`` (:func:`_warn_kv_cache`)."""
    kv = q.get("kv_cache_scheme")
    if kv is None:
        return
    if not isinstance(kv, Mapping):
        raise ValueError(f"{_WHAT}: {source}: kv_cache_scheme must be an object (num_bits, type, strategy, ...) or "
                         f"null, got {kv!r:.80}")
    what = (f"a KV cache in {kv['num_bits']}-bit {kv['type']}" if "num_bits" in kv and "type" in kv
            else f"a quantized KV cache ({json.dumps(kv, sort_keys=True, default=str)[:80]})")
    warnings.warn(f"autofp4: {source}: kv_cache_scheme asks for {what}, which autofp4 does not apply: the model's KV "
                  "cache stays in the model's dtype (the checkpoint's KV cache scales are not used)",
                  UserWarning, stacklevel=5)


def checkpoint_fmt(path: Union[str, Path]) -> Optional[str]:
    """The FP4 format of the quantized checkpoint at ``path`` (its folder or its config.json), or
    None where it is not one that loads (a plain config, a dense checkpoint, anything unreadable:
    its own command says why)."""
    return checkpoint_fmt_why(path)[0]


def checkpoint_fmt_why(path: Union[str, Path]) -> tuple[Optional[str], Optional[str]]:
    """``(fmt, None)`` for a quantized checkpoint that loads (:func:`checkpoint_fmt`), ``(None,
    why)`` for one that says it is quantized (a ``quantization_config`` in its config.json, or an
    ``hf_quant_config.json``) but whose quantization config does not load, ``(None, None)`` for
    anything else (a plain config, a dense checkpoint, an unreadable file)."""
    p = Path(path)
    root = p if p.is_dir() else p.parent if p.name == "config.json" else None
    if root is None:
        return None, None
    try:
        config = _read_config(root / "config.json")
    except (ValueError, TypeError, OSError, KeyError) as e:
        try:  # a config.json that does not read as a model's: still a quantized checkpoint's?
            raw = json.loads((root / "config.json").read_text())
        except (ValueError, OSError, RecursionError):
            return None, None
        return None, (str(e) if isinstance(raw, dict) and "quantization_config" in raw else None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _scheme(root, config).fmt, None
    except (ValueError, TypeError, OSError, KeyError) as e:
        quantized = isinstance(config, Mapping) and config.get("quantization_config") is not None
        try:
            quantized = quantized or present_file(root / "hf_quant_config.json", _WHAT)
        except (ValueError, OSError):
            quantized = True
        return None, (str(e) if quantized else None)


def _scheme(root: Path, config: Mapping) -> _Scheme:
    qc = config.get("quantization_config")
    hf = root / "hf_quant_config.json"
    if present_file(hf, _WHAT):
        q = _read_config(hf)
        q = q.get("quantization") if isinstance(q, dict) else None
        if not isinstance(q, dict):
            raise ValueError(f"{_WHAT}: {hf} has no 'quantization' object")
        if isinstance(qc, dict) and qc.get("quant_method", "modelopt") != "modelopt":
            raise ValueError(
                f"{_WHAT}: {root} has a ModelOpt {hf.name} but config.json says quant_method {qc.get('quant_method')!r}"
            )
        scheme = _modelopt_scheme(q, str(hf))
        _warn_kv_cache(q, str(hf))
        if isinstance(qc, dict) and "quant_algo" in qc:
            try:
                theirs = _modelopt_scheme(qc, "config.json quantization_config")
            except ValueError:
                theirs = None
            if theirs is None or sorted(theirs.exclude) != sorted(scheme.exclude) or str(
                    qc.get("quant_algo")).upper() != str(q.get("quant_algo")).upper():
                warnings.warn(f"autofp4: {root}: config.json's quantization_config and {hf.name} differ "
                              f"(quant_algo or excluded modules); {hf.name} is used", UserWarning, stacklevel=4)
        return scheme
    if qc is None:
        raise ValueError(
            f"{_WHAT}: {root} is not a quantized checkpoint: config.json has no quantization_config "
            "and there is no hf_quant_config.json"
        )
    if not isinstance(qc, dict):
        raise ValueError(f"{_WHAT}: config.json quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "modelopt":
        _warn_kv_cache(qc, "config.json quantization_config")
        return _modelopt_scheme(qc, "config.json quantization_config")
    if method == "compressed-tensors":
        scheme = _ct_scheme(qc, "config.json quantization_config")
        _warn_ct_kv_cache(qc, "config.json quantization_config")
        return scheme
    if method == "mxfp4":
        src = "config.json quantization_config"
        return _Scheme("mxfp4", _str_list(qc.get("modules_to_not_convert"), f"{src} modules_to_not_convert"), [], src,
                       fmt="mxfp4", labels=(f"{src} modules_to_not_convert", ""))
    raise ValueError(
        f"{_WHAT}: unknown quant_method {method!r} in config.json quantization_config; supported: "
        f"'modelopt' (quant_algo NVFP4), 'compressed-tensors' (formats {', '.join(map(repr, _CT_FORMATS))}) and 'mxfp4' "
        "(gpt-oss experts)"
    )


# -- one quantized linear ----------------------------------------------------------------------
def _reciprocal(s: Any, label: str, what: str) -> torch.Tensor:
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        s = torch.tensor(float(s))
    if not isinstance(s, torch.Tensor) or s.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{what}: {label} must be a float32 (or bf16/fp16) tensor, got {_describe(s)}")
    if s.numel() != 1:
        raise ValueError(f"{what}: {label} must be a scalar (shape () or (1,)), got shape {tuple(s.shape)}")
    return torch.reciprocal(s.to(torch.float32).reshape(()))


def from_compressed_tensors(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: Union[torch.Tensor, float],
    input_global_scale: Optional[Union[torch.Tensor, float]] = None,
    *,
    prefix: str = "",
) -> FP4Weight:
    """A compressed-tensors ``nvfp4-pack-quantized`` linear -> FP4Weight("nvfp4").

    compressed-tensors stores the global scales as reciprocals (``weight_global_scale`` =
    448 * 6 / amax), so ``FP4Weight.global_scale`` is ``1 / weight_global_scale`` in fp32
    and ``input_scale`` is ``1 / input_global_scale``. The packed codes and block scales are
    used as stored. ``prefix`` (the module's name) only labels errors.
    """
    what = "from_compressed_tensors"
    p = f"{prefix}." if prefix else ""
    labels = {"data": f"{p}weight_packed", "scale": f"{p}weight_scale",
              "global_scale": f"1 / {p}weight_global_scale", "input_scale": f"1 / {p}input_global_scale"}
    gs = _reciprocal(weight_global_scale, f"{p}weight_global_scale", what)
    ins = None if input_global_scale is None else _reciprocal(input_global_scale, f"{p}input_global_scale", what)
    if isinstance(weight_packed, torch.Tensor):
        gs = gs.to(weight_packed.device)
        ins = None if ins is None else ins.to(weight_packed.device)
    if isinstance(weight_scale, torch.Tensor) and weight_scale.dtype == torch.uint8:
        weight_scale = weight_scale.view(torch.float8_e4m3fn)
    if isinstance(weight_scale, torch.Tensor) and isinstance(weight_packed, torch.Tensor):
        weight_scale = weight_scale.to(weight_packed.device)
    return FP4Weight._build("nvfp4", weight_packed, weight_scale, gs, ins, what=what, labels=labels)


#: the safetensors dtype a stored ``weight_scale`` must have, per FP4 format
_SCALE_DTYPES = {"nvfp4": ("F8_E4M3", "float8_e4m3fn block scales"), "mxfp4": ("U8", "uint8 E8M0 exponents")}


def _check_scale_dtype(t: _Tensors, scheme: _Scheme, name: str) -> None:
    """The stored ``<name>.weight_scale`` has the dtype of ``scheme``'s format: NVFP4's E4M3 bytes
    and MXFP4's E8M0 exponents are both one byte, so one read as the other would load silently."""
    key = f"{name}.weight_scale"
    if key not in t:
        return  # named by the reader of the weight
    got = t.stored_dtype(key)
    want, what = _SCALE_DTYPES[scheme.fmt]
    if got != want:
        raise ValueError(f"{_WHAT}: tensor {key!r} in {t.root / t.file_of(key)} is stored as {got}, but "
                         f"{scheme.source} ({scheme.fmt}) stores {what}: expected {want}")


def _fp4_weight(t: _Tensors, scheme: _Scheme, name: str, lin: Optional[nn.Linear] = None) -> FP4Weight:
    """Module ``name``'s stored FP4 weight (``lin``: the Linear layer it is for, named in errors;
    None: one expert's)."""
    packed = _packed_key(scheme, name)
    shape = t.stored_shape(packed) if packed is not None and packed in t else None
    if shape is not None and len(shape) != 2 and lin is not None:
        raise ValueError(f"{_WHAT}: {packed!r} must be [N, K/2] = ({lin.out_features}, {lin.in_features // 2}) for "
                         f"the Linear layer {name!r}, got shape {shape} (stacked experts are 3-D; a Linear layer's "
                         "FP4 weight is 2-D)")
    if shape is not None and len(shape) != 2:
        raise ValueError(f"{_WHAT}: {packed!r} must be 2-D, [N, K/2] (the FP4 weight of one layer or one expert, two "
                         f"values a byte), got shape {shape}")
    if (shape is not None and lin is not None and tuple(shape) != (lin.out_features, lin.in_features // 2)
            and t.stored_dtype(packed) == "U8"):  # another dtype is named as such by the checks below
        # before the scales are compared with it (a weight short of a row blamed its intact scales)
        _shape_mismatch(name, (shape[0], 2 * shape[1]), lin, packed, shape)
    if scheme.method != "mxfp4":
        _check_scale_dtype(t, scheme, name)
    if scheme.method == "modelopt":
        w = load_state_dict_weight(t, name)
        if w.fmt != "nvfp4" or w.experts:
            raise ValueError(f"{_WHAT}: {name!r} is not a 2-D ModelOpt NVFP4 weight (found {w.fmt} {tuple(w.shape)})")
        return w
    if scheme.fmt == "mxfp4":
        keys = [f"{name}.weight_packed", f"{name}.weight_scale"]
        for k in keys:
            if k not in t:
                raise KeyError(f"{_WHAT}: {keys[0]!r} is stored but {k!r} is missing")
        packed, scale = t[keys[0]], t[keys[1]]
        if isinstance(scale, torch.Tensor) and isinstance(packed, torch.Tensor):
            scale = scale.to(packed.device)
        return FP4Weight._build("mxfp4", packed, scale, what=_WHAT, labels={"data": keys[0], "scale": keys[1]})
    keys = [f"{name}.{k}" for k in ("weight_packed", "weight_scale", "weight_global_scale")]
    for k in keys:
        if k not in t:
            raise KeyError(f"{_WHAT}: {keys[0]!r} is stored but {k!r} is missing")
    ins_key = f"{name}.input_global_scale"
    ins = t[ins_key] if ins_key in t else None
    return from_compressed_tensors(*(t[k] for k in keys), ins, prefix=name)


def _packed_key(scheme: _Scheme, name: str) -> Optional[str]:
    """The stored name of module ``name``'s packed FP4 values, where they are one 2-D tensor."""
    return {"modelopt": f"{name}.weight", "mxfp4": None}.get(scheme.method, f"{name}.weight_packed")


def _shape_mismatch(name: str, nk: tuple, lin: nn.Linear, packed_key: Any, packed_shape: tuple) -> None:
    raise ValueError(
        f"{_WHAT}: {name!r} is stored as an FP4 weight of shape {tuple(nk)} ([N, K]) but the model's config wants "
        f"[{lin.out_features}, {lin.in_features}] ({packed_key!r} {tuple(packed_shape)}); checkpoint and config.json "
        "do not match"
    )


def _fp4_linear(t: _Tensors, scheme: _Scheme, name: str, lin: nn.Linear, dtype: torch.dtype) -> FP4Linear:
    w = _fp4_weight(t, scheme, name, lin)
    if (w.n, w.k) != (lin.out_features, lin.in_features):
        _shape_mismatch(name, tuple(w.shape), lin, scheme.packed_key(name), tuple(w.data.shape))
    bias = None
    if lin.bias is not None:
        bias = _dense(t, f"{name}.bias", tuple(lin.bias.shape), dtype)
    return FP4Linear(w, bias)


# -- dense tensors, the model ------------------------------------------------------------------
def _dense(t: _Tensors, key: str, shape: tuple[int, ...], dtype: torch.dtype, param: bool = True) -> torch.Tensor:
    """The stored dense tensor ``key``, checked against the model's ``shape`` (and, for a
    parameter, being floating point), in ``dtype``; non-finite values are warned about."""
    if key not in t:
        raise MissingKeyError(f"{_WHAT}: {t.root}: the checkpoint has no tensor {key!r}, which the model needs "
                              f"(shape {list(shape)})")
    v = t[key]
    if (v.dtype == torch.uint8 and key.endswith(".weight") and len(shape) == 2
            and tuple(v.shape) == (shape[0], shape[1] // 2)):
        if key + "_scale" in t:
            raise ValueError(
                f"{_WHAT}: {key!r} is stored packed (uint8 {tuple(v.shape)}, two FP4 values a byte) with its "
                f"{key + '_scale'!r}, but the checkpoint's quantization config does not read them as an FP4 "
                "weight: its quant_method names FP4 tensors otherwise (gpt-oss 'mxfp4': '<name>_blocks' / "
                "'<name>_scales'; compressed-tensors: 'weight_packed'), or it excludes this module; check "
                "quantization_config in config.json (and hf_quant_config.json)"
            )
        raise ValueError(
            f"{_WHAT}: {key!r} is stored packed (uint8 {tuple(v.shape)}, two FP4 values a byte) but "
            f"{key + '_scale'!r} is missing (or the checkpoint's config excludes its module)"
        )
    if tuple(v.shape) != shape:
        raise ValueError(
            f"{_WHAT}: {key!r} has shape {tuple(v.shape)} in the checkpoint but the model's config wants {shape}"
        )
    if v.dtype == torch.uint8:
        raise ValueError(
            f"{_WHAT}: {key!r} is stored as uint8 (quantized?) but its module is dense (excluded or not targeted)"
        )
    if not v.is_floating_point():
        if param:
            raise ValueError(f"{_WHAT}: {key!r} is stored as {v.dtype}, but the model's parameter is floating "
                             f"point ({dtype})")
        return v
    bad = int((~torch.isfinite(v.float() if v.element_size() == 1 else v)).sum())  # no isfinite for float8
    if bad:
        warnings.warn(f"autofp4: {key!r} holds {bad} non-finite value(s) (NaN or inf) in the checkpoint",
                      UserWarning, stacklevel=3)
    return v.to(dtype)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters created inside go to the meta device (never written); buffers stay real, so
    values computed at construction (rotary frequencies) are kept."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        original(module, name, param)
        p = module._parameters.get(name)
        if p is not None and p.device.type != "meta":
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _generation_config(root: Path) -> Any:
    """The checkpoint's ``generation_config.json`` as a ``GenerationConfig`` (None without one); a
    file transformers cannot read is an error naming it."""
    from .writer import read_generation_config

    return read_generation_config(root, _WHAT)


def _model_class(config: Any) -> Any:
    """The transformers class of the checkpoint's ``architectures`` (a sequence classifier, a bare
    ``LlamaModel``, a speech seq2seq model are built as what they were saved as), else
    ``AutoModelForCausalLM``."""
    import transformers

    archs = getattr(config, "architectures", None)
    if isinstance(archs, (list, tuple)) and archs and isinstance(archs[0], str) and archs[0].isidentifier():
        try:
            cls = getattr(transformers, archs[0], None)
        except Exception:  # a lazy import that fails: not this checkpoint's problem
            cls = None
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) \
                and isinstance(config, getattr(cls, "config_class", None) or type(config)):
            return cls
    return transformers.AutoModelForCausalLM


def _empty_model(config: Any, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    qc = getattr(config, "quantization_config", None)
    if qc is not None:
        del config.quantization_config  # the model is built dense, then filled here
    cls = _model_class(config)
    try:
        with _parameters_on_meta(), no_init_weights():
            if cls is AutoModelForCausalLM:
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            else:
                model = cls._from_config(config, dtype=dtype)
    except (TypeError, ValueError, ZeroDivisionError, KeyError, AttributeError, IndexError) as e:
        if str(e).startswith(_WHAT):
            raise
        # a value transformers reads as it builds the model (rope_scaling, layer_types, ...)
        raise ValueError(f"{_WHAT}: transformers cannot build the {getattr(config, 'model_type', '?')} model of "
                         f"config.json: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (a field of "
                         "config.json with a value of the wrong type or out of range?)") from e
    finally:
        if qc is not None:
            config.quantization_config = qc
    return model


def _replace_linears(model: nn.Module, t: _Tensors, scheme: _Scheme, dtype: torch.dtype) -> list[str]:
    """Quantized linears -> FP4Linear; returns the names of non-excluded linears stored dense."""
    dense_stored = []
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        stored_fp4 = scheme.packed_key(name) in t
        if stored_fp4:
            scheme.check_stored_quantized(name, "Linear", scheme.packed_key(name))
        elif scheme.excluded(name, "Linear"):
            continue
        if not stored_fp4:
            if scheme.targeted(name, "Linear"):
                dense_stored.append(name)
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _fp4_linear(t, scheme, name, mod, dtype))
    return dense_stored


def _fp32_pattern(model: nn.Module) -> Optional["re.Pattern[str]"]:
    """What names the parameters the model class keeps in float32 (``_keep_in_fp32_modules`` and
    ``_keep_in_fp32_modules_strict``: T5's ``wo``, DeepSeek-V3's router ``gate.weight``), matched
    as transformers matches them: a run of whole dotted components of the name; None if none."""
    entries = keep_in_fp32_entries(model)
    if not entries:
        return None
    return re.compile("|".join(rf"(?:^|\.){re.escape(e)}(?:$|\.)" for e in entries))


def _fill_dense(model: nn.Module, t: _Tensors, dtype: torch.dtype) -> None:
    fp32 = _fp32_pattern(model)
    missing = []
    for mname, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            key = f"{mname}.{pname}" if mname else pname
            if key not in t:
                missing.append(key)
                continue
            want = torch.float32 if fp32 is not None and fp32.search(key) else dtype
            mod._parameters[pname] = nn.Parameter(_dense(t, key, tuple(p.shape), want), requires_grad=False)
        for bname, b in list(mod._buffers.items()):
            key = f"{mname}.{bname}" if mname else bname
            if (b is not None and not isinstance(mod, FP4Buffers) and bname not in mod._non_persistent_buffers_set
                    and key in t):
                mod._buffers[bname] = _dense(t, key, tuple(b.shape), b.dtype if b.is_floating_point() else dtype,
                                             param=False)
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if (getattr(model.config, "tie_word_embeddings", False) and isinstance(out, nn.Module)
            and out.weight.is_meta and not inp.weight.is_meta):
        out.weight = inp.weight
        missing = [k for k in missing if model.get_parameter(k) is not inp.weight]
    elif getattr(model.config, "tie_word_embeddings", False) and isinstance(out, nn.Module):
        ow, iw = getattr(out, "weight", None), getattr(inp, "weight", None)
        if (isinstance(ow, torch.Tensor) and isinstance(iw, torch.Tensor) and not ow.is_meta and not iw.is_meta
                and ow is not iw and (ow.shape != iw.shape or not torch.equal(ow, iw))):
            out_name = next((n for n, m in model.named_modules() if m is out), "lm_head")
            in_name = next((n for n, m in model.named_modules() if m is inp), "embed_tokens")
            warnings.warn(f"{_WHAT}: {t.root}: config.json sets tie_word_embeddings: true, but the checkpoint "
                          f"stores a {out_name}.weight that differs from {in_name}.weight; the stored "
                          f"{out_name}.weight is used (the model is loaded untied)", stacklevel=3)
    if missing:
        raise KeyError(f"{_WHAT}: the checkpoint lacks {len(missing)} tensors the model needs: {missing[:8]}"
                       f"{_lacking_note(missing, t, model)}")


def _index_list(indices: list[int]) -> str:
    return ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "")


def _lacking_note(missing: list[str], t: Mapping, model: nn.Module) -> str:
    """Where the tensors the model lacks are stored otherwise: routed experts where config.json
    builds a dense MLP (Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``), or per-expert
    tensors whose expert indices are not the 0..E-1 of config.json's expert count."""
    stored = list(t)
    dense_with_experts: list[str] = []
    notes: list[str] = []
    for key in missing:
        m = re.fullmatch(r"(.+\.mlp)\.(?:gate|up|down)_proj\.weight", key)
        if m and m.group(1) not in dense_with_experts and any(k.startswith(f"{m.group(1)}.experts.") for k in stored):
            dense_with_experts.append(m.group(1))
        m = re.fullmatch(r"(.+\.experts)\.(?:gate_up_proj|down_proj)", key)
        if m is None:
            continue
        prefix = f"{m.group(1)}."
        parts = {k[len(prefix):].split(".", 1)[0] for k in stored if k.startswith(prefix) and "." in k[len(prefix):]}
        found = sorted(int(p) for p in parts if re.fullmatch(r"0|[1-9][0-9]*", p))
        odd = sorted(p for p in parts if not re.fullmatch(r"0|[1-9][0-9]*", p) and p not in ("gate_up_proj", "down_proj"))
        note = f"{m.group(1)} stores experts"
        if (found or odd) and note not in "".join(notes):
            count = int(model.get_parameter(key).shape[0])
            lack = [i for i in range(count) if i not in found]
            beyond = [i for i in found if i >= count]
            notes.append(f"{note} {_index_list(found) if found else 'under no index'}, where config.json's expert count {count} means experts "
                         f"0..{count - 1}" + (f"; expert(s) {_index_list(lack)} missing" if lack else "")
                         + (f"; expert(s) {_index_list(beyond)} beyond the count" if beyond else "")
                         + (f"; {', '.join(map(repr, odd[:8]))} under it {'is' if len(odd) == 1 else 'are'} no expert "
                            "index (0, 1, 2, ... without leading zeros)" if odd else ""))
    if dense_with_experts:
        config = getattr(model, "config", None)
        fields = [f"{f} = {getattr(config, f)!r}" for f in ("mlp_only_layers", "decoder_sparse_step")
                  if getattr(config, f, None) not in (None, [], 1)]
        notes.append(f"config.json builds a dense MLP at {', '.join(dense_with_experts[:4])}"
                     + (" ..." if len(dense_with_experts) > 4 else "")
                     + f" where the checkpoint stores routed experts ('{dense_with_experts[0]}.experts.*')"
                     + (f": config.json's {' and '.join(fields)} {'do' if len(fields) > 1 else 'does'} not match the "
                        "checkpoint" if fields else ""))
    return "".join(f" ({n})" for n in notes)


def _device(device_map: Any) -> torch.device:
    if device_map is None:
        return torch.device("cpu")
    if isinstance(device_map, dict):
        places = set(device_map.values())
        if len(places) != 1:
            raise NotImplementedError(
                f"{_WHAT}: device_map spreading the model over several devices is not supported yet, got {device_map!r}"
            )
        device_map = places.pop()
    if device_map == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device_map)
    except (TypeError, RuntimeError):
        raise ValueError(f"{_WHAT}: device_map must be None, 'auto', a device or {{'': device}}, got {device_map!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{_WHAT}: device_map={device_map!r}: autofp4 loads a model onto the CPU or a CUDA GPU "
                         f"(a {dev.type} device{' holds no data' if dev.type == 'meta' else ' is not supported'}); "
                         "use None, 'auto', 'cpu' or 'cuda[:N]'")
    why = missing_device(dev)
    if why:
        raise ValueError(f"{_WHAT}: device_map={device_map!r}: {why}; load on the CPU (device_map=None) or use 'auto'")
    return dev


#: the dtypes a loaded model runs in: the FP4 kernels' activations (and the dense layers' weights)
_DTYPES = (torch.bfloat16, torch.float16)


def _check_dtype(dtype: Any) -> None:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{_WHAT}: dtype must be torch.bfloat16 or torch.float16, got {_describe(dtype)}")
    if dtype not in _DTYPES:
        raise ValueError(f"{_WHAT}: dtype must be torch.bfloat16 or torch.float16 (the activation dtypes of the "
                         f"FP4 kernels), got {dtype}")


def _checkpoint_dir(path: Union[str, Path]) -> Path:
    root = path_arg(path, "path", _WHAT)
    if not root.is_dir():
        raise FileNotFoundError(f"{_WHAT}: {root} is not a directory (a checkpoint directory with config.json)")
    if not present_file(root / "config.json", _WHAT):
        raise FileNotFoundError(f"{_WHAT}: {root} has no config.json")
    return root


def _open(root: Path, config: Mapping, model_type: Optional[str], device: torch.device) -> tuple[_Scheme, _Tensors]:
    """The quantization scheme (from ``config``, config.json's contents, and hf_quant_config.json)
    and the stored tensors, named as the model names them."""
    scheme = _scheme(root, config)
    scheme.renames = tuple(RENAMES.get(model_type or "", ()))
    return scheme, _Tensors(root, device, scheme.renames)


def load_quantized_modules(model: nn.Module, t: _Tensors, scheme: _Scheme, dtype: torch.dtype) -> list[str]:
    """The routed experts and linears of ``model`` that ``t`` stores in FP4 -> FP4Experts and
    FP4Linear in place; returns the names of those not excluded but stored dense."""
    return load_experts(model, t, scheme, dtype, Readers(_fp4_weight, _dense)) + _replace_linears(model, t, scheme, dtype)


#: safetensors dtypes of integers (and booleans): no floating-point parameter is stored so
_INTEGER_DTYPES = frozenset({"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"})


def check_dense_linears(model: nn.Module, t: _Tensors, scheme: _Scheme) -> None:
    """For the transformers path (which loads the dense tensors itself): no linear left dense in
    ``model`` has its ``weight`` stored as uint8 (packed FP4 bytes whose scales are missing, or
    a module the config excludes though stored quantized), which transformers would load as the
    layer's weight, and no other floating-point parameter (a norm, an embedding) is stored as
    integers, which transformers would cast."""
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        key = f"{name}.weight"
        if key not in t or t.stored_dtype(key) != "U8":
            continue
        stored = t[key]
        t.used.discard(key)
        shape = (mod.out_features, mod.in_features)
        _dense(t, key, shape, torch.bfloat16)  # raises, naming the missing scale (or the uint8 weight)
        raise ValueError(f"{_WHAT}: {key!r} is stored as uint8 {tuple(stored.shape)} (quantized?) but "
                         f"{scheme.source} leaves its module dense")
    for key, p in model.named_parameters():  # norms, embeddings, biases: transformers would cast the bytes
        if key in t and p.is_floating_point() and t.stored_dtype(key) in _INTEGER_DTYPES:
            raise ValueError(f"{_WHAT}: {key!r} is stored as {t.stored_dtype(key)} (quantized?), but the model's "
                             f"parameter is floating point and {scheme.source} does not quantize it")


def check_dense_stored(model: nn.Module, t: _Tensors, dense: list[str]) -> None:
    """For the transformers path (which initializes what the checkpoint lacks at random): every
    Linear layer left dense has its weight stored (but an output embedding tied to the input
    one), and every experts module in ``dense`` (those not stored in FP4) tensors under its
    name; KeyError naming those without (and where the checkpoint stores them otherwise,
    :func:`_lacking_note`)."""
    out = model.get_output_embeddings() if getattr(model.config, "tie_word_embeddings", False) else None
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not out]
    dense = [n for n in dense if not isinstance(model.get_submodule(n), nn.Linear)]
    under = {n: [k for k in t if k.startswith(f"{n}.")] for n in dense}
    absent = [n for n in linears if f"{n}.weight" not in t] + [n for n in dense if not under[n]]
    packed = [n for n in dense if any(t.stored_dtype(k) == "U8" for k in under[n])]
    if packed:  # FP4 experts the loader did not find where it reads them (expert indices other than 0..E-1)
        raise KeyError(f"{_WHAT}: the FP4 experts stored under {packed[:4]} are not where the model reads them"
                       f"{_lacking_note([f'{n}.gate_up_proj' for n in packed], t, model)}")
    if absent:
        keys = [f"{n}.weight" if isinstance(model.get_submodule(n), nn.Linear) else f"{n}.gate_up_proj" for n in absent]
        raise KeyError(f"{_WHAT}: the checkpoint stores no weight for {len(absent)} module(s) the model builds "
                       f"(transformers would initialize them at random): {absent[:8]}{_lacking_note(keys, t, model)}")


def _warn_dense(dense_stored: list[str], scheme: _Scheme, dtype: torch.dtype) -> None:
    if dense_stored:
        warnings.warn(
            f"{_WHAT}: {len(dense_stored)} linear layers or experts that {scheme.source} does not exclude are "
            f"stored dense and loaded in {dtype}: {dense_stored[:8]}",
            stacklevel=3,
        )


def from_pretrained(path: Union[str, Path], device_map: Any = None, dtype: torch.dtype = torch.bfloat16,
                    fuse: bool = True) -> nn.Module:
    """The transformers model of an FP4 checkpoint directory (ModelOpt NVFP4, compressed-tensors
    NVFP4 or MXFP4, gpt-oss MXFP4), its quantized linears as :class:`~autofp4.nn.FP4Linear` and its routed experts
    as :class:`~autofp4.integrations.transformers.FP4Experts`, in eval mode.

    device_map: None (CPU), ``"auto"`` (the current CUDA device if any), a device (``"cuda:0"``,
    ``0``) or ``{"": device}``. dtype: the dtype of the dense tensors and the activations,
    ``torch.bfloat16`` or ``torch.float16`` (those the FP4 kernels compute in).
    fuse: stack the stored q/k/v and gate/up projections of each block into one weight where
    that is exact (:func:`autofp4.nn.fuse_projections`: one kernel per group).
    """
    _check_dtype(dtype)
    if not isinstance(fuse, bool):
        raise TypeError(f"{_WHAT}: fuse must be True or False, got {_describe(fuse)}")
    device = _device(device_map)
    root = _checkpoint_dir(path)
    conf = _read_config(root / "config.json")  # checked before transformers builds anything from it
    config = auto_config(root, _WHAT, conf, local_files_only=True)
    scheme, t = _open(root, conf, config.model_type, device)
    generation = _generation_config(root)  # read (and checked) before the weights are
    model = _empty_model(config, dtype)
    if generation is not None and getattr(model, "generation_config", None) is not None:
        model.generation_config = generation  # the checkpoint's (eos ids, sampling), as transformers loads it
    try:
        dense_stored = load_quantized_modules(model, t, scheme, dtype)
        _fill_dense(model, t, dtype)
    except ValueError as e:  # a shape the config sets otherwise: name the sizes config.json leaves to defaults
        note = unset_size_fields(root, config) if "config wants" in str(e) else ""
        if note:
            raise ValueError(f"{e}{note}") from e
        raise
    except KeyError as e:  # a tensor the model needs and the checkpoint lacks: say which class wanted it
        arch = (getattr(config, "architectures", None) or [""])[0]
        if arch and not arch.endswith("ForCausalLM") and type(model).__name__ == arch:
            raise KeyError(f"{e.args[0] if e.args else e} (the model class is config.json's architectures[0], "
                           f"{arch}, not a causal LM: its tensors are named or shaped otherwise than this "
                           "checkpoint's; set architectures to the causal-LM class)") from e
        raise
    if fuse:
        fuse_projections(model)
    model.to(device)
    model.eval()
    notify_converted(model)  # a transformers model: marked quantized by autofp4 (its save_pretrained refuses)
    _warn_dense(dense_stored, scheme, dtype)
    unused = sorted(set(t) - t.used)
    if unused:
        warnings.warn(f"{_WHAT}: {len(unused)} checkpoint tensors were not used: {unused[:8]}", stacklevel=2)
    return model
