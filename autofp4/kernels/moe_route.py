"""The MoE routing metadata of :func:`autofp4.routing.moe_routing` in one CuTeDSL kernel.

One CTA of ``THREADS`` threads builds, from ``topk_ids`` (flattened, ``pairs = T * top_k``
entries, int32 or int64) and optionally an expert map (``[E_global]`` int32, ``-1``: another
rank's expert), what the grouped MoE kernels read: ``counts [E]``, ``sorted_rows [max_rows]``,
``block_expert [max_blocks]`` and ``num_blocks [1]``, with the same values as the torch ops
(pairs sorted by expert, in token order within an expert, each expert's run padded with ``-1`` to
a multiple of ``block_m``). In a CUDA graph that is one node where the torch ops are some forty.

Each warp owns a contiguous chunk of the pairs. Phases, between CTA barriers, with everything
but the outputs in shared memory:

1. every warp: the local expert of each pair of its chunk (``E`` for a pair routed elsewhere)
   into shared memory, and one shared-memory atomic add per pair into the warp's count of that
   expert; the outputs' padding (``-1``) is written meanwhile;
2. every thread, per expert: the warps' counts turned into each warp's offset within the expert
   (a running sum over the warps) and the expert's total; then warp 0: the padded totals' running
   sum (a warp scan per 32 experts), the start of each expert's run;
3. every warp: each pair of its chunk placed, 32 pairs at a time in pair order: lanes of the
   same expert find each other (``match.any``), a lane's row is its expert's start plus the warp's
   offset plus the lanes of that expert before it, and the first of them moves the warp's offset
   on. Token order within an expert follows from the pair order (a warp's pairs come after the
   earlier warps'); a warp walks ``pairs / (32 * warps)`` steps;
4. every thread: the expert of each block (a binary search of the run ends), ``-1`` past the
   used blocks; the counts and the number of used blocks.

:func:`max_pairs` bounds ``pairs`` (the shared-memory copy of the local experts, 2 bytes a pair);
:func:`autofp4.routing.moe_routing` uses the torch ops above it.
"""
from typing import Callable, Optional

import torch

from ..hopper import SMEM_PER_CTA

#: most local experts (the counts and run ends are kept in shared memory)
MAX_EXPERTS = 1024
THREADS = 512
WARPS = THREADS // 32


