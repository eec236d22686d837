"""Writing FP4 checkpoints: :func:`save_pretrained` for a model in memory, and the parts the
streaming converter (:mod:`autofp4.integrations.quantize_checkpoint`) shares with it.

    report = autofp4.quantize_model(model, "nvfp4")
    autofp4.save_pretrained(model, "out/llama-nvfp4")            # ModelOpt layout
    autofp4.save_pretrained(model, "out/llama-ct", layout="compressed-tensors")

The output directory is written in a hidden temporary directory beside it and moved into place
when complete: an error (or a crash) leaves nothing half-written under the name, and an existing
non-empty directory is replaced only with ``overwrite=True`` and only when it is a quantized
checkpoint (a previous output) holding nothing but a checkpoint's files: a file of anyone else's
in it (notes, a model card) is never deleted, the directory is refused naming it (see
:func:`check_output`). The layouts are described in
:mod:`autofp4.integrations.layouts` and docs/checkpoints.md.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Collection, Iterator, Optional, Union

import torch
from torch import nn

from ..nn import FP4FusedLinear, FP4Linear
from ..paths import REGULAR, kind_of, path_problem
from ..weights import FP4Weight, _describe
from . import layouts as L
from .safetensors_io import ShardedWriter, parse_size, present_file

__all__ = ["save_pretrained", "check_output", "staging_dir", "write_configs", "copy_side_files", "check_side_files"]

_WHAT = "autofp4.save_pretrained"
#: top-level files of a source checkpoint that are not copied: weights and what the writer writes
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
_WRITTEN = ("config.json", "hf_quant_config.json", "quantization_report.json", "model.safetensors.index.json",
            "pytorch_model.bin.index.json")
#: the files a checkpoint directory consists of: what autofp4's writers write (weights, configs,
#: the quality report) and what a tokenizer's or processor's save_pretrained writes beside them.
#: overwrite replaces a directory holding only these and the files the write itself writes (those
#: copied from the source among them); anything else in it is someone's, and refused, never deleted
_CHECKPOINT_FILES = frozenset({
    "config.json", "generation_config.json", "hf_quant_config.json", "quantization_report.json",
    "model.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json", "processor_config.json"})
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _is_side_file(f: Path) -> bool:
    """Whether :func:`copy_side_files` copies the entry ``f`` of a source checkpoint."""
    return not (f.name.startswith(".") or not f.is_file() or f.name in _WRITTEN
                or f.name.endswith(_NOT_COPIED_SUFFIXES))


def _side_file_names(source: Optional[Path]) -> set[str]:
    """The names of the files :func:`copy_side_files` copies from ``source``."""
    if source is None:
        return set()
    try:
        return {f.name for f in Path(source).iterdir() if _is_side_file(f)} if Path(source).is_dir() else set()
    except OSError:
        return set()


def _foreign_files(out: Path, written: Collection[str]) -> list[str]:
    """The names in the directory ``out`` that are neither a checkpoint's files nor in ``written``
    (the files this write writes): files of someone else's that replacing ``out`` would delete."""
    return sorted(p.name for p in out.iterdir()
                  if p.name not in written and p.name not in _CHECKPOINT_FILES and not _SHARD.fullmatch(p.name))


def _not_replaceable(out: Path, written: Collection[str], arg: str) -> Optional[str]:
    """Why ``overwrite`` may not replace the existing non-empty directory ``out`` and what to do
    (None: it may); ``written``: the names of the files the write puts in it besides a
    checkpoint's own; ``arg``: the argument that names ``out``."""
    only_outputs = ("overwrite replaces only a previous output (a directory of files with a config.json holding a "
                    f"quantization_config) or an empty directory: remove it yourself or choose another {arg}")
    real = out.resolve()
    if real == Path(real.anchor):
        return "is the root directory; " + only_outputs
    try:
        if real == Path.home().resolve():
            return "is the home directory; " + only_outputs
    except (RuntimeError, OSError):  # no home directory to compare with
        pass
    try:
        cwd = Path.cwd().resolve()
    except OSError:
        cwd = None
    if cwd is not None and (cwd == real or cwd.is_relative_to(real)):
        return "is the current working directory" + ("" if cwd == real else " (or holds it)") + "; " + only_outputs
    subdirs = sorted(p.name for p in out.iterdir() if p.is_dir() and not p.is_symlink())
    if subdirs:
        return f"holds the directory {subdirs[0]!r} (a checkpoint directory holds only files); " + only_outputs
    from ..models import load_config

    try:
        conf = load_config(out / "config.json")
    except (OSError, ValueError, TypeError):
        conf = None
    if not isinstance(conf, dict) or not isinstance(conf.get("quantization_config"), dict):
        return "is not a quantized checkpoint (it has no config.json with a quantization_config); " + only_outputs
    foreign = _foreign_files(out, written)
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:6]) + (f" and {len(foreign) - 6} more" if len(foreign) > 6 else "")
        return (f"holds {len(foreign)} file{'s' if len(foreign) > 1 else ''} that {'are' if len(foreign) > 1 else 'is'} "
                f"not part of a checkpoint ({shown}), which replacing it would delete; overwrite replaces only a "
                "previous output's own files (weights, configs, tokenizer files, the quality report, the files "
                f"copied from the source): move those out of it or choose another {arg}")
    return None


