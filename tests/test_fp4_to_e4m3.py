"""The FP4 -> E4M3 weight conversion of the W4A8 path that runs cuBLAS's FP8 GEMM
(:mod:`autofp4.kernels.fp4_to_e4m3`): its bit tricks emulated on the CPU against the in-kernel
conversion's reference (:func:`autofp4.kernels.sm90_w4a8_gemm.reference_weight`), compilation for
sm_90a without a GPU, and the kernel itself on a GPU."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from autofp4.kernels import fp4_to_e4m3 as cv  # noqa: E402
from autofp4.kernels import fp8_act_quant as aq  # noqa: E402
from autofp4.kernels import sm90_w4a8_gemm as g8  # noqa: E402
from autofp4.weights import quantize  # noqa: E402

needs_cute = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs nvidia-cutlass-dsl")


def _weight(fmt: str, n: int, k: int, seed: int, spread: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-spread, spread, n).unsqueeze(1)
    cols = torch.logspace(-spread, spread, k)[torch.randperm(k, generator=g)].unsqueeze(0)
    return quantize(torch.randn(n, k, generator=g) * rows * cols, fmt)


# ----------------------------------------------------------------- the kernel's algorithm
def _prmt(a: int, b: int, c: int) -> int:
    """PTX ``prmt.b32`` (default mode): byte i of the result is byte ``c``'s nibble i (low 3
    bits) of the 8 bytes (a, b); with the nibble's bit 3 set, that byte's sign bit replicated."""
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> 4 * i) & 0xF
        byte = src[sel & 7]
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * i
    return out


def _e4m3_bytes(v: torch.Tensor) -> list[int]:
    """``cvt.rn.satfinite.e4m3x2.f32`` of fp32 values (nearest even, saturated at 448)."""
    v = v.float()
    v = torch.where(v.isnan(), v, v.clamp(-448.0, 448.0))
    return v.to(torch.float8_e4m3fn).view(torch.uint8).tolist()


def _emulate(w, rows: range) -> torch.Tensor:
    """What the kernel computes for ``rows`` of ``w``, step by step as its PTX does."""
    n, k = int(w.shape[0]), int(w.shape[1])
    k32 = aq.padded_k(k)
    codes = w.data.to(torch.uint8).reshape(n, k // 2)
    raw = (w.scale if w.scale.dtype == torch.uint8 else w.scale.view(torch.uint8)).reshape(n, -1)
    emax = cv.e_max(w)
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    out = torch.zeros(len(rows), k32, dtype=torch.uint8)
    for i, r in enumerate(rows):
        for j in range(k32 // 16):
            if j >= k // 16:
                continue  # zeros
            c = codes[r, 8 * j:8 * j + 8].tolist()
            w0 = int.from_bytes(bytes(c[:4]), "little")
            w1 = int.from_bytes(bytes(c[4:]), "little")
            if w.fmt == "nvfp4":
                s = torch.tensor([raw[r, j].item()], dtype=torch.uint8).view(torch.float8_e4m3fn).float() * 0.125
            else:
                e = min(max(int(raw[r, j // 2]) - emax + 133, 1), 254)
                s = torch.tensor([e << 23], dtype=torch.int32).view(torch.float32)
            t = _e4m3_bytes(vals * s)
            tlo = int.from_bytes(bytes(t[:4]), "little")
            thi = int.from_bytes(bytes(t[4:]), "little")
            for q in range(4):
                sel = _prmt(w0, w1, (4 + q) << 4 | q) & 0xFFFF
                p = _prmt(tlo, thi, sel & 0x7777)
                rr = _prmt(0x7F7F7F7F, 0x7F7F7F7F, sel)
                word = p ^ (~(rr << 1) & 0x80808080)
                out[i, 16 * j + 4 * q:16 * j + 4 * q + 4] = torch.tensor(list(word.to_bytes(4, "little")),
                                                                          dtype=torch.uint8)
    return out


@pytest.mark.parametrize("fmt,n,k,spread", [("nvfp4", 6, 64, 1.0), ("nvfp4", 5, 48, 2.0), ("mxfp4", 6, 96, 1.0),
                                            ("mxfp4", 4, 64, 5.0)])
def test_the_algorithm_gives_the_in_kernel_conversion_bit_for_bit(fmt, n, k, spread):
    w = _weight(fmt, n, k, n * k, spread)
    ref = cv.reference(w)
    assert ref.shape == (n, aq.padded_k(k))
    got = _emulate(w, range(n))
    assert torch.equal(got, ref), (got != ref).nonzero()[:8]
    # and the reference is the in-kernel conversion's values, permuted as the activations are
    q, f = g8.reference_weight(w)
    deperm = aq.dequantize(ref, torch.ones(n), k).double()
    torch.testing.assert_close(deperm, q.double(), rtol=0, atol=0)
    assert f == cv.factor(w, cv.e_max(w))


def test_a_wide_mxfp4_weight_flushes_its_smallest_blocks_as_the_reference_does():
    w = _weight("mxfp4", 4, 128, 3, spread=8.0)
    raw = w.scale.view(torch.uint8).to(torch.int32)
    assert int(raw.max() - raw.min()) > 20  # some blocks convert to zero entirely
    ref = cv.reference(w)
    assert torch.equal(_emulate(w, range(4)), ref)
    assert (ref == 0).float().mean() > 0.05


def test_factor_restores_the_dequantized_weight():
    for fmt in ("nvfp4", "mxfp4"):
        w = _weight(fmt, 8, 128, 7)
        q = aq.dequantize(cv.reference(w), torch.ones(8), 128).double()
        got = q * cv.factor(w, cv.e_max(w))
        exact = w.dequantize(torch.float32).double()
        tol = 2.0**-4 if fmt == "nvfp4" else 0.0
        assert ((got - exact).abs() <= exact.abs() * tol * (1 + 1e-12)).all()


def test_validate_rules():
    assert cv.validate(4096, "nvfp4") is None and cv.validate(2880, "mxfp4") is None
    assert "multiple" in cv.validate(40, "nvfp4") and "multiple" in cv.validate(48, "mxfp4")
    assert "fmt" in cv.validate(64, "int4") and "arch" in cv.validate(64, "nvfp4", "sm_80")


@needs_cute
@pytest.mark.compile
@pytest.mark.parametrize("k,fmt", [(4096, "nvfp4"), (48, "nvfp4"), (2880, "mxfp4")])
def test_the_kernel_compiles(k, fmt, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(tmp_path))
    cv.compile_only(k, fmt)
    assert any(p.name.startswith("fp4_to_e4m3-") for p in tmp_path.iterdir())


def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _is_sm90(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("fmt,n,k,spread", [("nvfp4", 300, 4096, 2.0), ("nvfp4", 70, 144, 1.0),
                                            ("mxfp4", 300, 2880, 2.0), ("mxfp4", 64, 256, 8.0)])
def test_the_kernel_writes_the_reference_bits(fmt, n, k, spread):
    w = _weight(fmt, n, k, n + k, spread).to("cuda")
    conv = cv.compile_converter(k, fmt)
    ref = cv.reference(w)
    raw = w.scale if w.scale.dtype == torch.uint8 else w.scale.view(torch.uint8)
    out = torch.full((n, aq.padded_k(k)), 0xA5, dtype=torch.uint8, device="cuda")
    conv(w.data.view(torch.uint8).reshape(n, k // 2), raw.reshape(n, -1), cv.e_max(w), out)
    assert torch.equal(out, ref)
    # a run of rows, into a scratch buffer, as the chunked GEMM converts
    part = torch.full((n // 3, aq.padded_k(k)), 0x5A, dtype=torch.uint8, device="cuda")
    r0 = n // 3
    conv(w.data.view(torch.uint8).reshape(n, k // 2)[r0:r0 + n // 3], raw.reshape(n, -1)[r0:r0 + n // 3],
         cv.e_max(w), part)
    assert torch.equal(part, ref[r0:r0 + n // 3])


def test_stacked_experts_and_bad_rows_are_refused():
    experts = quantize(torch.randn(3, 32, 64) * torch.tensor([1.0, 10.0, 100.0]).view(3, 1, 1), "nvfp4")
    for fn in (cv.e_max, lambda w: cv.factor(w, 0), cv.reference):
        with pytest.raises(ValueError, match=r"one linear layer's weight \[N, K\], got shape \[3, 32, 64\]"):
            fn(experts)
    with pytest.raises(TypeError, match="rows must be a slice"):
        cv.reference(_weight("nvfp4", 8, 64, 1), rows=3)
    from autofp4.kernels import w4a8_cublas as cb

    assert "chunk_n" in cb.validate(cb.W4A8CublasConfig(chunk_n=1024.0), 4096, 4096, "nvfp4", "bfloat16")
