"""FP4Weight: packed E2M1 values, block scales, global scale (+ an expert dimension).

An :class:`FP4Weight` is a plain container of tensors that all live on one device:

==============  ==========================================  ====================================
attribute       nvfp4                                       mxfp4
==============  ==========================================  ====================================
data            uint8 [..., N, K/2], two E2M1 codes a byte  same
scale           torch.float8_e4m3fn [..., N, K/16]          uint8 E8M0 [..., N, K/32]
global_scale    fp32 [] (2-D) or [E] (stacked experts)      None
input_scale     optional fp32 [] or [E] (checkpoint's       optional, same shapes
                activation scale, carried along)
==============  ==========================================  ====================================

``...`` is empty for a linear weight ``[N, K]`` and ``E`` for stacked MoE experts ``[E, N, K]``.
The constructor checks dtypes, shapes, block size and device (cheap, no device sync) and, unless
``check_values=False``, the values that make a weight invalid: a global or input scale that is
not finite and positive, a NaN or negative E4M3 block scale, an E8M0 NaN (255). Those value
checks need one device sync on CUDA; they are skipped while a CUDA graph is being captured,
under torch.compile and for meta/fake tensors.

Backends keep their prepacked forms in a per-instance cache (:meth:`FP4Weight.packed`);
:meth:`FP4Weight.to` returns a new weight whose cache starts empty. Once every form its calls
will need is packed, a server may free the stored ``data`` and ``scale``
(:func:`autofp4.ops.free_loaded`): the weight keeps its shape, dtype and device, and anything
that would read them again (a new prepacked form, ``dequantize``, ``to``, a copy) raises
:class:`LoadedTensorsFreed`.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Union

import torch

from .formats import E8M0_NAN, check_fmt, dequantize_blocks, quantize_mxfp4, quantize_nvfp4
from .graph_pools import outside_graph_pools
from .problem import BLOCK_SIZE, FORMATS

__all__ = ["FP4Weight", "LoadedTensorsFreed", "quantize", "dequantize"]

Device = Union[torch.device, str, int]

try:  # FakeTensor (torch.compile / fake-tensor mode) cannot be read on the host
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
except ImportError:  # pragma: no cover
    _FakeTensor = ()  # type: ignore[assignment]


def _values_readable(t: torch.Tensor) -> bool:
    if t.device.type == "meta" or isinstance(t, _FakeTensor):
        return False
    if torch.compiler.is_compiling():
        return False
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return True


def _as_index(i: Any) -> Optional[int]:
    try:
        return operator.index(i)
    except TypeError:
        return None


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
    if isinstance(t, (str, int, float)) and not isinstance(t, bool):
        return f"{type(t).__name__} {t!r}"
    return type(t).__name__


_DENSE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_DENSE_NAMES = tuple(str(d).removeprefix("torch.") for d in _DENSE_DTYPES)


class LoadedTensorsFreed(RuntimeError):
    """An FP4Weight's stored tensors were freed after packing (:func:`autofp4.ops.free_loaded`)
    and something asked to read them."""


def missing_device(dev: torch.device) -> Optional[str]:
    """Why this machine has no device ``dev`` (a CUDA device without CUDA, or past the last
    GPU), or None."""
    if dev.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return "no CUDA GPU is available (torch.cuda.is_available() is False)"
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"this machine has {torch.cuda.device_count()} CUDA GPU(s), so there is no {dev}"
    return None


class FP4Weight:
    """An FP4-quantized weight ``[N, K]`` or stacked experts ``[E, N, K]``.

    Build one with :func:`autofp4.quantize` or a loader from :mod:`autofp4.loaders`; the
    constructor takes the stored tensors as they are (no copies).
    """

    def __init__(
        self,
        fmt: str,
        data: torch.Tensor,
        scale: torch.Tensor,
        global_scale: Optional[torch.Tensor] = None,
        input_scale: Optional[torch.Tensor] = None,
        *,
        check_values: bool = True,
    ) -> None:
        self._init(fmt, data, scale, global_scale, input_scale, check_values, "FP4Weight", {})

    @classmethod
    def _build(
        cls, fmt, data, scale, global_scale=None, input_scale=None, *, what: str, labels: dict[str, str]
    ) -> "FP4Weight":
        """The constructor, checked as usual, with errors that say ``what`` (the calling
        function) and call the tensors by ``labels`` (field -> the caller's argument name)."""
        w = cls.__new__(cls)
        w._init(fmt, data, scale, global_scale, input_scale, True, what, labels)
        return w

    def _init(self, fmt, data, scale, global_scale, input_scale, check_values, what, labels) -> None:
        if check_values is not True and check_values is not False:
            raise TypeError(f"{what}: check_values must be True or False, got {type(check_values).__name__}")
        self.fmt = fmt
        self.data = data
        self.scale = scale
        self.global_scale = global_scale
        self.input_scale = input_scale
        self._packed: dict[str, Any] = {}
        self._check_structure(what, labels)
        if check_values and _values_readable(data):
            self._check_values(what, labels)

    # -- validation -----------------------------------------------------------------
    def _check_structure(self, what: str, labels: dict[str, str]) -> None:
        fmt, data, scale = self.fmt, self.data, self.scale
        name = lambda field: labels.get(field, field)  # noqa: E731
        if not isinstance(fmt, str):
            raise TypeError(f"{what}: fmt must be a str, one of {FORMATS}, got {type(fmt).__name__}")
        if fmt not in FORMATS:
            raise ValueError(f"{what}: fmt must be one of {FORMATS}, got {fmt!r}")
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
            raise TypeError(
                f"{what}: {name('data')} must be a uint8 tensor (two E2M1 codes a byte), got {_describe(data)}"
            )
        if data.dim() not in (2, 3):
            raise ValueError(
                f"{what}: {name('data')} must be [N, K/2] or [E, N, K/2], got {data.dim()}-D shape {tuple(data.shape)}"
            )
        if data.numel() == 0:
            raise ValueError(f"{what}: {name('data')} is empty (shape {tuple(data.shape)})")
        bs = BLOCK_SIZE[fmt]
        k = data.shape[-1] * 2
        if k % bs:
            raise ValueError(
                f"{what}: {fmt} needs K to be a multiple of its block size {bs}, "
                f"got K={k} ({name('data')} shape {tuple(data.shape)})"
            )
        want_scale_dtype = torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8
        if not isinstance(scale, torch.Tensor) or scale.dtype != want_scale_dtype:
            hint = ""
            if fmt == "nvfp4" and isinstance(scale, torch.Tensor) and scale.dtype == torch.uint8:
                hint = " (a uint8 checkpoint tensor can be reinterpreted with .view(torch.float8_e4m3fn))"
            raise TypeError(f"{what}: {fmt} {name('scale')} must be {want_scale_dtype}, got {_describe(scale)}{hint}")
        want = tuple(data.shape[:-1]) + (k // bs,)
        if tuple(scale.shape) != want:
            raise ValueError(
                f"{what}: {fmt} {name('scale')} must have shape {want} (one per {bs} values of K={k}) "
                f"for {name('data')} of shape {tuple(data.shape)}, got {tuple(scale.shape)}"
            )
        lead = tuple(data.shape[:-2])  # () or (E,)
        gs = self.global_scale
        if fmt == "nvfp4":
            if not isinstance(gs, torch.Tensor) or gs.dtype != torch.float32:
                raise TypeError(f"{what}: nvfp4 needs a float32 {name('global_scale')} tensor, got {_describe(gs)}")
            if tuple(gs.shape) != lead:
                want_gs = "a scalar tensor (shape ())" if not lead else f"one per expert (shape {lead})"
                raise ValueError(
                    f"{what}: nvfp4 {name('global_scale')} must be {want_gs}, got shape {tuple(gs.shape)}"
                )
        elif gs is not None:
            raise ValueError(f"{what}: mxfp4 has no global scale, so {name('global_scale')} must be None, got {_describe(gs)}")
        ins = self.input_scale
        if ins is not None:
            if not isinstance(ins, torch.Tensor) or ins.dtype != torch.float32:
                raise TypeError(f"{what}: {name('input_scale')} must be a float32 tensor or None, got {_describe(ins)}")
            if tuple(ins.shape) not in ((), lead):
                want_in = "()" if not lead else f"() or {lead}"
                raise ValueError(f"{what}: {name('input_scale')} must have shape {want_in}, got {tuple(ins.shape)}")
        for field in ("scale", "global_scale", "input_scale"):
            t = getattr(self, field)
            if t is not None and t.device != data.device:
                raise ValueError(
                    f"{what}: {name(field)} is on {t.device} but {name('data')} is on {data.device}; "
                    "all tensors must share a device"
                )

    def _check_values(self, what: str, labels: dict[str, str]) -> None:
        name = lambda field: labels.get(field, field)  # noqa: E731
        checks = []  # (field, what is wrong, good: bool tensor)
        if self.fmt == "nvfp4":
            # E4M3 bytes: sign bit 0x80, NaN 0x7F/0xFF -> valid non-negative scales are < 0x7F
            checks.append(("scale", "a negative or NaN E4M3 block scale", self.scale.view(torch.uint8).max() < 0x7F))
            g = self.global_scale
            checks.append(("global_scale", "not finite and positive", (torch.isfinite(g) & (g > 0)).all()))
        else:
            checks.append(("scale", "an E8M0 scale of 255 (NaN)", self.scale.max() < E8M0_NAN))
        if self.input_scale is not None:
            s = self.input_scale
            checks.append(("input_scale", "not finite and positive", (torch.isfinite(s) & (s > 0)).all()))
        ok = torch.stack([c for _, _, c in checks]).cpu().tolist()  # one device sync for all checks
        for (field, wrong, _), good in zip(checks, ok):
            if good:
                continue
            t = getattr(self, field)
            if field == "scale":
                b = t.view(torch.uint8) if t.dtype != torch.uint8 else t
                bad = (b >= 0x7F) if self.fmt == "nvfp4" else (b == E8M0_NAN)
                at = tuple(int(i) for i in bad.nonzero()[0])
                byte = int(b[at])
                raise ValueError(f"{what}: {self.fmt} weight has {wrong}: {name(field)}{list(at)} is {byte:#04x}")
            an = "an" if name(field)[0] in "aeiou" else "a"
            raise ValueError(f"{what}: {self.fmt} weight has {an} {name(field)} that is {wrong}: {t.cpu().tolist()}")

    # -- shape ------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        """The dense shape ``[N, K]`` or ``[E, N, K]``."""
        return torch.Size((*self.data.shape[:-1], self.data.shape[-1] * 2))

    @property
    def n(self) -> int:
        return self.data.shape[-2]

    @property
    def k(self) -> int:
        return self.data.shape[-1] * 2

    @property
    def experts(self) -> int:
        """Number of stacked experts (0 for a 2-D weight)."""
        return self.data.shape[0] if self.data.dim() == 3 else 0

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def block_size(self) -> int:
        return BLOCK_SIZE[self.fmt]

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensors."""
        ts = [self.data, self.scale, self.global_scale, self.input_scale]
        return sum(t.untyped_storage().nbytes() if self.freed else t.numel() * t.element_size()
                   for t in ts if t is not None)

    # -- freeing the stored tensors once packed -----------------------------------------
    @property
    def freed(self) -> bool:
        """Whether ``data`` and ``scale`` were freed after packing (see :meth:`_free_loaded`)."""
        return self.__dict__.get("_freed") is not None

    def _require_loaded(self, what: str) -> None:
        why = self.__dict__.get("_freed")
        if why is not None:
            raise LoadedTensorsFreed(
                f"{what} needs this {self.fmt} weight {tuple(self.shape)}'s stored values, which were freed "
                f"after packing ({why})"
            )

    def _free_loaded(self, why: str) -> int:
        """Replace ``data`` and ``scale`` with placeholders of the same shape, dtype and device that
        hold one element each (stride 0), freeing the loaded bytes; returns the bytes freed. The
        prepacked forms cached so far stay; ``why`` is said by any later read of the values."""
        if self.freed:
            return 0
        freed = 0
        for field in ("data", "scale"):
            t = getattr(self, field)
            freed += t.untyped_storage().nbytes()
            setattr(self, field, torch.empty(1, dtype=t.dtype, device=t.device).expand(t.shape))
        self.__dict__["_freed"] = why
        return freed

    def __repr__(self) -> str:
        extra = "" if self.input_scale is None else ", input_scale"
        return f"FP4Weight(fmt={self.fmt!r}, shape={tuple(self.shape)}, device={self.device}{extra})"

    # -- views and copies --------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight ``[..., N, K]`` in ``dtype`` (float32, float64, bfloat16 or float16;
        computed in fp32)."""
        if type(dtype) is not torch.dtype:
            raise TypeError(f"dequantize: dtype must be a torch.dtype, one of {_DENSE_NAMES}, got {_describe(dtype)}")
        if dtype not in _DENSE_DTYPES:
            raise ValueError(f"dequantize: dtype must be one of {_DENSE_NAMES}, got {dtype}")
        self._require_loaded("dequantize")
        return dequantize_blocks(self.fmt, self.data, self.scale, self.global_scale, dtype)

    def _derived(self, data, scale, gs, ins) -> "FP4Weight":
        return FP4Weight(self.fmt, data, scale, gs, ins, check_values=False)

    def to(self, device: Device, non_blocking: bool = False) -> "FP4Weight":
        """This weight on ``device``; ``self`` when it is already there. A moved weight starts
        with an empty prepacked cache."""
        if isinstance(device, torch.dtype):
            raise TypeError(f"FP4Weight.to({device}): an FP4 weight moves between devices but has no dtype to convert "
                            f"to (its values are FP4 codes); dequantize({device}) gives a dense tensor")
        if not isinstance(non_blocking, bool):
            raise TypeError(f"FP4Weight.to: non_blocking must be True or False, got {_describe(non_blocking)}")
        try:
            why = missing_device(torch.device(device))
        except (TypeError, RuntimeError):
            why = None  # not a device name: torch's own error below
        if why:
            raise RuntimeError(f"FP4Weight.to({device!r}): {why}")
        data = self.data.to(device, non_blocking=non_blocking)
        if data is self.data:
            return self
        self._require_loaded("to")
        mv = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return self._derived(data, mv(self.scale), mv(self.global_scale), mv(self.input_scale))

    def expert(self, e: int) -> "FP4Weight":
        """Expert ``e`` of a stacked weight as a 2-D FP4Weight (views, no copy)."""
        if not self.experts:
            raise ValueError(f"expert() needs a stacked [E, N, K] weight, this one is {tuple(self.shape)}")
        i = _as_index(e)
        if i is None or not 0 <= i < self.experts:
            raise IndexError(f"expert index must be an int in [0, {self.experts}), got {e!r}")
        e = i
        self._require_loaded("expert()")
        gs = None if self.global_scale is None else self.global_scale[e]
        ins = self.input_scale
        if ins is not None and ins.dim() == 1:
            ins = ins[e]
        return self._derived(self.data[e], self.scale[e], gs, ins)

    def slice_rows(self, start: int, end: int) -> "FP4Weight":
        """Output rows ``[start:end]`` (along N; for stacked experts, of every expert), as views."""
        s, e = _as_index(start), _as_index(end)
        if s is None or e is None or not 0 <= s < e <= self.n:
            raise IndexError(f"slice_rows needs ints 0 <= start < end <= N={self.n}, got start={start!r}, end={end!r}")
        start, end = s, e
        self._require_loaded("slice_rows()")
        return self._derived(
            self.data[..., start:end, :], self.scale[..., start:end, :], self.global_scale, self.input_scale
        )

    # -- copies and pickles: the tensors, not the caches ---------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """What a copy or a pickle keeps: the format and the tensors. The prepacked forms and the
        runners ``autofp4.linear`` cached on this instance (which hold locks and device state)
        are built again on the copy's first use. An FP8 (NVFP4) scale is kept as its uint8 bytes,
        viewed back when loaded: torch's plain pickle cannot load an FP8 tensor back (its
        torch.save can; both work with this)."""
        self._require_loaded("a copy or pickle")
        state = {k: self.__dict__[k] for k in ("fmt", "data", "scale", "global_scale", "input_scale")}
        scale = state["scale"]
        if isinstance(scale, torch.Tensor) and scale.dtype == torch.float8_e4m3fn:
            state["scale"] = scale.view(torch.uint8)
            state["scale_dtype"] = "float8_e4m3fn"
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """What unpickling (or a copy) calls: the restored tensors are checked as the constructor
        checks them (fmt, the shapes and dtypes of data, scale, global_scale, input_scale)."""
        what = "FP4Weight (unpickled)"
        if not isinstance(state, dict):
            raise TypeError(f"{what}: the pickled state must be a dict, got {type(state).__name__}")
        state = dict(state)
        missing = [k for k in ("fmt", "data", "scale") if k not in state]
        if missing:
            raise ValueError(f"{what}: the pickled state has no {', '.join(missing)}")
        scale_dtype = state.pop("scale_dtype", None)
        if scale_dtype is not None:
            if scale_dtype != "float8_e4m3fn":
                raise ValueError(f"{what}: scale_dtype must be 'float8_e4m3fn', got {scale_dtype!r}")
            sc = state["scale"]
            if not isinstance(sc, torch.Tensor) or sc.dtype != torch.uint8:
                raise TypeError(f"{what}: a float8_e4m3fn scale is pickled as uint8 bytes, got {_describe(sc)}")
            state["scale"] = sc.view(torch.float8_e4m3fn)
        self.__dict__.update(state)
        self.__dict__.setdefault("global_scale", None)
        self.__dict__.setdefault("input_scale", None)
        self._packed = {}
        self._check_structure(what, {})

    # -- per-backend prepacked forms ------------------------------------------------------
    def packed(self, name: str, factory: Callable[["FP4Weight"], Any]) -> Any:
        """The prepacked form called ``name``, built by ``factory(self)`` on first use (outside
        CUDA graph memory pools, :func:`outside_graph_pools`) and cached on this instance."""
        try:
            return self._packed[name]
        except KeyError:
            self._require_loaded(f"the {name} backend's packed form")
            value = self._packed[name] = outside_graph_pools(lambda: factory(self), self.data.device)
            return value

    def clear_packed(self) -> None:
        """Drop every cached prepacked form (and the runners ``autofp4.linear`` kept with them)."""
        self._require_loaded("clear_packed() (the forms could not be packed again)")
        self._packed.clear()
        self.__dict__.pop("_linear_fast", None)


def quantize(w: torch.Tensor, fmt: str) -> FP4Weight:
    """Quantize a weight ``[N, K]`` or stacked experts ``[E, N, K]`` (bf16/fp16/fp32, any device)
    to ``fmt`` ("nvfp4" or "mxfp4"). For ``[E, N, K]`` NVFP4 the global scale is per expert, so
    each expert equals quantizing it alone."""
    check_fmt(fmt, "quantize")
    if isinstance(w, torch.Tensor) and w.layout != torch.strided:
        raise ValueError(f"quantize: w must be a dense tensor, got layout {w.layout}; convert it first (w.to_dense())")
    if fmt == "nvfp4":
        data, scale, gs = quantize_nvfp4(w)
        return FP4Weight("nvfp4", data, scale, gs, check_values=False)
    data, scale = quantize_mxfp4(w)
    return FP4Weight("mxfp4", data, scale, check_values=False)


def dequantize(w: FP4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense weight ``[..., N, K]`` of an FP4Weight, computed in fp32 and cast to ``dtype``
    (float32, float64, bfloat16 or float16)."""
    if not isinstance(w, FP4Weight):
        hint = " (an FP4Linear's is .fp4_weight())" if hasattr(w, "fp4_weight") else ""
        raise TypeError(f"dequantize: w must be an FP4Weight, got {_describe(w)}{hint}")
    return w.dequantize(dtype)
