"""MoE routing metadata on the device, with no host synchronization.

A grouped MoE kernel works on blocks of ``block_m`` token rows that all go to one expert. From
the router's ``topk_ids [T, top_k]`` this module builds, with fixed-size torch ops only (no
``.item()``, no ``.tolist()``, no data-dependent shapes; CUDA-graph capturable and traceable by
``torch.compile(fullgraph=True)``):

* ``counts [E]``: how many (token, slot) pairs each local expert received;
* ``sorted_rows [max_rows]``: the pairs (as flat indices ``t * top_k + j`` into ``topk_ids``)
  sorted by expert, each expert's run padded with ``-1`` to a multiple of ``block_m``;
* ``block_expert [max_blocks]``: the expert of each block of ``block_m`` rows, ``-1`` for the
  blocks past the last used one (a kernel's CTA for such a block exits at once);
* ``num_blocks [1]``: how many blocks are used.

Every size depends on ``T * top_k``, ``E`` and ``block_m`` only: ``max_rows`` is
``T * top_k + E * (block_m - 1)`` rounded up to ``block_m`` (each expert's run wastes at most
``block_m - 1`` rows), ``max_blocks = max_rows // block_m``.

:func:`per_pair_routing` is the metadata without sorting, for a batch with fewer pairs than
experts (decode): one block per pair, holding just that pair (two small ops instead of a sort,
scans and scatters); an expert that several pairs choose is then read once per pair.

Tensors that depend on the sizes only (the per-pair rows and block count, the index ranges the
sorting uses) are built once per ``(sizes, device)`` and shared by later calls (in a CUDA graph
each would otherwise be one more small kernel per layer): treat the returned metadata as
read-only. They are not shared when built during CUDA graph capture or ``torch.compile`` tracing.

On a Hopper GPU :func:`moe_routing` is one CuTeDSL kernel (:mod:`autofp4.kernels.moe_route`,
the same values) where CuTeDSL is installed and the call fits one CTA (up to
``MAX_PAIRS`` pairs); the torch ops otherwise, or everywhere with ``$AUTOFP4_MOE_ROUTING=torch``.

:func:`prebuilt` hands routing metadata built elsewhere (by :func:`autofp4.router.route`, in the
same kernel that scored the router logits) to the kernels' calls of these functions for the same
``topk_ids`` tensor, so that the MoE kernels run without building it again.

Expert parallelism: with ``expert_map`` (``[E_global]`` int, the local index of each global
expert or ``-1`` where another rank holds it), pairs routed to experts elsewhere are left out
(not in ``sorted_rows``, not counted); ``E`` is then the number of local experts.
"""
from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from .env import env_choice
from .graph_pools import outside_graph_pools

__all__ = ["MoERouting", "moe_routing", "per_pair_routing", "prebuilt", "rank_expert_map", "routing_sizes"]


@dataclass(frozen=True)
class MoERouting:
    """The routing metadata of one MoE call (all int32, on ``topk_ids``'s device)."""

    counts: torch.Tensor  # [E]
    sorted_rows: torch.Tensor  # [max_rows]: flat pair index, -1 for padding
    block_expert: torch.Tensor  # [max_blocks]: local expert of each block, -1 past the used ones
    num_blocks: torch.Tensor  # [1]
    block_m: int
    top_k: int


@dataclass(frozen=True)
class _Prebuilt:
    ids: torch.Tensor
    routing: MoERouting
    experts: int
    per_pair: bool
    expert_map: torch.Tensor | None


_PREBUILT = threading.local()


@contextmanager
def prebuilt(topk_ids: torch.Tensor, routing: MoERouting, experts: int, per_pair: bool,
             expert_map: torch.Tensor | None = None):
    """Inside this block (on this thread), :func:`moe_routing` (``per_pair=False``) or
    :func:`per_pair_routing` (``per_pair=True``) called with this very ``topk_ids`` tensor, these
    ``experts``, ``routing.block_m`` and this ``expert_map`` object returns ``routing`` instead of
    building it; any other call builds its own."""
    prev = getattr(_PREBUILT, "value", None)
    _PREBUILT.value = _Prebuilt(topk_ids, routing, experts, per_pair, expert_map)
    try:
        yield
    finally:
        _PREBUILT.value = prev


def _prebuilt_for(topk_ids: torch.Tensor, experts: int, block_m: int, per_pair: bool,
                  expert_map: torch.Tensor | None) -> MoERouting | None:
    pre = getattr(_PREBUILT, "value", None)
    if (pre is None or pre.ids is not topk_ids or pre.experts != experts or pre.per_pair != per_pair
            or pre.routing.block_m != block_m or pre.expert_map is not expert_map):
        return None
    return pre.routing


