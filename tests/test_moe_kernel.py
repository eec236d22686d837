"""The grouped MoE kernels of the Hopper backend (autofp4.kernels.w4a16_moe).

CPU: the experts' packed layout decodes to the dequantized weights (gate and up rows
interleaved for w13), the validity rules, every default config (plus a sample of the space)
compiles for sm_90a, and so do the activations and the bias options (checked in the PTX).
GPU (H200): autofp4.moe through the dispatcher against the reference backend on fresh random
data: both formats and dtypes, ragged token counts, experts that get no pair, one expert that
gets every token, top-k 1 to 8, every activation, expert biases (split-K too), CUDA-graph
replay with changing routing.
"""
import os
import random

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import autofp4  # noqa: E402
from autofp4.backends import get_backend  # noqa: E402
from autofp4.backends.reference import reference_moe  # noqa: E402
from autofp4.problem import ProblemKey  # noqa: E402
from moe_cases import MODELS, check_graph_replays, experts as _experts, replays, routing as _routing  # noqa: E402

M = pytest.importorskip("autofp4.kernels.w4a16_moe")
from autofp4.kernels import w4a16_decode as D  # noqa: E402

# compiles CuTeDSL kernels on the CPU (minutes on 2 cores): not in the quick subset
pytestmark = pytest.mark.compile

SEED = int.from_bytes(os.urandom(4), "little")



def _unpack_expert(p, e, dtype="bfloat16"):
    """Expert ``e`` of a MoEPacked, decoded by the decode kernel's reference unpacker."""
    one = D.DecodePacked(p.fmt, p.n, p.k, p.data[e * p.data_stride:(e + 1) * p.data_stride],
                         p.scales[e * p.scale_stride:(e + 1) * p.scale_stride], p.alpha[e],
                         tuple(int(v) for v in p.scale_add[e]), (None, None))
    return D.unpack_reference(one, dtype)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("gate_up", [True, False])
def test_packed_experts_decode_to_the_weights(fmt, gate_up):
    gen = torch.Generator().manual_seed(SEED)
    e, n, k = 3, 96, 640  # K not a multiple of the 512 K group: padded
    w = _experts(e, n, k, fmt, gen)
    p = M.pack_experts(w, gate_up)
    order = M.gate_up_order(n) if gate_up else torch.arange(n)
    assert sorted(order.tolist()) == list(range(n))
    for i in range(e):
        want = w.expert(i).dequantize(torch.float32)[order]
        assert torch.equal(_unpack_expert(p, i), want), i


def test_gate_up_order_pairs_the_same_rows():
    order = M.gate_up_order(64).tolist()
    assert order[:16] == list(range(16)) and order[16:32] == list(range(32, 48))
    assert order[32:48] == list(range(16, 32)) and order[48:] == list(range(48, 64))


@pytest.mark.parametrize("cfg,n,k,match", [
    (M.MoEDecodeConfig(m_block=4), 1536, 2048, "m_block"),
    (M.MoEDecodeConfig(warps=3), 1536, 2048, "warps"),
    (M.MoEDecodeConfig(k_split=4), 1536, 2048, "k_split=4 exceeds"),
    (M.MoEDecodeConfig(warps=2, k_warps=4), 1536, 2048, "divide warps"),
    (M.MoEDecodeConfig(k_warps=3), 1536, 2048, "k_warps"),
    (M.MoEDecodeConfig(k_warps=4), 1536, 1536, "leaves a warp without work"),  # 3 K groups
    (M.MoEDecodeConfig(warps=8, k_warps=8), 1536, 2048, "leaves a warp without work"),
    (M.MoEDecodeConfig(), 1528, 2048, "multiple of 32"),
    (M.MoEDecodeConfig(), 1536, 2040, "multiple of 32"),
])
def test_invalid_configs_are_refused_before_compiling(cfg, n, k, match):
    assert match in M.validate(cfg, n, k, "nvfp4", "bfloat16")
    with pytest.raises(ValueError, match="invalid MoEDecodeConfig"):
        M.compile_only(cfg, n, k, "nvfp4", "bfloat16")


