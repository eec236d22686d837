"""Calls larger than the Hopper kernels' 32-bit offsets: a MoE layer whose packed experts exceed
2 GiB runs as runs of experts, a call with more rows than the offsets reach in runs of rows.

CPU: the runs of experts are views of the packed layouts that cover every expert once, each
under the limit; the expert maps of the runs; the row and token runs. GPU (H200): DeepSeek-V3's
full 256-expert layer (w13 3.8 GB of FP4) in both formats against the reference backend, a
small layer forced into several runs against the same layer in one, and a linear whose output
has more than 2**31 elements against float math."""
import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import autofp4  # noqa: E402
from moe_cases import require_hopper  # noqa: E402
from autofp4.backends import sm90_w4a16 as B  # noqa: E402

SEED = int.from_bytes(os.urandom(4), "little")


def _packed(kind, fmt, gen, e=6, n=64, k=512):
    w = autofp4.quantize(torch.randn(e, n, k, generator=gen), fmt)
    if kind == "moe_decode":
        from autofp4.kernels import w4a16_moe as M
    else:
        from autofp4.kernels import sm90_moe_gemm as M
    return M.pack_experts(w, True)


@pytest.mark.parametrize("kind", ["moe_decode", "moe_gemm"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_runs_of_experts_are_views_that_cover_every_expert_under_the_limit(kind, fmt, gen):
    p = _packed(kind, fmt, gen)
    assert B.expert_groups(p) == [(0, 6, p)]  # a small layer: one run, the layout itself
    per = p.data.numel() // 6
    runs = B.expert_groups(p, limit=2 * per + 1)
    assert [(a, b) for a, b, _ in runs] == [(0, 2), (2, 4), (4, 6)]
    for a, b, q in runs:
        assert q.experts == b - a and q.n == p.n and q.k == p.k and q.fmt == p.fmt
        for f in B._FLAT:
            if hasattr(p, f):
                whole, part = getattr(p, f), getattr(q, f)
                step = whole.numel() // 6
                assert part.numel() <= 2 * per + 1 or f != "data"
                assert torch.equal(part, whole[a * step:b * step])
                assert part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()  # a view
        for f in B._PER_EXPERT:
            if hasattr(p, f):
                assert torch.equal(getattr(q, f), getattr(p, f)[a:b])
    # the largest flat tensor decides: a limit below one expert still gives one expert a run
    assert [(a, b) for a, b, _ in B.expert_groups(p, limit=1)] == [(i, i + 1) for i in range(6)]


def test_the_expert_map_of_a_run():
    m = B._group_map(None, 6, 2, 4, "cpu")
    assert m.tolist() == [-1, -1, 0, 1, -1, -1] and m.dtype == torch.int32
    emap = torch.tensor([-1, 5, 0, 3, -1, 2, 4, 1])  # 8 global experts onto 6 local ones
    m = B._group_map(emap, 6, 2, 5, "cpu")
    assert m.tolist() == [-1, -1, -1, 1, -1, 0, 2, -1]


def test_runs_of_rows_and_tokens():
    assert B._row_chunks(100, 10) == [(0, 100)]
    runs = B._row_chunks(5000, 1000, limit=1_000_000)
    assert runs[0] == (0, 768) and runs[-1][1] == 5000 and all(b - a <= 1000 for a, b in runs)
    assert all(a == b0 for (_, b0), (a, _) in zip(runs, runs[1:]))
    # lm_head of a 152064-token vocabulary over 16k tokens: 2.5e9 outputs, two runs
    runs = B._row_chunks(16384, 152064)
    assert len(runs) == 2 and all((b - a) * 152064 <= 2**31 - 1 for a, b in runs)
    assert B._token_runs(4096, 8, 256, 7168) == [(0, 4096)]
    runs = B._token_runs(65536, 8, 256, 7168)
    assert len(runs) > 1 and runs[-1][1] == 65536
    assert all(((b - a) * 8 + 256 * 256) * 7168 <= 2**31 - 1 for a, b in runs)


def test_a_dense_weight_past_the_offsets_is_named_once(monkeypatch, gen):
    w = autofp4.quantize(torch.randn(256, 512, generator=gen), "nvfp4")
    prep = B.SM90Prepared(w)
    assert B._too_large(prep) is None
    monkeypatch.setattr(B, "MAX_ARG_BYTES", 256 * 512 // 2)  # the values alone fill it
    assert B._too_large(prep) is None  # decided once per weight
    why = B._too_large(B.SM90Prepared(w))
    assert "256 x 512 weight packs to more than 2 GiB" in why


# ----------------------------------------------------------------------------- on the GPU
def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_deepseek_v3s_full_layer_runs_and_matches_the_reference(fmt):
    """256 experts, H 7168, I 2048, top-8 (w13 holds 3.8 GB of FP4): every T up to 4096, both
    kernels' configs, against the reference backend on the same FP4 weights."""
    require_hopper()
    from autofp4.backends.reference import reference_moe

    gen = torch.Generator(device="cuda").manual_seed(SEED)
    e, h, i, k = 256, 7168, 2048, 8
    w13 = autofp4.quantize(torch.randn(e, 2 * i, h, device="cuda", generator=gen, dtype=torch.bfloat16), fmt)
    w2 = autofp4.quantize(torch.randn(e, h, i, device="cuda", generator=gen, dtype=torch.bfloat16), fmt)
    assert w13.data.numel() > 2**31
    for t in (1, 16, 256, 4096):
        x = torch.randn(t, h, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.05
        logits = torch.randn(t, e, device="cuda", generator=gen)
        bias = torch.rand(e, device="cuda", generator=gen) * 0.1
        kw = dict(scoring="sigmoid", correction_bias=bias, n_group=8, topk_group=4, routed_scaling_factor=2.5)
        tw, ti = autofp4.route(logits, k, **kw)
        y = autofp4.moe(x, w13, w2, router_logits=logits, top_k=k, **kw)
        ref = reference_moe(x, w13, w2, tw, ti, "silu")
        assert _rel(y, ref) < 2e-2, t
        assert torch.isfinite(y).all() and y.abs().amax() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["moe_decode", "moe_gemm"])
def test_a_layer_in_runs_of_experts_and_tokens_is_the_layer_in_one(monkeypatch, kernel, gen):
    """The same layer and routing through one kernel config, whole and forced into runs (a
    limit a few experts wide), with an expert map and biases."""
    require_hopper()
    from autofp4.kernels import sm90_moe_gemm, w4a16_moe
    from autofp4.problem import ProblemKey

    e, h, i, t, k = 12, 256, 128, 40, 3
    w13 = autofp4.quantize(torch.randn(e, 2 * i, h, generator=gen).cuda(), "nvfp4")
    w2 = autofp4.quantize(torch.randn(e, h, i, generator=gen).cuda(), "nvfp4")
    cfg = w4a16_moe.MoEDecodeConfig(m_block=16) if kernel == "moe_decode" else sm90_moe_gemm.MoEGemmConfig(tile_m=64)
    backend = B.SM90W4A16Backend()
    run = backend.compile(cfg, ProblemKey("moe", "nvfp4", "bfloat16", 2 * i, h, e, k))
    x = torch.randn(t, h, generator=gen).bfloat16().cuda()
    emap = torch.tensor([-1] * 4 + list(range(e)) + [-1] * 4, dtype=torch.int32).cuda()
    tw, ti = autofp4.route(torch.randn(t, e + 8, generator=gen).cuda(), k)
    b13 = torch.randn(e, 2 * i, generator=gen).cuda()
    b2 = torch.randn(e, h, generator=gen).cuda()

    def layer():
        p13, p2 = backend.prepare(w13), backend.prepare(w2)  # fresh: no cached runs
        return run(x, p13, p2, tw, ti, "silu", emap, b13, b2)

    whole = layer()
    one = w13.packed(backend.name, backend.prepare).moe(kernel, True)
    monkeypatch.setattr(B, "MAX_ARG_BYTES", one.data.numel() // e * 5)  # runs of 5 experts
    assert len(B.expert_groups(one)) == 3
    split = layer()
    assert _rel(split, whole) < 1e-2
    monkeypatch.setattr(B, "MAX_ARG_BYTES", (e * 256 + 7 * k) * h)  # and runs of 7 tokens
    assert len(B._token_runs(t, k, e, h)) == 6
    assert _rel(layer(), whole) < 1e-2


@pytest.mark.gpu
def test_a_linear_with_more_than_2_31_outputs():
    """lm_head-sized: M = 16384 tokens x N = 152064 (2.5e9 outputs), in runs of rows."""
    require_hopper()
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    m, n, kk = 16384, 152064, 256
    w = autofp4.quantize(torch.randn(n, kk, device="cuda", generator=gen), "nvfp4")
    x = torch.randn(m, kk, device="cuda", generator=gen, dtype=torch.bfloat16)
    y = autofp4.linear(x, w)
    dense = w.dequantize(torch.bfloat16)
    for r0 in (0, m // 2, m - 64):  # rows of both runs, the last ones included
        ref = x[r0:r0 + 64].float() @ dense.float().T
        assert _rel(y[r0:r0 + 64], ref) < 1e-2, r0
