"""``autofp4 quantize``: a bf16 (or fp16/fp32) Hugging Face checkpoint -> an FP4 checkpoint, streamed.

    autofp4 quantize path/to/Llama-3.1-70B --fmt nvfp4 --layout modelopt --out path/to/Llama-3.1-70B-NVFP4

The checkpoint is read tensor by tensor, row block by row block, with plain file reads (no
memory map), and written the same way (:mod:`autofp4.integrations.safetensors_io`): memory stays
bounded by a few row blocks and the FP4 form of the largest tensor (about a quarter of its bf16
bytes), whatever the model's size. Which tensors are quantized is decided as
:func:`autofp4.quantize_model` decides for the model built from ``config.json`` (on the meta
device: no weights): every ``nn.Linear`` but ``lm_head``, the MoE routers and ``skip`` patterns, and
the routed experts; sibling projections (q/k/v, gate/up, each expert's gate/up) share one NVFP4
global scale, so the output is bit for bit what :func:`autofp4.save_pretrained` writes after
``quantize_model`` of the same model. The gpt-oss layout quantizes the routed experts only.

A quality report (``quantization_report.json`` beside the checkpoint, and printed): per quantized
tensor the relative error ``||w - deq(q(w))|| / ||w||`` and the SQNR in dB, the worst named.
"""
from __future__ import annotations

import fnmatch
import io
import json
import math
import resource
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, TextIO, Union

import torch

from ..formats import E2M1_MAX, E4M3_MAX, check_fmt, dequantize_blocks, quantize_mxfp4, quantize_nvfp4
from ..patterns import pattern_list, warn_unmatched
from ..problem import BLOCK_SIZE
from . import layouts as L
from .safetensors_io import SafetensorsReader, ShardedWriter, parse_size, path_arg, present_file
from .writer import check_output, check_side_files, copy_side_files, fp4_weight_like, staging_dir, write_configs

__all__ = ["quantize_checkpoint", "QuantizeSummary"]

_WHAT = "autofp4 quantize"
_CHUNK_BYTES = 64 * 2**20  # source bytes read and quantized at a time
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # as quantize_model's fuse


@dataclass
class TensorQuality:
    name: str
    shape: tuple[int, ...]
    sum_sq: float = 0.0
    err_sq: float = 0.0

    @property
    def rel_error(self) -> float:
        return math.sqrt(self.err_sq / self.sum_sq) if self.sum_sq > 0 else 0.0

    @property
    def sqnr_db(self) -> Optional[float]:
        if self.err_sq == 0 or self.sum_sq == 0:
            return None  # exact (or all zero): no finite SQNR
        return 10 * math.log10(self.sum_sq / self.err_sq)


@dataclass
class QuantizeSummary:
    """What :func:`quantize_checkpoint` did."""

    out: Path
    fmt: str
    layout: str
    quantized: int = 0  # source tensors quantized
    copied: int = 0  # source tensors copied as they are
    bytes_before: int = 0  # all source tensors
    bytes_after: int = 0  # all written tensors
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    excluded: list[str] = field(default_factory=list)
    quality: list[TensorQuality] = field(default_factory=list)

    def worst(self, n: int = 5) -> list[TensorQuality]:
        return sorted(self.quality, key=lambda q: -q.rel_error)[:n]

    def report(self) -> dict:
        return {
            "format": self.fmt, "layout": self.layout, "tensors_quantized": self.quantized,
            "tensors_copied": self.copied, "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
            "seconds": round(self.seconds, 2), "peak_rss_bytes": self.peak_rss_bytes,
            "kept_in_high_precision": self.excluded,
            "worst": [q.name for q in self.worst(10)],
            "tensors": [{"name": q.name, "shape": list(q.shape), "rel_error": q.rel_error, "sqnr_db": q.sqnr_db}
                        for q in self.quality],
        }

    def __str__(self) -> str:
        lines = [f"autofp4: wrote {self.out} ({self.layout}, {self.fmt}): quantized {self.quantized} tensors, "
                 f"copied {self.copied}; {_size(self.bytes_before)} -> {_size(self.bytes_after)} in "
                 f"{self.seconds:.1f} s, peak memory {_size(self.peak_rss_bytes)}"]
        if self.quality:
            rel = [q.rel_error for q in self.quality]
            lines.append(f"  relative error: median {sorted(rel)[len(rel) // 2]:.4f}, max {max(rel):.4f}; worst:")
            for q in self.worst(5):
                s = "exact" if q.sqnr_db is None else f"{q.sqnr_db:.1f} dB"
                lines.append(f"    {q.name} {list(q.shape)}: {q.rel_error:.4f} ({s})")
        return "\n".join(lines)


