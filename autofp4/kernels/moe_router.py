"""MoE routing from router logits in one CuTeDSL kernel (sm_90a): scores, top-k, the router
weights, and the routing metadata the grouped MoE kernels read.

A warp per token (``WARPS`` warps a CTA, the tokens strided over the grid; ``SORT_WARPS`` in the one CTA of a call that sorts): lane ``j`` holds the
logits of experts ``j, j + 32, ...`` in fp32 registers.

* **Scores.** ``"softmax"``: the experts are chosen by their logits (the softmax is monotonic) and
  weighted ``exp(l - l_max)`` over the chosen ones (``renormalize``: divided by their sum, which is
  the softmax over all experts renormalized over the top-k, as Qwen3-MoE and Mixtral compute it,
  and the softmax over the top-k logits, as gpt-oss does) or over every expert (no
  renormalization). ``"sigmoid"`` (DeepSeek-V3): ``s = sigmoid(l)``, chosen by ``s + bias`` (the
  ``e_score_correction_bias``), weighted by ``s`` (``renormalize``: divided by their sum + 1e-20).
  Both are then multiplied by ``scale`` (the ``routed_scaling_factor``).
* **Group-limited top-k** (``n_group > 1``): the experts form ``n_group`` groups of consecutive
  ids; a group's score is the sum of its two best choice values; only the ``topk_group`` best
  groups' experts can be chosen.
* **Top-k**: ``top_k`` rounds of a warp arg-max over (value, expert id), ties to the lower id, so
  the ids come out in descending order of their choice values. A row holding a NaN logit gets
  NaN weights (the caller's check reports it).
* **Metadata** (``meta``): ``"none"``; ``"pairs"``: the block expert of every (token, slot) pair,
  one block per pair (:func:`autofp4.routing.per_pair_routing`: the id, or with an expert map
  its local index, -1 for another rank's expert); ``"sorted"``: the pairs sorted by expert and
  padded per expert to ``block_m`` rows (:func:`autofp4.routing.moe_routing`), built by the CTA
  itself from the local experts its warps leave in shared memory (:func:`.moe_route.sort_phases`),
  so this needs one CTA: at most ``SORT_MAX_TOKENS`` tokens.

Everything is compiled per ``RouterKey``; T is symbolic.
"""

from dataclasses import dataclass
from typing import Callable, Optional

#: warps per CTA (a warp per token): a call with sorted metadata is one CTA of ``SORT_WARPS``
WARPS = 4
SORT_WARPS = 16
#: most experts (logits per row: 32 per lane at most) and most experts chosen per token
MAX_EXPERTS = 1024
MAX_TOP_K = 32
#: most tokens of a call whose sorted routing metadata the kernel builds (one CTA, a token a warp);
#: above it the kernel scores and :mod:`.moe_route` sorts
SORT_MAX_TOKENS = SORT_WARPS
SCORINGS = ("softmax", "sigmoid")
LOGIT_DTYPES = ("float32", "bfloat16", "float16")
METAS = ("none", "pairs", "sorted")
#: added to the sum of the chosen sigmoid scores before renormalizing (as DeepSeek-V3 does)
SIGMOID_EPS = 1e-20


