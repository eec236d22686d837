"""CPU tests of the Hopper W4A8 GEMM: the activation quantization and weight conversion it
computes (against independent float math), the packed-weight decode emulated bit for bit, its
configs, and compilation of both kernels for sm_90a."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from autofp4.kernels import fp8_act_quant as aq  # noqa: E402
from autofp4.kernels import sm90_w4a16_gemm as g16  # noqa: E402
from autofp4.kernels import sm90_w4a8_gemm as g8  # noqa: E402
from autofp4.kernels._fp4_bits import decode_terms, rotl  # noqa: E402
from autofp4.weights import quantize  # noqa: E402

cute_available = importlib.util.find_spec("cutlass") is not None  # the compile tests need CuTeDSL
needs_cute = pytest.mark.skipif(not cute_available, reason="needs nvidia-cutlass-dsl")


def _e4m3(b: int) -> float:
    """Value of an E4M3 byte, by hand (NaN for 0x7F / 0xFF)."""
    e, m = (b >> 3) & 0xF, b & 7
    if e == 15 and m == 7:
        return float("nan")
    v = m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if b & 0x80 else v


E4M3_VALUES = torch.tensor([_e4m3(b) for b in range(256)], dtype=torch.float64)


def _nearest_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 value of each element (ties: the even mantissa), by search over the table."""
    finite = E4M3_VALUES[~E4M3_VALUES.isnan()].unique()
    d = (y.double().reshape(-1, 1) - finite.reshape(1, -1)).abs()
    best = d.min(dim=1, keepdim=True).values
    cand = (d == best)
    # ties: the candidate whose byte has an even mantissa
    idx = torch.argmax(cand.double() * (1 + (torch.arange(finite.numel()) % 2 == 0).double()), dim=1)
    out = finite[idx].reshape(y.shape)
    return out


# ------------------------------------------------------------------ activation quantization
def test_perm32_is_a_permutation_grouping_each_k16_step():
    assert sorted(aq.PERM32) == list(range(32))
    # bytes 0..15 hold the first 16 K offsets (one k16 step), 16..31 the second
    assert set(aq.PERM32[:16]) == set(range(16))
    # byte 4t + q: offsets 2t, 2t+1, 2t+8, 2t+9
    assert aq.PERM32[4:8] == (2, 3, 10, 11)


@pytest.mark.parametrize("m,k", [(5, 64), (3, 200), (1, 8)])
def test_reference_quantize_matches_independent_rounding(m, k):
    torch.manual_seed(m * k)
    x = (torch.randn(m, k) * torch.logspace(-3, 3, m).unsqueeze(1)).to(torch.bfloat16)
    xq, sx = aq.reference_quantize(x, permute=False)
    assert xq.shape == (m, aq.padded_k(k)) and xq.dtype == torch.uint8
    amax = x.double().abs().amax(dim=1)
    torch.testing.assert_close(sx.double(), amax / 448, rtol=2**-23, atol=0)
    vals = E4M3_VALUES[xq.long()]
    assert (vals[:, k:] == 0).all()
    expect = _nearest_e4m3(x.double() * (448 / amax)[:, None])
    # the kernel scales in fp32 (448 / amax rounded once): allow the rare tie flipped by it
    diff = (vals[:, :k] != expect)
    assert diff.float().mean() < 0.01
    # every row's largest magnitude maps to 448 (or a neighbour by the fp32 scaling)
    assert (vals[:, :k].abs().amax(dim=1) >= 416).all()
    deq = aq.dequantize(xq, sx, k, permute=False).double()
    err = (deq - x.double()).abs()
    assert (err <= x.double().abs() * 2.0**-4 + amax[:, None] * 2.0**-17 + 1e-30).all()


