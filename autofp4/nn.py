"""torch.nn modules: :class:`FP4Linear` and :func:`quantize_model`."""
from __future__ import annotations

import fnmatch
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
from torch import nn

from . import ops
from .problem import BLOCK_SIZE
from .formats import check_fmt
from .patterns import pattern_list, warn_unmatched
from .weights import FP4Weight, _describe, quantize

__all__ = ["FP4Linear", "FP4FusedLinear", "FP4LinearPart", "ConversionReport", "TensorRecord", "fuse_projections",
           "quantize_model", "register_module_converter"]


def _other_format_hint(key: str, given: torch.dtype, fmt: str) -> str:
    """Where block scales come in the other FP4 format's dtype: that the state dict is of another
    format (and which), else nothing."""
    if not key.endswith("_scale") or key.endswith("_global_scale"):
        return ""
    other = {("nvfp4", torch.uint8): "mxfp4 (E8M0 block scales, uint8)",
             ("mxfp4", torch.float8_e4m3fn): "nvfp4 (E4M3 block scales)"}.get((fmt, given))
    if other is None:
        return ""
    return f" (this layer is {fmt}: the state dict is of an {other} model; quantize to its format to load it)"


class FP4Buffers(nn.Module):
    """A module whose FP4 tensors are buffers that keep their dtypes: ``model.to(torch.bfloat16)``
    (or ``.half()``, ``.float()``) converts a module's floating-point buffers, which would turn
    the E4M3 block scales and the fp32 global scales into the model's dtype. Device moves apply
    to them as usual; dtype conversions leave them as they are.

    ``act_dtype``: the activations its calls run with (None: as given; ``"fp8"`` /
    ``"fp8-prefill"``: FP8, see :func:`autofp4.linear`); :func:`set_activations` sets it model-wide."""

    _act_dtype: Optional[str] = None

    @property
    def act_dtype(self) -> Optional[str]:
        return self._act_dtype

    @act_dtype.setter
    def act_dtype(self, value: Optional[str]) -> None:
        from .w4a8 import check_act_dtype

        check_act_dtype(value, f"{type(self).__name__}.act_dtype")
        self._act_dtype = value

    #: the stems of the FP4 weights among the buffers (``<stem>_packed``, ``_scale``, ``_global_scale``)
    _fp4_stems: tuple[str, ...] = ()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Loading copies values into the buffers in place: an FP4 weight's tensors are checked
        first, of their dtype (FP4 bytes and scales load as stored, never converted) and of their
        values as :class:`~autofp4.weights.FP4Weight` checks a weight's (a NaN or negative scale is
        an error of the load, as torch reports a wrong shape); a weight refused either way is not
        copied (the layer keeps its values) and not reported missing."""
        parts = ("_packed", "_scale", "_global_scale")
        refused: list[str] = []
        for stem in self._fp4_stems:
            keys = [f"{prefix}{stem}{part}" for part in parts]
            given = {k: state_dict[k] for k in keys if isinstance(state_dict.get(k), torch.Tensor)}
            if not given:
                continue
            mine = {k: getattr(self, k[len(prefix):]) for k in keys}
            wrong = [k for k, v in given.items() if mine[k] is not None and v.dtype != mine[k].dtype]
            for key in wrong:  # torch would convert the values
                error_msgs.append(f"{key}: stored as {given[key].dtype}, but the layer's buffer is {mine[key].dtype}"
                                  f"{_other_format_hint(key, given[key].dtype, self.fmt)}; FP4 "
                                  "tensors load in their own dtype")
            if (not wrong and not any(v.is_meta for v in given.values())  # no values: torch names what it cannot copy
                    and all(mine[k] is None or tuple(v.shape) == tuple(mine[k].shape) for k, v in given.items())):
                # on the buffers' device: a partial dict from another device is checked with the rest
                dev = next(m.device for m in mine.values() if m is not None)
                parts_now = [given[k].to(dev) if k in given else mine[k] for k in keys]
                try:
                    FP4Weight(self.fmt, *parts_now)
                except (ValueError, TypeError) as e:
                    error_msgs.append(f"{prefix}{stem}: {e}")
                    wrong = list(given)
            if wrong:  # the whole weight: its codes without their scales would be another weight
                refused += list(given)
        if refused:
            state_dict = {k: v for k, v in state_dict.items() if k not in refused}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for key in refused:  # given, and refused (said above): not missing too
            while key in missing_keys:
                missing_keys.remove(key)

    def _apply(self, fn, recurse=True):
        kept = {name: t for name, t in self._buffers.items() if t is not None}
        out = super()._apply(fn, recurse)
        for name, old in kept.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        return out

    # torch's plain pickle cannot load an FP8 tensor back (its torch.save can): the E4M3 block
    # scales are pickled as their uint8 bytes and viewed back when loaded (see FP4Weight.__getstate__)
    def __getstate__(self):
        state = super().__getstate__()
        fp8 = [n for n, t in self._buffers.items() if t is not None and t.dtype == torch.float8_e4m3fn]
        if fp8:
            buffers = state["_buffers"] = type(self._buffers)(self._buffers)
            for name in fp8:
                buffers[name] = buffers[name].view(torch.uint8)
            state["_autofp4_fp8_buffers"] = fp8
        return state

    def __setstate__(self, state):
        state = dict(state)
        fp8 = state.pop("_autofp4_fp8_buffers", ())
        if fp8:
            buffers = state["_buffers"] = type(state["_buffers"])(state["_buffers"])
            for name in fp8:
                buffers[name] = buffers[name].view(torch.float8_e4m3fn)
        super().__setstate__(state)


class _PackedWeight:
    """Mixin of the FP4 linear layers: they have no dense ``.weight``, and code that reads one
    (T5's feed-forward ``wo``, torch's ``MultiheadAttention.out_proj``) is told why; TorchScript
    is refused by name."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # type: ignore[misc]
        except AttributeError:
            if name != "weight":
                raise
        raise AttributeError(
            f"'{type(self).__name__}' object has no attribute 'weight': an FP4 layer keeps its weight packed "
            f"({self.__dict__.get('fmt', 'FP4')}; fp4_weight() returns it, fp4_weight().dequantize() a dense copy). "
            "Code that reads a layer's .weight needs that layer in high precision: pass its name in "
            "quantize_model(..., skip=[...])")

    def __prepare_scriptable__(self):
        raise RuntimeError(f"{type(self).__name__} cannot be compiled with torch.jit.script (TorchScript): its FP4 "
                           "kernels are torch custom ops for torch.compile and torch.export; use torch.compile")


