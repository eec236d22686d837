"""The public API on a CUDA GPU: whatever backend the dispatcher picks must match float64 math."""
import pytest
import torch

import autofp4
from autofp4.backends import available_backends

pytestmark = pytest.mark.gpu


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 16, 33, 200, 1000])
def test_linear_cuda_matches_float64(fmt, dtype, m, gen):
    n, k = 768, 2048
    dev = torch.device("cuda")
    w = autofp4.quantize(torch.randn(n, k, generator=gen).to(dev, torch.bfloat16), fmt)
    x = torch.randn(m, k, generator=gen).to(dev, dtype)
    bias = torch.randn(n, generator=gen).to(dev, dtype)
    y = autofp4.linear(x, w, bias)
    ref = x.double() @ w.dequantize(torch.float32).double().T + bias.double()
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel_err(y, ref) < (1e-2 if dtype == torch.bfloat16 else 3e-3)


def test_hopper_backend_is_picked_on_h100_h200():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("not a Hopper GPU")
    names = [b.name for b in available_backends(torch.device("cuda"))]
    assert names[0] == "sm90_w4a16", names


@pytest.mark.parametrize("m", [1, 64])
def test_linear_cuda_graph_capture(m, gen):
    dev = torch.device("cuda")
    w = autofp4.quantize(torch.randn(512, 1024, generator=gen).to(dev), "nvfp4")
    x = torch.randn(m, 1024, generator=gen).to(dev, torch.bfloat16)
    y_eager = autofp4.linear(x, w)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y_graph = autofp4.linear(x, w)
    x.copy_(torch.randn(m, 1024, generator=gen).to(dev, torch.bfloat16))
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(y_graph.float(), autofp4.linear(x, w).float(), rtol=1e-2, atol=1e-2)
    assert not torch.equal(y_graph, y_eager)  # the replay really recomputed with the new input


def test_moe_cuda_matches_float64(gen):
    dev = torch.device("cuda")
    e, h, inter, t = 8, 256, 128, 12
    w13 = autofp4.quantize(torch.randn(e, 2 * inter, h, generator=gen).to(dev), "nvfp4")
    w2 = autofp4.quantize(torch.randn(e, h, inter, generator=gen).to(dev), "nvfp4")
    x = torch.randn(t, h, generator=gen).to(dev, torch.bfloat16)
    tw, ti = autofp4.route(torch.randn(t, e, generator=gen).to(dev), 2)
    y = autofp4.moe(x, w13, w2, tw, ti)
    a13, a2 = w13.dequantize().double(), w2.dequantize().double()
    ref = torch.zeros(t, h, dtype=torch.float64, device=dev)
    for i in range(t):
        for j in range(2):
            ex = int(ti[i, j])
            gu = a13[ex] @ x[i].double()
            ref[i] += float(tw[i, j]) * (a2[ex] @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
    assert rel_err(y, ref) < 2e-2


def test_torch_compile_inductor_cuda(gen):
    dev = torch.device("cuda")
    lin = torch.nn.Linear(1024, 512, bias=True).to(dev, torch.bfloat16)
    q = autofp4.FP4Linear.from_linear(lin, "nvfp4")
    model = torch.nn.Sequential(q, torch.nn.GELU())
    x = torch.randn(8, 1024, generator=gen).to(dev, torch.bfloat16)
    with torch.no_grad():
        eager = model(x)
        out = torch.compile(model, fullgraph=True)(x)
    assert torch.allclose(out.float(), eager.float(), rtol=1e-2, atol=1e-2)


def test_reduce_overhead_compile_without_an_eager_call_first(gen):
    """torch.compile's CUDA graphs warm up with allocations routed to the graph's pool: weights
    packed in that first run must stay out of it (else recording refuses the untracked tensors)."""
    dev = torch.device("cuda")
    layers = []
    for n, k in ((1024, 512), (512, 1024)):
        lin = torch.nn.Linear(k, n, bias=False).to(dev, torch.bfloat16)
        layers.append(autofp4.FP4Linear.from_linear(lin, "mxfp4"))
    model = torch.nn.Sequential(layers[0], torch.nn.SiLU(), layers[1])
    ref = [(layer.fp4_weight().dequantize(torch.float32).to(dev)) for layer in layers]
    step = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(4):  # warm-up, recording, replays
            x = torch.randn(1, 512, generator=gen).to(dev, torch.bfloat16)
            out = step(x).float().clone()
            h = torch.nn.functional.silu((x.float() @ ref[0].T).to(torch.bfloat16).float())
            assert rel_err(out, h.to(torch.bfloat16).float() @ ref[1].T) < 2e-2
