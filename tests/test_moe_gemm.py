"""The grouped wgmma MoE GEMMs of the Hopper backend (autofp4.kernels.sm90_moe_gemm).

CPU: the packed experts are the dense GEMM's packing of each expert (w13 with gate and up rows
in groups of 8), the validity rules, and the default configs of the MoE models compile for
sm_90a. GPU (H200): every kind of config against the reference backend on fresh random data
(token blocks of 64, 128 and 256 rows, both rasters, x multicast over a cluster of two, a
producer warp, 256-row weight tiles), both formats and dtypes, ragged counts, experts with no
pair and one expert with every token, expert-parallel slices, CUDA-graph replay with changing
routing.
"""
import os
import random

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from autofp4.backends import get_backend  # noqa: E402
from autofp4.backends.reference import reference_moe  # noqa: E402
from autofp4.problem import ProblemKey  # noqa: E402
from moe_cases import MODELS, check_graph_replays, experts as _experts, replays, routing  # noqa: E402

G = pytest.importorskip("autofp4.kernels.sm90_moe_gemm")
from autofp4.kernels import sm90_w4a16_gemm as D  # noqa: E402

# compiles CuTeDSL kernels on the CPU (minutes on 2 cores): not in the quick subset
pytestmark = pytest.mark.compile

SEED = int.from_bytes(os.urandom(4), "little")



def test_gate_up_rows_alternate_groups_of_eight():
    order = G.gate_up_rows(48).tolist()  # I = 24
    assert order[:16] == list(range(8)) + list(range(24, 32))
    assert order[16:32] == list(range(8, 16)) + list(range(32, 40))
    assert sorted(order) == list(range(48))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_packed_experts_are_each_experts_dense_packing(fmt):
    gen = torch.Generator().manual_seed(SEED)
    w = _experts(3, 96, 256, fmt, gen)
    p = G.pack_experts(w, gate_up=True)
    per = p.data.numel() // 3
    order = G.gate_up_rows(96)
    for e in range(3):
        we = w.expert(e)
        one = D.pack_weight(type(we)(we.fmt, we.data[order], we.scale[order], we.global_scale, check_values=False))
        assert torch.equal(p.data[e * per:(e + 1) * per], one.data.reshape(-1))
        assert torch.equal(p.alpha[e:e + 1], one.alpha)
    down = G.pack_experts(w, gate_up=False)
    assert torch.equal(down.data[:per], D.pack_weight(w.expert(0)).data.reshape(-1))
    with pytest.raises(ValueError, match="stacked experts"):
        G.pack_experts(w.expert(0), gate_up=False)


@pytest.mark.parametrize("cfg,n,k,match", [
    (G.MoEGemmConfig(tile_m=48), 1536, 2048, "tile_m must be"),
    (G.MoEGemmConfig(), 1544, 2048, "multiple of 16"),
    (G.MoEGemmConfig(), 1536, 2047, "even"),
    (G.MoEGemmConfig(raster="x"), 1536, 2048, "raster"),
    (G.MoEGemmConfig(cluster_n=2, tile_n=256, raster="n"), 5760, 2880, "the up GEMM .*cluster_n=2 must divide"),
    (G.MoEGemmConfig(cluster_n=2), 1536, 2048, "needs raster=.n."),
    (G.MoEGemmConfig(tile_k=256, stages=8), 1536, 2048, "shared memory"),
    (G.MoEGemmConfig(pdl=1), 1536, 2048, "pdl must be a bool"),
    (G.MoEGemmConfig(fused_sum=True), 1536, 2048, "fused_sum needs persistent"),
    (G.MoEGemmConfig(persistent=True, raster="n"), 1536, 2048, "persistent=True needs producer=True"),
    (G.MoEGemmConfig(persistent=True, producer=True), 1536, 2048, "raster='n'"),
    (G.MoEGemmConfig(persistent=1, producer=True, raster="n"), 1536, 2048, "persistent must be a bool"),
    (G.MoEGemmConfig(tile_n=128, tile_m=128, producer=True, raster="n", persistent=True, ctas_per_sm=2), 1536, 2048,
     "two warpgroups and a producer warp"),
    (G.MoEGemmConfig(tile_n=64, tile_m=128, stages=6, ctas_per_sm=2), 1536, 2048, "two CTAs' shared memory"),
])
def test_invalid_configs_are_refused_before_compiling(cfg, n, k, match):
    assert G.validate(cfg, n, k, "nvfp4", "bfloat16") is not None
    with pytest.raises(ValueError, match=match):
        G.compile_only(cfg, n, k, "nvfp4", "bfloat16")