class FP4Linear(_PackedWeight, FP4Buffers):
    """A linear layer whose weight is stored in NVFP4 or MXFP4.

    The packed values, block scales and global scale are buffers, so ``state_dict``,
    ``.to(device)`` and ``load_state_dict`` work as for any module.

    ``compute_dtype`` (``torch.bfloat16``, ``torch.float16`` or None): with None the layer
    computes in the dtype of its input, which must be bf16 or fp16. With a dtype, an input of
    another floating dtype (a float32 model's activations) is cast to it, the product is
    computed in it and the output is cast back to the input's dtype; a bias of another dtype is
    added after the cast back.
    """

    _fp4_stems = ("weight",)

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
        self._compute_dtype = compute_dtype

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        """The dtype the layer computes in (None: x's own); bfloat16, float16 or None."""
        d = self.__dict__
        return d["_compute_dtype"] if "_compute_dtype" in d else d.get("compute_dtype")  # (a layer pickled before)

    @compute_dtype.setter
    def compute_dtype(self, value: Optional[torch.dtype]) -> None:
        _check_compute_dtype(value, f"{type(self).__name__}.compute_dtype")
        self._compute_dtype = value

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
        act = self._act_dtype
        if ops._traced_as_op():  # inside a torch.func transform: eagerly, as ops.linear
            if act is not None:
                from .w4a8 import check_act_dtype

                return torch.ops.autofp4.linear_fp8(x, self.weight_packed, self.weight_scale,
                                                    self.weight_global_scale, bias, self.fmt,
                                                    check_act_dtype(act, "FP4Linear"))
            return torch.ops.autofp4.linear(
                x, self.weight_packed, self.weight_scale, self.weight_global_scale, bias, self.fmt
            )
        if act is not None:
            return ops.linear(x, self.fp4_weight(), bias, act_dtype=act)
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
        act = "" if self._act_dtype is None else f", act_dtype={self._act_dtype!r}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
                f"bias={self.bias is not None}{cd}{act}")