@dataclass(frozen=True)
class RouterKey:
    """What one compiled router kernel is specialized for."""

    experts: int  # logits per token (the global experts)
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    bias: bool = False  # a correction bias [experts] is added to the scores to choose
    dtype: str = "float32"  # the logits' dtype
    meta: str = "none"
    mapped: bool = False  # an expert map turns global ids into local ones (the metadata only)
    local_experts: int = 0  # "sorted": the experts the metadata counts (E, or this rank's)
    block_m: int = 1  # "sorted": the token block

    def problem(self) -> Optional[str]:
        """Why this kernel cannot be built (None if it can)."""
        e, k = self.experts, self.top_k
        if not 1 <= e <= MAX_EXPERTS:
            return f"experts must be in 1..{MAX_EXPERTS}, got {e}"
        if not 1 <= k <= min(e, MAX_TOP_K):
            return f"top_k must be in 1..{min(e, MAX_TOP_K)}, got {k}"
        if self.scoring not in SCORINGS:
            return f"scoring must be one of {SCORINGS}, got {self.scoring!r}"
        if self.dtype not in LOGIT_DTYPES:
            return f"logits must be one of {LOGIT_DTYPES}, got {self.dtype}"
        if self.meta not in METAS:
            return f"meta must be one of {METAS}, got {self.meta!r}"
        g, tg = self.n_group, self.topk_group
        if not (1 <= g <= 32 and e % g == 0 and e // g >= 2 or g == 1):
            return f"n_group must be 1, or divide experts={e} into groups of 2 or more (at most 32 groups), got {g}"
        if not 1 <= tg <= g or tg * (e // g) < k:
            return f"topk_group must be in 1..n_group={g} and leave at least top_k={k} experts, got {tg}"
        if self.meta == "sorted":
            from .moe_route import MAX_EXPERTS as SORT_EXPERTS

            if not 1 <= self.local_experts <= SORT_EXPERTS or self.block_m < 1:
                return f"sorted metadata needs 1..{SORT_EXPERTS} local experts and block_m >= 1"
        return None


def _build(key: RouterKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int16, Int32, Uint32
    from cutlass.cutlass_dsl import T

    from ._moe_act import ex2
    from ._ptx import asm
    from .moe_route import sort_phases

    LOG2E = 1.4426950408889634

    E, K = key.experts, key.top_k
    EPL = -(-E // 32)  # logits per lane
    G, TG = key.n_group, key.topk_group
    GS = E // G
    # groups of whole registers (GS a multiple of 32: DeepSeek-V3's 8 groups of 32): each group's
    # registers, (first, end); else a group is some lanes of registers, found per lane
    REGS = [(g * GS // 32, (g + 1) * GS // 32) for g in range(G)] if G > 1 and GS % 32 == 0 else None
    SIG = key.scoring == "sigmoid"
    META, MAPPED = key.meta, key.mapped
    EL = key.local_experts
    NW = SORT_WARPS if META == "sorted" else WARPS
    NT = 32 * NW
    NEG_INF = float("-inf")
    if META == "sorted":
        alloc, prepare, count, finish = sort_phases(EL, key.block_m, NT, SORT_MAX_TOKENS * K)

    def sel(c, a, b, ty):
        return ty(cutlass.select_(c, ty(a), ty(b)))

    def bfly(v, off, ty):
        return ty(cute.arch.shuffle_sync_bfly(ty(v), offset=off))

    def rcp(v):
        """``1 / v`` (``rcp.approx.ftz.f32``, within 1 ulp)."""
        return Float32(asm(T.f32(), [Float32(v)], "rcp.approx.ftz.f32 $0, $1;", "=f,f"))

    def ordered(v):
        """fp32 ``v`` as a uint32 key of the same order (sign-magnitude to offset binary)."""
        bits = Uint32(asm(T.i32(), [Float32(v)], "mov.b32 $0, $1;", "=r,f"))
        return bits ^ (Uint32(Int32(bits) >> 31) | Uint32(0x80000000))

    def unordered(key):
        """The fp32 value of an :func:`ordered` key."""
        bits = key ^ (Uint32(Int32(~key) >> 31) | Uint32(0x80000000))
        return Float32(asm(T.f32(), [Uint32(bits)], "mov.b32 $0, $1;", "=f,r"))

    @cute.jit
    def local_expert(emap: cute.Tensor, e):
        """The metadata's expert of global expert ``e``: its local index (-1: another rank's)."""
        le = e
        if cutlass.const_expr(MAPPED):
            le = emap[e]
        return le

    @cute.kernel
    def router_kernel(logits: cute.Tensor, bias: cute.Tensor, emap: cute.Tensor, w_out: cute.Tensor,
                      id_out: cute.Tensor, counts: cute.Tensor, rows: cute.Tensor, bexp: cute.Tensor,
                      nblk: cute.Tensor, scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        gx, _, _ = cute.arch.grid_dim()
        warp, lane = tidx // 32, tidx % 32
        tokens = logits.shape[0]
        if cutlass.const_expr(META == "sorted"):
            le, cntw, cnt, start, end = alloc()
            prepare(cntw, rows, tidx)
            cute.arch.barrier()
        choice = cute.make_rmem_tensor((EPL,), Float32)  # what the experts are chosen by
        score = cute.make_rmem_tensor((EPL,), Float32)  # what the chosen are weighted by
        sel_id = cute.make_rmem_tensor((K,), Int32)
        sel_w = cute.make_rmem_tensor((K,), Float32)
        for t in cutlass.range(bx * NW + warp, tokens, gx * NW, unroll=1):
            bad = Int32(0)
            for i in cutlass.range_constexpr(EPL):
                e = lane + 32 * i
                v = Float32(NEG_INF)
                if e < E:
                    v = logits[t, e].to(Float32)
                bad = bad | Int32(v != v)
                s = v
                c = v
                if cutlass.const_expr(SIG):
                    s = rcp(Float32(1.0) + ex2(v * Float32(-LOG2E)))
                    c = s
                    if cutlass.const_expr(key.bias):
                        if e < E:
                            c = s + bias[e]
                    if e >= E:
                        c = Float32(NEG_INF)
                choice[i] = c
                score[i] = s
            allowed = Uint32(0xFFFFFFFF)  # bit g: group g may be chosen
            if cutlass.const_expr(G > 1):
                gsc = []
                for g in cutlass.range_constexpr(G):
                    b1 = Float32(NEG_INF)
                    b2 = Float32(NEG_INF)
                    for i in cutlass.range_constexpr(*(REGS[g] if REGS else (EPL,))):
                        v = choice[i]
                        if cutlass.const_expr(not REGS):  # a group's experts are some lanes of this register
                            e = lane + 32 * i
                            v = sel((e >= g * GS) & (e < (g + 1) * GS), choice[i], NEG_INF, Float32)
                        n1 = cutlass.max(b1, v)
                        b2 = cutlass.max(b2, cutlass.min(b1, v))
                        b1 = n1
                    for o in cutlass.range_constexpr(5):
                        o1 = bfly(b1, 1 << o, Float32)
                        o2 = bfly(b2, 1 << o, Float32)
                        n1 = cutlass.max(b1, o1)
                        b2 = cutlass.max(cutlass.min(b1, o1), cutlass.max(b2, o2))
                        b1 = n1
                    gsc.append(b1 + b2)
                allowed = Uint32(0)
                for r in cutlass.range_constexpr(TG):
                    gbest = Float32(NEG_INF)
                    bg = Int32(G)
                    for g in cutlass.range_constexpr(G):
                        free = ((allowed >> Uint32(g)) & Uint32(1)) == Uint32(0)
                        better = free & ((bg == G) | (gsc[g] > gbest))
                        gbest = sel(better, gsc[g], gbest, Float32)
                        bg = sel(better, Int32(g), bg, Int32)
                    allowed = allowed | (Uint32(1) << Uint32(bg))
            # top-k: per round a warp arg-max of ordered keys (redux.sync), ties to the lower id
            keys = cute.make_rmem_tensor((EPL,), Uint32)  # 0: not a candidate
            for i in cutlass.range_constexpr(EPL):
                e = lane + 32 * i
                ok = e < E
                if cutlass.const_expr(G > 1):
                    grp = Uint32(32 * i // GS) if cutlass.const_expr(REGS) else Uint32(e // GS)
                    ok = ok & (((allowed >> grp) & Uint32(1)) == Uint32(1))
                keys[i] = sel(ok, ordered(choice[i]), 0, Uint32)
            for r in cutlass.range_constexpr(K):
                lb = Uint32(0)
                li = Int32(0)
                for i in cutlass.range_constexpr(EPL):
                    better = keys[i] > lb
                    lb = sel(better, keys[i], lb, Uint32)
                    li = sel(better, Int32(i), li, Int32)
                best = cute.arch.warp_redux_sync(lb, "umax")
                win = cute.arch.warp_redux_sync(sel(lb == best, Uint32(lane + 32 * li), 0xFFFFFFFF, Uint32), "umin")
                for i in cutlass.range_constexpr(EPL):
                    keys[i] = sel(win == Uint32(lane + 32 * i), 0, keys[i], Uint32)
                sel_id[r] = Int32(win)
                if cutlass.const_expr(SIG):  # the chosen expert's score, from the lane that holds it
                    mine = Float32(0.0)
                    for i in cutlass.range_constexpr(EPL):
                        mine = sel(win == Uint32(lane + 32 * i), score[i], mine, Float32)
                    sel_w[r] = Float32(cute.arch.shuffle_sync(mine, Int32(win) % 32))
                else:
                    sel_w[r] = unordered(best)
            # the weights
            total = Float32(0.0)
            if cutlass.const_expr(not SIG):
                top = sel_w[0]
                for r in cutlass.range_constexpr(K):
                    sel_w[r] = ex2((sel_w[r] - top) * Float32(LOG2E))
                if cutlass.const_expr(key.renormalize):
                    for r in cutlass.range_constexpr(K):
                        total = total + sel_w[r]
                else:
                    part = Float32(0.0)
                    for i in cutlass.range_constexpr(EPL):
                        if lane + 32 * i < E:
                            part = part + ex2((choice[i] - top) * Float32(LOG2E))
                    for o in cutlass.range_constexpr(5):
                        part = part + bfly(part, 1 << o, Float32)
                    total = part
            elif cutlass.const_expr(key.renormalize):
                for r in cutlass.range_constexpr(K):
                    total = total + sel_w[r]
                total = total + Float32(SIGMOID_EPS)
            else:
                total = Float32(1.0)
            if cute.arch.vote_any_sync(bad != 0):
                total = Float32(float("nan"))
            f = scale / total
            for r in cutlass.range_constexpr(K):
                if lane == r:
                    p = t * K + r
                    w_out[p] = sel_w[r] * f
                    id_out[p] = sel_id[r]
                    if cutlass.const_expr(META == "pairs"):
                        bexp[p] = local_expert(emap, sel_id[r])
                    if cutlass.const_expr(META == "sorted"):
                        x = local_expert(emap, sel_id[r])
                        if (x < 0) | (x >= EL):
                            x = Int32(EL)
                        le[p] = Int16(x)
                        count(cntw, warp, x)  # warp w's chunk: token w's pairs
        if cutlass.const_expr(META == "sorted"):
            cute.arch.barrier()
            finish(le, cntw, cnt, start, end, tokens * K, K, tidx, counts, rows, bexp, nblk)

    @cute.jit
    def launch(logits: cute.Tensor, bias: cute.Tensor, emap: cute.Tensor, w_out: cute.Tensor, id_out: cute.Tensor,
               counts: cute.Tensor, rows: cute.Tensor, bexp: cute.Tensor, nblk: cute.Tensor, scale: Float32,
               ctas: Int32, stream):
        router_kernel(logits, bias, emap, w_out, id_out, counts, rows, bexp, nblk, scale).launch(
            grid=[ctas, 1, 1], block=[NT, 1, 1], stream=stream)

    return launch


def _compile_now(key: RouterKey):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    dt = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[key.dtype]
    t = cute.sym_int()

    def vec(ty, n=None):
        return make_fake_compact_tensor(ty, (cute.sym_int() if n is None else n,), assumed_align=4)

    flogits = make_fake_compact_tensor(dt, (t, key.experts), stride_order=(1, 0), assumed_align=4 if
                                       key.dtype == "float32" else 2)
    args = (flogits, vec(cutlass.Float32), vec(cutlass.Int32), vec(cutlass.Float32), vec(cutlass.Int32),
            vec(cutlass.Int32), vec(cutlass.Int32), vec(cutlass.Int32), vec(cutlass.Int32, 1))
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(_build(key), *args, 1.0, 1, stream, options="--enable-tvm-ffi --gpu-arch sm_90a")


def compile_kernel(key: RouterKey) -> Callable:
    """``run(logits [T, E], bias, emap, w [T*k], ids [T*k], counts, rows, bexp, nblk, scale, ctas)``
    on the current stream (tensors the key does not use: any 1-element ones of their dtype)."""
    from ..kernel_cache import compile_cached

    why = key.problem()
    if why:
        raise ValueError(f"the router kernel cannot take {key}: {why}")
    return compile_cached("moe_router", __name__, key, lambda: _compile_now(key))


def ctas_for(tokens: int, meta: str) -> int:
    """The grid of a call: one CTA for sorted metadata, else one per ``WARPS`` tokens."""
    if meta == "sorted":
        return 1
    return max(1, -(-tokens // WARPS))