def test_the_backend_serves_moe_with_its_own_configs():
    b = get_backend("sm90_w4a16")
    key = ProblemKey("moe", "nvfp4", "bfloat16", 1536, 2048, 128, 8)
    cands = b.candidates(key, 16)
    assert cands and all(c.kernel.startswith("moe_") and b.is_valid(c, key) is None for c in cands)
    assert b.default(key, 1).per_pair and b.default(key, 16).per_pair and not b.default(key, 64).per_pair
    assert "cannot run a linear problem" in b.is_valid(b.default(key, 1), ProblemKey("linear", "nvfp4", "bfloat16", 1536, 2048))
    assert b.source_part(b.config_dict(b.default(key, 1))) == "moe_decode"
    assert {m.__name__ for m in b.source_modules("moe_decode")} == {M.__name__}


def test_decode_defaults_split_k_where_few_experts_are_hit():
    """The warp-level default splits the up GEMM's H over a CTA's warps and the down GEMM's I
    over CTAs while their warp tasks stay within the heuristic's limits: at T = 1 the H200
    tuning winners' splits (Qwen3-30B-A3B 4 and 2, gpt-oss-120b 2 and 4, Mixtral-8x7B 4 and 4);
    none at T = 16, where enough pairs are in flight; every default valid."""
    from autofp4.backends import sm90_heuristics as H

    want = {"qwen3-30b-a3b": (4, 2), "gpt-oss-120b": (2, 4), "mixtral-8x7b": (4, 4)}
    for name, (e, topk, h, i) in MODELS.items():
        one, sixteen = (H.moe_decode_default(2 * i, h, "nvfp4", "bfloat16", e, topk, t) for t in (1, 16))
        for cfg in (one, sixteen):
            assert M.validate(cfg, 2 * i, h, "nvfp4", "bfloat16") is None, (name, cfg)
        if name in want:
            assert (one.k_warps, one.k_split) == want[name], (name, one)
        assert (sixteen.k_warps, sixteen.k_split) == (1, 1), (name, sixteen)
        assert one.k_warps >= sixteen.k_warps


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_default_configs_of_the_models_compile_for_sm90a(fmt):
    b = get_backend("sm90_w4a16")
    seen = set()
    for e, topk, h, i in MODELS.values():
        key = ProblemKey("moe", fmt, "bfloat16", 2 * i, h, e, topk)
        for t in (1, 4096):
            cfg = b.default(key, t)
            if (cfg, key) not in seen:
                seen.add((cfg, key))
                b.compile_only(cfg, key)


@pytest.mark.slow
def test_a_random_sample_of_the_space_compiles_for_sm90a():
    rng = random.Random(SEED)
    b = get_backend("sm90_w4a16")
    e, topk, h, i = rng.choice(list(MODELS.values()))
    key = ProblemKey("moe", rng.choice(["nvfp4", "mxfp4"]), rng.choice(["bfloat16", "float16"]), 2 * i, h, e, topk)
    for cfg in rng.sample(b.candidates(key), 2):
        print(key, cfg)
        b.compile_only(cfg, key)


def _ptx(monkeypatch, tmp_path, cfg, *variant) -> tuple[str, str]:
    """The PTX of the up and of the down kernel of one compiled variant (the kernel cache bypassed)."""
    pytest.importorskip("cutlass")
    d = tmp_path / "_".join(map(str, variant))
    d.mkdir()
    monkeypatch.setenv("AUTOFP4_CUTE_DSL_OPTIONS", f"--keep-ptx --dump-dir={d}")
    M._compile(cfg, 2048, 1024, "nvfp4", "bfloat16", *variant)
    (ptx,) = d.glob("*.ptx")
    text = ptx.read_text()
    i = text.index(".entry kernel_cutlass_down_kernel")
    return text[:i], text[i:]