_CONSTS: dict[tuple, torch.Tensor] = {}
_CONSTS_MAX = 512  # entries kept (per-pair routing meets at most E sizes per layer shape)


def _const(key: tuple, device: torch.device, build) -> torch.Tensor:
    """``build()`` (a tensor of sizes only), built once per ``(key, device)``: outside CUDA graph
    memory pools, and not kept when built under stream capture (its values would exist only
    once the graph replays) or while ``torch.compile`` traces."""
    k = (*key, device)
    t = _CONSTS.get(k)
    if t is not None:
        return t
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return build()
    t = outside_graph_pools(build, device)
    if len(_CONSTS) >= _CONSTS_MAX:
        _CONSTS.clear()
    _CONSTS[k] = t
    return t


#: build sorted routing with the routing kernel where it can run (``$AUTOFP4_MOE_ROUTING=torch``: never)
USE_KERNEL = env_choice("AUTOFP4_MOE_ROUTING", {"kernel": True, "torch": False}, True,
                        "the routing kernel is used where it can run")
_KERNELS: dict[tuple, Callable | None] = {}


def _kernel(experts: int, block_m: int, pairs: int, ids64: bool, mapped: bool,
            device: torch.device) -> Callable | None:
    """The compiled routing kernel for these sizes, or None where it does not apply (no
    CuTeDSL, not a Hopper GPU: the binary is sm_90a's, too many pairs or experts, tracing). A
    kernel that fails to compile warns once and leaves these sizes to the torch ops."""
    if not USE_KERNEL or torch.compiler.is_compiling() or not _on_hopper(device):
        return None
    from .kernels import moe_route

    if not moe_route.supported(experts, pairs):
        return None
    key = (experts, block_m, ids64, mapped)
    if key not in _KERNELS:
        if not cute_available():
            _KERNELS[key] = None
            return None
        try:
            _KERNELS[key] = moe_route.compile_kernel(*key)
        except Exception as e:  # a broken toolchain must not take the MoE layer down
            warnings.warn(f"autofp4: the MoE routing kernel {key} did not compile ({e}); "
                          "using torch ops for its routing", RuntimeWarning, stacklevel=3)
            _KERNELS[key] = None
    return _KERNELS[key]


_CUTE: list[bool] = []


def cute_available() -> bool:
    """Whether CuTeDSL (``nvidia-cutlass-dsl``) imports here (looked up once)."""
    if not _CUTE:
        try:
            import cutlass  # noqa: F401

            _CUTE.append(True)
        except ImportError:
            _CUTE.append(False)
    return _CUTE[0]


_HOPPER: dict[int, bool] = {}


def _on_hopper(device: torch.device) -> bool:
    """Whether ``device`` is an sm_90 GPU (looked up once per device)."""
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _HOPPER:
        _HOPPER[i] = torch.cuda.get_device_capability(i) == (9, 0)
    return _HOPPER[i]


