"""MoE routing from router logits (autofp4.router, autofp4.route, autofp4.moe(router_logits=...))
against a float64 reference written here in plain Python, transformers' own DeepSeek-V3 router,
and on the GPU the router kernel against both; fresh random logits every run."""
import math
import os

import pytest
import torch

import autofp4
from moe_cases import require_hopper
from autofp4 import router
from autofp4.router import RouterSpec
from autofp4.routing import moe_routing, per_pair_routing

# a token whose float64 decision (the k-th against the next choice value, or the last chosen
# group against the next group) is closer than this, but not an exact tie, is not compared id for
# id: fp32 rounding of the scores may order it either way (exact ties go to the lower id in both)
MARGIN = 1e-5


def reference(row: list[float], spec: RouterSpec, bias: list[float] | None = None):
    """``(ids, weights, margin)`` of one token's float64 logits: ids in descending order of
    choice value, ties to the lower id; ``margin``: how close the decision is."""
    e = len(row)
    k = spec.top_k
    margins = []
    if spec.scoring == "softmax":
        choice = list(row)
        weight_of = None
    else:
        s = [1.0 / (1.0 + math.exp(-v)) for v in row]
        choice = [s[i] + (bias[i] if bias is not None else 0.0) for i in range(e)]
        weight_of = s
    cands = list(range(e))
    if spec.n_group > 1:
        gs = e // spec.n_group
        score = [sum(sorted(choice[g * gs:(g + 1) * gs], reverse=True)[:2]) for g in range(spec.n_group)]
        order = sorted(range(spec.n_group), key=lambda g: (-score[g], g))
        if spec.topk_group < spec.n_group:
            margins.append(score[order[spec.topk_group - 1]] - score[order[spec.topk_group]])
        keep = set(order[:spec.topk_group])
        cands = [i for i in range(e) if i // gs in keep]
    order = sorted(cands, key=lambda i: (-choice[i], i))
    ids = order[:k]
    if len(order) > k:
        margins.append(choice[order[k - 1]] - choice[order[k]])
    # the ids come in score order: two selected experts whose scores all but tie (float32 against
    # float64) may come in either order
    margins += [choice[a] - choice[b] for a, b in zip(ids, ids[1:]) if choice[a] != choice[b]]
    if spec.scoring == "softmax":
        top = choice[ids[0]]
        w = [math.exp(choice[i] - top) for i in ids]
        total = sum(w) if spec.renormalize else sum(math.exp(v - top) for v in row)
        w = [v / total for v in w]
    else:
        w = [weight_of[i] for i in ids]
        if spec.renormalize:
            total = sum(w) + 1e-20
            w = [v / total for v in w]
    return ids, [v * spec.scale for v in w], min(margins) if margins else float("inf")


SPECS = [  # (experts, spec, with a correction bias)
    (128, RouterSpec(8), False),  # Qwen3-30B-A3B
    (128, RouterSpec(4), False),  # gpt-oss-120b
    (8, RouterSpec(2), False),  # Mixtral-8x7B
    (60, RouterSpec(4, renormalize=False), False),  # Qwen1.5-MoE-like: no renormalization, E not a multiple of 32
    (256, RouterSpec(8, "sigmoid", True, 8, 4, 2.5), True),  # DeepSeek-V3
    (160, RouterSpec(6, "sigmoid", True, 8, 3, 16.0), True),  # DeepSeek-V2-like groups of 20
    (64, RouterSpec(6, "sigmoid", False, 1, 1, 1.0), False),  # plain sigmoid top-k
]


def check_against_reference(logits: torch.Tensor, spec: RouterSpec, bias, w: torch.Tensor, ids: torch.Tensor,
                            atol: float = 1e-5) -> int:
    """Asserts ``(w, ids)`` is the reference routing of ``logits`` (float64 math on the same
    values); returns how many tokens were too close to call."""
    close = 0
    rows = logits.double().tolist()
    b = None if bias is None else bias.double().tolist()
    for t, row in enumerate(rows):
        rid, rw, margin = reference(row, spec, b)
        if 0 < margin < MARGIN:
            close += 1
            continue
        assert ids[t].tolist() == rid, (t, ids[t].tolist(), rid)
        assert torch.allclose(w[t].double().cpu(), torch.tensor(rw, dtype=torch.float64), atol=atol, rtol=0), t
    return close


def _logits(gen, t, e, dtype=torch.float32, spread=2.0):
    return (torch.randn(t, e, generator=gen) * spread).to(dtype)


@pytest.mark.parametrize("experts,spec,with_bias", SPECS)
def test_torch_routing_matches_the_float64_reference(experts, spec, with_bias, gen):
    logits = _logits(gen, 97, experts)
    bias = torch.rand(experts, generator=gen) * 0.1 if with_bias else None
    w, ids = router.route_torch(logits, spec, bias)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (97, spec.top_k)
    # torch.topk may order the chosen ids of a tie differently: compare per token as sets of (id, weight)
    close = 0
    for t, row in enumerate(logits.double().tolist()):
        rid, rw, margin = reference(row, spec, None if bias is None else bias.double().tolist())
        if margin < MARGIN:
            close += 1
            continue
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        assert sorted(got) == sorted(rid), t
        assert all(abs(got[i] - v) < 1e-5 for i, v in zip(rid, rw)), t
    assert close < 5


def test_deepseek_v3_scoring_is_transformers_router(gen):
    """The sigmoid, group-limited scoring against transformers' own DeepseekV3TopkRouter (its
    real class, random weights and correction bias), fed the logits it computes."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(hidden_size=64, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
                                        topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True)
    r = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        r.weight.copy_(torch.randn(256, 64, generator=gen) * 0.3)
        r.e_score_correction_bias.copy_(torch.rand(256, generator=gen) * 0.2 - 0.1)
    h = torch.randn(50, 64, generator=gen)
    with torch.no_grad():
        logits, want_w, want_ids = r(h)
    spec = RouterSpec.checked(256, 8, "sigmoid", True, 8, 4, 2.5)
    w, ids = autofp4.route(logits, 8, scoring="sigmoid", correction_bias=r.e_score_correction_bias, n_group=8,
                           topk_group=4, routed_scaling_factor=2.5)
    assert spec == RouterSpec(8, "sigmoid", True, 8, 4, 2.5)
    for t in range(50):  # transformers leaves its ids unsorted
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        want = dict(zip(want_ids[t].tolist(), want_w[t].tolist()))
        assert sorted(got) == sorted(want), t
        assert all(abs(got[i] - want[i]) < 1e-6 for i in want), t
    # and both are the float64 reference
    assert check_against_reference(logits, spec, r.e_score_correction_bias, w, ids) < 3


@pytest.mark.parametrize("bad,match", [
    (dict(top_k=0), "top_k must be in"),
    (dict(top_k=2.0), "top_k must be an int"),
    (dict(scoring="relu"), "scoring must be one of"),
    (dict(scoring="sigmoid", n_group=5), "n_group must divide"),
    (dict(scoring="sigmoid", n_group=8, topk_group=9), "topk_group must be in"),
    (dict(scoring="sigmoid", n_group=16, topk_group=1, top_k=8), "at least top_k=8"),
    (dict(n_group=4, topk_group=2), "use scoring='sigmoid'"),
    (dict(renormalize=1), "renormalize must be True or False"),
    (dict(routed_scaling_factor=float("nan")), "finite positive number"),
    (dict(scoring="sigmoid", correction_bias=torch.zeros(31)), r"correction_bias must be a float tensor \[E=32\]"),
])
def test_bad_routing_arguments_are_named(bad, match, gen):
    args = dict(top_k=2, **{k: v for k, v in bad.items() if k != "top_k"})
    if "top_k" in bad:
        args["top_k"] = bad["top_k"]
    with pytest.raises((TypeError, ValueError), match=match):
        autofp4.route(torch.randn(3, 32, generator=gen), **args)


def test_nan_logits_are_reported():
    logits = torch.zeros(4, 16)
    logits[2, 5] = float("nan")
    for scoring in ("softmax", "sigmoid"):
        with pytest.raises(ValueError, match="rows are not, the first is row 2"):
            autofp4.route(logits + torch.randn(4, 16), 2, scoring=scoring)


def _layer(gen, e=8, h=64, inter=32, fmt="nvfp4", device="cpu"):
    w13 = autofp4.quantize(torch.randn(e, 2 * inter, h, generator=gen).to(device), fmt)
    w2 = autofp4.quantize(torch.randn(e, h, inter, generator=gen).to(device), fmt)
    return w13, w2


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_moe_from_logits_is_moe_of_route(scoring, gen):
    """``moe(router_logits=...)`` is ``moe`` of ``route``'s weights and ids, bit for bit, also
    with an expert map (logits over the global experts)."""
    w13, w2 = _layer(gen)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    logits = torch.randn(5, 8, generator=gen)
    bias = torch.rand(8, generator=gen) if scoring == "sigmoid" else None
    kw = dict(scoring=scoring, correction_bias=bias, routed_scaling_factor=1.5)
    tw, ti = autofp4.route(logits, 2, **kw)
    want = autofp4.moe(x, w13, w2, tw, ti)
    got = autofp4.moe(x, w13, w2, router_logits=logits, top_k=2, **kw)
    assert torch.equal(got, want) and got.abs().sum() > 0
    emap = torch.tensor([-1] * 4 + list(range(8)) + [-1] * 4, dtype=torch.int32)
    glogits = torch.randn(5, 16, generator=gen)
    tw, ti = autofp4.route(glogits, 3)
    assert torch.equal(autofp4.moe(x, w13, w2, router_logits=glogits, top_k=3, expert_map=emap),
                       autofp4.moe(x, w13, w2, tw, ti, expert_map=emap))


def test_moe_from_logits_rejects_bad_input(gen):
    w13, w2 = _layer(gen)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    logits = torch.randn(5, 8, generator=gen)
    tw, ti = autofp4.route(logits, 2)
    with pytest.raises(ValueError, match="not both"):
        autofp4.moe(x, w13, w2, tw, ti, router_logits=logits, top_k=2)
    with pytest.raises(TypeError, match="needs top_k"):
        autofp4.moe(x, w13, w2, router_logits=logits)
    with pytest.raises(TypeError, match="needs topk_weights and topk_ids"):
        autofp4.moe(x, w13, w2)
    with pytest.raises(ValueError, match=r"router_logits must be \[T=5, E=8\]"):
        autofp4.moe(x, w13, w2, router_logits=torch.randn(5, 9), top_k=2)
    with pytest.raises(ValueError, match="top_k must be in"):
        autofp4.moe(x, w13, w2, router_logits=logits, top_k=9)


def test_moe_from_logits_traces_without_graph_breaks(gen):
    w13, w2 = _layer(gen)
    x = torch.randn(4, 64, generator=gen).bfloat16()
    logits = torch.randn(4, 8, generator=gen)

    def f(x, logits):
        return autofp4.moe(x, w13, w2, router_logits=logits, top_k=2)

    got = torch.compile(f, fullgraph=True, backend="eager")(x, logits)
    assert torch.equal(got, f(x, logits))


KEYS = [
    dict(experts=128, top_k=8, dtype="bfloat16"),
    dict(experts=128, top_k=4, dtype="bfloat16", meta="pairs"),
    dict(experts=8, top_k=2, dtype="float16", meta="sorted", local_experts=8, block_m=64),
    dict(experts=60, top_k=4, renormalize=False, meta="sorted", local_experts=60, block_m=8),
    dict(experts=256, top_k=8, scoring="sigmoid", n_group=8, topk_group=4, bias=True, meta="pairs", mapped=True,
         local_experts=0),
    dict(experts=256, top_k=8, scoring="sigmoid", n_group=8, topk_group=4, bias=True, meta="sorted",
         local_experts=256, block_m=16),
    dict(experts=1024, top_k=32, scoring="sigmoid"),
]


@pytest.mark.parametrize("fields", KEYS)
def test_the_router_kernel_compiles_for_sm90a(monkeypatch, fields):
    pytest.importorskip("cutlass")
    from autofp4.kernels import moe_router

    monkeypatch.setenv("CUTE_DSL_ARCH", os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    key = moe_router.RouterKey(**fields)
    assert key.problem() is None
    assert moe_router._compile_now(key) is not None


def test_router_kernel_keys_that_cannot_be_built_say_why():
    from autofp4.kernels.moe_router import RouterKey

    assert "experts must be" in RouterKey(1025, 2).problem()
    assert "top_k must be" in RouterKey(64, 33).problem()
    assert "n_group" in RouterKey(64, 2, "sigmoid", n_group=3).problem()
    assert "topk_group" in RouterKey(64, 9, "sigmoid", n_group=8, topk_group=1).problem()
    assert "sorted metadata" in RouterKey(64, 2, meta="sorted", local_experts=0).problem()
    with pytest.raises(ValueError, match="cannot take"):
        from autofp4.kernels import moe_router

        moe_router.compile_kernel(RouterKey(2000, 2))


# ----------------------------------------------------------------------------- on the GPU
GPU_CASES = [(e, spec, b, dtype, t) for (e, spec, b) in SPECS for dtype in (torch.float32, torch.bfloat16)
             for t in (1, 5, 16, 64, 300)]


@pytest.mark.gpu
@pytest.mark.parametrize("experts,spec,with_bias,dtype,t", GPU_CASES)
def test_the_router_kernel_matches_the_reference(experts, spec, with_bias, dtype, t, gen):
    """The kernel's weights and ids against the float64 reference (bf16 logits: their ties go
    to the lower id, as in the reference), and its metadata against the routing of its ids."""
    require_hopper()
    logits = _logits(gen, t, experts, dtype).cuda()
    bias = (torch.rand(experts, generator=gen) * 0.1).cuda() if with_bias else None
    n = len(router._KERNELS)
    w, ids, meta = router.route(logits, spec, bias)
    assert meta is None and len(router._KERNELS) >= n and all(v is not None for v in router._KERNELS.values())
    assert check_against_reference(logits.float().cpu(), spec, None if bias is None else bias.cpu(), w, ids) <= max(2, t // 50)
    # with the metadata of a per-pair and of a sorted layout: the ids and weights are the same
    for layout in ((8, True), (16, False), (64, False)):
        w2, ids2, meta = router.route(logits, spec, bias, layout=layout, experts=experts)
        assert torch.equal(ids2, ids) and torch.equal(w2, w)
        want = (per_pair_routing if layout[1] else moe_routing)(ids.cpu(), experts, layout[0])
        for name in ("counts", "sorted_rows", "block_expert", "num_blocks"):
            assert torch.equal(getattr(meta, name).cpu(), getattr(want, name)), (layout, name)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 40, 100])
def test_the_router_kernel_maps_an_expert_parallel_slice(t, gen):
    require_hopper()
    spec = RouterSpec(8, "sigmoid", True, 8, 4, 2.5)
    logits = _logits(gen, t, 256).cuda()
    bias = (torch.rand(256, generator=gen) * 0.1).cuda()
    emap = autofp4.routing.rank_expert_map(256, 32, 3, "cuda")
    w, ids, _ = router.route(logits, spec, bias)
    for layout in ((8, True), (16, False)):
        _, ids2, meta = router.route(logits, spec, bias, layout=layout, experts=32, expert_map=emap)
        assert torch.equal(ids2, ids)
        want = (per_pair_routing if layout[1] else moe_routing)(ids.cpu(), 32, layout[0], expert_map=emap.cpu())
        for name in ("counts", "sorted_rows", "block_expert", "num_blocks"):
            assert torch.equal(getattr(meta, name).cpu(), getattr(want, name)), (layout, name)


@pytest.mark.gpu
def test_the_router_kernel_replays_in_a_cuda_graph(gen):
    require_hopper()
    spec = RouterSpec(8)
    static = _logits(gen, 12, 128, torch.bfloat16).cuda()
    router.route(static, spec, layout=(8, False), experts=128)  # compiled outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w, ids, meta = router.route(static, spec, layout=(8, False), experts=128)
    for _ in range(3):
        static.copy_(_logits(gen, 12, 128, torch.bfloat16))
        g.replay()
        torch.cuda.synchronize()
        assert check_against_reference(static.float().cpu(), spec, None, w, ids) <= 1
        want = moe_routing(ids.cpu(), 128, 8)
        assert torch.equal(meta.sorted_rows.cpu(), want.sorted_rows)
        assert torch.equal(meta.block_expert.cpu(), want.block_expert)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("t", [1, 16, 100])
def test_moe_from_logits_on_the_gpu_is_moe_of_route(fmt, t, gen):
    """The whole layer from logits (the router kernel's metadata handed to the MoE kernels)
    against the same layer from ``route``'s ids, for the configs of both MoE kernels."""
    require_hopper()
    w13, w2 = _layer(gen, e=32, h=256, inter=128, fmt=fmt, device="cuda")
    x = torch.randn(t, 256, generator=gen).bfloat16().cuda()
    logits = _logits(gen, t, 32).cuda()
    tw, ti = autofp4.route(logits, 4)
    want = autofp4.moe(x, w13, w2, tw, ti)
    got = autofp4.moe(x, w13, w2, router_logits=logits, top_k=4)
    # the grouped kernels add the top-k in fp32 with atomics: equal up to their rounding order
    assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
    ref = autofp4.moe(x.cpu(), w13.to("cpu"), w2.to("cpu"), tw.cpu(), ti.cpu())
    assert (got.float().cpu() - ref.float()).norm() / ref.float().norm() < 2e-2


def test_a_moe_call_from_logits_counts_one_miss(gen):
    """Routing from logits resolves the layer's kernel once: an untuned call is one miss."""
    from autofp4.dispatch import get_dispatcher

    w13, w2 = _layer(gen)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    before = {(k, m): n for k, m, n in get_dispatcher("cpu").misses()}
    autofp4.moe(x, w13, w2, router_logits=torch.randn(3, 8, generator=gen), top_k=2)
    after = {(k, m): n for k, m, n in get_dispatcher("cpu").misses()}
    grown = {km: n - before.get(km, 0) for km, n in after.items() if n != before.get(km, 0)}
    assert list(grown.values()) == [1] and next(iter(grown))[0].op == "moe"