def check_output(out: Any, overwrite: Any, what: str, arg: str = "path",
                 source: Optional[Path] = None, *, side_files: Optional[Path] = None) -> Path:
    """The output directory ``out`` (the argument ``arg``) as an absolute path, checked before
    anything is written: a str or path, not empty (an unset variable is not the current
    directory); an existing ``out`` must be a directory, empty, or with ``overwrite`` (a bool) a
    quantized checkpoint to replace: a directory of files only with a config.json holding a
    quantization_config (what autofp4 and other FP4 tools write), holding no file but a
    checkpoint's (weights, configs, tokenizer files, the quality report, and the files
    :func:`copy_side_files` copies from ``side_files``, the directory the write copies them from),
    and neither the root, the home or the current working directory (nor one holding it); ``out``
    may not be (or hold) the ``source`` checkpoint."""
    if not isinstance(out, (str, os.PathLike)):
        raise TypeError(f"{what}: {arg} must be a directory path (a str or a Path), got {_describe(out)}")
    text = os.fsdecode(os.fspath(out))
    if not text:
        raise ValueError(f"{what}: {arg} is empty (''); name the output directory ('.' for the current one)")
    if "\0" in text:
        raise ValueError(f"{what}: {arg} contains a NUL character: {text[:80]!r}")
    if not isinstance(overwrite, bool):
        raise TypeError(f"{what}: overwrite must be True or False, got {_describe(overwrite)}")
    why = path_problem(text, written=True)
    if why is not None:
        raise ValueError(f"{what}: {arg}={text!r:.80}: {why}")
    path = Path(os.path.abspath(text))  # "." and "sub/.." named by what they are
    if source is not None:
        src, dst = Path(source).resolve(), path.resolve()
        if src == dst or src.is_relative_to(dst):
            raise ValueError(f"{what}: the output {path} would replace the source checkpoint {source}")
    _check_existing(path, overwrite, what, arg, _side_file_names(side_files))
    return path