def rank_expert_map(experts_global: int, experts: int, rank: int = 0,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The ``expert_map`` (``[experts_global]`` int32) of the rank that holds the ``rank``-th
    run of ``experts`` consecutive experts: their local index, ``-1`` for every other one."""
    if not 0 < experts <= experts_global or not 0 <= rank < experts_global // experts:
        raise ValueError(f"rank {rank} of {experts} experts does not fit {experts_global} experts")
    emap = torch.full((experts_global,), -1, dtype=torch.int32, device=device)
    emap[rank * experts:(rank + 1) * experts] = torch.arange(experts, dtype=torch.int32, device=device)
    return emap


def routing_sizes(pairs: int, experts: int, block_m: int) -> tuple[int, int]:
    """``(max_rows, max_blocks)`` for ``pairs = T * top_k`` routed pairs over ``experts``."""
    if block_m < 1 or experts < 1 or pairs < 0:
        raise ValueError(f"need block_m >= 1, experts >= 1, pairs >= 0; got {block_m}, {experts}, {pairs}")
    rows = pairs + experts * (block_m - 1)
    rows = -(-rows // block_m) * block_m
    return rows, rows // block_m


def moe_routing(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                expert_map: torch.Tensor | None = None) -> MoERouting:
    """The routing metadata of ``topk_ids`` ``[T, top_k]`` (int32/int64, values in
    ``[0, num_experts)`` or, with ``expert_map``, in ``[0, len(expert_map))``) for kernels that
    work on blocks of ``block_m`` rows. ``num_experts``: the local experts (``E``)."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be a 2-D tensor [T, top_k], got {getattr(topk_ids, 'shape', topk_ids)!r}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"block_m must be a positive int, got {block_m!r}")
    pre = _prebuilt_for(topk_ids, num_experts, block_m, False, expert_map)
    if pre is not None:
        return pre
    dev = topk_ids.device
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    max_rows, max_blocks = routing_sizes(pairs, num_experts, block_m)
    if dev.type == "cuda" and pairs:
        emap = None if expert_map is None else expert_map.to(device=dev, dtype=torch.int32).contiguous()
        fn = _kernel(num_experts, block_m, pairs, topk_ids.dtype == torch.int64, emap is not None, dev)
        if fn is not None:
            from .kernels.moe_route import route

            counts, rows, bexp, nblk = route(topk_ids.reshape(-1).contiguous(), num_experts, block_m, max_rows,
                                             max_blocks, emap, fn)
            return MoERouting(counts=counts, sorted_rows=rows, block_expert=bexp, num_blocks=nblk,
                              block_m=block_m, top_k=top_k)
    if expert_map is not None:
        local = expert_map.to(device=dev, dtype=torch.long)[flat]
        local = torch.where(local < 0, torch.full_like(local, num_experts), local)  # elsewhere: a last bin
    else:
        local = flat
    # counts by scatter (bincount's output size would depend on the data: a host sync)
    counts_all = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    counts_all.scatter_add_(0, local, torch.ones_like(local))
    counts = counts_all[:num_experts]
    padded = (counts + (block_m - 1)) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)  # inclusive end of each expert's padded run
    pad_start = pad_end - padded
    raw_start = torch.cumsum(counts_all, 0) - counts_all  # start of each expert in the sorted pairs
    order = torch.sort(local, stable=True).indices  # pairs by expert, in token order within one
    e_sorted = local[order]
    rank = _const(("arange", pairs), dev, lambda: torch.arange(pairs, device=dev)) - raw_start[e_sorted]
    valid = e_sorted < num_experts
    dest = torch.where(valid, pad_start[e_sorted.clamp(max=num_experts - 1)] + rank,
                       torch.full_like(rank, max_rows))  # elsewhere: a dropped slot
    rows = torch.full((max_rows + 1,), -1, dtype=torch.long, device=dev)
    rows.scatter_(0, dest, order)
    total = pad_end[-1:]
    starts = _const(("starts", max_blocks, block_m), dev, lambda: torch.arange(max_blocks, device=dev) * block_m)
    block_expert = torch.searchsorted(pad_end, starts, right=True)
    block_expert = torch.where(starts < total, block_expert, torch.full_like(block_expert, -1))
    return MoERouting(
        counts=counts.to(torch.int32),
        sorted_rows=rows[:max_rows].to(torch.int32),
        block_expert=block_expert.to(torch.int32),
        num_blocks=(total // block_m).to(torch.int32),
        block_m=block_m,
        top_k=top_k,
    )


def per_pair_routing(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                     expert_map: torch.Tensor | None = None) -> MoERouting:
    """Routing metadata with one block per (token, slot) pair, in pair order: block ``p`` is
    pair ``p`` followed by ``block_m - 1`` padding rows, its expert ``topk_ids.flatten()[p]``
    (with ``expert_map``: that expert's local index, ``-1`` for a pair routed to another rank,
    whose block is then unused). ``counts`` is left empty (the kernels do not read it)."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be a 2-D tensor [T, top_k], got {getattr(topk_ids, 'shape', topk_ids)!r}")
    if not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"block_m must be a positive int, got {block_m!r}")
    pre = _prebuilt_for(topk_ids, num_experts, block_m, True, expert_map)
    if pre is not None:
        return pre
    # a column of a wider tensor of ids reshapes to a strided view:
    ids = topk_ids.reshape(-1)
    block_expert = (ids if expert_map is None else expert_map.to(device=ids.device)[ids.long()]).to(torch.int32)
    block_expert = block_expert.contiguous()  # the kernels take it compact
    return per_pair_layout(block_expert, block_m, topk_ids.shape[1])


def per_pair_layout(block_expert: torch.Tensor, block_m: int, top_k: int) -> MoERouting:
    """The per-pair routing metadata (:func:`per_pair_routing`) around ``block_expert`` (int32
    ``[T * top_k]``, the local expert of each pair, -1 for another rank's)."""
    dev = block_expert.device
    pairs = block_expert.numel()

    def rows() -> torch.Tensor:
        r = torch.full((pairs, block_m), -1, dtype=torch.int32, device=dev)
        r[:, 0] = torch.arange(pairs, dtype=torch.int32, device=dev)
        return r.reshape(-1)

    return MoERouting(
        counts=_const(("empty",), dev, lambda: torch.empty(0, dtype=torch.int32, device=dev)),
        sorted_rows=_const(("per_pair_rows", pairs, block_m), dev, rows),
        block_expert=block_expert,
        num_blocks=_const(("num_blocks", pairs), dev, lambda: torch.full((1,), pairs, dtype=torch.int32, device=dev)),
        block_m=block_m,
        top_k=top_k,
    )
