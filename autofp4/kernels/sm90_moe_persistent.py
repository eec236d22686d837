"""Hopper (sm_90a) persistent grouped W4A16 GEMM for the MoE layer at prefill.

The same data path per tile as the grouped GEMM of :mod:`.sm90_moe_gemm` (the FP4 weight decoded
into the ``wgmma`` register operand, ``x`` by TMA into the shared-memory operand, one
``stages``-deep mbarrier ring), but each CTA walks a list of work units instead of computing one:

* the work is the flat list of (token block, weight tile) pairs of the used blocks, block-major
  (``num_blocks * n_tiles`` units, the count read on the device from the routing's
  ``num_blocks``); CTA ``b`` of a grid of about one CTA per SM takes units ``b, b + grid, ...``,
  so CTAs that run at the same time share a token block's x tile and an expert's weight in L2;
* a dedicated producer warp streams the stages of every unit back to back: the ring does not
  drain between units, so the next unit's K tiles load while the consumer warpgroups finish the
  current one's wgmmas and run its epilogue (on short-K GEMMs, such as a small expert's down
  projection with K = 768, the fill and the epilogue were a large part of a one-tile CTA);
* ``fused_sum`` (the down GEMM): instead of writing each (token, slot) pair's weighted expert
  output to ``y [T * top_k, H]`` and summing the top-k slots in a second pass, the epilogue adds
  it into an fp32 ``out [T, H]`` with vector reductions (``red.global.add.v2.f32``); the caller
  zeroes ``out`` and rounds it to the activation dtype. The sum's order varies between runs (fp32
  atomics): results agree to fp32 rounding, not bit for bit.

The tile's data layout, the decode and the epilogue's fragment walk are those documented in
:mod:`.sm90_w4a16_gemm`, whose kernel traces them inline: this module repeats that decode loop
and fragment walk rather than moving them into shared helpers, because any edit of that module
retires its 165 tuned rows (dense GEMM and grouped MoE) unless every compiled kernel is proven
byte-identical; share them when those rows are next re-tuned.
"""
from __future__ import annotations

from typing import Any

from . import sm90_w4a16_gemm as G
from ._fp4_bits import decode_terms

try:  # CuTeDSL is an optional dependency; annotations of the jit functions resolve here
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
except ImportError:  # pragma: no cover - exercised only without nvidia-cutlass-dsl
    cuda = cutlass = cute = None  # type: ignore[assignment]


