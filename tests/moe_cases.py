"""Shared inputs of the MoE kernel tests: the models' layer shapes, random experts, routings."""
import torch

import autofp4

#: name -> (experts, top-k, hidden H, intermediate I) of one MoE layer (DeepSeek-V3: one EP-8 rank)
MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "gpt-oss-120b": (128, 4, 2880, 2880),
          "mixtral-8x7b": (8, 2, 4096, 14336), "deepseek-v3-ep8": (32, 8, 7168, 2048)}


def experts(e, n, k, fmt, gen, device="cpu"):
    """Random experts whose scales differ per expert, sized so that a layer's outputs stay O(1)
    (within fp16's range)."""
    w = torch.randn(e, n, k, generator=gen) * torch.exp(0.5 * torch.randn(e, 1, 1, generator=gen)) / k ** 0.5
    return autofp4.quantize(w.to(device), fmt)


def routing(t, e, k, mode, gen):
    """Renormalized softmax top-k routing (fp32 weights, int32 ids, on the CPU); ``mode``:
    ``"uniform"``, ``"one_expert"`` (every token's first choice is expert 0) or ``"few_experts"``
    (only experts 0 .. k+1 get tokens: the others get none)."""
    logits = torch.randn(t, e, generator=gen)
    if mode == "one_expert":
        logits[:, 0] += 100.0
    if mode == "few_experts":
        logits[:, k + 2:] -= 100.0
    w, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


def replays(graph, x, tw, ti, e, gen, modes=("uniform", "one_expert", "few_experts")):
    """Replay a captured layer on fresh inputs: for each routing of ``modes``, new random ``x``,
    router weights and expert ids copied into the captured tensors, then ``graph.replay()``;
    yields the mode after each replay."""
    t, h = x.shape
    for mode in modes:
        ntw, nti = routing(t, e, ti.shape[1], mode, gen)
        x.copy_(torch.randn(t, h, generator=gen).to(x.dtype))
        tw.copy_(ntw)
        ti.copy_(nti)
        graph.replay()
        yield mode


def check_graph_replays(run, x, p13, p2, w13, w2, tw, ti, e, gen, label=None, tol=2e-2):
    """Capture one call of ``run`` (a compiled MoE layer, SiLU) in a CUDA graph, replay it on
    each routing of :func:`replays`, and check each output against the reference backend on the
    same inputs (relative error below ``tol``)."""
    from autofp4.backends.reference import reference_moe

    run(x, p13, p2, tw, ti, "silu")  # compile and pack outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run(x, p13, p2, tw, ti, "silu")
    for mode in replays(g, x, tw, ti, e, gen):
        torch.cuda.synchronize()
        want = reference_moe(x.float(), w13, w2, tw, ti, "silu").float()
        err = float((out.float() - want).norm() / want.norm())
        assert err < tol, (label, mode, err)


def ep_slice(fmt, gen, e=4, eg=16, h=64, i=32, t=5, rank=1):
    """One rank's slice of an expert-parallel layer on the CPU: ``(x, w13, w2, tw, ti, expert_map)``
    with ``e`` local experts of ``eg``, top-2 ids among all ``eg``."""
    from autofp4.routing import rank_expert_map

    w13, w2 = experts(e, 2 * i, h, fmt, gen), experts(e, h, i, fmt, gen)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ti = torch.randint(0, eg, (t, 2), generator=gen)
    tw = torch.softmax(torch.randn(t, 2, generator=gen), -1)
    return x, w13, w2, tw, ti, rank_expert_map(eg, e, rank)


def require_hopper() -> None:
    """Skip the calling test unless a Hopper GPU (sm_90) and CuTeDSL are here."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cutlass")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 kernels need Hopper")
