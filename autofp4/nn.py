"""torch.nn modules: :class:`FP4Linear` and :func:`quantize_model`."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional

import torch
from torch import nn

from . import ops
from .problem import BLOCK_SIZE
from .formats import check_fmt
from .weights import FP4Weight, _describe, quantize

__all__ = ["FP4Linear", "ConversionReport", "TensorRecord", "quantize_model", "register_module_converter"]


class FP4Buffers(nn.Module):
    """A module whose FP4 tensors are buffers that keep their dtypes: ``model.to(torch.bfloat16)``
    (or ``.half()``, ``.float()``) converts a module's floating-point buffers, which would turn
    the E4M3 block scales and the fp32 global scales into the model's dtype. Device moves apply
    to them as usual; dtype conversions leave them as they are."""

    def _apply(self, fn, recurse=True):
        kept = {name: t for name, t in self._buffers.items() if t is not None}
        out = super()._apply(fn, recurse)
        for name, old in kept.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        return out


class FP4Linear(FP4Buffers):
    """A linear layer whose weight is stored in NVFP4 or MXFP4.

    The packed values, block scales and global scale are buffers, so ``state_dict``,
    ``.to(device)`` and ``load_state_dict`` work as for any module.

    ``compute_dtype`` (``torch.bfloat16``, ``torch.float16`` or None): with None the layer
    computes in the dtype of its input, which must be bf16 or fp16. With a dtype, an input of
    another floating dtype (a float32 model's activations) is cast to it, the product is
    computed in it and the output is cast back to the input's dtype; a bias of another dtype is
    added after the cast back.
    """

    def __init__(self, weight: FP4Weight, bias: Optional[torch.Tensor] = None,
                 compute_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        _check_compute_dtype(compute_dtype, "FP4Linear: compute_dtype")
        if not isinstance(weight, FP4Weight):
            raise TypeError(f"FP4Linear: weight must be a 2-D FP4Weight [N, K] (see autofp4.quantize), got {_describe(weight)}")
        if weight.experts:
            raise ValueError(f"FP4Linear: weight must be a 2-D FP4Weight [N, K], got stacked experts {tuple(weight.shape)}")
        if bias is not None:
            if not isinstance(bias, torch.Tensor):
                raise TypeError(f"FP4Linear: bias must be a torch.Tensor [{weight.n}] or None, got {_describe(bias)}")
            if bias.shape != (weight.n,):
                raise ValueError(f"FP4Linear: bias must be [{weight.n}], got {tuple(bias.shape)}")
            if not bias.is_floating_point():
                raise ValueError(f"FP4Linear: bias must be a floating-point tensor, got {bias.dtype}")
            if bias.device != weight.device:
                raise ValueError(f"FP4Linear: bias is on {bias.device} but weight is on {weight.device}; move one of them")
        self.in_features = weight.k
        self.out_features = weight.n
        self.fmt = weight.fmt
        self.register_buffer("weight_packed", weight.data)
        self.register_buffer("weight_scale", weight.scale)
        self.register_buffer("weight_global_scale", weight.global_scale)
        if bias is not None:
            self.bias = nn.Parameter(bias.detach(), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self._w = weight
        self.compute_dtype = compute_dtype

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str,
                    compute_dtype: Optional[torch.dtype] = None) -> "FP4Linear":
        """Quantize ``linear``'s weight to ``fmt`` ("nvfp4" or "mxfp4"); the bias is kept as is."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"FP4Linear.from_linear: linear must be a torch.nn.Linear, got {_describe(linear)}")
        check_fmt(fmt, "FP4Linear.from_linear")
        w = quantize(linear.weight.detach(), fmt)
        return cls(w, None if linear.bias is None else linear.bias.detach().clone(), compute_dtype)

    def fp4_weight(self) -> FP4Weight:
        """The FP4Weight over the current buffers (rebuilt after ``.to()`` or loading)."""
        w = self._w
        if (
            w.data is not self.weight_packed
            or w.scale is not self.weight_scale
            or w.global_scale is not self.weight_global_scale
        ):
            ins = w.input_scale
            if ins is not None:
                ins = ins.to(self.weight_packed.device)
            w = self._w = FP4Weight(
                self.fmt, self.weight_packed, self.weight_scale, self.weight_global_scale, ins, check_values=False
            )
        return w

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.autofp4.linear(
                x, self.weight_packed, self.weight_scale, self.weight_global_scale, bias, self.fmt
            )
        return ops.linear(x, self.fp4_weight(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cd = self.compute_dtype
        bias = self.bias
        if cd is None or not isinstance(x, torch.Tensor) or not x.is_floating_point() or (
            x.dtype == cd and (bias is None or bias.dtype == cd)
        ):
            return self._linear(x, bias)
        fused = bias is None or bias.dtype == cd
        y = self._linear(x.to(cd), bias if fused else None).to(x.dtype)
        return y if fused else y + bias.to(x.dtype)

    def extra_repr(self) -> str:
        cd = "" if self.compute_dtype is None else f", compute_dtype={self.compute_dtype}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
                f"bias={self.bias is not None}{cd}")


_COMPUTE_DTYPES = (torch.bfloat16, torch.float16)


def _check_compute_dtype(dtype, what: str) -> None:
    if dtype is not None and dtype not in _COMPUTE_DTYPES:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{what} must be torch.bfloat16, torch.float16 or None, got {_describe(dtype)}")
        raise ValueError(f"{what} must be torch.bfloat16, torch.float16 or None, got {dtype}")


def _skip_patterns(skip: Iterable[str]) -> list[str]:
    """``skip`` as a list of glob patterns (an iterable of str; a lone str is refused: it would
    iterate as one pattern per character)."""
    if isinstance(skip, (str, bytes, Mapping)):
        raise TypeError(
            f"quantize_model: skip must be an iterable of glob patterns such as ['lm_head'], got {_describe(skip)}"
        )
    try:
        patterns = list(skip)
    except TypeError:
        raise TypeError(
            f"quantize_model: skip must be an iterable of glob patterns such as ['lm_head'], got {_describe(skip)}"
        ) from None
    for i, p in enumerate(patterns):
        if not isinstance(p, str):
            raise TypeError(f"quantize_model: skip must hold str glob patterns, got {_describe(p)} at position {i}")
    return patterns


@dataclass
class TensorRecord:
    """One weight tensor that :func:`quantize_model` looked at: converted or skipped (with a reason).

    ``kind`` is ``"linear"`` (an ``nn.Linear``, named by its module) or ``"experts"`` (a fused
    3-D expert parameter, named by its parameter); ``bytes_after`` equals ``bytes_before`` when skipped."""

    name: str
    kind: str
    shape: tuple[int, ...]
    converted: bool
    bytes_before: int
    bytes_after: int
    reason: str = ""


@dataclass
class ConversionReport:
    """What :func:`quantize_model` did: converted layer names and skipped ones with a reason.

    ``converted`` and ``skipped`` hold the ``nn.Linear`` module names and the fused expert
    parameter names (``...experts.gate_up_proj``); ``tensors`` has one :class:`TensorRecord` per
    tensor with its bytes before and after; ``bytes_before``/``bytes_after`` sum the converted ones."""

    fmt: str
    converted: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    tensors: list[TensorRecord] = field(default_factory=list)

    def add(self, record: TensorRecord) -> None:
        """Record one converted or skipped tensor (and update the lists and the byte totals)."""
        self.tensors.append(record)
        if record.converted:
            self.converted.append(record.name)
            self.bytes_before += record.bytes_before
            self.bytes_after += record.bytes_after
        else:
            self.skipped.append((record.name, record.reason))
    #: converted layers that compute in another dtype than their weights had: name -> dtype
    compute_dtypes: dict[str, torch.dtype] = field(default_factory=dict)

    def __str__(self) -> str:
        n_exp = sum(1 for r in self.tensors if r.converted and r.kind == "experts")
        n_lin = len(self.converted) - n_exp
        what = f"{n_lin} Linear layers" + (f" and {n_exp} expert tensors" if n_exp else "")
        lines = [
            f"autofp4: converted {what} to {self.fmt}, skipped {len(self.skipped)}; "
            f"weights {self.bytes_before / 2**20:.1f} MiB -> {self.bytes_after / 2**20:.1f} MiB"
        ]
        by_dtype: dict[torch.dtype, int] = {}
        for cd in self.compute_dtypes.values():
            by_dtype[cd] = by_dtype.get(cd, 0) + 1
        for cd, count in by_dtype.items():
            lines.append(
                f"  {count} converted layers compute in {str(cd).replace('torch.', '')}: inputs of another "
                "dtype are cast to it and the outputs cast back"
            )
        for name, why in self.skipped:
            lines.append(f"  skipped {name}: {why}")
        return "\n".join(lines)


#: Hooks that convert structures other than ``nn.Linear`` (such as fused MoE experts); each is
#: called as ``hook(model, fmt, patterns, report)`` before the Linear layers are converted and
#: returns ``{linear module name: reason}`` for Linear layers to keep in high precision (routers).
_MODULE_CONVERTERS: list[Callable[[nn.Module, str, list[str], "ConversionReport"], Mapping[str, str]]] = []


def register_module_converter(hook: Callable[[nn.Module, str, list[str], "ConversionReport"], Mapping[str, str]]) -> None:
    """Add a conversion hook to :func:`quantize_model` (see ``_MODULE_CONVERTERS``); idempotent."""
    if hook not in _MODULE_CONVERTERS:
        _MODULE_CONVERTERS.append(hook)


def matches_skip(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _weight_bytes(w: FP4Weight) -> int:
    return sum(t.numel() * t.element_size() for t in (w.data, w.scale) + ((w.global_scale,) if w.global_scale is not None else ()))


def quantize_model(
    model: nn.Module,
    fmt: str,
    skip: Iterable[str] = ("lm_head", "*.lm_head"),
    dtype: Optional[torch.dtype] = None,
) -> ConversionReport:
    """Replace the ``torch.nn.Linear`` layers of ``model`` by :class:`FP4Linear` in place.

    ``skip`` holds glob patterns matched against each layer's qualified name (``"lm_head"``,
    ``"*.mlp.gate"``): an iterable of str, such as a list (a lone str is refused, it would
    match single characters). Layers whose input size is not a multiple of the format's block size,
    or whose weight is not bf16/fp16/fp32 or lives on the meta device, are skipped with a
    reason in the returned report.

    The fused 3-D expert parameters of transformers MoE models (``experts.gate_up_proj``,
    ``experts.down_proj``) are converted too: the experts module becomes an FP4 module that runs
    :func:`autofp4.moe` (see ``autofp4.integrations.transformers``); the MoE routers stay in high
    precision, and expert layouts that :func:`autofp4.moe` does not compute are skipped with a reason.
    ``skip`` patterns also match the experts module and parameter names.

    ``dtype`` (``torch.bfloat16`` or ``torch.float16``) is the dtype the converted layers
    compute in: inputs of another dtype are cast to it and outputs cast back (see
    :class:`FP4Linear`). With None, a layer with bf16 or fp16 weights computes in its input's
    dtype (as the model runs today), and one with float32 weights computes in bfloat16 and
    casts back, so a float32 model keeps working; the report's ``compute_dtypes`` lists the
    layers that compute in a dtype other than their weights'. For the FP4 kernels' speed
    without casts, convert the model first (``model.to(torch.bfloat16)``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_model: model must be a torch.nn.Module, got {_describe(model)}")
    check_fmt(fmt, "quantize_model")
    _check_compute_dtype(dtype, "quantize_model: dtype")
    patterns = _skip_patterns(skip)
    report = ConversionReport(fmt)
    keep: dict[str, str] = {}
    for hook in list(_MODULE_CONVERTERS):
        keep.update(hook(model, fmt, patterns, report))
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, FP4Linear)]
    for name, lin in targets:
        why = None
        if matches_skip(name, patterns):
            why = "matches a skip pattern"
        elif name in keep:
            why = keep[name]
        elif lin.weight.is_meta:
            why = "weight is on the meta device"
        elif lin.weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            why = f"weight dtype {lin.weight.dtype} is not bf16/fp16/fp32"
        elif lin.in_features % BLOCK_SIZE[fmt]:
            why = f"in_features={lin.in_features} is not a multiple of {fmt}'s block size {BLOCK_SIZE[fmt]}"
        before = lin.weight.numel() * lin.weight.element_size()
        shape = tuple(lin.weight.shape)
        if why:
            report.add(TensorRecord(name, "linear", shape, False, before, before, why))
            continue
        cd = dtype if dtype is not None else (torch.bfloat16 if lin.weight.dtype == torch.float32 else None)
        new = FP4Linear.from_linear(lin, fmt, cd)
        if cd is not None and cd != lin.weight.dtype:
            report.compute_dtypes[name] = cd
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        report.add(TensorRecord(name, "linear", shape, True, before, _weight_bytes(new.fp4_weight())))
    return report