def test_the_default_is_the_grouped_gemm_from_enough_pairs_per_expert():
    b = get_backend("sm90_w4a16")
    key = ProblemKey("moe", "nvfp4", "bfloat16", 1536, 2048, 128, 8)
    assert b.default(key, 16).kernel == "moe_decode"
    big = b.default(key, 4096)
    assert big.kernel == "moe_gemm" and big.tile_m == 64  # small experts: 64-row token blocks
    mixtral = ProblemKey("moe", "nvfp4", "bfloat16", 28672, 4096, 8, 2)
    assert b.default(mixtral, 4096).tile_m == 128 and b.default(mixtral, 256).tile_m == 64
    assert b.default(mixtral, 1).kernel == "moe_decode"
    assert b.parse_config(b.config_dict(big)) == big
    assert any(c.kernel == "moe_gemm" for c in b.candidates(key, 256))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_default_configs_of_the_models_compile_for_sm90a(fmt):
    b = get_backend("sm90_w4a16")
    for e, topk, h, i in MODELS.values():
        key = ProblemKey("moe", fmt, "bfloat16", 2 * i, h, e, topk)
        cfg = b.default(key, 4096)
        assert cfg.kernel == "moe_gemm", cfg
        b.compile_only(cfg, key)


def test_small_token_blocks_are_seeded_where_they_fit_and_compile_for_sm90a():
    """Token blocks of 16 and 32 rows (the dense GEMM's smallest wgmma N) come first among the
    grouped-GEMM seeds where a hit expert gets about that many pairs (each expert's run is
    padded to a block), not where it gets far more; both compile for sm_90a."""
    b = get_backend("sm90_w4a16")
    e, topk, h, i = MODELS["qwen3-30b-a3b"]
    key = ProblemKey("moe", "nvfp4", "bfloat16", 2 * i, h, e, topk)
    seeds = b.seeds(key, 256)  # 16 pairs per expert
    assert [c.tile_m for c in seeds[:2]] == [16, 32]
    assert all(c.tile_m >= 64 for c in b.seeds(key, 4096))  # 256 pairs per expert
    for cfg in seeds[:2]:
        b.compile_only(cfg, key)


def test_persistent_kernels_are_seeded_and_compile_for_sm90a():
    """The persistent kernels (one CTA of two warpgroups, two CTAs of one per SM, the top-k sum
    fused) are among the seeds at prefill sizes and compile for sm_90a, with a bias too."""
    b = get_backend("sm90_w4a16")
    e, topk, h, i = MODELS["qwen3-30b-a3b"]
    key = ProblemKey("moe", "nvfp4", "bfloat16", 2 * i, h, e, topk)
    seeds = b.seeds(key, 4096)
    assert {(c.ctas_per_sm, c.fused_sum) for c in seeds if c.persistent} >= {(0, False), (2, False), (2, True)}
    assert all(b.is_valid(c, key) is None for c in seeds)
    for cfg in PERSISTENT:
        G.compile_only(cfg, 2 * i, h, "nvfp4", "bfloat16")
    G._compile(PERSISTENT[1], 2 * i, h, "mxfp4", "float16", "down", True)


def test_a_random_sample_of_the_space_compiles_for_sm90a():
    rng = random.Random(SEED)
    b = get_backend("sm90_w4a16")
    e, topk, h, i = rng.choice(list(MODELS.values()))
    key = ProblemKey("moe", rng.choice(["nvfp4", "mxfp4"]), rng.choice(["bfloat16", "float16"]), 2 * i, h, e, topk)
    grid = [c for c in b.candidates(key, 4096) if c.kernel == "moe_gemm"]
    for cfg in rng.sample(grid, 2):
        print(key, cfg)
        b.compile_only(cfg, key)


# ----------------------------------------------------------------------------- GPU
def _gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU")


def _routing(t, e, k, mode, gen):
    return tuple(a.cuda() for a in routing(t, e, k, mode, gen))


def _layer(t, e, k, h, i, fmt, dtype, mode, gen):
    w13 = _experts(e, 2 * i, h, fmt, gen, "cuda")
    w2 = _experts(e, h, i, fmt, gen, "cuda")
    x = torch.randn(t, h, generator=gen).to("cuda", dtype)
    return (x, w13, w2, *_routing(t, e, k, mode, gen))


def _err(got, want):
    return float((got.float() - want).norm() / want.norm())