def test_reference_quantize_permutes_within_32_blocks_and_round_trips():
    torch.manual_seed(1)
    x = torch.randn(4, 96, dtype=torch.float16)
    plain, sx0 = aq.reference_quantize(x, permute=False)
    perm, sx1 = aq.reference_quantize(x, permute=True)
    assert torch.equal(sx0, sx1)
    for blk in range(3):
        for p, off in enumerate(aq.PERM32):
            assert torch.equal(perm[:, 32 * blk + p], plain[:, 32 * blk + off])
    torch.testing.assert_close(aq.dequantize(perm, sx1, 96), aq.dequantize(plain, sx0, 96, permute=False))


def _emulate_quantizer_row(q_plain: torch.Tensor) -> torch.Tensor:
    """The bytes the quantizer kernel stores for one row, from the E4M3 bytes in K order: lane
    ``l`` of a 256-value step owns offsets 8l..8l+7 as 4 pairs p_i (low byte first); the even lane
    of a pair sends (p2, p3), the odd one (p0, p1); the even lane stores (p0 | got.p0, p1 | got.p1),
    the odd one (got.p2 | p2, got.p3 | p3), 8 bytes at offset 8l."""
    k32 = q_plain.numel()
    out = torch.zeros(k32, dtype=torch.uint8)
    b = q_plain.to(torch.int64)
    for base in range(0, k32, 16):
        ev = [int(b[base + 2 * i]) | int(b[base + 2 * i + 1]) << 8 for i in range(4)]
        od = [int(b[base + 8 + 2 * i]) | int(b[base + 9 + 2 * i]) << 8 for i in range(4)]
        send_even, send_odd = ev[2] | ev[3] << 16, od[0] | od[1] << 16
        words = [ev[0] | (send_odd & 0xFFFF) << 16, ev[1] | (send_odd >> 16) << 16,
                 (send_even & 0xFFFF) | od[2] << 16, (send_even >> 16) | od[3] << 16]
        for i, wd in enumerate(words):
            for j in range(4):
                out[base + 4 * i + j] = (wd >> (8 * j)) & 0xFF
    return out


def test_quantizer_lane_exchange_stores_the_permuted_order():
    torch.manual_seed(2)
    x = torch.randn(2, 96, dtype=torch.bfloat16)
    plain, _ = aq.reference_quantize(x, permute=False)
    perm, _ = aq.reference_quantize(x, permute=True)
    for r in range(2):
        assert torch.equal(_emulate_quantizer_row(plain[r]), perm[r])


def test_reference_quantize_zero_rows_and_nonfinite():
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    x[0] = 0
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    xq, sx = aq.reference_quantize(x, permute=False)
    assert sx[0] == 0 and (xq[0] == 0).all()
    assert torch.isnan(E4M3_VALUES[xq[1, 5].long()]) and torch.isfinite(sx[1])
    assert torch.isinf(sx[2])


# ------------------------------------------------------------------ weight conversion
def _dense(n, k, seed, spread=1.0):
    torch.manual_seed(seed)
    return (torch.randn(n, k) * torch.exp(torch.randn(n, 1) * spread)).to(torch.bfloat16)


def _weight(fmt, n, k, seed, spread=1.0):
    return quantize(_dense(n, k, seed, spread), fmt)


def test_mxfp4_conversion_is_exact_within_14_binades():
    w = _weight("mxfp4", 96, 256, 3)
    packed = g16.pack_weight(w)
    assert packed.fp16_ok and g8.weight_exact(packed)
    q, f = g8.reference_weight(w)
    torch.testing.assert_close(q.double() * f, w.dequantize(torch.float32).double(), rtol=0, atol=0)


def test_nvfp4_conversion_rounds_within_a_sixteenth():
    dense = _dense(64, 512, 4)
    w = quantize(dense, "nvfp4")
    q, f = g8.reference_weight(w)
    exact = w.dequantize(torch.float32).double()
    got = q.double() * f
    err = (got - exact).abs()
    assert (err <= exact.abs() * 2.0**-4 * (1 + 1e-12)).all()
    assert (err > 0).any()  # some products need 5 significant bits
    assert not g8.weight_exact(g16.pack_weight(w))
    # the added error is small against the FP4 quantization's own (about 0.1): ~0.02
    fp4_err = float((exact - dense.double()).norm() / dense.double().norm())
    assert float(err.norm() / exact.norm()) < 0.25 * fp4_err