class PersistentMoEKernel:
    """One compiled grouped GEMM (``kind`` "up" with ``act``, or "down") for (config, N, K, fmt,
    dtype). ``cfg`` has the grouped GEMM's tile fields (``tile_n``, ``tile_m``, ``tile_k``,
    ``stages``, ``scale_select``, ``ctas_per_sm``); a producer warp is always used."""

    def __init__(self, cfg: Any, n: int, k: int, fmt: str, dtype: str, kind: str, act: Any = None,
                 bias: bool = False, fused_sum: bool = False):
        self.cfg = cfg
        self.n, self.k, self.fmt, self.dtype = n, k, fmt, dtype
        self.kind, self.act, self.bias, self.fused_sum = kind, act, bias, fused_sum and kind == "down"
        self.np_, self.kp = G._pad(n), G._pad(k)
        self.chunk = G.chunk_bytes(fmt)
        self.num_wg = min(cfg.tile_n // G.CHUNK_N, 2)
        self.reps = cfg.tile_n // G.CHUNK_N // self.num_wg
        self.cons_threads = 128 * self.num_wg
        self.threads = self.cons_threads + 32
        self.kc_per_tile = cfg.tile_k // G.CHUNK_K
        self.w_stage_bytes = (cfg.tile_n // G.CHUNK_N) * self.kc_per_tile * self.chunk
        self.k_tiles = self.kp // cfg.tile_k
        self.terms = decode_terms(dtype)

    def build(self):
        import cutlass
        import cutlass.cute as cute
        import cutlass.pipeline as pipeline
        import cutlass.utils as utils
        import cutlass.utils.hopper_helpers as sm90_utils
        from cutlass.cute.nvgpu import cpasync, warpgroup
        from cutlass.cutlass_dsl import T

        from ._ptx import asm, asm_void, decode_pair, griddep_launch_dependents, griddep_wait, mul_x2, prmt

        cfg = self.cfg
        CHUNK_N, CHUNK_K = G.CHUNK_N, G.CHUNK_K
        dt = cutlass.BFloat16 if self.dtype == "bfloat16" else cutlass.Float16
        is_bf16 = dt is cutlass.BFloat16
        is_nv = self.fmt == "nvfp4"
        tile_n, tile_m, tile_k, stages = cfg.tile_n, cfg.tile_m, cfg.tile_k, cfg.stages
        reps, threads, cons_threads = self.reps, self.threads, self.cons_threads
        cons_warps = cons_threads // 32
        load_warp = cons_warps
        kc_per_tile, chunk = self.kc_per_tile, self.chunk
        s_words = G._scale_words(self.fmt)
        n_real, np_ = self.n, self.np_
        nkc_total = self.kp // CHUNK_K
        w_stage_bytes = self.w_stage_bytes
        w_copy_bytes = kc_per_tile * chunk
        nb_per_cta = tile_n // CHUNK_N
        k_tiles = self.k_tiles
        n_tiles = np_ // tile_n
        terms = self.terms
        tx_bytes = tile_m * tile_k * 2 + w_stage_bytes
        scale_select = cfg.scale_select
        kind, act, has_bias, fused = self.kind, self.act, self.bias, self.fused_sum
        # two CTAs per SM: asked of the compiler (registers), the carveout given so that it needs no device query
        occupancy = ({"min_blocks_per_mp": cfg.ctas_per_sm, "preferred_smem_carveout": -1}
                     if cfg.ctas_per_sm else {})
        inter = n_real // 2
        mul_op = "mul.rn.bf16x2" if is_bf16 else "mul.rn.f16x2"
        cvt_x2 = "cvt.rn.bf16x2.f32" if is_bf16 else "cvt.rn.f16x2.f32"

        def mul_half(v, sw, hi: int):
            """``v`` times the low (``hi=0``) or high half of ``sw`` in both lanes."""
            h = "h, h" if hi else "l, l"
            return cutlass.Uint32(asm(
                T.i32(), [cutlass.Uint32(v), cutlass.Uint32(sw)],
                f"{{ .reg .b16 l, h; .reg .b32 s; mov.b32 {{l, h}}, $2; mov.b32 s, {{{h}}}; {mul_op} $0, $1, s; }}",
                "=r,r,r"))

        def st_x2(addr, lo, hi):
            """(lo, hi) rounded to the output dtype at ``addr``, one 4-byte store."""
            asm_void("{ .reg .b32 p; " + cvt_x2 + " p, $2, $1; st.global.b32 [$0], p; }", "l,f,f",
                     cutlass.Int64(addr), cutlass.Float32(lo), cutlass.Float32(hi))

        def red_x2(addr, lo, hi):
            """fp32 ``out[addr], out[addr + 4] += lo, hi``: one 8-byte vector reduction."""
            asm_void("red.global.add.v2.f32 [$0], {$1, $2};", "l,f,f",
                     cutlass.Int64(addr), cutlass.Float32(lo), cutlass.Float32(hi))

        def gate_row(p):
            """The output of the up GEMM's interleaved weight row ``p = 16 q + s`` (s < 8): 8 q + s."""
            return p // 16 * 8 + p % 16

        @cute.kernel
        def kernel(
            tma_atom_x: cute.CopyAtom,
            mX: cute.Tensor,
            mW: cute.Tensor,
            mAlpha: cute.Tensor,
            mBias: cute.Tensor,
            mOut: cute.Tensor,
            tiled_mma: cute.TiledMma,
            x_smem_layout_staged: cute.ComposedLayout,
            mBlockExpert: cute.Tensor,
            mRows: cute.Tensor,
            mTopkW: cute.Tensor,
            mNumBlocks: cute.Tensor,
            top_k: cutlass.Int32,
        ):
            tidx, _, _ = cute.arch.thread_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            bidx, _, _ = cute.arch.block_idx()
            grid, _, _ = cute.arch.grid_dim()
            if warp_idx == load_warp:
                cpasync.prefetch_descriptor(tma_atom_x)

            x_dt = dt  # (named in the body: the class below is traced with the body's names)

            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, stages * 2]
                sX: cute.struct.Align[cute.struct.MemRange[x_dt, cute.cosize(x_smem_layout_staged)], 1024]
                sW: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, w_stage_bytes * stages], 1024]

            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sX = storage.sX.get_tensor(x_smem_layout_staged.outer, swizzle=x_smem_layout_staged.inner)
            sW = storage.sW.get_tensor(cute.make_layout((w_stage_bytes, stages)))
            n_chunks_stage = nb_per_cta * kc_per_tile
            sWv = cute.make_tensor(
                cute.recast_ptr(storage.sW.data_ptr(), dtype=cutlass.Uint32),
                cute.make_layout((4, 128, n_chunks_stage, stages),
                                 stride=(1, 4, chunk // 4, w_stage_bytes // 4)),
            )
            sSv = cute.make_tensor(
                cute.recast_ptr(storage.sW.data_ptr(), dtype=cutlass.Uint32) + G.VALUE_BYTES // 4,
                cute.make_layout((s_words, 32, n_chunks_stage, stages),
                                 stride=(1, s_words, chunk // 4, w_stage_bytes // 4)),
            )
            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(),
                num_stages=stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, cons_warps),
                tx_count=tx_bytes,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            )
            # x tiles: (tile_m, tile_k, token blocks, K tiles)
            gX = cute.local_tile(mX, (tile_m, tile_k), (None, None))
            tXsX, tXgX = cpasync.tma_partition(
                tma_atom_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
            bulk_atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), cutlass.Uint8,
                                            num_bits_per_copy=w_copy_bytes * 8)

            wg = cute.arch.make_warp_uniform(tidx // 128)
            wtid = tidx % 128
            thr_mma = tiled_mma.get_slice(wtid)
            tCsB = thr_mma.partition_B(sX)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((CHUNK_N * reps, tile_m)), cutlass.Float32)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            a_shape = thr_mma.partition_shape_A((CHUNK_N * reps, tile_k))
            rAs = [tiled_mma.make_fragment_A(a_shape), tiled_mma.make_fragment_A(a_shape)]
            wregs = cute.make_rmem_tensor(cute.make_layout((4, reps)), cutlass.Uint32)
            swords = cute.make_rmem_tensor(cute.make_layout((s_words, reps)), cutlass.Uint32)
            lane_q = wtid // 4
            cid = cute.make_identity_tensor((CHUNK_N * reps, tile_m))
            tcid = thr_mma.partition_C(cid)
            n_acc = cute.size(acc)

            prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
            cons_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            rel_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)

            griddep_wait()  # the routing metadata comes from the previous kernels of the stream
            n_work = mNumBlocks[0] * n_tiles

            if warp_idx == load_warp:
                # ---- the producer: every K tile of every unit, back to back
                for unit in cutlass.range(bidx, n_work, grid, unroll=1):
                    pid_m = unit // n_tiles
                    pid_n = unit - pid_m * n_tiles
                    n_row0 = pid_n * nb_per_cta + mBlockExpert[pid_m] * (np_ // CHUNK_N)
                    for kt in cutlass.range(k_tiles, unroll=1):
                        pipe.producer_acquire(prod_state)
                        bar = pipe.producer_get_barrier(prod_state)
                        cute.copy(tma_atom_x, tXgX[(None, pid_m, kt)], tXsX[(None, prod_state.index)],
                                  tma_bar_ptr=bar)
                        with cute.arch.elect_one():
                            for b in range(nb_per_cta):
                                goff = (cutlass.Int64(n_row0 + b) * nkc_total + kt * kc_per_tile) * chunk
                                src = cute.make_tensor(mW.iterator + goff, cute.make_layout((w_copy_bytes,)))
                                dst = cute.make_tensor(sW[(None, prod_state.index)].iterator + b * w_copy_bytes,
                                                       cute.make_layout((w_copy_bytes,)))
                                cute.copy(bulk_atom, src, dst, mbar_ptr=bar)
                        pipe.producer_commit(prod_state)
                        prod_state.advance()

            if warp_idx < cons_warps:
                lane_odd = (tidx // 4) % 2
                r0, c0 = tcid[0]
                for unit in cutlass.range(bidx, n_work, grid, unroll=1):
                    pid_m = unit // n_tiles
                    pid_n = unit - pid_m * n_tiles
                    expert = mBlockExpert[pid_m]
                    acc.fill(0.0)
                    # ---- main loop: decode K tile t into A buffer t % 2 and issue its wgmmas,
                    # then wait for tile t-1's and release its stage
                    for kt2 in cutlass.range((k_tiles + 1) // 2, unroll=1):
                        for buf in cutlass.range_constexpr(2):
                            t_cur = kt2 * 2 + buf
                            if t_cur < k_tiles:
                                rA = rAs[buf]
                                rA32 = cute.make_tensor(cute.recast_ptr(rA.iterator, dtype=cutlass.Uint32),
                                                        cute.make_layout((4, reps, tile_k // 16)))
                                pipe.consumer_wait(cons_state)
                                for kc in cutlass.range_constexpr(kc_per_tile):
                                    for r in cutlass.range_constexpr(reps):
                                        cidx = (wg * reps + r) * kc_per_tile + kc
                                        cute.autovec_copy(sWv[(None, wtid, cidx, cons_state.index)], wregs[(None, r)])
                                        cute.autovec_copy(sSv[(None, lane_q, cidx, cons_state.index)],
                                                          swords[(None, r)])
                                    for st in cutlass.range_constexpr(4):
                                        kb = kc * 4 + st
                                        for r in cutlass.range_constexpr(reps):
                                            sw = swords[st if is_nv else st // 2, r]
                                            if cutlass.const_expr(not is_bf16):
                                                sw = sw * cutlass.Uint32(8) + cutlass.Uint32(G.FP16_FROM_BF16)
                                            word = wregs[st, r]
                                            if cutlass.const_expr(not scale_select):
                                                s_pair = (prmt(sw, 0x1010), prmt(sw, 0x3232))
                                            for j in cutlass.range_constexpr(4):
                                                v = decode_pair(word, terms[j])
                                                if cutlass.const_expr(scale_select):
                                                    rA32[j, r, kb] = mul_half(v, sw, j % 2)
                                                else:
                                                    rA32[j, r, kb] = mul_x2(v, s_pair[j % 2], is_bf16)
                                    cute.nvgpu.warpgroup.fence()
                                    for st in cutlass.range_constexpr(4):
                                        cute.gemm(tiled_mma, acc, rA[(None, None, kc * 4 + st)],
                                                  tCrB[(None, None, kc * 4 + st, cons_state.index)], acc)
                                cute.nvgpu.warpgroup.commit_group()
                                cons_state.advance()
                                cute.nvgpu.warpgroup.wait_group(1)
                                if t_cur > 0:
                                    pipe.consumer_release(rel_state)
                                    rel_state.advance()
                    cute.nvgpu.warpgroup.wait_group(0)
                    pipe.consumer_release(rel_state)  # the unit's last stage
                    rel_state.advance()

                    # ---- epilogue (the fragment walk of sm90_w4a16_gemm): thread pairs 4 lanes
                    # apart trade a column so each stores two consecutive n of one m
                    alpha = mAlpha[expert]
                    row0 = pid_n * tile_n + wg * (reps * CHUNK_N)
                    col0 = pid_m * tile_m
                    for i in cutlass.range_constexpr(0, n_acc, 2):
                        h = i // 2 % 2
                        rep = i // (tile_m // 2)
                        if cutlass.const_expr(kind != "up" or h == 0):
                            t0 = acc[i] * alpha
                            t1 = acc[i + 1] * alpha
                            col = col0 + c0 + i // 4 % (tile_m // 8) * 8
                            if cutlass.const_expr(kind == "up"):
                                u0, u1 = acc[i + 2] * alpha, acc[i + 3] * alpha
                                if cutlass.const_expr(has_bias):  # bias [E, 2I]: gate j, up I + j
                                    jb = expert * n_real + cutlass.min(gate_row(row0 + r0 + CHUNK_N * rep), inter - 1)
                                    bg, bu = mBias[jb], mBias[jb + inter]
                                    t0, t1, u0, u1 = t0 + bg, t1 + bg, u0 + bu, u1 + bu
                                v0 = act(t0, u0)
                                v1 = act(t1, u1)
                            else:  # "down": (+ bias [E, H]) times the router weight of the column's pair
                                if cutlass.const_expr(has_bias):
                                    bn = mBias[expert * n_real + cutlass.min(row0 + r0 + 8 * h + CHUNK_N * rep,
                                                                             n_real - 1)]
                                    t0, t1 = t0 + bn, t1 + bn
                                v0 = t0 * mTopkW[cutlass.max(mRows[col], 0)]
                                v1 = t1 * mTopkW[cutlass.max(mRows[col + 1], 0)]
                            send = v1
                            if lane_odd == 1:
                                send = v0
                            got = cute.arch.shuffle_sync_bfly(send, offset=4)
                            lo = v0
                            hi = got
                            if lane_odd == 1:
                                lo = got
                                hi = v1
                            nn = row0 + r0 + 8 * h + CHUNK_N * rep - lane_odd
                            mm = col0 + c0 + i // 4 % (tile_m // 8) * 8 + lane_odd
                            base = mOut.iterator.toint()
                            if cutlass.const_expr(kind == "up"):
                                j = gate_row(nn)
                                if j < inter:
                                    st_x2(base + cutlass.Int64(mm * inter + j) * 2, lo, hi)
                            else:
                                pair = mRows[mm]
                                if nn < n_real and pair >= 0:
                                    if cutlass.const_expr(fused):
                                        red_x2(base + (cutlass.Int64(pair // top_k) * n_real + nn) * 4, lo, hi)
                                    else:
                                        st_x2(base + (cutlass.Int64(pair) * n_real + nn) * 2, lo, hi)
            griddep_launch_dependents()

        def operands(mX: cute.Tensor):
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, cutlass.Float32,
                (1, 1, 1), tiler_mn=(CHUNK_N, tile_m), a_source=warpgroup.OperandSource.RMEM)
            x_smem_layout_staged = sm90_utils.make_smem_layout_b(
                utils.LayoutEnum.ROW_MAJOR, (CHUNK_N, tile_m, tile_k), dt, stages)
            x_smem_one = cute.slice_(x_smem_layout_staged, (None, None, 0))
            tma_atom_x, tma_x = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), mX, x_smem_one, (tile_m, tile_k))
            return tiled_mma, x_smem_layout_staged, tma_atom_x, tma_x

        @cute.jit
        def host(
            mX: cute.Tensor,
            mW: cute.Tensor,
            mAlpha: cute.Tensor,
            mBias: cute.Tensor,
            mOut: cute.Tensor,
            mBlockExpert: cute.Tensor,
            mRows: cute.Tensor,
            mTopkW: cute.Tensor,
            mNumBlocks: cute.Tensor,
            top_k: cutlass.Int32,
            ctas: cutlass.Int32,
            use_pdl: cutlass.Int32,
            stream: cuda.CUstream,
        ):
            tiled_mma, x_smem_layout_staged, tma_atom_x, tma_x = operands(mX)
            kernel(
                tma_atom_x, tma_x, mW, mAlpha, mBias, mOut, tiled_mma, x_smem_layout_staged,
                mBlockExpert, mRows, mTopkW, mNumBlocks, top_k,
            ).launch(grid=(ctas, 1, 1), block=[threads, 1, 1], stream=stream, use_pdl=use_pdl, **occupancy)

        return host

    def fake_args(self):
        """x [rows, K] (sorted rows), every expert's packed weight, alpha [E], bias (fp32, flat;
        read only by a kernel built with it), out ("up": h [rows, N / 2]; "down": y [pairs, N],
        or with ``fused_sum`` fp32 [T, N]), block_expert [blocks], sorted_rows [rows],
        topk_weights [pairs] (fp32), num_blocks [1], top_k, the grid size, the PDL flag, stream."""
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

        dt = cutlass.BFloat16 if self.dtype == "bfloat16" else cutlass.Float16
        e, rows, blocks, pairs = (cute.sym_int32() for _ in range(4))
        x = make_fake_compact_tensor(dt, (rows, self.k), stride_order=(1, 0), assumed_align=16)
        w = make_fake_compact_tensor(
            cutlass.Uint8, (e * (self.np_ // G.CHUNK_N * (self.kp // G.CHUNK_K) * self.chunk),), assumed_align=16)
        alpha = make_fake_compact_tensor(cutlass.Float32, (e,), assumed_align=4)
        bias = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int32(),), assumed_align=4)
        if self.kind == "up":
            out = make_fake_compact_tensor(dt, (rows, self.n // 2), stride_order=(1, 0), assumed_align=4)
        elif self.fused_sum:
            out = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int32(), self.n), stride_order=(1, 0),
                                           assumed_align=8)
        else:
            out = make_fake_compact_tensor(dt, (pairs, self.n), stride_order=(1, 0), assumed_align=4)
        bexp = make_fake_compact_tensor(cutlass.Int32, (blocks,), assumed_align=4)
        srows = make_fake_compact_tensor(cutlass.Int32, (rows,), assumed_align=4)
        tw = make_fake_compact_tensor(cutlass.Float32, (pairs,), assumed_align=4)
        nblk = make_fake_compact_tensor(cutlass.Int32, (1,), assumed_align=4)
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        return x, w, alpha, bias, out, bexp, srows, tw, nblk, 1, 1, 1, stream
