"""MoE routing from router logits: ``(topk_weights, topk_ids)`` and, for the MoE kernels, the
routing metadata, in one kernel launch on Hopper.

Scoring (:class:`RouterSpec`):

* ``"softmax"`` (Qwen3-MoE, Mixtral, gpt-oss): the softmax of the logits, the ``top_k`` largest,
  renormalized over them (``renormalize=True``: the softmax of the top-k logits, gpt-oss's
  order of operations gives the same weights) or not;
* ``"sigmoid"`` (DeepSeek-V3): ``s = sigmoid(logits)``; experts chosen by ``s + correction_bias``
  within the ``topk_group`` best of ``n_group`` groups (a group's score: the sum of its two best),
  weighted by ``s``, renormalized (``/ (sum + 1e-20)``) or not;

then both multiplied by ``scale`` (DeepSeek-V3's ``routed_scaling_factor``). The ids come sorted
by descending score; ties go to the lower expert id.

On an sm_90 GPU with CuTeDSL the kernel :mod:`autofp4.kernels.moe_router` computes all of it
(and, asked for a metadata layout, the per-pair blocks or, up to its
``SORT_MAX_TOKENS`` tokens, the sorted metadata; more tokens: the routing kernel sorts after
it); elsewhere fixed-size torch ops (CUDA-graph capturable) compute the same values in fp32
(``$AUTOFP4_MOE_ROUTING=torch`` forces them).
"""
from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import routing
from .routing import MoERouting

__all__ = ["RouterSpec", "SCORINGS", "route", "route_torch"]

SCORINGS = ("softmax", "sigmoid")
SIGMOID_EPS = 1e-20  # added to the sum of the chosen sigmoid scores before renormalizing