CONFIGS = [G.MoEGemmConfig(), G.MoEGemmConfig(tile_m=64, raster="n"), G.MoEGemmConfig(tile_m=256, stages=3),
           G.MoEGemmConfig(cluster_n=2, raster="n", producer=True, scale_select=True),
           G.MoEGemmConfig(tile_n=256, tile_k=128, stages=3, producer=True),
           G.MoEGemmConfig(tile_m=16, raster="n", stages=6), G.MoEGemmConfig(tile_m=32, producer=True)]
#: the persistent kernels: plain, with the top-k sum in the down GEMM's epilogue, 256-row weight tiles
PERSISTENT = [G.MoEGemmConfig(tile_m=64, raster="n", producer=True, persistent=True),
              G.MoEGemmConfig(tile_m=128, raster="n", producer=True, persistent=True, fused_sum=True, stages=6),
              G.MoEGemmConfig(tile_n=256, tile_m=32, tile_k=128, stages=3, raster="n", producer=True, persistent=True,
                              fused_sum=True, scale_select=True)]
CONFIGS += PERSISTENT


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("case", [  # (T, E, top_k, H, I, routing)
    (1, 8, 2, 512, 256, "uniform"), (37, 16, 4, 512, 256, "few_experts"), (300, 8, 1, 512, 256, "one_expert"),
    (1000, 32, 8, 512, 256, "uniform"), (4096, 8, 2, 512, 256, "uniform"),
    (200, 8, 2, 1440, 736, "uniform"),  # N and K of both GEMMs padded (to multiples of 256)
])
def test_every_config_kind_matches_the_reference(fmt, case):
    """Every config kind on one shape (the compiles are shared), the default on a padded one."""
    _gpu()
    b = get_backend("sm90_w4a16")
    t, e, k, h, i, mode = case
    gen = torch.Generator().manual_seed(SEED + t)
    x, w13, w2, tw, ti = _layer(t, e, k, h, i, fmt, torch.bfloat16, mode, gen)
    key = ProblemKey("moe", fmt, "bfloat16", 2 * i, h, e, k)
    p13, p2 = w13.packed(b.name, b.prepare), w2.packed(b.name, b.prepare)
    for act in ("silu", "gelu"):
        want = reference_moe(x.float(), w13, w2, tw, ti, act).float()
        for cfg in CONFIGS if act == "silu" and (h, i) == (512, 256) else CONFIGS[:1]:
            if b.is_valid(cfg, key) is not None:
                continue
            got = b.compile(cfg, key)(x, p13, p2, tw, ti, act)
            assert got.shape == (t, h) and got.dtype == torch.bfloat16
            assert _err(got, want) < 2e-2, (cfg, act)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp16_activations_match_the_reference(fmt):
    _gpu()
    gen = torch.Generator().manual_seed(SEED)
    x, w13, w2, tw, ti = _layer(513, 16, 4, 512, 256, fmt, torch.float16, "uniform", gen)
    b = get_backend("sm90_w4a16")
    key = ProblemKey("moe", fmt, "float16", 512, 512, 16, 4)
    got = b.compile(G.MoEGemmConfig(tile_m=64), key)(
        x, w13.packed(b.name, b.prepare), w2.packed(b.name, b.prepare), tw, ti, "silu")
    assert got.dtype == torch.float16
    assert _err(got, reference_moe(x.float(), w13, w2, tw, ti, "silu").float()) < 2e-2


@pytest.mark.gpu
def test_expert_parallel_slices_skip_the_pairs_routed_elsewhere():
    _gpu()
    b = get_backend("sm90_w4a16")
    gen = torch.Generator().manual_seed(SEED)
    x, w13, w2, tw, ti = _layer(700, 32, 8, 512, 256, "nvfp4", torch.bfloat16, "uniform", gen)
    total = torch.zeros(700, 512, device="cuda")
    for r in range(4):
        emap = torch.full((32,), -1, dtype=torch.int32, device="cuda")
        emap[r * 8:(r + 1) * 8] = torch.arange(8, dtype=torch.int32, device="cuda")
        idx = torch.arange(r * 8, (r + 1) * 8, device="cuda")
        a, c = (type(w)(w.fmt, w.data[idx], w.scale[idx], w.global_scale[idx], check_values=False) for w in (w13, w2))
        key = ProblemKey("moe", "nvfp4", "bfloat16", 512, 512, 8, 8)
        want = reference_moe(x.float(), a, c, tw, ti, "silu", expert_map=emap).float()
        for cfg in (G.MoEGemmConfig(), PERSISTENT[1]):
            got = b.compile(cfg, key)(x, a.packed(b.name, b.prepare), c.packed(b.name, b.prepare), tw, ti, "silu", emap)
            assert _err(got, want) < 2e-2, (r, cfg)
        total += got.float()
    assert _err(total, reference_moe(x.float(), w13, w2, tw, ti, "silu").float()) < 2e-2