def _check_existing(path: Path, overwrite: bool, what: str, arg: str, written: Collection[str]) -> None:
    """An existing ``path`` may be written: an empty directory, or with ``overwrite`` one that
    :func:`_not_replaceable` allows (``written``: what the write puts in it)."""
    if not path.exists():
        return
    if not path.is_dir():
        raise FileExistsError(f"{what}: {path} exists and is not a directory")
    if not any(path.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(f"{what}: {path} exists and is not empty; pass overwrite=True (--overwrite) "
                              "to replace it")
    why = _not_replaceable(path, written, arg)
    if why:
        raise FileExistsError(f"{what}: {path} {why}")


@contextmanager
def staging_dir(out: Union[str, Path], overwrite: bool, what: str,
                source: Optional[Path] = None, arg: str = "path", *,
                side_files: Optional[Path] = None) -> Iterator[Path]:
    """A temporary directory beside ``out``, moved to ``out`` when the block ends without an
    error and removed when it raises. ``out`` is checked by :func:`check_output`: a non-empty
    ``out`` is refused unless ``overwrite``, and replaced only when it is a quantized checkpoint
    holding nothing but a checkpoint's files; ``out`` may not be (or hold) the ``source``
    checkpoint. Checked again before it is replaced, against the files written: a file put in
    ``out`` meanwhile is refused too, never deleted."""
    out = check_output(out, overwrite, what, arg, source, side_files=side_files)
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=parent))
    except OSError as e:
        raise OSError(f"{what}: cannot write the checkpoint {out}: cannot create a directory in {parent} "
                      f"({e.strerror or e})") from None
    old = None
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        _check_existing(out, overwrite, what, arg, {p.name for p in tmp.iterdir()})  # what appeared meanwhile
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
            os.rename(out, old / "d")
            os.rename(tmp, out)
        else:
            os.rename(tmp, out)
    except BaseException:
        if old is not None and (old / "d").exists() and not out.exists():
            os.rename(old / "d", out)  # the user's directory back where it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def write_configs(root: Path, config: dict, layout: str, fmt: str, excluded: list[str]) -> dict:
    """config.json with the layout's quantization_config (and hf_quant_config.json for ModelOpt);
    returns config.json's contents."""
    config = dict(config)
    qc, extra = L.quantization_config(layout, fmt, excluded)
    config["quantization_config"] = qc
    (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name, doc in extra.items():
        (root / name).write_text(json.dumps(doc, indent=2) + "\n")
    return config


def read_generation_config(root: Path, what: str) -> Any:
    """``root``'s ``generation_config.json`` as a transformers ``GenerationConfig`` (None without
    one), read as a loader reads it: ``ValueError`` naming the file where it is a link to nothing,
    not a regular file, not a JSON object (read bounded, its nesting checked first), or values
    transformers refuses (``"max_new_tokens": "abc"``)."""
    path = Path(root) / "generation_config.json"
    if not present_file(path, what):
        return None
    from ..models import load_config

    try:
        load_config(path)  # bounded, depth-checked, a JSON object
    except (OSError, ValueError) as e:
        detail = " ".join(str(e).replace(f"{path}: ", "").replace(str(path), "it").split())
        raise ValueError(f"{what}: {path}: cannot read it as a generation config: {detail[:300]}") from None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(root), local_files_only=True)
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as e:
        raise ValueError(f"{what}: {path}: cannot read it as a generation config: "
                         f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from None


def check_side_files(source: Optional[Path], what: str) -> None:
    """The side files of ``source`` that a loader reads back (``generation_config.json``) are
    readable as the loader reads them (:func:`read_generation_config`); ``ValueError`` naming
    the file otherwise, before anything is written."""
    if source is None or not Path(source).is_dir():
        return
    read_generation_config(Path(source), what)


def copy_side_files(source: Optional[Path], root: Path) -> list[str]:
    """The tokenizer, generation config and other small top-level files of ``source`` copied to
    ``root`` (not the weights, nor the files the writer writes); returns their names."""
    if source is None or not source.is_dir():
        return []
    copied = []
    for f in sorted(source.iterdir()):
        if not _is_side_file(f) or (root / f.name).exists():
            _warn_not_copied(f)
            continue
        shutil.copy2(f, root / f.name)
        copied.append(f.name)
    return copied


def _warn_not_copied(f: Path) -> None:
    """Warn about an entry of a source checkpoint that looks like one of its files but is left out
    for not being a regular file (a FIFO, device or socket; a folder with a checkpoint file's name)."""
    kind = kind_of(f)
    if f.name.startswith(".") or kind in (None, REGULAR):
        return
    if kind == "a directory" and f.name not in _CHECKPOINT_FILES:
        return  # a subfolder: not part of a checkpoint's top level
    warnings.warn(f"{f}: not copied to the output: it is {kind}", RuntimeWarning, stacklevel=3)


def config_dict(config: Any) -> dict:
    """A transformers config as JSON-ready dict, without a quantization_config."""
    d = json.loads(config.to_json_string(use_diff=False))
    d.pop("quantization_config", None)
    return d


def write_tensors(root: Path, tensors: dict[str, torch.Tensor], max_shard_size: Union[int, str]) -> dict[str, str]:
    writer = ShardedWriter(root, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], max_shard_size)
    try:
        for k, v in tensors.items():
            writer.write(k, v)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


# -- a model in memory --------------------------------------------------------------------------
def _experts_cls():
    from .transformers import FP4Experts

    return FP4Experts


def _model_fmt(model: nn.Module) -> Optional[str]:
    fmts = {m.fmt for m in model.modules() if isinstance(m, (FP4Linear, _experts_cls()))}
    if len(fmts) > 1:
        raise ValueError(f"{_WHAT}: the model mixes FP4 formats {sorted(fmts)}; a checkpoint holds one")
    return fmts.pop() if fmts else None