@dataclass(frozen=True)
class RouterSpec:
    """How router logits become the top-k routing (see the module docstring)."""

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0

    @classmethod
    def checked(cls, experts: int, top_k, scoring="softmax", renormalize=True, n_group=1, topk_group=1,
                scale=1.0, what: str = "route") -> "RouterSpec":
        """The spec for logits over ``experts`` experts; TypeError/ValueError naming the argument."""
        k = as_int(top_k)
        if k is None:
            raise TypeError(f"{what}: top_k must be an int, got {type(top_k).__name__}")
        if not 0 < k <= experts:
            raise ValueError(f"{what}: top_k must be in [1, E={experts}], got {k}")
        if not isinstance(scoring, str) or scoring not in SCORINGS:
            raise ValueError(f"{what}: scoring must be one of {SCORINGS}, got {scoring!r}")
        if not isinstance(renormalize, bool):
            raise TypeError(f"{what}: renormalize must be True or False, got {renormalize!r}")
        g, tg = as_int(n_group), as_int(topk_group)
        if g is None or tg is None:
            raise TypeError(f"{what}: n_group and topk_group must be ints, got {n_group!r} and {topk_group!r}")
        if g < 1 or experts % g or (g > 1 and experts // g < 2):
            raise ValueError(f"{what}: n_group must divide the E={experts} experts into groups of 2 or more "
                             f"(or be 1), got {g}")
        if not 1 <= tg <= g or tg * (experts // g) < k:
            raise ValueError(f"{what}: topk_group must be in [1, n_group={g}] and its groups must hold at least "
                             f"top_k={k} experts, got {tg}")
        if g > 1 and scoring != "sigmoid":
            raise ValueError(f"{what}: group-limited routing (n_group > 1) is DeepSeek-V3's: use scoring='sigmoid'")
        if (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale == scale
                or abs(scale) == float("inf") or scale <= 0):
            raise ValueError(f"{what}: routed_scaling_factor must be a finite positive number (it multiplies the "
                             f"routing weights), got {scale!r}")
        return cls(k, scoring, renormalize, g, tg, float(scale))


def as_int(v) -> Optional[int]:
    """``v`` as an int where it is an integer (not a bool), else None."""
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def check_bias(bias, experts: int, device, what: str = "route") -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or bias.shape != (experts,) or not bias.is_floating_point():
        got = (f"{tuple(bias.shape)} {bias.dtype}" if isinstance(bias, torch.Tensor) else type(bias).__name__)
        raise ValueError(f"{what}: correction_bias must be a float tensor [E={experts}], got {got}")
    if bias.device != device:
        raise ValueError(f"{what}: correction_bias is on {bias.device} but the router logits are on {device}")


# ----------------------------------------------------------------------------- torch ops
def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk`` along the last dim with its ties ordered as the kernel orders them: the
    lower index first (``torch.topk`` leaves their order to the device and the size)."""
    v, i = torch.sort(x, dim=-1, descending=True, stable=True)
    return v[..., :k], i[..., :k]


def route_torch(logits: torch.Tensor, spec: RouterSpec,
                bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights fp32 [T, k], topk_ids int32 [T, k])`` with fixed-size torch ops in fp32."""
    l32 = logits.float()
    k = spec.top_k
    if spec.scoring == "softmax":
        w, ids = _topk(torch.softmax(l32, dim=-1), k)
        if spec.renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
    else:
        s = torch.sigmoid(l32)
        c = s if bias is None else s + bias.float()
        if spec.n_group > 1:
            t, e = c.shape
            gs = _topk(c.view(t, spec.n_group, e // spec.n_group), 2)[0].sum(-1)
            keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, _topk(gs, spec.topk_group)[1], True)
            c = c.masked_fill(~keep.repeat_interleave(e // spec.n_group, dim=1), float("-inf"))
        ids = _topk(c, k)[1]
        w = s.gather(1, ids)
        if spec.renormalize:
            w = w / (w.sum(dim=-1, keepdim=True) + SIGMOID_EPS)
    if spec.scale != 1.0:
        w = w * spec.scale
    return w, ids.to(torch.int32)


# ----------------------------------------------------------------------------- the kernel
_KERNELS: dict = {}


def _kernel(key) -> Optional[Callable]:
    """The compiled router kernel for ``key`` (a ``RouterKey``), or None where it cannot be
    built (a failed compile warns once and leaves the key to the torch ops)."""
    if key not in _KERNELS:
        from .kernels import moe_router

        try:
            _KERNELS[key] = moe_router.compile_kernel(key)
        except Exception as e:  # a broken toolchain must not take the MoE layer down
            warnings.warn(f"autofp4: the router kernel {key} did not compile ({e}); using torch ops for it",
                          RuntimeWarning, stacklevel=4)
            _KERNELS[key] = None
    return _KERNELS[key]


def _kernel_applies(logits: torch.Tensor) -> bool:
    if not routing.USE_KERNEL or logits.device.type != "cuda" or torch.compiler.is_compiling():
        return False
    return routing._on_hopper(logits.device) and routing.cute_available()


def _placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-element tensor for an argument the kernel does not read or write (shared)."""
    return routing._const(("router_ph", dtype), device, lambda: torch.zeros(1, dtype=dtype, device=device))


def route(logits: torch.Tensor, spec: RouterSpec, bias: Optional[torch.Tensor] = None, *,
          layout: Optional[tuple[int, bool]] = None, experts: int = 0,
          expert_map: Optional[torch.Tensor] = None
          ) -> tuple[torch.Tensor, torch.Tensor, Optional[MoERouting]]:
    """``(topk_weights fp32 [T, k], topk_ids int32 [T, k], metadata)`` of ``logits [T, E]``
    (checked by the caller; ``bias``: the sigmoid scoring's correction bias ``[E]``).

    ``layout``: ``(block_m, per_pair)`` of the MoE kernel that will run, whose routing metadata
    (over ``experts`` local experts, through ``expert_map`` if given) is built too, else None
    (and the metadata None)."""
    from .kernels import moe_router as R
    from .kernels.moe_route import MAX_EXPERTS as SORT_EXPERTS

    t, e = logits.shape
    dev = logits.device
    k = spec.top_k
    meta = "none" if layout is None else ("pairs" if layout[1] else "sorted")
    block_m = 1 if layout is None else layout[0]
    use = _kernel_applies(logits) and t > 0
    if use and meta == "sorted" and (t > R.SORT_MAX_TOKENS or not 1 <= experts <= SORT_EXPERTS):
        meta = "none"  # scored here, sorted by the routing kernel (or the torch ops) below
    key = R.RouterKey(e, k, spec.scoring, spec.renormalize, spec.n_group, spec.topk_group, bias is not None,
                      str(logits.dtype).removeprefix("torch."), meta, expert_map is not None,
                      experts if meta == "sorted" else 0, block_m if meta == "sorted" else 1)
    fn = _kernel(key) if use and key.problem() is None else None
    if fn is None:
        w, ids = route_torch(logits, spec, bias)
        meta = "none"
    else:
        x = logits if logits.stride(-1) == 1 and logits.stride(0) == e else logits.contiguous()
        w = torch.empty(t, k, dtype=torch.float32, device=dev)
        ids = torch.empty(t, k, dtype=torch.int32, device=dev)
        i32 = _placeholder(torch.int32, dev)
        counts = rows = bexp = nblk = i32
        if meta == "pairs":
            bexp = torch.empty(t * k, dtype=torch.int32, device=dev)
        elif meta == "sorted":
            max_rows, max_blocks = routing.routing_sizes(t * k, experts, block_m)
            counts = torch.empty(experts, dtype=torch.int32, device=dev)
            rows = torch.empty(max_rows, dtype=torch.int32, device=dev)
            bexp = torch.empty(max_blocks, dtype=torch.int32, device=dev)
            nblk = torch.empty(1, dtype=torch.int32, device=dev)
        b = _placeholder(torch.float32, dev) if bias is None else bias.float().contiguous()
        emap = i32 if expert_map is None else expert_map.to(dtype=torch.int32).contiguous()
        fn(x, b, emap, w.view(-1), ids.view(-1), counts, rows, bexp, nblk, spec.scale, R.ctas_for(t, meta))
    if layout is None:
        return w, ids, None
    if meta == "pairs":
        return w, ids, routing.per_pair_layout(bexp, block_m, k)
    if meta == "sorted":
        return w, ids, MoERouting(counts=counts, sorted_rows=rows, block_expert=bexp, num_blocks=nblk,
                                  block_m=block_m, top_k=k)
    build = routing.per_pair_routing if layout[1] else routing.moe_routing
    return w, ids, build(ids, experts, block_m, expert_map=expert_map)