def test_mxfp4_wide_spread_is_detected_rounded_within_the_bound_and_warned():
    import autofp4

    w = _weight("mxfp4", 64, 256, 5, spread=4.0)
    packed = g16.pack_weight(w)
    raw = w.scale.view(torch.uint8).to(torch.int32)
    assert int(raw.max() - raw.min()) > 14
    assert not packed.fp16_ok and not g8.weight_exact(packed)
    q, f = g8.reference_weight(w)
    exact = w.dequantize(torch.float32).double()
    err = (q.double() * f - exact).abs()
    assert (err > 0).any() and float(err.max()) < 2.0**-18 * float(exact.abs().max())
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="spanning more than 14 binades: FP8 \\(E4M3\\) rounds its smallest blocks"):
        autofp4.linear(x, w, act_dtype="fp8")


def _words(b: torch.Tensor) -> torch.Tensor:
    """Little-endian 32-bit words of uint8 [..., 4j] as int64 [..., j]."""
    b = b.to(torch.int64).reshape(*b.shape[:-1], -1, 4)
    return b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24


def _bf16_bits_to_f32(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) << 16).view(torch.float32)


def _emulate_w4a8_weight(packed: g16.PackedSm90Weight) -> torch.Tensor:
    """The E4M3 weight the kernel feeds its wgmmas, from the packed bytes, by the kernel's steps:
    word i of thread t (k16 step i), pair j decoded with the shift/mask terms, times the half of
    the row group's scale word (bf16, exact), 2**C added to both exponent fields, each lane
    widened to fp32 and rounded to E4M3; bytes (P0.lo, P0.hi, P2.lo, P2.hi) of row r and (P1, P3)
    of row r + 8 at bytes 16 (step % 2) + 4 (t % 4) of the 32-value block, then un-permuted with
    PERM32. Returns float64 [Np, Kp] values."""
    fmt = packed.fmt
    data = packed.data
    nbk, nkc, _ = data.shape
    vals = _words(data[..., :g16.VALUE_BYTES]).reshape(nbk, nkc, 128, 4)       # [nb, kc, t, step]
    sw = _words(data[..., g16.VALUE_BYTES:]).reshape(nbk, nkc, 32, -1)          # [nb, kc, q, words]
    terms = decode_terms("bfloat16")
    c = g8.EXP_SHIFT[fmt]
    np_, kp = nbk * 64, nkc * 64
    out = torch.full((np_, kp), float("nan"), dtype=torch.float64)
    t = torch.arange(128)
    warp, g, tq = t // 32, (t % 32) // 4, t % 4
    for st in range(4):
        word = vals[..., st]                                                    # [nb, kc, 128]
        s = sw[:, :, t // 4, st if fmt == "nvfp4" else st // 2]                  # [nb, kc, 128]
        prods = []
        for j in range(4):
            pair = torch.zeros_like(word)
            for rot, mask in terms[j]:
                pair |= rotl(word, rot) & mask
            half = (s >> (16 * (j % 2))) & 0xFFFF
            lanes = []
            for h in range(2):
                v = _bf16_bits_to_f32((pair >> (16 * h)) & 0xFFFF)
                p = (v * _bf16_bits_to_f32(half)).to(torch.bfloat16)             # exact
                assert torch.equal(p.float(), v * _bf16_bits_to_f32(half))
                pb = p.view(torch.int16).to(torch.int64) & 0xFFFF
                pb = (pb + (c << 7)) & 0xFFFF                                   # exponent + C
                lanes.append(_bf16_bits_to_f32(pb).to(torch.float8_e4m3fn).double())
            prods.append(lanes)
        for rr, (ja, jb) in enumerate(((0, 2), (1, 3))):
            row = (torch.arange(nbk)[:, None, None] * 64 + (16 * warp + g + 8 * rr)[None, None, :])
            blk = torch.arange(nkc)[None, :, None] * 2 + st // 2
            for q, val in enumerate((prods[ja][0], prods[ja][1], prods[jb][0], prods[jb][1])):
                p = 16 * (st % 2) + 4 * tq + q
                col = blk * 32 + torch.tensor(aq.PERM32)[p][None, None, :]
                out[row.expand(nbk, nkc, 128), col.expand(nbk, nkc, 128)] = val
    return out


@pytest.mark.parametrize("fmt,n,k", [("nvfp4", 64, 256), ("nvfp4", 200, 320), ("mxfp4", 128, 256), ("mxfp4", 72, 96)])
def test_packed_decode_to_e4m3_matches_reference_weight(fmt, n, k):
    w = _weight(fmt, n, k, n + k)
    packed = g16.pack_weight(w)
    emu = _emulate_w4a8_weight(packed)
    assert not torch.isnan(emu).any()
    q, _ = g8.reference_weight(w)
    torch.testing.assert_close(emu[:n, :k], q.double(), rtol=0, atol=0)
    assert (emu[n:] == 0).all() and (emu[:, k:] == 0).all()


def test_reference_gemm_against_float64():
    torch.manual_seed(7)
    for fmt in ("nvfp4", "mxfp4"):
        w = _weight(fmt, 96, 256, 11)
        x = torch.randn(33, 256, dtype=torch.bfloat16)
        bias = torch.randn(96, dtype=torch.bfloat16)
        out = g8.reference(x, w, bias)
        exact = x.double() @ w.dequantize(torch.float32).double().T + bias.double()
        rel = float((out.double() - exact).norm() / exact.norm())
        assert 1e-3 < rel < 0.05, (fmt, rel)  # FP8 activations: a few percent, not bf16's 0.2%
        x3 = x.reshape(3, 11, 256)
        torch.testing.assert_close(g8.reference(x3, w).reshape(33, 96), g8.reference(x, w))


# ------------------------------------------------------------------ configs and compilation
def test_validate_rules():
    ok = g8.Sm90W4A8Config()
    assert g8.validate(ok, 4096, 4096, "nvfp4", "bfloat16") is None
    assert "tile_m" in g8.validate(g8.Sm90W4A8Config(tile_m=32), 4096, 4096, "nvfp4", "bfloat16")
    assert "producer" in g8.validate(g8.Sm90W4A8Config(producer=True), 4096, 4096, "nvfp4", "bfloat16")
    assert g8.validate(g8.Sm90W4A8Config(producer=True, tile_m=128), 4096, 4096, "nvfp4", "bfloat16") is None
    assert "accumulators" in g8.validate(g8.Sm90W4A8Config(tile_n=256, tile_m=256), 4096, 4096, "nvfp4", "bfloat16")
    assert "shared memory" in g8.validate(g8.Sm90W4A8Config(stages=8), 4096, 4096, "nvfp4", "bfloat16")
    assert "block size" in g8.validate(ok, 4096, 100, "mxfp4", "bfloat16")
    with pytest.raises(ValueError, match="invalid Sm90W4A8Config"):
        g8.compile_only(g8.Sm90W4A8Config(tile_k=64), 256, 256, "nvfp4", "bfloat16")


def test_quantizer_validate():
    assert [aq.warps_per_row(k) for k in (8, 1024, 1032, 2048, 4096, 8192, 28672)] == [1, 1, 2, 2, 4, 8, 8]
    assert aq.validate(4096, "bfloat16") is None
    assert "multiple of 8" in aq.validate(100, "bfloat16")
    assert "dtype" in aq.validate(64, "float32")


@needs_cute
@pytest.mark.compile
@pytest.mark.parametrize("cfg,n,k,fmt,dtype", [
    (g8.Sm90W4A8Config(), 4096, 4096, "nvfp4", "bfloat16"),
    (g8.Sm90W4A8Config(tile_n=256, tile_m=128, stages=3, raster="m", swizzle=4), 1000, 320,
     "mxfp4", "float16"),
    (g8.Sm90W4A8Config(tile_n=64, tile_m=64, tile_k=256, producer=True, pdl=True), 96, 96, "mxfp4", "bfloat16"),
])
def test_w4a8_gemm_compiles(cfg, n, k, fmt, dtype, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(tmp_path))
    g8.compile_only(cfg, n, k, fmt, dtype)
    assert any(p.name.startswith("sm90_w4a8_gemm-") for p in tmp_path.iterdir())


@needs_cute
@pytest.mark.compile
@pytest.mark.parametrize("k,dtype", [(4096, "bfloat16"), (200, "float16"), (1040, "bfloat16"), (28672, "float16")])
def test_fp8_quantizer_compiles(k, dtype, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(tmp_path))
    aq.compile_only(k, dtype)
    assert any(p.name.startswith("fp8_act_quant-") for p in tmp_path.iterdir())


# ------------------------------------------------------------------ the opt-in API (CPU: torch numerics)
def test_linear_act_fp8_on_cpu_is_the_reference():
    import autofp4

    w = _weight("nvfp4", 48, 128, 21)
    x = torch.randn(2, 5, 128, dtype=torch.bfloat16)
    bias = torch.randn(48, dtype=torch.bfloat16)
    out = autofp4.linear(x, w, bias, act_dtype="fp8")
    assert out.shape == (2, 5, 48) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, g8.reference(x, w, bias), rtol=0, atol=0)
    plain = autofp4.linear(x, w, bias)
    assert not torch.equal(out, plain)  # FP8 activations: different numerics, only when asked
    rel = float((out.double() - plain.double()).norm() / plain.double().norm())
    assert rel < 0.05
    assert autofp4.linear(x[:, :0], w, act_dtype="fp8").shape == (2, 0, 48)