class FP4FusedLinear(FP4Linear):
    """One FP4 weight for sibling projections of the same input (``q_proj``, ``k_proj``,
    ``v_proj``; ``gate_proj``, ``up_proj``), their weights stacked along N: one kernel call
    reads all of them, at the larger N the kernels stream better, and the model launches fewer
    kernels. Its :class:`FP4LinearPart` modules take the places of the original layers.

    ``parts``: the original layers' names and output sizes, in the order of the stacked rows.
    The first part called with an input computes every part's output; the others return their
    slice of it when called with the same tensor, unchanged (any other input computes again, so
    every part's output is its own layer's for its own input). The output is held until every
    part took its slice."""

    def __init__(self, weight: FP4Weight, bias: Optional[torch.Tensor], compute_dtype: Optional[torch.dtype],
                 parts: Sequence[tuple[str, int]]) -> None:
        super().__init__(weight, bias, compute_dtype)
        if not isinstance(parts, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in parts):
            raise TypeError(f"FP4FusedLinear: parts must be a list of (name, output size) pairs, got {_describe(parts)}")
        sizes = [n for _, n in parts]
        if not all(type(n) is int for n in sizes):
            raise TypeError(f"FP4FusedLinear: each part's output size must be an int, got {sizes}")
        bad = next(((name, n) for name, n in parts if n <= 0), None)
        if bad is not None:
            raise ValueError(f"FP4FusedLinear: part {bad[0]!r} has size {bad[1]}; every part needs a positive number of "
                             f"rows (sizes summing to N = {weight.n})")
        if len(parts) < 2 or sum(sizes) != weight.n:
            raise ValueError(f"FP4FusedLinear: parts {list(parts)} must be two or more sizes summing to N = {weight.n}")
        names = [name for name, _ in parts]
        bad = [name for name in names if not isinstance(name, str) or not name]
        if bad:
            raise TypeError(f"FP4FusedLinear: each part's name must be a non-empty str (the original layer's "
                            f"name), got {bad[0]!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"FP4FusedLinear: the parts' names must differ (each is an original layer), got {names}")
        self.part_names = tuple(name for name, _ in parts)
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        self.part_bounds = tuple(bounds)
        self._held: Optional[tuple] = None  # (input, its version, output, bit mask of parts still to take it)

    def part_forward(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Part ``i``'s output for input ``x`` (see the class docstring)."""
        if type(i) is not int or not 0 <= i < len(self.part_names):
            raise IndexError(f"FP4FusedLinear.part_forward: part index must be an int in [0, {len(self.part_names)}) "
                             f"(parts {[n.rpartition('.')[2] for n in self.part_names]}), got {i!r}")
        held = self._held
        compiling = torch.compiler.is_compiling()
        if (held is None or held[0] is not x or not held[3] >> i & 1
                or (not compiling and held[1] != x._version)):
            held = (x, None if compiling else x._version, self.forward(x), (1 << len(self.part_names)) - 1)
        pending = held[3] & ~(1 << i)
        self._held = (held[0], held[1], held[2], pending) if pending else None
        return held[2][..., self.part_bounds[i]:self.part_bounds[i + 1]]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parts={[n.rpartition('.')[2] for n in self.part_names]}"


class FP4LinearPart(_PackedWeight, nn.Module):
    """A layer whose weight is rows of an :class:`FP4FusedLinear` (which its parent module
    holds; this module refers to it without owning it, so its buffers appear once)."""

    def __init__(self, fused: FP4FusedLinear, index: int) -> None:
        super().__init__()
        if not isinstance(fused, FP4FusedLinear):
            raise TypeError(f"FP4LinearPart: fused must be an FP4FusedLinear, got {_describe(fused)}")
        if isinstance(index, bool) or _as_int(index) is None:
            raise TypeError(f"FP4LinearPart: index must be an int (one of the fused weight's parts), "
                            f"got {_describe(index)}")
        if not 0 <= index < len(fused.part_bounds) - 1:
            raise ValueError(f"FP4LinearPart: index must be an int in [0, {len(fused.part_bounds) - 1}) "
                             f"(one of the fused weight's parts), got {_describe(index)}")
        self.__dict__["_fused"] = fused  # not a submodule: the parent owns it
        self.index = int(index)
        self.in_features = fused.in_features
        self.out_features = fused.part_bounds[index + 1] - fused.part_bounds[index]
        self.fmt = fused.fmt

    @property
    def fused(self) -> FP4FusedLinear:
        return self.__dict__["_fused"]

    @property
    def rows(self) -> slice:
        """This layer's rows of the fused weight."""
        b = self.fused.part_bounds
        return slice(b[self.index], b[self.index + 1])

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        return self.fused.compute_dtype

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return None if self.fused.bias is None else self.fused.bias[self.rows]

    @property
    def act_dtype(self) -> Optional[str]:
        """The activations this layer runs with: its fused layer's (one call runs every part)."""
        return self.fused.act_dtype

    @act_dtype.setter
    def act_dtype(self, value: Optional[str]) -> None:
        from .w4a8 import check_act_dtype

        check_act_dtype(value, f"{type(self).__name__}.act_dtype")
        if value == self.fused.act_dtype:
            return  # what it runs already
        raise AttributeError(f"FP4LinearPart.act_dtype: {self._describe_part()}, so it runs with that layer's "
                             f"activations (act_dtype={self.fused.act_dtype!r}) and cannot have its own "
                             f"{value!r}; set act_dtype on the FP4FusedLinear ({self._fused_label()}; all its parts "
                             f"change), or call autofp4.set_activations(model, {value!r})")

    def _fused_label(self) -> str:
        """The fused layer, as its parent names it where the parts' names tell (``...qkv_proj``)."""
        names = self.fused.part_names
        stems = tuple(n.rpartition(".")[2] for n in names)
        prefix = names[0].rpartition(".")[0]
        for fused, parts in FUSED_PROJECTIONS:
            if parts == stems and all(n.rpartition(".")[0] == prefix for n in names):
                return f"{prefix}.{fused}" if prefix else fused
        return "the module beside this one that holds it"

    def _describe_part(self) -> str:
        """This layer as a part: its name, its rows and the siblings its fused layer runs with it."""
        f = self.fused
        stems = [n.rpartition(".")[2] for n in f.part_names]
        return (f"{f.part_names[self.index]} is rows {f.part_bounds[self.index]}:{f.part_bounds[self.index + 1]} of "
                f"an FP4FusedLinear that computes all its parts ({', '.join(stems)}) in one call")

    def fp4_weight(self) -> FP4Weight:
        """This layer's FP4 weight: its rows of the fused one (views of its buffers)."""
        r = self.rows
        return self.fused.fp4_weight().slice_rows(r.start, r.stop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part_forward(self.index, x)

    def extra_repr(self) -> str:
        f = self.fused
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, rows "
                f"{f.part_bounds[self.index]}:{f.part_bounds[self.index + 1]} of a fused {f.out_features}-row weight")


#: sibling projections of one input that :func:`quantize_model` stores as one weight: the fused
#: module's name under their parent and the parts in row order (transformers' module names)
FUSED_PROJECTIONS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


_COMPUTE_DTYPES = (torch.bfloat16, torch.float16)


def _as_int(value) -> Optional[int]:
    try:
        return operator.index(value)
    except TypeError:
        return None


def _check_compute_dtype(dtype, what: str) -> None:
    if dtype is not None and dtype not in _COMPUTE_DTYPES:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{what} must be torch.bfloat16, torch.float16 or None, got {_describe(dtype)}")
        raise ValueError(f"{what} must be torch.bfloat16, torch.float16 or None, got {dtype}")


def _skip_patterns(skip: Iterable[str]) -> list[str]:
    """``skip`` as a list of glob patterns (an iterable of non-empty str; a lone str is refused: it
    would iterate as one pattern per character)."""
    return pattern_list(skip, "quantize_model: skip")


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
    #: fused modules added (see quantize_model's ``fuse``): name -> the converted layers it holds
    fused: dict[str, list[str]] = field(default_factory=dict)

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
        if self.fused:
            kinds: dict[str, int] = {}
            for name, parts in self.fused.items():
                k = f"{'/'.join(p.rpartition('.')[2] for p in parts)} -> {name.rpartition('.')[2]}"
                kinds[k] = kinds.get(k, 0) + 1
            lines += [f"  fused {k} in {n} modules (one stacked weight each)" for k, n in kinds.items()]
        for name, why in self.skipped:
            lines.append(f"  skipped {name}: {why}")
        return "\n".join(lines)


#: Hooks that convert structures other than ``nn.Linear`` (such as fused MoE experts); each is
#: called as ``hook(model, fmt, patterns, report)`` before the Linear layers are converted and
#: returns ``{linear module name: reason}`` for Linear layers to keep in high precision (routers).
_MODULE_CONVERTERS: list[Callable[[nn.Module, str, list[str], "ConversionReport"], Mapping[str, str]]] = []


def register_module_converter(hook: Callable[[nn.Module, str, list[str], "ConversionReport"], Mapping[str, str]]) -> None:
    """Add a conversion hook to :func:`quantize_model` (see ``_MODULE_CONVERTERS``); idempotent."""
    if not callable(hook):
        raise TypeError(f"register_module_converter: hook must be callable as hook(model, fmt, patterns, report), "
                        f"got {_describe(hook)}")
    if hook not in _MODULE_CONVERTERS:
        _MODULE_CONVERTERS.append(hook)


def matches_skip(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _warn_unmatched_skips(model: nn.Module, patterns: list[str]) -> None:
    """quantize_model's warning for skip patterns that keep nothing, as quantize_checkpoint's: the
    names a pattern can keep are the model's Linear layers (under every name a shared one has),
    its stacked experts modules (3-D ``gate_up_proj`` / ``down_proj``) and those parameters; its
    other modules are the ``others`` of :func:`autofp4.patterns.warn_unmatched`."""
    names, experts, others = [], {}, []
    for name, mod in model.named_modules(remove_duplicate=False):
        if not name:
            continue
        stacked = [p for p in ("gate_up_proj", "down_proj") if getattr(mod._parameters.get(p), "dim", lambda: 0)() == 3]
        if isinstance(mod, (nn.Linear, FP4Buffers, FP4LinearPart)) or stacked:
            names.append(name)
        else:
            others.append(name)
        names += [f"{name}.{p}" for p in stacked]
        if stacked:
            experts.setdefault(name, int(mod._parameters[stacked[0]].shape[0]))
    warn_unmatched(patterns, names, experts, "quantize_model", others=others, ignore=("lm_head", "*.lm_head"),
                   stacklevel=4)


def _weight_bytes(w: FP4Weight) -> int:
    return sum(t.numel() * t.element_size() for t in (w.data, w.scale) + ((w.global_scale,) if w.global_scale is not None else ()))


def set_activations(model: nn.Module, act_dtype: Optional[str]) -> int:
    """Run every FP4 layer of ``model`` (linear, fused and MoE experts) with activations
    ``act_dtype``: None (as given, the default), ``"fp8"`` (FP8 E4M3 per token: W4A8, other
    numerics, faster prefill on Hopper) or ``"fp8-prefill"`` (FP8 from
    :data:`autofp4.w4a8.PREFILL_MIN_ROWS` rows). Returns the number of layers set; a model
    without FP4 layers is a ``ValueError``."""
    from .w4a8 import check_act_dtype

    if not isinstance(model, nn.Module):
        raise TypeError(f"set_activations: model must be a torch.nn.Module, got {_describe(model)}")
    check_act_dtype(act_dtype, "set_activations")
    layers = [m for m in model.modules() if isinstance(m, FP4Buffers)]
    owned = {id(m) for m in layers}
    stray = next(((n, m) for n, m in model.named_modules()
                  if isinstance(m, FP4LinearPart) and id(m.fused) not in owned), None)
    if stray is not None:  # a part runs as its fused layer does, which this call would not reach
        name, part = stray
        where = "the module given is an FP4LinearPart" if not name else f"{name} is an FP4LinearPart"
        raise ValueError(f"set_activations: {where} ({part._describe_part()}), and that fused layer is not in the "
                         f"module given, so its activations cannot change here; call set_activations on a module "
                         f"that holds the fused layer ({part._fused_label()}), such as the model, or set act_dtype "
                         "on the fused layer itself (all its parts change)")
    if not layers:
        raise ValueError("set_activations: the model has no FP4 layer (quantize it first: autofp4.quantize_model, "
                         "or load an FP4 checkpoint with autofp4.from_pretrained)")
    for m in layers:
        m.act_dtype = act_dtype
    return len(layers)


def quantize_model(
    model: nn.Module,
    fmt: str,
    skip: Iterable[str] = ("lm_head", "*.lm_head"),
    dtype: Optional[torch.dtype] = None,
    fuse: bool = True,
    activations: Optional[str] = None,
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

    ``fuse``: sibling projections of one input (``q_proj``/``k_proj``/``v_proj`` and
    ``gate_proj``/``up_proj`` under one parent, all converted, same input size, dtype and device,
    all with or all without bias) are quantized as one stacked weight, an
    :class:`FP4FusedLinear` added to their parent as ``qkv_proj`` / ``gate_up_proj``, and each
    original layer becomes an :class:`FP4LinearPart` of it: one kernel instead of three or two,
    at the stacked shape the shipped tuning rows cover. In NVFP4 the stacked weight has one
    global scale (its parts' largest amax), as a serving engine's fused layers do. The report's
    ``fused`` maps each fused module to its parts. Parts called with different inputs (the
    cross-attention of an encoder-decoder model: ``k_proj`` and ``v_proj`` on the encoder's
    states) stay correct but compute the whole stacked product for each input: use
    ``fuse=False`` there.

    ``activations`` (opt-in, other numerics): ``"fp8"`` runs every FP4 layer with FP8
    activations (W4A8, the way past the bf16 rate at prefill on Hopper), ``"fp8-prefill"`` only
    calls of many tokens; None keeps the activations as given. :func:`set_activations` changes
    it later (a loaded checkpoint too).

    A model that already holds FP4 layers keeps them: in ``fmt`` they are reported as skipped
    (already quantized); in another FP4 format the call is refused (``ValueError``): FP4 weights
    are not re-quantized, convert the original high-precision model instead.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_model: model must be a torch.nn.Module, got {_describe(model)}")
    check_fmt(fmt, "quantize_model")
    _check_compute_dtype(dtype, "quantize_model: dtype")
    from .w4a8 import check_act_dtype

    check_act_dtype(activations, "quantize_model: activations")
    if not isinstance(fuse, bool):
        raise TypeError(f"quantize_model: fuse must be True or False, got {_describe(fuse)}")
    patterns = _skip_patterns(skip)
    already = _fp4_layers(model)
    other = [(n, f) for n, f, *_ in already if f != fmt]
    if other:
        fmts = sorted({f for _, f in other})
        raise ValueError(f"quantize_model: the model is already quantized: {len(other)} of its layers are "
                         f"{' and '.join(fmts)} (the first: {other[0][0]!r}); re-quantizing FP4 weights to {fmt} is "
                         "not supported: convert the original high-precision model")
    report = ConversionReport(fmt)
    for name, _, kind, shape, nbytes in already:  # the same format: left as they are
        report.add(TensorRecord(name, kind, shape, False, nbytes, nbytes, f"already quantized ({fmt})"))
    if isinstance(model, nn.Linear):
        raise TypeError("quantize_model converts the layers inside a model, in place, and the model itself is "
                        f"{type(model).__name__} (an nn.Linear): use autofp4.FP4Linear.from_linear(layer, {fmt!r})")
    _warn_unmatched_skips(model, patterns)
    keep: dict[str, str] = {}
    for hook in list(_MODULE_CONVERTERS):
        kept = hook(model, fmt, patterns, report)
        if not isinstance(kept, Mapping):
            raise TypeError(f"quantize_model: the module converter {getattr(hook, '__qualname__', hook)!r} "
                            f"returned {_describe(kept)}; a converter returns a mapping {{layer name: why it is "
                            "kept} (empty if none)")
        keep.update(kept)
    keep.update(_kept_by_the_model(model))
    targets, aliases = _linear_layers(model)
    reasons = {name: _skip_reason(name, lin, fmt, patterns, keep) for name, lin in targets}
    for alias, name in aliases.items():  # one layer under several names: the first name decides
        if reasons[name] is None and matches_skip(alias, patterns):
            reasons[name] = f"matches a skip pattern under its other name {alias}"
    for name, why in _other_layers(model).items():
        report.add(TensorRecord(name, "linear", (), False, 0, 0, why))
    convertible = {name: lin for name, lin in targets if reasons[name] is None}
    shared = set(aliases.values())  # a layer under several names is converted alone
    groups = _sibling_groups(model, {n: m for n, m in convertible.items() if n not in shared}, _stackable) if fuse else {}
    in_group = {n for names in groups.values() for n in names}
    for name, lin in targets:
        why = reasons[name]
        before = lin.weight.numel() * lin.weight.element_size()
        shape = tuple(lin.weight.shape)
        if why:
            report.add(TensorRecord(name, "linear", shape, False, before, before, why))
            continue
        cd = _layer_compute_dtype(dtype, lin.weight.dtype)
        if cd is not None and cd != lin.weight.dtype:
            report.compute_dtypes[name] = cd
        if name in in_group:
            continue  # converted with its group below
        new = FP4Linear.from_linear(lin, fmt, cd)
        _carry_hooks(lin, new)
        for n in [name, *(a for a, first in aliases.items() if first == name)]:
            parent_name, _, child = n.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, new)
            report.add(TensorRecord(n, "linear", shape, True, before, _weight_bytes(new.fp4_weight()))
                       if n == name else TensorRecord(n, "linear", shape, True, 0, 0))
    for fused_name, names in groups.items():
        lins = [convertible[n] for n in names]
        w = torch.cat([lin.weight.detach() for lin in lins], 0)
        bias = None if lins[0].bias is None else torch.cat([lin.bias.detach() for lin in lins], 0)
        cd = _layer_compute_dtype(dtype, lins[0].weight.dtype)
        fused = FP4FusedLinear(quantize(w, fmt), bias, cd, [(n, lin.out_features) for n, lin in zip(names, lins)])
        del w
        _install_fused(model, fused_name, fused)
        for n, lin in zip(names, lins):
            _carry_hooks(lin, model.get_submodule(n))
            rows = lin.out_features * lin.in_features
            after = _weight_bytes(fused.fp4_weight()) * rows // (fused.out_features * fused.in_features)
            report.add(TensorRecord(n, "linear", tuple(lin.weight.shape), True,
                                    lin.weight.numel() * lin.weight.element_size(), after))
        report.fused[fused_name] = list(names)
    if activations is not None and any(isinstance(m, FP4Buffers) for m in model.modules()):
        set_activations(model, activations)
    if report.converted:
        notify_converted(model)
    return report


#: called with a model that now holds FP4 layers (converted by :func:`quantize_model` or built by
#: ``autofp4.from_pretrained``); autofp4's transformers integration marks transformers models
#: quantized with it (see ``autofp4.integrations.transformers_hook``)
_CONVERTED_HOOKS: list[Callable[[nn.Module], None]] = []


def register_converted_hook(hook: Callable[[nn.Module], None]) -> None:
    if hook not in _CONVERTED_HOOKS:
        _CONVERTED_HOOKS.append(hook)


def notify_converted(model: nn.Module) -> None:
    for hook in list(_CONVERTED_HOOKS):
        hook(model)


def _fp4_weight_bytes(w: FP4Weight) -> int:
    return sum(t.numel() * t.element_size() for t in (w.data, w.scale, w.global_scale) if t is not None)


def _fp4_layers(model: nn.Module) -> list[tuple[str, str, str, tuple[int, ...], int]]:
    """The FP4 layers ``model`` already holds, as :func:`quantize_model` reports tensors:
    ``(name, fmt, kind, shape, bytes)``; a fused weight is listed as its parts, experts as their
    two stacked weights."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, FP4FusedLinear):
            continue  # its FP4LinearPart modules, in the original layers' places, are listed
        if isinstance(m, (FP4Linear, FP4LinearPart)):
            w = m.fp4_weight()
            out.append((name, m.fmt, "linear", (m.out_features, m.in_features), _fp4_weight_bytes(w)))
        elif isinstance(m, FP4Buffers) and isinstance(getattr(m, "fmt", None), str):
            for p in ("gate_up_proj", "down_proj"):
                try:
                    w = m.fp4_weight(p)
                except (AttributeError, KeyError, TypeError):
                    continue
                out.append((f"{name}.{p}" if name else p, m.fmt, "experts", tuple(w.shape), _fp4_weight_bytes(w)))
    return out


def _linear_layers(model: nn.Module) -> tuple[list[tuple[str, nn.Linear]], dict[str, str]]:
    """The ``nn.Linear`` layers :func:`quantize_model` considers, each under its first name, and
    ``{other name: first name}`` of a layer registered under several names (one shared module)."""
    first: dict[int, str] = {}
    targets, aliases = [], {}
    for n, m in model.named_modules(remove_duplicate=False):
        if not isinstance(m, nn.Linear) or isinstance(m, FP4Linear):
            continue
        if id(m) in first:
            aliases[n] = first[id(m)]
        else:
            first[id(m)] = n
            targets.append((n, m))
    return targets, aliases


def keep_in_fp32_entries(obj: Any) -> list[str]:
    """The entries of a transformers model's (or class's) ``_keep_in_fp32_modules`` and
    ``_keep_in_fp32_modules_strict``: module names (T5's ``wo``) or parameter names (DeepSeek-V3's
    ``gate.weight``), matched as runs of whole dotted components of a name."""
    out = []
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        entries = getattr(obj, attr, None)
        out += [e for e in (entries if isinstance(entries, (list, tuple, set)) else ()) if isinstance(e, str) and e]
    return out


def _fp32_module_entries(cls: type) -> list[str]:
    """The module names a transformers model class keeps in float32 (:func:`keep_in_fp32_entries`;
    an entry naming a parameter names its module)."""
    out = []
    for e in keep_in_fp32_entries(cls):
        for tail in (".weight", ".bias"):
            e = e.removesuffix(tail)
        if e:
            out.append(e)
    return out


def _kept_by_the_model(model: nn.Module) -> dict[str, str]:
    """Linear layers whose owner reads their weight, by name: those a transformers model keeps in
    float32 (``_keep_in_fp32_modules``, as T5's feed-forward reads ``wo.weight``) and those of
    torch's own transformer layers and ``MultiheadAttention``."""
    out: dict[str, str] = {}
    for prefix, mod in model.named_modules():
        if isinstance(mod, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.MultiheadAttention)):
            for name, sub in mod.named_modules(prefix=prefix):
                if isinstance(sub, nn.Linear):
                    out.setdefault(name, f"in torch's {type(mod).__name__}, whose forward reads its layers' .weight")
            continue
        entries = _fp32_module_entries(type(mod))
        if not entries:
            continue
        for name, sub in mod.named_modules(prefix=prefix):
            if not isinstance(sub, nn.Linear):
                continue
            parts = name.split(".")
            for e in entries:
                ep = str(e).split(".")
                if any(parts[i:i + len(ep)] == ep for i in range(len(parts) - len(ep) + 1)):
                    out.setdefault(name, f"{type(mod).__name__} keeps {e!r} in float32 (_keep_in_fp32_modules: its code "
                                 "reads the weight)")
                    break
    return out


def _other_layers(model: nn.Module) -> dict[str, str]:
    """Projection layers that are not ``nn.Linear`` (transformers' ``Conv1D`` of GPT-2 style
    models), named in the report: :func:`quantize_model` does not convert them."""
    return {n: f"a {type(m).__name__} layer (GPT-2 style, weight [in, out]), not an nn.Linear: not converted"
            for n, m in model.named_modules()
            if type(m).__name__ == "Conv1D" and hasattr(m, "nf") and isinstance(getattr(m, "weight", None), torch.Tensor)}


def _carry_hooks(old: nn.Module, new: nn.Module) -> None:
    """The forward hooks and pre-hooks registered on ``old`` (a layer being replaced), on ``new``."""
    for attr in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                 "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        src = getattr(old, attr, None)
        if src:
            getattr(new, attr).update(src)


def _skip_reason(name: str, lin: nn.Linear, fmt: str, patterns, keep: Mapping[str, str]) -> Optional[str]:
    """Why :func:`quantize_model` keeps ``lin`` in high precision (None: it converts it)."""
    if matches_skip(name, patterns):
        return "matches a skip pattern"
    if name in keep:
        return keep[name]
    cls = type(lin)
    if cls is not nn.Linear:
        if cls.__name__ == "NonDynamicallyQuantizableLinear":
            return "MultiheadAttention's out_proj: torch's attention reads its .weight"
        if cls.forward is not nn.Linear.forward:
            return f"a subclass of nn.Linear ({cls.__name__}) with its own forward, which an FP4 layer would drop"
    if lin.weight.is_meta:
        return "weight is on the meta device"
    if lin.weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"weight dtype {lin.weight.dtype} is not bf16/fp16/fp32"
    if lin.in_features % BLOCK_SIZE[fmt]:
        return f"in_features={lin.in_features} is not a multiple of {fmt}'s block size {BLOCK_SIZE[fmt]}"
    return None


def _layer_compute_dtype(dtype: Optional[torch.dtype], weight_dtype: torch.dtype) -> Optional[torch.dtype]:
    """The compute dtype of a converted layer (see :func:`quantize_model`'s ``dtype``)."""
    return dtype if dtype is not None else (torch.bfloat16 if weight_dtype == torch.float32 else None)


def _stackable(lins: list) -> bool:
    """Whether nn.Linear siblings quantize as one stacked weight (see :func:`quantize_model`'s ``fuse``)."""
    first = lins[0]
    return all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None)
               for m in lins)


def _install_fused(model: nn.Module, fused_name: str, fused: FP4FusedLinear) -> None:
    """Add ``fused`` to its parent under ``fused_name`` and put its parts in the places of the
    layers it stacks."""
    parent_name, _, child = fused_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent.add_module(child, fused)
    for i, n in enumerate(fused.part_names):
        setattr(parent, n.rpartition(".")[2], FP4LinearPart(fused, i))


def _sibling_groups(model: nn.Module, members: Mapping[str, nn.Module],
                    compatible: Callable[[list], bool]) -> dict[str, list[str]]:
    """``{fused module name: part names}``: each :data:`FUSED_PROJECTIONS` group whose parts are
    all in ``members`` (qualified name -> module) under one parent that has no module of the
    fused name yet, and ``compatible``."""
    out: dict[str, list[str]] = {}
    for parent_name, parent in model.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        for fused, parts in FUSED_PROJECTIONS:
            names = [prefix + p for p in parts]
            mods = [members.get(n) for n in names]
            if all(m is not None for m in mods) and not hasattr(parent, fused) and compatible(mods):
                out[prefix + fused] = names
    return out


def fuse_projections(model: nn.Module) -> dict[str, list[str]]:
    """Stack sibling :class:`FP4Linear` projections of one input (``q_proj``/``k_proj``/``v_proj``,
    ``gate_proj``/``up_proj``) of an FP4 model, such as one loaded from a checkpoint, into one
    :class:`FP4FusedLinear` each, in place and exactly: their packed values and block scales
    are concatenated. Fused only where that is exact: the same format, input size, device,
    compute dtype and bias presence, and in NVFP4 the same global scale and input scale (a
    ModelOpt export gives fused-in-serving layers one shared scale). Returns ``{fused module
    name: part names}``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse_projections: model must be a torch.nn.Module, got {_describe(model)}")
    layers = {n: m for n, m in model.named_modules() if type(m) is FP4Linear}

    def same(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
        return (a is None) == (b is None) and (a is None or (a.shape == b.shape and torch.equal(a, b.to(a.device))))

    def compatible(mods) -> bool:
        f = mods[0]
        w0 = f.fp4_weight()
        for m in mods:
            w = m.fp4_weight()
            if (m.fmt != f.fmt or m.in_features != f.in_features or w.data.device != w0.data.device
                    or m.compute_dtype != f.compute_dtype or (m.bias is None) != (f.bias is None)
                    or (m.bias is not None and m.bias.dtype != f.bias.dtype)
                    or not same(w.global_scale, w0.global_scale) or not same(w.input_scale, w0.input_scale)):
                return False
        return True

    groups = _sibling_groups(model, layers, compatible)
    for fused_name, names in groups.items():
        mods = [layers[n] for n in names]
        ws = [m.fp4_weight() for m in mods]
        w = FP4Weight(ws[0].fmt, torch.cat([x.data for x in ws], 0), torch.cat([x.scale for x in ws], 0),
                      ws[0].global_scale, ws[0].input_scale, check_values=False)
        bias = None if mods[0].bias is None else torch.cat([m.bias.detach() for m in mods], 0)
        fused = FP4FusedLinear(w, bias, mods[0].compute_dtype, [(n, m.out_features) for n, m in zip(names, mods)])
        _install_fused(model, fused_name, fused)
    return groups