def _size(n: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


# -- the plan -----------------------------------------------------------------------------------
@dataclass
class _Linear:
    """Quantized linears sharing one global scale: their stored names (model names) in row order."""

    members: list[tuple[str, str]]  # (stored weight key, stored module name for the output)


@dataclass
class _Experts:
    """One routed-experts module: its stored (output) name and where each expert's gate, up and
    down weights are read."""

    out_name: str
    num: int
    two_i: int
    h: int
    read_gate_up: Callable[[SafetensorsReader, int], tuple[torch.Tensor, torch.Tensor]]
    read_down: Callable[[SafetensorsReader, int], torch.Tensor]
    sources: list[str]
    bias_keys: tuple[Optional[str], Optional[str]] = (None, None)  # gpt-oss: (gate_up_proj_bias, down_proj_bias)


def _model_on_meta(src: Path) -> tuple[Any, Any]:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise RuntimeError(f"{_WHAT} needs transformers (to know the model's layers): pip install transformers") from None
    from ..models import load_checked_config

    from .checkpoints import _model_class, auto_config

    conf = load_checked_config(src)  # bounded, depth-checked, sizes within bounds, no NaN: before transformers
    check_side_files(Path(src) if Path(src).is_dir() else Path(src).parent, _WHAT)  # copied at the end
    config = auto_config(src, _WHAT, conf, local_files_only=True)
    if getattr(config, "quantization_config", None) is not None:
        raise ValueError(f"{_WHAT}: {src} is already quantized (config.json has a quantization_config); "
                         "quantize a bf16, fp16 or fp32 checkpoint")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    built = _model_class(config)
    if built is not AutoModelForCausalLM and built.__name__ != type(model).__name__:
        raise ValueError(f"{_WHAT}: config.json's architectures[0] is {built.__name__}, not the causal LM "
                         f"{type(model).__name__} this command quantizes: autofp4.from_pretrained builds "
                         f"architectures[0], so the output would not load; if the tensors are the causal LM's, set "
                         f"architectures to [{type(model).__name__!r}]")
    return config, model


#: the skip patterns every call carries (lm_head is kept in bf16): no warning where a model has none
DEFAULT_SKIP = ("lm_head", "*.lm_head")


def _expert_count(mod: Any) -> int:
    """The routed experts of a stacked experts module (its first weight's leading size)."""
    w = getattr(mod, "gate_up_proj", None)
    return int(w.shape[0]) if isinstance(w, torch.Tensor) and w.dim() == 3 else 0


def _plan(reader: SafetensorsReader, model: Any, model_type: Optional[str], fmt: str, layout: str,
          skip: list[str]) -> tuple[list[Any], list[str]]:
    """Units in source order (_Linear, _Experts, or a str: a tensor copied as it is) and the
    excluded module names."""
    from torch import nn

    from .checkpoint_experts import experts_modules
    from .transformers import _activation, _is_gpt_oss, _layout_problem

    bs = BLOCK_SIZE[fmt]
    by_model = {L.model_name(k, model_type): k for k in reader}
    for k in reader:
        if k.endswith(("_blocks", ".weight_packed", ".weight_scale", ".weight_scale_2")):
            raise ValueError(f"{_WHAT}: {reader.root} already holds quantized tensors ({k!r}); quantize a bf16, "
                             "fp16 or fp32 checkpoint")
    experts = dict(experts_modules(model))
    keep = set(L.routers_next_to(model, list(experts)))

    def matches(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in skip)

    _check_against_model(reader, model, model_type, by_model, experts)
    layers = [n for n, m in model.named_modules(remove_duplicate=False) if n and (isinstance(m, nn.Linear) or n in experts)]
    seen = set(layers)
    warn_unmatched(skip, layers + [f"{n}.{p}" for n in experts for p in ("gate_up_proj", "down_proj")],
                   {n: _expert_count(m) for n, m in experts.items()}, _WHAT, ignore=DEFAULT_SKIP, stacklevel=4,
                   others=[n for n, _ in model.named_modules() if n and n not in seen])

    # linears to quantize
    linears: dict[str, str] = {}  # module name -> stored weight key
    excluded: list[str] = []
    misfit: list[str] = []  # layers to quantize whose K the format's block does not divide
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        key = by_model.get(f"{name}.weight")
        wanted = layout != "gpt-oss" and key is not None and name not in keep and not matches(name)
        if wanted and reader.info(key).dtype not in _FLOATS:
            raise ValueError(f"{_WHAT}: {key!r} is stored as {reader.info(key).dtype}; a weight to quantize must be "
                             f"bfloat16, float16 or float32 (or keep the layer with --skip {name})")
        ok = wanted and mod.in_features % bs == 0
        if ok:
            linears[name] = key
        elif key is not None or name in keep:
            excluded.append(name)
            if wanted:
                misfit.append(f"{name} (K = {mod.in_features})")
    excluded += sorted(keep)

    # groups sharing a global scale: quantize_model's fused siblings
    group_of: dict[str, list[str]] = {}
    for name in linears:
        parent, _, child = name.rpartition(".")
        for parts in _FUSED:
            if child != parts[0]:
                continue
            names = [f"{parent}.{p}" if parent else p for p in parts]
            if all(n in linears for n in names):
                infos = [reader.info(linears[n]) for n in names]
                biases = [f"{n}.bias" in by_model for n in names]
                if len({i.shape[1] for i in infos}) == 1 and len({i.dtype for i in infos}) == 1 and len(set(biases)) == 1:
                    for n in names:
                        group_of[n] = names

    # routed experts
    exp_units: dict[str, _Experts] = {}
    for name, mod in experts.items():
        gpt_oss = _is_gpt_oss(mod)
        if (matches(name) or any(matches(f"{name}.{p}") for p in ("gate_up_proj", "down_proj"))
                or _layout_problem(mod) or _activation(mod) is None):
            excluded.append(name)
            continue
        e = mod.gate_up_proj.shape[0]
        two_i, h = (mod.gate_up_proj.shape[:0:-1] if gpt_oss else mod.gate_up_proj.shape[1:])
        if h % bs or (two_i // 2) % bs:
            excluded.append(name)
            misfit.append(f"{name} (hidden {h}, intermediate {two_i // 2})")
            continue
        unit = _experts_unit(reader, name, e, two_i, h, gpt_oss, by_model, model_type)
        if unit is None:
            raise ValueError(f"{_WHAT}: the routed experts {L.stored_name(name, model_type)!r} are not stored, neither "
                             "one linear per expert nor stacked; checkpoint and config.json do not match")
        for k in unit.sources:
            info = reader.info(k)
            if info.dtype not in _FLOATS:
                raise ValueError(f"{_WHAT}: {k!r} is stored as {info.dtype}; a weight to quantize must be "
                                 "bfloat16, float16 or float32")
        exp_units[name] = unit

    if misfit:
        shown = ", ".join(misfit[:4]) + (f", ... ({len(misfit)} in all)" if len(misfit) > 4 else "")
        warnings.warn(f"{_WHAT}: kept in high precision (not quantized), as K is not a multiple of {fmt}'s block of "
                      f"{bs}: {shown}", RuntimeWarning, stacklevel=3)

    # units in the order of their first source tensor
    units: list[Any] = []
    claimed: dict[str, Any] = {}
    for name, key in linears.items():
        members = group_of.get(name, [name])
        if members[0] != name:
            continue
        unit = _Linear([(linears[n], L.stored_name(n, model_type)) for n in members])
        for k, _ in unit.members:
            claimed[k] = unit
    for unit in exp_units.values():
        for k in unit.sources:
            claimed[k] = unit
    seen: set[int] = set()
    for key in sorted(reader, key=lambda k: (reader.info(k).file.name, reader.info(k).start)):
        unit = claimed.get(key)
        if unit is None:
            units.append(key)
        elif id(unit) not in seen:
            seen.add(id(unit))
            units.append(unit)
    return units, sorted({L.stored_name(n, model_type) for n in excluded})


def _check_against_model(reader: SafetensorsReader, model: Any, model_type: Optional[str], by_model: dict[str, str],
                         experts: dict[str, Any]) -> None:
    """The stored tensors against the model config.json builds: every parameter stored (the routed
    experts are checked with their layout), in its shape, linear weights floating point; stored
    tensors the model does not have are warned about and copied."""
    from torch import nn

    params = dict(model.named_parameters(remove_duplicate=False))
    state = set(model.state_dict())
    under_experts = tuple(f"{n}." for n in experts)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing, wrong = [], []
    for name, p in params.items():
        if name.startswith(under_experts):
            continue
        key = by_model.get(name)
        if key is None:
            if not (tied and name.endswith("lm_head.weight")):
                missing.append(L.stored_name(name, model_type))
            continue
        info = reader.info(key)
        if info.shape != tuple(p.shape):
            wrong.append(f"{key!r} is {list(info.shape)}, config.json wants {list(p.shape)}")
        elif p.dtype.is_floating_point and not info.dtype.is_floating_point:
            what = "a linear weight" if name.endswith(".weight") and isinstance(
                model.get_submodule(name.rsplit(".", 1)[0]), nn.Linear) else "the model's parameter"
            wrong.append(f"{key!r} is stored as {info.dtype}, {what} must be floating point")
    if missing:
        raise ValueError(f"{_WHAT}: {reader.root} lacks {len(missing)} tensors the model of its config.json needs "
                         f"(a shard missing from the index?){L.unset_size_fields(reader.root, model.config)}: {missing[:8]}")
    if wrong:
        raise ValueError(f"{_WHAT}: {len(wrong)} stored tensors do not match the model of config.json"
                         f"{L.unset_size_fields(reader.root, model.config)}: " + "; ".join(wrong[:5]))
    extra = [k for m, k in by_model.items() if m not in state and not m.startswith(under_experts)]
    if extra:
        warnings.warn(f"{_WHAT}: {len(extra)} stored tensors are not in the model config.json builds; copied as they "
                      f"are: {extra[:8]}", UserWarning, stacklevel=3)


def _want_shape(reader: SafetensorsReader, key: str, want: tuple[int, ...]) -> None:
    if reader.info(key).shape != want:
        raise ValueError(f"{_WHAT}: {key!r} is {list(reader.info(key).shape)}, config.json wants {list(want)}")


def _experts_unit(reader: SafetensorsReader, name: str, e: int, two_i: int, h: int, gpt_oss: bool,
                  by_model: dict[str, str], model_type: Optional[str]) -> Optional[_Experts]:
    """Where the experts ``name`` are stored: one linear per expert (either projection naming)
    or stacked (transformers' ``gate_up_proj [E, 2I, H]``, gpt-oss's ``[E, H, 2I]`` interleaved)."""
    i = two_i // 2
    out = L.stored_name(name, model_type)
    for g, u, d in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        keys = [[by_model.get(f"{name}.{x}.{p}.weight") for p in (g, u, d)] for x in range(e)]
        if all(k is not None for ks in keys for k in ks):
            for ks in keys:
                for k, want in zip(ks, ((i, h), (i, h), (h, i))):
                    _want_shape(reader, k, want)
            return _Experts(out, e, two_i, h, lambda r, x, ks=keys: (r.read(ks[x][0]), r.read(ks[x][1])),
                            lambda r, x, ks=keys: r.read(ks[x][2]), [k for ks in keys for k in ks])
    gu, dn = by_model.get(f"{name}.gate_up_proj"), by_model.get(f"{name}.down_proj")
    if gu is None or dn is None:
        return None
    _want_shape(reader, gu, (e, h, two_i) if gpt_oss else (e, two_i, h))
    _want_shape(reader, dn, (e, i, h) if gpt_oss else (e, h, i))
    if gpt_oss:
        def gate_up(r: SafetensorsReader, x: int) -> tuple[torch.Tensor, torch.Tensor]:
            t = r.read(gu, (x, x + 1))[0].t()  # [2I, H], gate and up rows interleaved
            return t[0::2], t[1::2]

        bias = (by_model.get(f"{name}.gate_up_proj_bias"), by_model.get(f"{name}.down_proj_bias"))
        srcs = [gu, dn] + [b for b in bias if b is not None]
        return _Experts(out, e, two_i, h, gate_up, lambda r, x: r.read(dn, (x, x + 1))[0].t(), srcs, bias)

    def gate_up_std(r: SafetensorsReader, x: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = r.read(gu, (x, x + 1))[0]
        return t[:i], t[i:]

    return _Experts(out, e, two_i, h, gate_up_std, lambda r, x: r.read(dn, (x, x + 1))[0], [gu, dn])


# -- quantizing ---------------------------------------------------------------------------------
class _Quantizer:
    def __init__(self, fmt: str, device: torch.device, summary: QuantizeSummary, progress: Any) -> None:
        self.fmt, self.device, self.summary, self.progress = fmt, device, summary, progress

    def _rows(self, t_rows: int, row_bytes: int) -> int:
        return max(1, min(t_rows, _CHUNK_BYTES // max(row_bytes, 1)))

    def global_scale(self, parts: Iterable[Callable[[], Iterable[torch.Tensor]]], label: str) -> Optional[torch.Tensor]:
        """The NVFP4 global scale of tensors quantized as one: ``amax / (6 * 448)`` (1 if all zero),
        computed as :func:`autofp4.formats.quantize_nvfp4` computes it."""
        if self.fmt != "nvfp4":
            return None
        amax = torch.zeros((), dtype=torch.float32, device=self.device)
        for chunks in parts:
            for c in chunks():
                # the largest |w| in the stored dtype is exact; NaN and inf show in it
                amax = torch.maximum(amax, c.to(self.device).abs().amax().float())
        if not bool(torch.isfinite(amax)):
            raise ValueError(f"{_WHAT}: {label} holds NaN or inf")
        gs = amax / torch.tensor(E2M1_MAX * E4M3_MAX, dtype=torch.float32, device=self.device)
        return torch.where(gs > 0, gs, torch.ones_like(gs))

    def quantize(self, name: str, chunks: Iterable[torch.Tensor], shape: tuple[int, int],
                 gs: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed, scale) of the [N, K] weight ``name`` given as row chunks, on the CPU; its
        error is added to the summary's quality."""
        n, k = shape
        bs = BLOCK_SIZE[self.fmt]
        data = torch.empty((n, k // 2), dtype=torch.uint8)
        scale = torch.empty((n, k // bs), dtype=torch.float8_e4m3fn if self.fmt == "nvfp4" else torch.uint8)
        q = TensorQuality(name, shape)
        at = 0
        for c in chunks:
            w = c.to(self.device)
            if self.fmt == "nvfp4":
                d, s, _ = quantize_nvfp4(w, gs)
            else:
                try:
                    d, s = quantize_mxfp4(w)
                except ValueError:
                    raise ValueError(f"{_WHAT}: {name} holds NaN or inf") from None
            deq = dequantize_blocks(self.fmt, d, s, gs)
            wf = w.float()
            q.sum_sq += float(wf.square().sum())
            q.err_sq += float((deq - wf).square().sum())
            rows = w.shape[0]
            data[at:at + rows] = d.cpu()
            scale[at:at + rows] = s.cpu()
            at += rows
            if self.progress is not None:
                self.progress.update(w.numel() * c.element_size())
        self.summary.quality.append(q)
        return data, scale

    def row_chunks(self, reader: SafetensorsReader, key: str) -> Callable[[], Iterable[torch.Tensor]]:
        info = reader.info(key)

        def gen() -> Iterable[torch.Tensor]:
            step = self._rows(info.shape[0], info.row_bytes)
            for a in range(0, info.shape[0], step):
                yield reader.read(key, (a, min(a + step, info.shape[0])))
        return gen

    def tensor_chunks(self, t: torch.Tensor) -> Callable[[], Iterable[torch.Tensor]]:
        def gen() -> Iterable[torch.Tensor]:
            step = self._rows(t.shape[0], t[0].numel() * t.element_size())
            for a in range(0, t.shape[0], step):
                yield t[a:a + step]
        return gen


def _fp4(fmt: str, data: torch.Tensor, scale: torch.Tensor, gs: Optional[torch.Tensor]):
    from ..weights import FP4Weight

    return FP4Weight(fmt, data, scale, None if gs is None else gs.cpu().reshape(data.shape[:-2]), check_values=False)


def _declare(units: list[Any], reader: SafetensorsReader, fmt: str, layout: str,
             model_type: Optional[str]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    out: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for u in units:
        if isinstance(u, str):
            info = reader.info(u)
            out.append((u, info.dtype, info.shape))
            continue
        if isinstance(u, _Linear):
            for key, name in u.members:
                info = reader.info(key)
                ts = L.linear_tensors(layout, name, fp4_weight_like(fmt, info.shape))
                out += [(k, v.dtype, tuple(v.shape)) for k, v in ts.items()]
            continue
        b13, b2 = (None if k is None else torch.empty(reader.info(k).shape, dtype=reader.info(k).dtype, device="meta")
                   for k in u.bias_keys)
        ts = L.experts_tensors(layout, u.out_name, fp4_weight_like(fmt, (u.num, u.two_i, u.h)),
                               fp4_weight_like(fmt, (u.num, u.h, u.two_i // 2)), b13, b2, model_type)
        out += [(k, v.dtype, tuple(v.shape)) for k, v in ts.items()]
    return out


def _run_linear(u: _Linear, reader: SafetensorsReader, writer: ShardedWriter, qz: _Quantizer, layout: str) -> None:
    gs = qz.global_scale([qz.row_chunks(reader, k) for k, _ in u.members], " or ".join(repr(k) for k, _ in u.members))
    for key, name in u.members:
        info = reader.info(key)
        data, scale = qz.quantize(name, qz.row_chunks(reader, key)(), info.shape, gs)
        for k, v in L.linear_tensors(layout, name, _fp4(qz.fmt, data, scale, gs)).items():
            writer.write(k, v)
        qz.summary.quantized += 1


def _run_experts(u: _Experts, reader: SafetensorsReader, writer: ShardedWriter, qz: _Quantizer, layout: str,
                 model_type: Optional[str]) -> None:
    i = u.two_i // 2
    biases = [None if k is None else reader.read(k) for k in u.bias_keys]
    for x in range(u.num):
        gate, up = u.read_gate_up(reader, x)
        down = u.read_down(reader, x)
        gs13 = qz.global_scale([qz.tensor_chunks(gate), qz.tensor_chunks(up)], f"expert {x} of {u.out_name!r} (gate or up)")
        g, up_, dn = (f"{u.out_name}.{x}.{p}" for p in L.expert_proj_names(model_type))
        d_g, s_g = qz.quantize(g, qz.tensor_chunks(gate)(), (i, u.h), gs13)
        d_u, s_u = qz.quantize(up_, qz.tensor_chunks(up)(), (i, u.h), gs13)
        gs2 = qz.global_scale([qz.tensor_chunks(down)], f"expert {x} of {u.out_name!r} (down)")
        d_d, s_d = qz.quantize(dn, qz.tensor_chunks(down)(), (u.h, i), gs2)
        w13 = _fp4(qz.fmt, torch.cat((d_g, d_u))[None], torch.cat((s_g, s_u))[None],
                   None if gs13 is None else gs13.reshape(1))
        w2 = _fp4(qz.fmt, d_d[None], s_d[None], None if gs2 is None else gs2.reshape(1))
        # gpt-oss stores the gate_up bias interleaved, as its rows: gate first here, as the weights
        b13 = None if biases[0] is None else torch.cat((biases[0][x:x + 1, 0::2], biases[0][x:x + 1, 1::2]), 1)
        b2 = None if biases[1] is None else biases[1][x:x + 1]
        for k, v in L.experts_tensors(layout, u.out_name, w13, w2, b13, b2, model_type, first=x).items():
            # stacked layouts (gpt-oss): expert x's slice of each tensor is contiguous
            writer.write(k, v, at=x * v.numel() * v.element_size() if layout == "gpt-oss" else 0)
        qz.summary.quantized += 3
    qz.summary.copied += sum(b is not None for b in biases)


def _copy(key: str, reader: SafetensorsReader, writer: ShardedWriter, qz: _Quantizer) -> None:
    info = reader.info(key)
    bad = 0
    step = qz._rows(info.shape[0], info.row_bytes) if info.shape else 1
    for a in range(0, info.shape[0] if info.shape else 1, step):
        t = reader.read(key, (a, min(a + step, info.shape[0])) if info.shape else None)
        if t.is_floating_point():
            bad += int((~torch.isfinite(t)).sum())
        writer.write(key, t, at=a * info.row_bytes if info.shape else 0)
    if bad:
        warnings.warn(f"{_WHAT}: {key!r} holds {bad} non-finite value(s) (NaN or inf); copied as it is",
                      UserWarning, stacklevel=3)
    if qz.progress is not None:
        qz.progress.update(info.nbytes)
    qz.summary.copied += 1


def quantize_checkpoint(src: Union[str, Path], out: Union[str, Path], fmt: str, layout: Optional[str] = None, *,
                        skip: Iterable[str] = DEFAULT_SKIP, device: Union[str, torch.device] = "cpu",
                        max_shard_size: Union[int, str] = "5GB", overwrite: bool = False,
                        progress: bool = True, stream: Optional[TextIO] = None) -> QuantizeSummary:
    """Quantize the checkpoint directory ``src`` to ``fmt`` and write it to ``out`` in ``layout``
    (see the module's docstring; None: ModelOpt for NVFP4, gpt-oss for gpt-oss MXFP4,
    compressed-tensors otherwise). ``device``: where the row blocks are quantized (``"cuda"``
    for speed; the result is the same). Returns the summary (also written as
    ``quantization_report.json`` in ``out``)."""
    t0 = time.perf_counter()
    check_fmt(fmt, _WHAT)
    skip = pattern_list(skip, f"{_WHAT}: skip", option="--skip",
                        empty="which matches no layer; give a glob such as 'lm_head' or '*.mlp.*' (or leave --skip out)")
    src = path_arg(src, "src", _WHAT)
    if not isinstance(overwrite, bool):
        raise TypeError(f"{_WHAT}: overwrite must be True or False, got {type(overwrite).__name__} {overwrite!r:.80}")
    if not isinstance(progress, bool):
        raise TypeError(f"{_WHAT}: progress must be True or False, got {type(progress).__name__} {progress!r:.80}")
    if stream is not None and not callable(getattr(stream, "write", None)):
        raise TypeError(f"{_WHAT}: stream must be a text stream (with write) or None, got {type(stream).__name__}")
    if isinstance(stream, (io.RawIOBase, io.BufferedIOBase)):
        raise TypeError(f"{_WHAT}: stream must be a text stream (progress lines are text), got the binary "
                        f"{type(stream).__name__}; wrap it (io.TextIOWrapper) or pass None")
    if stream is not None and getattr(stream, "closed", False) is True:
        raise ValueError(f"{_WHAT}: stream is closed: the progress would be lost; pass an open stream (or None: "
                         "standard error)")
    if not isinstance(device, (str, torch.device)) or isinstance(device, bool):
        raise TypeError(f"{_WHAT}: device must be a str such as 'cuda' or a torch.device, got "
                        f"{type(device).__name__} {device!r:.80}")
    try:
        parse_size(max_shard_size)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{_WHAT}: {e}") from None
    if not src.is_dir() or not present_file(src / "config.json", _WHAT):
        raise FileNotFoundError(f"{_WHAT}: {src} is not a checkpoint directory (a directory with config.json)")
    check_output(out, overwrite, _WHAT, "out (--out)", src, side_files=src)  # before the work: again when written
    from ..models import load_checked_config, load_config

    load_checked_config(src / "config.json")  # bounded read of config.json before transformers uses it
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{_WHAT}: device must be cpu or cuda[:N], got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{_WHAT}: device {device!r} asked for, but CUDA is not available")
    config, model = _model_on_meta(src)
    model_type = getattr(config, "model_type", None)
    layout = L.check_layout(L.default_layout(fmt, model_type) if layout is None else layout, fmt, model_type, _WHAT)
    reader = SafetensorsReader(src, _WHAT)
    try:
        units, excluded = _plan(reader, model, model_type, fmt, layout, skip)
        if not any(not isinstance(u, str) for u in units):
            kept = [p for p in skip if p not in DEFAULT_SKIP]
            raise ValueError(f"{_WHAT}: nothing in {src} to quantize to {fmt} in the {layout} layout "
                             "(no linear layer or routed experts it can convert"
                             + (f" that the skip patterns {kept} leave: {len(excluded)} kept" if kept else "") + ")")
        summary = QuantizeSummary(Path(out), fmt, layout, excluded=excluded)
        summary.bytes_before = sum(reader.info(k).nbytes for k in reader)
        declared = _declare(units, reader, fmt, layout, model_type)
        bar = None
        cfg = load_config(src / "config.json")  # the source's own config.json, with a quantization_config added
        with staging_dir(out, overwrite, _WHAT, source=src, arg="out (--out)", side_files=src) as tmp:
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=summary.bytes_before, unit="B", unit_scale=True, desc=f"quantize {src.name}",
                           file=stream or sys.stderr)
            qz = _Quantizer(fmt, dev, summary, bar)
            writer = ShardedWriter(tmp, declared, max_shard_size)
            try:
                for u in units:
                    if isinstance(u, str):
                        _copy(u, reader, writer, qz)
                    elif isinstance(u, _Linear):
                        _run_linear(u, reader, writer, qz, layout)
                    else:
                        _run_experts(u, reader, writer, qz, layout, model_type)
                    if bar is not None:
                        bar.set_postfix_str(f"{summary.quantized} quantized", refresh=False)
            except BaseException:
                writer.abort()
                raise
            writer.close()
            summary.bytes_after = writer.total_size
            write_configs(tmp, cfg, layout, fmt, excluded)
            copy_side_files(src, tmp)
            summary.seconds = time.perf_counter() - t0
            summary.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            (tmp / "quantization_report.json").write_text(json.dumps(summary.report(), indent=1) + "\n")
        if bar is not None:
            bar.close()
        return summary
    finally:
        reader.close()
