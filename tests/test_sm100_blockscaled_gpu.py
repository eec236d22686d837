"""GPU tests of the W4A4 path: the activation quantizer bit for bit against autofp4.quantize
(on Hopper or Blackwell: the kernel runs on both), and the Blackwell backend against the W4A4
reference (on a compute capability 10.x GPU only)."""
from __future__ import annotations

import pytest
import torch

from autofp4 import quantize
from autofp4.backends.reference import reference_linear_w4a4
from autofp4.kernels import fp4_act_quant as Q
from autofp4.kernels import sm100_blockscaled_gemm as G
from autofp4.problem import ProblemKey

pytestmark = pytest.mark.gpu


def _cc() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def _arch() -> str | None:
    cc = _cc()
    return {9: "sm_90a", 10: "sm_100a"}.get(cc[0]) if cc else None


needs_quant_gpu = pytest.mark.skipif(_arch() is None, reason="needs a Hopper or Blackwell GPU")
needs_sm100 = pytest.mark.skipif(_arch() != "sm_100a", reason="needs a Blackwell (compute capability 10.x) GPU")


@needs_quant_gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(1, 64), (130, 512), (300, 4096 + 96)])
def test_quantizer_matches_autofp4_quantize_bit_for_bit(fmt, dtype, m, k):
    torch.manual_seed(m + k)
    x = (torch.randn(m, k) * torch.logspace(-3, 3, k)).to(device="cuda", dtype=dtype)
    x[0, :32] = 0  # an all-zero block
    quant = Q.compile_quantizer(k, fmt, str(dtype).removeprefix("torch."), _arch())
    g = Q.dynamic_global_scale(x) if fmt == "nvfp4" else None
    q, buf = quant(x, g)
    torch.cuda.synchronize()
    want_q, want_buf = Q.reference_quantize(x, fmt, g)
    w = quantize(x, fmt)
    assert torch.equal(q, w.data) and torch.equal(q, want_q)
    rows, blocks = m, k // G.BLOCK_SIZE[fmt]
    assert torch.equal(G.unswizzle_scales(buf, rows, blocks), G.unswizzle_scales(want_buf, rows, blocks))
    off = G.swizzle_offsets(rows, blocks, buf.device).reshape(-1)
    pad = torch.ones(buf.numel(), dtype=torch.bool, device=buf.device)
    pad[off] = False
    assert not bool(buf[pad].any())  # padding scales are zero


@needs_quant_gpu
def test_quantizer_with_a_static_global_scale():
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    g = torch.tensor([0.002], device="cuda")
    q, buf = Q.compile_quantizer(256, "nvfp4", "bfloat16", _arch())(x, g)
    want_q, want_buf = Q.reference_quantize(x, "nvfp4", g)
    assert torch.equal(q, want_q) and torch.equal(buf, want_buf)


@needs_sm100
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m", [1, 200, 1024])
def test_backend_matches_the_w4a4_reference(fmt, m):
    from autofp4.backends import get_backend

    b = get_backend("sm100_blockscaled")
    assert b.applies_to(torch.device("cuda")), b.unavailable_reason(torch.device("cuda"))
    n, k = 2048, 1536
    w = quantize(torch.randn(n, k, device="cuda"), fmt)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    key = ProblemKey("linear", fmt, "bfloat16", n, k)
    for cfg in b.candidates(key, m)[:8]:
        out = b.compile(cfg, key)(x, b.prepare(w), bias)
        ref = reference_linear_w4a4(x, w, bias)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        assert err < 1e-2, (cfg, err)