def _module_tensors(name: str, module: nn.Module, layout: str, model_type: Optional[str]) -> dict[str, torch.Tensor]:
    """The stored tensors of one FP4 module of the model (named by the model)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(module, FP4FusedLinear):
        w = module.fp4_weight()
        for i, part in enumerate(module.part_names):
            a, b = module.part_bounds[i], module.part_bounds[i + 1]
            stored = L.stored_name(part, model_type)
            out.update(L.linear_tensors(layout, stored, w.slice_rows(a, b)))
            if module.bias is not None:
                out[f"{stored}.bias"] = module.bias[a:b]
        return out
    if isinstance(module, FP4Linear):
        stored = L.stored_name(name, model_type)
        out.update(L.linear_tensors(layout, stored, module.fp4_weight()))
        if module.bias is not None:
            out[f"{stored}.bias"] = module.bias
        return out
    return L.experts_tensors(layout, L.stored_name(name, model_type), module.fp4_weight("gate_up_proj"),
                             module.fp4_weight("down_proj"), module.gate_up_proj_bias, module.down_proj_bias,
                             model_type)


def _dense_experts_tensors(name: str, module: nn.Module, model_type: Optional[str]) -> dict[str, torch.Tensor]:
    """Experts left in high precision, one linear per expert as checkpoints store them (gpt-oss's
    stay stacked, under their own names)."""
    from .transformers import _is_gpt_oss

    stored = L.stored_name(name, model_type)
    if _is_gpt_oss(module) or getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
        return {f"{stored}.{k}": v for k, v in module.state_dict().items()}
    g, u, d = L.expert_proj_names(model_type)
    gu, dn = module.gate_up_proj.detach(), module.down_proj.detach()
    i = gu.shape[1] // 2
    out = {}
    for x in range(gu.shape[0]):
        out[f"{stored}.{x}.{g}.weight"] = gu[x, :i]
        out[f"{stored}.{x}.{u}.weight"] = gu[x, i:]
        out[f"{stored}.{x}.{d}.weight"] = dn[x]
    return out


def _excluded_modules(model: nn.Module, model_type: Optional[str], fp4_experts: list[str]) -> list[str]:
    """Stored names of the modules kept in high precision that an engine could quantize: dense
    linears, the routers next to the experts, experts left dense."""
    from .checkpoint_experts import experts_modules

    dense_experts = [n for n, _ in experts_modules(model)]
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)] + dense_experts
    names += L.routers_next_to(model, fp4_experts + dense_experts)
    return sorted({L.stored_name(n, model_type) for n in names})


def save_pretrained(model: nn.Module, path: Union[str, Path], layout: Optional[str] = None, *,
                    max_shard_size: Union[int, str] = "5GB", overwrite: bool = False, tokenizer: Any = None,
                    copy_files_from: Union[str, Path, None] = None) -> Path:
    """Write ``model`` (converted by :func:`autofp4.quantize_model` or loaded by
    :func:`autofp4.from_pretrained`) as a Hugging Face checkpoint directory in ``layout``:
    ``"modelopt"`` (NVFP4), ``"compressed-tensors"`` (NVFP4 or MXFP4) or ``"gpt-oss"`` (MXFP4
    experts of a gpt-oss model); None picks ModelOpt for NVFP4, gpt-oss for a gpt-oss MXFP4 model
    and compressed-tensors otherwise.

    Quantized layers are written in the layout; everything else (embeddings, norms, routers,
    skipped layers) as the model holds it. Fused q/k/v and gate/up weights are written as their
    parts, sharing the fused weight's global scale (what a serving engine fuses again exactly).
    ``tokenizer`` (anything with ``save_pretrained``) is saved alongside; the tokenizer and
    generation files of ``copy_files_from`` (default: the directory the model was loaded from,
    if it is a local one) are copied; a ``generation_config.json`` there replaces the model's
    ``generation_config`` when ``copy_files_from`` is given (else the model's is written). See :func:`staging_dir` for ``overwrite`` and what an error
    leaves behind. Returns the directory."""
    inner = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
        model = inner  # torch.compile's wrapper: its state_dict names carry an '_orig_mod.' prefix
    config = getattr(model, "config", None)
    if not isinstance(model, nn.Module) or config is None or not hasattr(config, "to_json_string"):
        raise TypeError(f"{_WHAT}: model must be a transformers model (with a .config), got {_describe(model)}")
    try:
        parse_size(max_shard_size)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{_WHAT}: {e}") from None
    if copy_files_from is not None and not isinstance(copy_files_from, (str, os.PathLike)):
        raise TypeError(f"{_WHAT}: copy_files_from must be a folder path (str or Path), "
                        f"got {type(copy_files_from).__name__} {copy_files_from!r}")
    source = Path(copy_files_from) if copy_files_from is not None else _loaded_from(config)
    check_output(path, overwrite, _WHAT, "path", side_files=source)
    model_type = getattr(config, "model_type", None)
    fmt = _model_fmt(model)
    if fmt is None:
        raise ValueError(f"{_WHAT}: the model has no FP4 layers; convert it first with autofp4.quantize_model(model, "
                         "'nvfp4') (or load an FP4 checkpoint with autofp4.from_pretrained)")
    layout = L.check_layout(L.default_layout(fmt, model_type) if layout is None else layout, fmt, model_type, _WHAT)
    acts = sorted({str(a) for m in model.modules() if (a := getattr(m, "_act_dtype", None)) is not None})
    if acts:
        warnings.warn(f"{_WHAT}: the model's FP4 layers run with act_dtype={acts[0]!r} (W4A8), which the {layout} "
                      "checkpoint does not record (it stores the FP4 weights): after loading it, turn it on again "
                      f"with autofp4.set_activations(model, {acts[0]!r})", RuntimeWarning, stacklevel=2)
    experts_cls = _experts_cls()
    fp4 = {n: m for n, m in model.named_modules() if isinstance(m, (FP4Linear, experts_cls))}
    if layout == "gpt-oss":
        linears = [n for n, m in fp4.items() if isinstance(m, FP4Linear)]
        if linears:
            raise ValueError(
                f"{_WHAT}: the gpt-oss layout stores only the routed experts in MXFP4, but {len(linears)} linear "
                f"layers are FP4 ({linears[:3]}); quantize with skip=['lm_head', '*.self_attn.*'] or write "
                "layout='compressed-tensors'")
    from .checkpoint_experts import experts_modules

    dense_experts = dict(experts_modules(model))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for key, value in state.items():
        owner = next((p for p in _owners(key, fp4, dense_experts)), None)
        if owner is not None:
            if owner not in done:
                done.add(owner)
                if owner in fp4:
                    tensors.update(_module_tensors(owner, fp4[owner], layout, model_type))
                else:
                    tensors.update(_dense_experts_tensors(owner, dense_experts[owner], model_type))
            continue
        if (tied and emb is not None and key.endswith("lm_head.weight")
                and value.data_ptr() == emb.weight.data_ptr()):
            continue  # the embeddings' copy: transformers ties it again
        tensors[L.stored_name(key, model_type)] = value
    excluded = _excluded_modules(model, model_type, [n for n, m in fp4.items() if isinstance(m, experts_cls)])
    cfg = config_dict(config)
    cfg["architectures"] = [type(model).__name__]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if tied and isinstance(head, FP4Linear):
        cfg["tie_word_embeddings"] = False  # an FP4 lm_head no longer shares the embeddings' weight
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(f"{_WHAT}: tokenizer must have a save_pretrained method (a transformers tokenizer), "
                        f"got {_describe(tokenizer)}")
    if copy_files_from is not None and not Path(copy_files_from).is_dir():
        raise FileNotFoundError(f"{_WHAT}: copy_files_from={str(copy_files_from)!r} is not a directory")
    check_side_files(source, _WHAT)
    meta = [k for k, v in tensors.items() if v.is_meta]
    if meta:
        raise ValueError(f"{_WHAT}: {len(meta)} tensors of the model are on the meta device (no values to write): "
                         f"{meta[:5]}")
    with staging_dir(path, overwrite, _WHAT, side_files=source) as tmp:
        write_tensors(tmp, tensors, max_shard_size)  # each copied to the host only as it is written
        write_configs(tmp, cfg, layout, fmt, excluded)
        gen = getattr(model, "generation_config", None)
        given = copy_files_from is not None and (Path(copy_files_from) / "generation_config.json").is_file()
        if gen is not None and hasattr(gen, "to_json_file") and not given:  # an explicit source's file wins
            gen.to_json_file(str(tmp / "generation_config.json"))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        copy_side_files(source, tmp)
    return Path(path)


def _owners(key: str, fp4: dict, dense_experts: dict) -> Iterator[str]:
    """The FP4 module or dense experts module whose state ``key`` is."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in fp4 or prefix in dense_experts:
            yield prefix
            return


def _loaded_from(config: Any) -> Optional[Path]:
    p = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    if isinstance(p, (str, os.PathLike)) and str(p) and Path(p).is_dir():
        return Path(p)
    return None


def fp4_weight_like(fmt: str, shape: tuple[int, ...], device: Union[str, torch.device] = "meta") -> FP4Weight:
    """An FP4Weight of ``shape`` ([N, K] or [E, N, K]) with uninitialised tensors (the meta device by
    default): the layouts' functions on it give the stored tensors' names, dtypes and shapes."""
    *lead, n, k = shape
    bs = 16 if fmt == "nvfp4" else 32
    data = torch.empty((*lead, n, k // 2), dtype=torch.uint8, device=device)
    scale = torch.empty((*lead, n, k // bs), dtype=torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8,
                        device=device)
    gs = torch.empty(tuple(lead), dtype=torch.float32, device=device) if fmt == "nvfp4" else None
    return FP4Weight(fmt, data, scale, gs, check_values=False)