def test_linear_act_dtype_is_checked():
    import autofp4

    w = _weight("mxfp4", 32, 64, 22)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="act_dtype must be None, 'fp8' or 'fp8-prefill'"):
        autofp4.linear(x, w, act_dtype="int8")
    with pytest.raises(TypeError, match="act_dtype"):
        autofp4.linear(x, w, act_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="last dimension"):
        autofp4.linear(x[:, :32], w, act_dtype="fp8")


def test_linear_act_fp8_under_torch_compile():
    import autofp4

    w = _weight("nvfp4", 32, 64, 23)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    f = torch.compile(lambda t: autofp4.linear(t, w, act_dtype="fp8"), fullgraph=True, backend="eager")
    torch.testing.assert_close(f(x), g8.reference(x, w), rtol=0, atol=0)


def _experts(fmt, e, inter, h, seed):
    torch.manual_seed(seed)
    w13 = quantize((torch.randn(e, 2 * inter, h) * 0.5).to(torch.bfloat16), fmt)
    w2 = quantize((torch.randn(e, h, inter) * 0.5).to(torch.bfloat16), fmt)
    return w13, w2


def test_moe_act_fp8_on_cpu_is_the_reference_and_close_to_bf16():
    import autofp4
    from autofp4.w4a8 import reference_moe

    w13, w2 = _experts("mxfp4", 4, 32, 64, 31)
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    logits = torch.randn(9, 4)
    tw, ids = autofp4.route(logits, 2)
    out = autofp4.moe(x, w13, w2, tw, ids, act_dtype="fp8")
    torch.testing.assert_close(out, reference_moe(x, w13, w2, tw, ids), rtol=0, atol=0)
    plain = autofp4.moe(x, w13, w2, tw, ids)
    rel = float((out.double() - plain.double()).norm() / plain.double().norm())
    assert 1e-3 < rel < 0.06, rel
    # from the router's logits: the same routing
    torch.testing.assert_close(autofp4.moe(x, w13, w2, router_logits=logits, top_k=2, act_dtype="fp8"), out,
                               rtol=0, atol=0)
    # an expert-parallel slice: this rank's share only
    emap = torch.tensor([0, 1, -1, -1])
    part = autofp4.moe(x, w13, w2, tw, ids, expert_map=emap, act_dtype="fp8")
    keep = (ids < 2)
    torch.testing.assert_close(part, reference_moe(x, w13, w2, tw * keep, torch.where(keep, ids, 0)), rtol=0, atol=0)
    with pytest.raises(ValueError, match="act_dtype"):
        autofp4.moe(x, w13, w2, tw, ids, act_dtype="e4m3")