def test_activations_and_biases_compile_for_sm90a(monkeypatch, tmp_path):
    """swigluoai clamps the gate at 7 and up at +-7 and scales its sigmoid by 1.702 (the fp32
    constants 7, -7 and -1.702 log2(e) in the up kernel); a kernel without biases reads none and
    one with them converts bf16 / fp16 biases to fp32; the down kernel's bias is added by K
    slice 0 (k_split=2)."""
    cfg = M.MoEDecodeConfig(k_split=2)
    clamp, slope = ("0f40E00000", "0fC0E00000"), "0fC01D265F"
    silu_up, _ = _ptx(monkeypatch, tmp_path, cfg, "silu", None, None)
    up, down = _ptx(monkeypatch, tmp_path, cfg, "swigluoai", None, None)
    bup, bdown = _ptx(monkeypatch, tmp_path, cfg, "swigluoai", "bfloat16", "float16")
    assert all(c in up and c in bup for c in (*clamp, slope))
    assert not any(c in silu_up for c in (*clamp, slope)) and "0fBFB8AA3B" in silu_up  # -log2(e)
    assert "cvt.f32.bf16" not in up and "cvt.f32.f16" not in down
    assert bup.count("cvt.f32.bf16") and bdown.count("cvt.f32.f16")
    assert "ctaid.z" in bdown
    with pytest.raises(ValueError, match="bias dtypes"):
        M._compile(cfg, 2048, 1024, "nvfp4", "bfloat16", "silu", "float64", None)
    with pytest.raises(ValueError, match="activation must be one of"):
        M._compile(cfg, 2048, 1024, "nvfp4", "bfloat16", "relu")


# ----------------------------------------------------------------------------- GPU
CASES = [  # (T, E, top_k, H, I, routing)
    (1, 8, 2, 512, 256, "uniform"), (3, 16, 4, 640, 96, "uniform"), (16, 8, 1, 512, 256, "uniform"),
    (33, 64, 8, 1024, 384, "few_experts"), (100, 8, 2, 512, 768, "one_expert"), (257, 16, 4, 512, 256, "uniform"),
    (1000, 32, 8, 256, 128, "uniform"), (4096, 8, 2, 512, 256, "uniform"),
]


def _biases(e, i, h, gen, device="cuda"):
    """Random biases: w13's fp32 (large enough that swigluoai's clamps act), w2's bf16."""
    return (4 * torch.randn(e, 2 * i, generator=gen)).to(device), torch.randn(e, h, generator=gen).to(device, torch.bfloat16)


def _gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_moe_matches_the_reference_backend(fmt, dtype, case):
    _gpu()
    t, e, k, h, i, mode = case
    gen = torch.Generator().manual_seed(SEED + t + e)
    w13 = _experts(e, 2 * i, h, fmt, gen, "cuda")
    w2 = _experts(e, h, i, fmt, gen, "cuda")
    x = torch.randn(t, h, generator=gen).to("cuda", dtype)
    tw, ti = _routing(t, e, k, mode, gen)
    tw, ti = tw.cuda(), ti.cuda()
    b13, b2 = _biases(e, i, h, gen)
    acts = M.ACTIVATIONS if t <= 100 else ("silu",)
    for act, biases in [(a, {}) for a in acts] + [("swigluoai", {"w13_bias": b13, "w2_bias": b2})]:
        got = autofp4.moe(x, w13, w2, tw, ti, activation=act, **biases)
        want = reference_moe(x.float(), w13, w2, tw, ti, act, **biases).float()
        assert got.dtype == dtype and got.shape == (t, h)
        err = float((got.float() - want).norm() / want.norm())
        assert err < 2e-2, (act, bool(biases), err)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_graph_replay_with_changing_routing_matches_eager(fmt):
    _gpu()
    gen = torch.Generator().manual_seed(SEED)
    t, e, k, h, i = 24, 16, 4, 512, 256
    w13 = _experts(e, 2 * i, h, fmt, gen, "cuda")
    w2 = _experts(e, h, i, fmt, gen, "cuda")
    x = torch.randn(t, h, generator=gen).cuda().bfloat16()
    tw, ti = (a.cuda() for a in _routing(t, e, k, "uniform", gen))
    autofp4.moe(x, w13, w2, tw, ti)  # compile and pack outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = autofp4.moe(x, w13, w2, tw, ti)
    for mode in replays(g, x, tw, ti, e, gen):
        want = autofp4.moe(x, w13, w2, tw, ti)
        torch.cuda.synchronize()
        # the top-k sums meet in fp32 atomics, in no fixed order: equal up to rounding
        assert float((out.float() - want.float()).norm() / want.float().norm()) < 2e-3, mode


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_dependent_launch_under_graph_replay_matches_the_reference(fmt):
    """``pdl``: the down kernel launches during the up kernel and reads its blocks' experts before
    its wait. A graph replayed on new routings (other experts per block, empty blocks) must
    still match the reference."""
    _gpu()
    b = get_backend("sm90_w4a16")
    gen = torch.Generator().manual_seed(SEED + 11)
    t, e, k, h, i = 24, 16, 4, 1024, 1024
    key = ProblemKey("moe", fmt, "bfloat16", 2 * i, h, e, k)
    w13 = _experts(e, 2 * i, h, fmt, gen, "cuda")
    w2 = _experts(e, h, i, fmt, gen, "cuda")
    x = torch.randn(t, h, generator=gen).cuda().bfloat16()
    tw, ti = (a.cuda() for a in _routing(t, e, k, "uniform", gen))
    p13, p2 = w13.packed(b.name, b.prepare), w2.packed(b.name, b.prepare)
    cfgs = (M.MoEDecodeConfig(m_block=8, k_split=2, pdl=True, per_pair=True),
            M.MoEDecodeConfig(m_block=16, warps=4, k_split=2, k_warps=2, pdl=True))
    for cfg in cfgs:
        assert b.is_valid(cfg, key) is None, cfg
        check_graph_replays(b.compile(cfg, key), x, p13, p2, w13, w2, tw, ti, e, gen, cfg)