@pytest.mark.gpu
def test_graph_replay_with_changing_routing_matches_eager():
    _gpu()
    b = get_backend("sm90_w4a16")
    gen = torch.Generator().manual_seed(SEED)
    t, e, k, h, i = 600, 16, 4, 512, 256
    x, w13, w2, tw, ti = _layer(t, e, k, h, i, "nvfp4", torch.bfloat16, "uniform", gen)
    run = b.compile(G.MoEGemmConfig(tile_m=64), ProblemKey("moe", "nvfp4", "bfloat16", 2 * i, h, e, k))
    p13, p2 = w13.packed(b.name, b.prepare), w2.packed(b.name, b.prepare)
    run(x, p13, p2, tw, ti, "silu")  # compile and pack outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run(x, p13, p2, tw, ti, "silu")
    for mode in replays(g, x, tw, ti, e, gen):
        want = run(x, p13, p2, tw, ti, "silu")
        torch.cuda.synchronize()
        assert torch.equal(out, want), mode  # no atomics: the same sums in the same order


@pytest.mark.gpu
def test_persistent_kernels_replay_in_a_graph_with_changing_routing():
    """The persistent kernels read the number of used blocks on the device: a graph captured for
    one routing serves another (more or fewer blocks); the fused top-k sum adds in any order."""
    _gpu()
    b = get_backend("sm90_w4a16")
    gen = torch.Generator().manual_seed(SEED)
    t, e, k, h, i = 900, 16, 4, 512, 256
    x, w13, w2, tw, ti = _layer(t, e, k, h, i, "mxfp4", torch.bfloat16, "uniform", gen)
    run = b.compile(PERSISTENT[1], ProblemKey("moe", "mxfp4", "bfloat16", 2 * i, h, e, k))
    p13, p2 = w13.packed(b.name, b.prepare), w2.packed(b.name, b.prepare)
    check_graph_replays(run, x, p13, p2, w13, w2, tw, ti, e, gen, PERSISTENT[1])


def _torch_moe(x, w13, w2, tw, ti, b13, b2):
    """gpt-oss's MoE with biases in plain torch, token by token (fp32, dequantized experts)."""
    d13, d2 = w13.dequantize().float(), w2.dequantize().float()
    i = d2.shape[-1]
    out = torch.zeros(x.shape[0], d2.shape[1], device=x.device)
    for t in range(x.shape[0]):
        for j in range(ti.shape[1]):
            e = int(ti[t, j])
            gu = d13[e] @ x[t].float() + b13[e].float()
            gate, up = gu[:i].clamp(max=7.0), gu[i:].clamp(-7.0, 7.0)
            hid = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            out[t] += tw[t, j] * (d2[e] @ hid + b2[e].float())
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpt_oss_activation_and_biases_match_a_torch_loop(fmt):
    _gpu()
    b = get_backend("sm90_w4a16")
    gen = torch.Generator().manual_seed(SEED)
    t, e, k, h, i = 150, 8, 4, 512, 256
    x, w13, w2, tw, ti = _layer(t, e, k, h, i, fmt, torch.bfloat16, "uniform", gen)
    x = x * 4  # gate and up values beyond the clamp at 7
    b13 = torch.randn(e, 2 * i, generator=gen).cuda()
    b2 = (0.1 * torch.randn(e, h, generator=gen)).cuda().bfloat16()
    want = _torch_moe(x, w13, w2, tw, ti, b13, b2)
    key = ProblemKey("moe", fmt, "bfloat16", 2 * i, h, e, k)
    p13, p2 = w13.packed(b.name, b.prepare), w2.packed(b.name, b.prepare)
    for cfg in (G.MoEGemmConfig(tile_m=64), G.MoEGemmConfig(tile_n=256, raster="n", tile_m=64, producer=True),
                PERSISTENT[1]):
        assert b.is_valid(cfg, key) is None, cfg
        got = b.compile(cfg, key)(x, p13, p2, tw, ti, "swigluoai", None, b13, b2)
        assert _err(got, want) < 2e-2, cfg
        no_bias = b.compile(cfg, key)(x, p13, p2, tw, ti, "swigluoai")
        assert _err(no_bias, want) > 5e-2  # the biases matter at this size: the check can fail