def test_moe_reference_against_float64_layer():
    from autofp4.w4a8 import reference_moe

    w13, w2 = _experts("nvfp4", 3, 48, 64, 32)
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    tw = torch.rand(7, 2)
    ids = torch.stack([torch.randperm(3)[:2] for _ in range(7)])
    out = reference_moe(x, w13, w2, tw, ids, "gelu").double()
    exact = torch.zeros(7, 64, dtype=torch.float64)
    for t in range(7):
        for j in range(2):
            e = int(ids[t, j])
            g = w13.expert(e).dequantize(torch.float32).double() @ x[t].double()
            hv = torch.nn.functional.gelu(g[:48], approximate="tanh") * g[48:]
            exact[t] += tw[t, j] * (w2.expert(e).dequantize(torch.float32).double() @ hv)
    rel = float((out - exact).norm() / exact.norm())
    assert 1e-3 < rel < 0.1, rel  # two FP8 quantizations and two NVFP4 weight roundings, over few terms


def test_moe_act_fp8_under_torch_compile():
    import autofp4
    from autofp4.w4a8 import reference_moe

    w13, w2 = _experts("nvfp4", 4, 16, 32, 33)
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    tw, ids = autofp4.route(torch.randn(5, 4), 2)
    f = torch.compile(lambda a, b, c: autofp4.moe(a, w13, w2, b, c, act_dtype="fp8"), fullgraph=True, backend="eager")
    torch.testing.assert_close(f(x, tw, ids), reference_moe(x, w13, w2, tw, ids), rtol=0, atol=0)