def max_pairs(experts: int, warps: int = WARPS) -> int:
    """Most (token, slot) pairs one CTA takes for ``experts`` local experts: what shared memory
    holds beside the per-warp counts (a multiple of 4096, at most 65536)."""
    counts = (warps + 3) * (experts + 1) * 4 + 1024
    return max(0, min(65536, (SMEM_PER_CTA - counts) // 2 // 4096 * 4096))


#: the pairs of the largest layer shapes this CTA takes (64 local experts or fewer: 65536)
MAX_PAIRS = max_pairs(MAX_EXPERTS)


def sort_phases(experts: int, block_m: int, threads: int, capacity: int):
    """The CTA-wide parts of the routing metadata, for a kernel of ``threads`` threads whose
    warps put their chunks' local experts (at most ``capacity`` pairs in all) in shared memory
    (``le``, ``E`` for a pair routed elsewhere) and count them per warp (``cntw``, through
    ``count``): ``alloc`` (the buffers), ``prepare`` (every thread, before: clears the counts and
    writes the rows' padding), ``count(cntw, warp, e)`` and ``finish`` (every thread, after a CTA
    barrier: phases 2-4 of the module docstring, writing ``counts``, ``rows``, ``bexp`` and
    ``nblk``; ``chunk``: the pairs of each warp's chunk). Also used by :mod:`.moe_router`, which
    scores the router logits into ``le`` itself."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int16, Int32, Uint32

    E, BM, NT = experts, block_m, threads
    NW = NT // 32
    E1 = E + 1  # the experts and the bin of pairs routed elsewhere
    SCANS = -(-E // 32)
    STEPS = [1 << s for s in range(max(E - 1, 1).bit_length() - 1, -1, -1)]  # binary search over E

    def alloc():
        """(le, cntw, cnt, start, end) in shared memory."""
        smem = cutlass.memory.SmemAllocator()
        le = smem.allocate_tensor(Int16, cute.make_layout(capacity), byte_alignment=16)
        cntw = smem.allocate_tensor(Int32, cute.make_layout(NW * E1), byte_alignment=16)  # [warp][expert]
        cnt = smem.allocate_tensor(Int32, cute.make_layout(E1), byte_alignment=16)
        start = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)  # the run's first row
        end = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)  # padded run's end
        return le, cntw, cnt, start, end

    @cute.jit
    def prepare(cntw: cute.Tensor, rows: cute.Tensor, tidx):
        for i in cutlass.range(tidx, NW * E1, NT):
            cntw[i] = Int32(0)
        for i in cutlass.range(tidx, rows.shape[0], NT):
            rows[i] = Int32(-1)

    @cute.jit
    def count(cntw: cute.Tensor, warp, e):
        cute.arch.atomic_add(cntw.iterator + (warp * E1 + e), Int32(1), scope="cta")

    @cute.jit
    def finish(le: cute.Tensor, cntw: cute.Tensor, cnt: cute.Tensor, start: cute.Tensor, end: cute.Tensor, pairs,
               chunk, tidx, counts: cute.Tensor, rows: cute.Tensor, bexp: cute.Tensor, nblk: cute.Tensor):
        warp, lane = tidx // 32, tidx % 32
        max_blocks = bexp.shape[0]
        # 2a: per expert, each warp's offset within the expert, and the expert's total
        for e in cutlass.range(tidx, E1, NT):
            run = Int32(0)
            for w in cutlass.range_constexpr(NW):
                c = cntw[w * E1 + e]
                cntw[w * E1 + e] = run
                run = run + c
            cnt[e] = run
        cute.arch.barrier()
        # 2b: the padded runs' running sum
        if warp == 0:
            carry = Int32(0)
            for s in cutlass.range_constexpr(SCANS):
                i = s * 32 + lane
                c = Int32(0)
                if i < E:
                    c = cnt[i]
                v = (c + (BM - 1)) // BM * BM
                run = v
                for off in cutlass.range_constexpr(5):
                    u = cute.arch.shuffle_sync_up(run, 1 << off)
                    if lane >= (1 << off):
                        run = run + u
                if i < E:
                    end[i] = carry + run
                    start[i] = carry + run - v
                carry = carry + cute.arch.shuffle_sync(run, 31)
        cute.arch.barrier()
        # 3: each pair's row, every warp its chunk in pair order
        lo = warp * chunk
        hi = cutlass.min(lo + chunk, pairs)
        for base in cutlass.range(lo, hi, 32):
            p = base + lane
            e = Int32(E1 + 1) + lane  # past the chunk: a key no pair has
            if p < hi:
                e = Int32(le[p])
            same = cute.arch.match_sync(Uint32(0xFFFFFFFF), e)
            before = cute.arch.popc(same & cute.arch.lanemask_lt())
            row = Int32(0)
            if e < E:
                row = start[e] + cntw[warp * E1 + e]
            cute.arch.sync_warp()
            if e < E:
                rows[row + Int32(before)] = p
                if before == Uint32(0):
                    cntw[warp * E1 + e] = cntw[warp * E1 + e] + Int32(cute.arch.popc(same))
            cute.arch.sync_warp()
        cute.arch.barrier()
        # 4: each block's expert
        total = end[E - 1]
        for b in cutlass.range(tidx, max_blocks, NT):
            s = b * BM
            x = Int32(-1)
            if s < total:
                x = Int32(0)
                for step in cutlass.range_constexpr(len(STEPS)):
                    st = STEPS[step]
                    if x + st <= E - 1:
                        if end[x + st - 1] <= s:
                            x = x + st
            bexp[b] = x
        for i in cutlass.range(tidx, E, NT):
            counts[i] = cnt[i]
        if tidx == 0:
            nblk[0] = total // BM

    return alloc, prepare, count, finish


def _build(experts: int, block_m: int, ids64: bool, mapped: bool):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int16, Int32

    E, NT = experts, THREADS
    alloc, prepare, count, finish = sort_phases(experts, block_m, THREADS, max_pairs(experts))

    @cute.kernel
    def route_kernel(ids: cute.Tensor, emap: cute.Tensor, counts: cute.Tensor, rows: cute.Tensor,
                     bexp: cute.Tensor, nblk: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        warp, lane = tidx // 32, tidx % 32
        pairs = ids.shape[0]
        chunk = (pairs + (WARPS - 1)) // WARPS
        le, cntw, cnt, start, end = alloc()
        prepare(cntw, rows, tidx)
        cute.arch.barrier()
        # 1: local experts and each warp's counts, over its chunk
        for p in cutlass.range(warp * chunk + lane, cutlass.min(warp * chunk + chunk, pairs), 32):
            e = Int32(ids[p])
            if cutlass.const_expr(mapped):
                e = emap[e]
            if (e < 0) | (e >= E):
                e = Int32(E)
            le[p] = Int16(e)
            count(cntw, warp, e)
        cute.arch.barrier()
        finish(le, cntw, cnt, start, end, pairs, chunk, tidx, counts, rows, bexp, nblk)

    @cute.jit
    def launch(ids: cute.Tensor, emap: cute.Tensor, counts: cute.Tensor, rows: cute.Tensor, bexp: cute.Tensor,
               nblk: cute.Tensor, stream):
        route_kernel(ids, emap, counts, rows, bexp, nblk).launch(grid=[1, 1, 1], block=[NT, 1, 1], stream=stream)

    return launch


def _compile_now(experts: int, block_m: int, ids64: bool, mapped: bool):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    fids = make_fake_compact_tensor(cutlass.Int64 if ids64 else cutlass.Int32, (cute.sym_int(),),
                                    assumed_align=8 if ids64 else 4)
    fmap = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    fcounts = make_fake_compact_tensor(cutlass.Int32, (experts,), assumed_align=4)
    frows = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    fbexp = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    fnblk = make_fake_compact_tensor(cutlass.Int32, (1,), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(_build(experts, block_m, ids64, mapped), fids, fmap, fcounts, frows, fbexp, fnblk, stream,
                        options="--enable-tvm-ffi --gpu-arch sm_90a")


def supported(experts: int, pairs: int) -> bool:
    """Whether one CTA takes this call (see :func:`max_pairs`, ``MAX_EXPERTS``)."""
    return 1 <= experts <= MAX_EXPERTS and pairs <= max_pairs(experts)


def compile_kernel(experts: int, block_m: int, ids64: bool, mapped: bool) -> Callable:
    """``run(ids [pairs], emap, counts [E], rows [max_rows], bexp [max_blocks], nblk [1])`` (all
    int32 but ``ids``, int64 when ``ids64``; ``emap``: the expert map, or any int32 tensor when
    not ``mapped``), filling the four outputs on the current stream."""
    from ..kernel_cache import compile_cached

    if not supported(experts, 0):
        raise ValueError(f"the routing kernel takes 1..{MAX_EXPERTS} experts, got {experts}")
    if not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"block_m must be a positive int, got {block_m!r}")
    return compile_cached("moe_route", __name__, (experts, block_m, ids64, mapped),
                          lambda: _compile_now(experts, block_m, ids64, mapped))


def route(ids: torch.Tensor, experts: int, block_m: int, max_rows: int, max_blocks: int,
          expert_map: Optional[torch.Tensor], fn: Callable) -> tuple[torch.Tensor, ...]:
    """``(counts, sorted_rows, block_expert, num_blocks)`` of ``ids`` (flat topk_ids) by ``fn``
    (:func:`compile_kernel` of these sizes)."""
    dev = ids.device
    counts = torch.empty(experts, dtype=torch.int32, device=dev)
    rows = torch.empty(max_rows, dtype=torch.int32, device=dev)
    bexp = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    nblk = torch.empty(1, dtype=torch.int32, device=dev)
    fn(ids, counts if expert_map is None else expert_map, counts, rows, bexp, nblk)
    return counts, rows, bexp, nblk
