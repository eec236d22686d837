"""MoE routing metadata (autofp4.routing) against a plain-Python reference, on fresh random
routings: ragged counts, experts that get no pair, one expert that gets every pair, top-k 1..8,
expert-parallel slices; fixed sizes; traceable without graph breaks."""
import os
import random

import pytest
import torch

from autofp4.routing import moe_routing, per_pair_routing, rank_expert_map, routing_sizes

SEED = int.from_bytes(os.urandom(4), "little")


def reference(ids: list[list[int]], experts: int, block_m: int, expert_map=None):
    """Per local expert, its pairs (flat index t * top_k + j) in token order; then the padded
    rows and the expert of each block."""
    top_k = len(ids[0]) if ids else 0
    per = [[] for _ in range(experts)]
    for t, row in enumerate(ids):
        for j, e in enumerate(row):
            le = e if expert_map is None else expert_map[e]
            if le >= 0:
                per[le].append(t * top_k + j)
    rows, blocks = [], []
    for e, pairs in enumerate(per):
        n = -(-len(pairs) // block_m) * block_m
        rows += pairs + [-1] * (n - len(pairs))
        blocks += [e] * (n // block_m)
    return [len(p) for p in per], rows, blocks


def _ids(rng: random.Random, t: int, k: int, e_global: int, mode: str) -> list[list[int]]:
    if mode == "one_hot":  # every pair to the same expert (top-k distinct per token is not required)
        hot = rng.randrange(e_global)
        return [[hot] + rng.sample([x for x in range(e_global) if x != hot], k - 1) for _ in range(t)]
    if mode == "skewed":  # a few hot experts
        hot = rng.sample(range(e_global), max(1, e_global // 8))
        out = []
        for _ in range(t):
            pool = list(dict.fromkeys(rng.sample(hot, min(k, len(hot))) + rng.sample(range(e_global), k)))
            out.append(pool[:k])
        return out
    return [rng.sample(range(e_global), k) for _ in range(t)]


CASES = [(t, k, e, bm, mode) for (t, k, e) in [(1, 1, 4), (1, 8, 128), (3, 2, 8), (16, 4, 64), (64, 8, 16),
                                                (257, 2, 8), (1000, 8, 256)]
         for bm in (1, 8, 16, 64) for mode in ("uniform", "skewed", "one_hot")]


@pytest.mark.parametrize("t,k,e,bm,mode", CASES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_routing_matches_the_reference(t, k, e, bm, mode, dtype):
    rng = random.Random(SEED + t * 7 + k * 13 + e + bm)
    ids = _ids(rng, t, k, e, mode)
    r = moe_routing(torch.tensor(ids, dtype=dtype), e, bm)
    counts, rows, blocks = reference(ids, e, bm)
    max_rows, max_blocks = routing_sizes(t * k, e, bm)
    assert r.counts.tolist() == counts and sum(counts) == t * k
    assert r.sorted_rows.shape == (max_rows,) and r.block_expert.shape == (max_blocks,)
    assert r.sorted_rows.tolist() == rows + [-1] * (max_rows - len(rows))
    assert r.block_expert.tolist() == blocks + [-1] * (max_blocks - len(blocks))
    assert r.num_blocks.tolist() == [len(blocks)]
    assert all(x.dtype == torch.int32 for x in (r.counts, r.sorted_rows, r.block_expert, r.num_blocks))
    # each used block's rows all go to its expert
    flat = [x for row in ids for x in row]
    for b, be in enumerate(r.block_expert.tolist()[: len(blocks)]):
        got = [flat[i] for i in r.sorted_rows[b * bm:(b + 1) * bm].tolist() if i >= 0]
        assert got and all(x == be for x in got)


@pytest.mark.parametrize("t,k,e_global,ranks", [(1, 8, 256, 8), (33, 8, 256, 8), (200, 2, 8, 2), (5, 4, 16, 16)])
def test_expert_parallel_slices_skip_pairs_routed_elsewhere(t, k, e_global, ranks):
    rng = random.Random(SEED + t + e_global)
    ids = _ids(rng, t, k, e_global, "uniform")
    per = e_global // ranks
    seen = 0
    for rank in range(ranks):
        emap = [g - rank * per if rank * per <= g < (rank + 1) * per else -1 for g in range(e_global)]
        r = moe_routing(torch.tensor(ids), per, 8, expert_map=torch.tensor(emap, dtype=torch.int32))
        counts, rows, blocks = reference(ids, per, 8, emap)
        assert r.counts.tolist() == counts
        assert r.sorted_rows.tolist()[: len(rows)] == rows and set(r.sorted_rows.tolist()[len(rows):]) <= {-1}
        assert r.block_expert.tolist()[: len(blocks)] == blocks
        seen += sum(counts)
    assert seen == t * k  # every pair is on exactly one rank


def test_sizes_depend_on_the_shapes_only():
    a = moe_routing(torch.zeros(10, 2, dtype=torch.int32), 8, 16)  # every pair to expert 0
    b = moe_routing(torch.arange(20, dtype=torch.int32).reshape(10, 2) % 8, 8, 16)
    assert a.sorted_rows.shape == b.sorted_rows.shape and a.block_expert.shape == b.block_expert.shape
    assert routing_sizes(20, 8, 16) == (144, 9)
    assert a.num_blocks.tolist() == [2] and b.num_blocks.tolist() == [8]


def test_traces_without_graph_breaks():
    fn = torch.compile(lambda ids: moe_routing(ids, 16, 8).sorted_rows, backend="eager", fullgraph=True)
    ids = torch.randint(0, 16, (12, 4), generator=torch.Generator().manual_seed(SEED))
    want = moe_routing(ids, 16, 8).sorted_rows
    assert torch.equal(fn(ids), want)


@pytest.mark.parametrize("t,k,e,bm", [(1, 8, 128, 8), (3, 2, 8, 16), (5, 4, 64, 8)])
def test_per_pair_routing_gives_each_pair_its_own_block(t, k, e, bm):
    ids = torch.randint(0, e, (t, k), generator=torch.Generator().manual_seed(SEED + t), dtype=torch.int32)
    r = per_pair_routing(ids, e, bm)
    rows = r.sorted_rows.view(t * k, bm)
    assert rows[:, 0].tolist() == list(range(t * k)) and set(rows[:, 1:].flatten().tolist()) <= {-1}
    assert r.block_expert.tolist() == ids.flatten().tolist() and r.num_blocks.tolist() == [t * k]
    emap = torch.where(torch.arange(e) % 2 == 0, torch.arange(e) // 2, -1).to(torch.int32)  # even experts here
    m = per_pair_routing(ids, e // 2, bm, expert_map=emap)
    assert m.block_expert.tolist() == [x // 2 if x % 2 == 0 else -1 for x in ids.flatten().tolist()]


def test_per_pair_routing_of_a_strided_column_of_ids_is_contiguous():
    """The ids as a column of a wider tensor (stride 2): the per-pair blocks' experts, which the
    kernels take as a compact tensor, come out contiguous (a strided view was passed on)."""
    wide = torch.randint(0, 8, (5, 2), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    ids = wide[:, :1]
    assert ids.reshape(-1).stride() == (2,)
    r = per_pair_routing(ids, 8, 4)
    assert r.block_expert.is_contiguous() and torch.equal(r.block_expert, wide[:, 0])


@pytest.mark.parametrize("bad,match", [
    (dict(topk_ids=torch.zeros(4, dtype=torch.int32)), "2-D"),
    (dict(topk_ids=torch.zeros(4, 2)), "int32 or int64"),
    (dict(num_experts=0), "num_experts"),
    (dict(block_m=0), "block_m"),
])
def test_bad_arguments_are_named(bad, match):
    args = dict(topk_ids=torch.zeros(4, 2, dtype=torch.int32), num_experts=4, block_m=8) | bad
    with pytest.raises((TypeError, ValueError), match=match):
        moe_routing(**args)


@pytest.mark.gpu
def test_routing_on_the_gpu_matches_the_cpu_and_captures_in_a_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, 64, (300, 8), generator=gen).cuda()
    want = moe_routing(ids.cpu(), 64, 16)
    got = moe_routing(ids, 64, 16)
    assert torch.equal(got.sorted_rows.cpu(), want.sorted_rows) and torch.equal(got.block_expert.cpu(), want.block_expert)
    static = ids.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = moe_routing(static, 64, 16)
    for _ in range(3):  # new routings replayed through the same graph
        static.copy_(torch.randint(0, 64, (300, 8), generator=gen))
        g.replay()
        ref = moe_routing(static.cpu(), 64, 16)
        assert torch.equal(out.sorted_rows.cpu(), ref.sorted_rows) and torch.equal(out.num_blocks.cpu(), ref.num_blocks)


@pytest.mark.parametrize("experts,block_m,ids64,mapped", [(8, 16, False, False), (128, 8, True, False),
                                                          (32, 64, True, True), (1, 1, False, False),
                                                          (1024, 256, False, True)])
def test_the_routing_kernel_compiles_for_sm90a(monkeypatch, experts, block_m, ids64, mapped):
    pytest.importorskip("cutlass")
    from autofp4.kernels import moe_route

    monkeypatch.setenv("CUTE_DSL_ARCH", os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    assert moe_route._compile_now(experts, block_m, ids64, mapped) is not None
    assert moe_route.supported(experts, moe_route.MAX_PAIRS) and not moe_route.supported(experts, moe_route.MAX_PAIRS + 1)
    assert not moe_route.supported(moe_route.MAX_EXPERTS + 1, 1)
    with pytest.raises(ValueError, match="experts"):
        moe_route.compile_kernel(moe_route.MAX_EXPERTS + 1, block_m, ids64, mapped)


def test_the_routing_kernel_is_used_on_hopper_only_and_a_failed_compile_falls_back(monkeypatch):
    """The kernel's binary is sm_90a's: on another GPU the torch ops build the routing (nothing is
    compiled); a compile that fails warns once and leaves those sizes to the torch ops."""
    pytest.importorskip("cutlass")
    import autofp4.routing as R
    from autofp4.kernels import moe_route

    calls = []

    def broken(*key):
        calls.append(key)
        raise RuntimeError("no toolchain")

    monkeypatch.setattr(moe_route, "compile_kernel", broken)
    monkeypatch.setattr(R, "_KERNELS", {})
    monkeypatch.setattr(R, "_HOPPER", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (8, 0))
    assert R._kernel(8, 16, 32, False, False, torch.device("cuda", 0)) is None and not calls
    monkeypatch.setattr(R, "_HOPPER", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    with pytest.warns(RuntimeWarning, match="did not compile"):
        assert R._kernel(8, 16, 32, False, False, torch.device("cuda", 0)) is None
    assert R._kernel(8, 16, 32, False, False, torch.device("cuda", 0)) is None and len(calls) == 1  # once
    assert R._kernel(8, 16, moe_route.MAX_PAIRS + 1, False, False, torch.device("cuda", 0)) is None
    monkeypatch.setattr(R, "USE_KERNEL", False)
    assert R._kernel(4, 16, 32, False, False, torch.device("cuda", 0)) is None and len(calls) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_routing_kernel_matches_the_reference(dtype):
    """The CUDA routing (one CuTeDSL kernel) against the plain-Python reference, every case of the
    CPU test, and expert-parallel slices; the kernel (not the torch fallback) built them."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cutlass")
    import autofp4.routing as R

    assert R.USE_KERNEL
    wide = [(t, k, e, bm, "skewed") for (t, k, e) in [(300, 8, 128), (1000, 2, 8)] for bm in (128, 256)]
    # prefill: up to the kernel's 65,536 pairs, each warp a chunk of thousands
    wide += [(4096, 8, 128, 64, "uniform"), (4096, 8, 256, 128, "skewed"), (8192, 8, 32, 256, "one_hot"),
             (32768, 2, 8, 128, "skewed"), (8192, 4, 1000, 16, "uniform")]
    for t, k, e, bm, mode in CASES + wide + [(0, 2, 8, 16, "uniform"), (2, 2, 1000, 8, "uniform")]:
        rng = random.Random(SEED + t * 7 + k * 13 + e + bm)
        ids = _ids(rng, t, k, e, mode) if t else []
        r = moe_routing(torch.tensor(ids, dtype=dtype).reshape(t, k).cuda(), e, bm)
        assert R._KERNELS[(e, bm, dtype == torch.int64, False)] is not None
        counts, rows, blocks = reference(ids, e, bm)
        max_rows, max_blocks = routing_sizes(t * k, e, bm)
        case = (t, k, e, bm, mode)
        assert r.counts.tolist() == counts, case
        assert r.sorted_rows.tolist() == rows + [-1] * (max_rows - len(rows)), case
        assert r.block_expert.tolist() == blocks + [-1] * (max_blocks - len(blocks)), case
        assert r.num_blocks.tolist() == [len(blocks)], case
    for t, k, e_global, ranks in [(1, 8, 256, 8), (33, 8, 256, 8), (200, 2, 8, 2), (5, 4, 16, 16), (4096, 8, 256, 8)]:
        rng = random.Random(SEED + t + e_global)
        ids = _ids(rng, t, k, e_global, "uniform")
        per = e_global // ranks
        for rank in range(ranks):
            emap = [i - rank * per if rank * per <= i < (rank + 1) * per else -1 for i in range(e_global)]
            r = moe_routing(torch.tensor(ids, dtype=dtype).cuda(), per, 8,
                            expert_map=torch.tensor(emap, dtype=torch.int32).cuda())
            counts, rows, blocks = reference(ids, per, 8, emap)
            max_rows, max_blocks = routing_sizes(t * k, per, 8)
            assert r.counts.tolist() == counts, (t, rank)
            assert r.sorted_rows.tolist() == rows + [-1] * (max_rows - len(rows)), (t, rank)
            assert r.block_expert.tolist() == blocks + [-1] * (max_blocks - len(blocks)), (t, rank)


def test_size_only_tensors_are_built_once_and_shared():
    """The per-pair rows and block count depend on the sizes only: later calls of the same sizes
    share them (no kernel per call); other sizes get their own; the data-dependent parts stay
    per call."""
    g = torch.Generator().manual_seed(5)
    ids_a = torch.randint(0, 16, (3, 2), generator=g, dtype=torch.int32)
    ids_b = torch.randint(0, 16, (3, 2), generator=g, dtype=torch.int32)
    ra, rb = per_pair_routing(ids_a, 16, 8), per_pair_routing(ids_b, 16, 8)
    assert ra.sorted_rows.data_ptr() == rb.sorted_rows.data_ptr()
    assert ra.num_blocks.data_ptr() == rb.num_blocks.data_ptr() and int(ra.num_blocks) == 6
    expect = torch.full((6, 8), -1, dtype=torch.int32)
    expect[:, 0] = torch.arange(6)
    assert torch.equal(rb.sorted_rows, expect.reshape(-1))
    assert torch.equal(rb.block_expert, ids_b.reshape(-1)) and not torch.equal(ra.block_expert, rb.block_expert)
    rc = per_pair_routing(torch.randint(0, 16, (4, 2), generator=g, dtype=torch.int32), 16, 8)
    assert rc.sorted_rows.numel() == 64 and int(rc.num_blocks) == 8
    # the sorted routing's index ranges are shared too; its results still follow the data
    s1 = moe_routing(ids_a, 16, 4)
    s2 = moe_routing(ids_b, 16, 4)
    assert not torch.equal(s1.sorted_rows, s2.sorted_rows)
    for ids, r in ((ids_a, s1), (ids_b, s2)):
        rows = r.sorted_rows[r.sorted_rows >= 0].long()
        experts = ids.reshape(-1)[rows]
        assert torch.equal(experts, experts.sort().values)  # sorted by expert
        assert sorted(rows.tolist()) == list(range(ids.numel()))  # every pair once


def test_a_ranks_expert_map_holds_its_run_of_experts():
    for eg, e in ((16, 4), (256, 32)):
        for rank in range(eg // e):
            emap = rank_expert_map(eg, e, rank)
            assert emap.dtype == torch.int32 and emap.shape == (eg,)
            for g in range(eg):
                assert int(emap[g]) == (g - rank * e if rank * e <= g < (rank + 1) * e else -1)
    with pytest.raises(ValueError, match="does not fit"):
        rank_expert_map(16, 4, 4)
    with pytest.raises(ValueError, match="does not fit"):
        rank_expert_map(4, 8)


@pytest.mark.parametrize("value, use_kernel", [("kernal", True), ("TORCH", False), ("kernel", True)])
def test_routing_variable_warns_on_an_unknown_value(value, use_kernel):
    """$AUTOFP4_MOE_ROUTING: kernel or torch (read once, at import); a typo warns once, naming the
    variable, its value and the accepted values, and keeps the kernel."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "import autofp4.routing as r; print(r.USE_KERNEL)"],
                       env={**os.environ, "AUTOFP4_MOE_ROUTING": value}, capture_output=True, text=True, check=True)
    assert r.stdout.strip() == str(use_kernel)
    warned = [line for line in r.stderr.splitlines() if "AUTOFP4_MOE_ROUTING" in line]
    if value == "kernal":
        assert len(warned) == 1 and "AUTOFP4_MOE_ROUTING='kernal' ignored: use one of kernel, torch" in warned[0]
    else:
        assert not warned, r.stderr