@needs_cute
@pytest.mark.compile
@pytest.mark.parametrize("cfg,n,k,fmt,act", [
    (g8.Sm90W4A8Config(tile_m=128), 1536, 2048, "nvfp4", "silu"),
    (g8.Sm90W4A8Config(tile_m=64, raster="m", stages=6), 5760, 2880, "mxfp4", "swigluoai"),
])
def test_w4a8_grouped_gemms_compile(cfg, n, k, fmt, act, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(tmp_path))
    g8.compile_moe_only(cfg, n, k, fmt, "bfloat16", act)
    assert sum(p.name.startswith("sm90_w4a8_moe-") and p.suffix == ".o" for p in tmp_path.iterdir()) == 2


def test_fp8_prefill_switches_on_rows():
    import autofp4
    from autofp4.w4a8 import PREFILL_MIN_ROWS, reference_moe

    w = _weight("nvfp4", 32, 64, 41)
    few = torch.randn(PREFILL_MIN_ROWS - 1, 64, dtype=torch.bfloat16)
    many = torch.randn(PREFILL_MIN_ROWS, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(autofp4.linear(few, w, act_dtype="fp8-prefill"), autofp4.linear(few, w), rtol=0, atol=0)
    torch.testing.assert_close(autofp4.linear(many, w, act_dtype="fp8-prefill"), g8.reference(many, w), rtol=0, atol=0)
    w13, w2 = _experts("mxfp4", 4, 32, 32, 42)
    for t, fp8 in ((PREFILL_MIN_ROWS * 2 - 1, False), (PREFILL_MIN_ROWS * 2, True)):
        x = torch.randn(t, 32, dtype=torch.bfloat16)
        tw, ids = autofp4.route(torch.randn(t, 4), 2)
        got = autofp4.moe(x, w13, w2, tw, ids, act_dtype="fp8-prefill")
        want = reference_moe(x, w13, w2, tw, ids) if fp8 else autofp4.moe(x, w13, w2, tw, ids)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