def _configs_match_the_reference(fmt, t, e, k, h, i, seed, cfgs, all_valid: bool) -> int:
    """Run each valid config of ``cfgs`` on one random layer (SiLU without biases, gpt-oss's
    activation with both biases) against the reference; how many ran (``all_valid``: all must)."""
    b = get_backend("sm90_w4a16")
    gen = torch.Generator().manual_seed(seed)
    key = ProblemKey("moe", fmt, "bfloat16", 2 * i, h, e, k)
    w13 = _experts(e, 2 * i, h, fmt, gen, "cuda")
    w2 = _experts(e, h, i, fmt, gen, "cuda")
    x = torch.randn(t, h, generator=gen).cuda().bfloat16()
    tw, ti = (a.cuda() for a in _routing(t, e, k, "uniform", gen))
    b13, b2 = _biases(e, i, h, gen)
    want = reference_moe(x.float(), w13, w2, tw, ti, "silu").float()
    want_b = reference_moe(x.float(), w13, w2, tw, ti, "swigluoai", w13_bias=b13, w2_bias=b2).float()
    p13, p2 = w13.packed(b.name, b.prepare), w2.packed(b.name, b.prepare)
    ran = 0
    for cfg in cfgs:
        if b.is_valid(cfg, key) is not None:
            assert not all_valid, (cfg, b.is_valid(cfg, key))
            continue
        ran += 1
        run = b.compile(cfg, key)
        got = run(x, p13, p2, tw, ti, "silu")
        err = float((got.float() - want).norm() / want.norm())
        assert err < 2e-2, (cfg, err)
        # biases: with k_split=2 only K slice 0 adds w2's
        got = run(x, p13, p2, tw, ti, "swigluoai", w13_bias=b13, w2_bias=b2)
        err = float((got.float() - want_b).norm() / want_b.norm())
        assert err < 2e-2, (cfg, "biases", err)
    return ran


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("t,e,k", [(1, 32, 4), (4, 64, 8), (40, 8, 2)])
def test_every_config_kind_matches_the_reference(fmt, t, e, k):
    """Sorted blocks of 8 and 16, one block per pair, split-K of the down GEMM, 2 and 8 warps."""
    _gpu()
    cfgs = (M.MoEDecodeConfig(m_block=8, per_pair=True), M.MoEDecodeConfig(m_block=16, warps=2, k_split=1),
            M.MoEDecodeConfig(m_block=8, warps=8, k_split=2, per_pair=True), M.MoEDecodeConfig(m_block=16, warps=4, k_split=2))
    # h 512, i 1024: two K groups in the down GEMM, k_split=2 is valid
    _configs_match_the_reference(fmt, t, e, k, 512, 1024, SEED + t * e, cfgs, all_valid=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("t,h", [(1, 2048), (3, 2560), (24, 2048)])
def test_up_gemm_k_shared_by_warps_matches_the_reference(fmt, t, h):
    """``k_warps``: the warps of a tile pair split H (4 K groups in shares of 1 and 2; 5 groups
    in shares of 3 and 2), their sums meet in shared memory; per pair and sorted, with biases."""
    _gpu()
    cfgs = [M.MoEDecodeConfig(warps=4, k_warps=2, per_pair=True), M.MoEDecodeConfig(warps=8, k_warps=2, m_block=16),
            M.MoEDecodeConfig(warps=8, k_warps=4, k_split=2, per_pair=True), M.MoEDecodeConfig(warps=4, k_warps=4)]
    assert _configs_match_the_reference(fmt, t, 16, 4, h, 256, SEED + 7 * t + h, cfgs, all_valid=False) >= 2


def _ep_case(fmt, device, gen, t=9, eg=16, k=4, h=256, i=128, ranks=4):
    w13 = _experts(eg, 2 * i, h, fmt, gen, device)
    w2 = _experts(eg, h, i, fmt, gen, device)
    x = torch.randn(t, h, generator=gen).to(device, torch.bfloat16)
    tw, ti = (a.to(device) for a in _routing(t, eg, k, "uniform", gen))
    per = eg // ranks
    slices = []
    for r in range(ranks):
        emap = torch.full((eg,), -1, dtype=torch.int32, device=device)
        emap[r * per:(r + 1) * per] = torch.arange(per, dtype=torch.int32, device=device)
        idx = torch.arange(r * per, (r + 1) * per, device=device)
        sub = [type(w)(w.fmt, w.data[idx], w.scale[idx], None if w.global_scale is None else w.global_scale[idx],
                       check_values=False) for w in (w13, w2)]
        slices.append((sub, emap))
    return x, w13, w2, tw, ti, slices


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_expert_parallel_slices_add_up_to_the_layer(fmt):
    """On the CPU (reference backend): each rank's autofp4.moe with its expert map skips the pairs
    routed elsewhere; the ranks' results add up to the whole layer."""
    gen = torch.Generator().manual_seed(SEED)
    x, w13, w2, tw, ti, slices = _ep_case(fmt, "cpu", gen)
    whole = autofp4.moe(x, w13, w2, tw, ti).float()
    total = sum(autofp4.moe(x, a, b, tw, ti, expert_map=emap).float() for (a, b), emap in slices)
    assert float((total - whole).norm() / whole.norm()) < 2e-2
    (a, b), emap = slices[0]
    with pytest.raises(ValueError, match="expert_map values"):
        autofp4.moe(x, a, b, tw, ti, expert_map=torch.full_like(emap, 99))
    with pytest.raises(ValueError, match="expert_map must be"):
        autofp4.moe(x, a, b, tw, ti, expert_map=emap[:2])
    with pytest.raises(TypeError, match="expert_map"):
        autofp4.moe(x, a, b, tw, ti, expert_map=[0, 1])
    with pytest.raises(ValueError, match="topk_ids must lie in"):  # global ids beyond the map
        autofp4.moe(x, a, b, tw, ti + 100, expert_map=emap)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_expert_parallel_slices_on_the_gpu_match_the_reference(fmt):
    _gpu()
    gen = torch.Generator().manual_seed(SEED)
    x, w13, w2, tw, ti, slices = _ep_case(fmt, "cuda", gen, t=40, eg=32, k=8, h=512, i=256)
    for (a, b), emap in slices:
        got = autofp4.moe(x, a, b, tw, ti, expert_map=emap).float()
        want = reference_moe(x.float(), a, b, tw, ti, "silu", expert_map=emap).float()
        assert float((got - want).norm() / want.norm()) < 2e-2
