"""The reference backend: dequantize, then matmul in the activation dtype.

Runs on the CPU and on any CUDA GPU. It is also the correctness oracle for every other
backend, so it stays simple and obviously right: the only tunable knob is how many output
rows of the weight are dequantized at once (memory vs. speed), which never changes the math
beyond the order of independent output columns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from ..formats import dequantize_blocks, quantize_mxfp4, quantize_nvfp4
from ..kernels._moe_act import ACTIVATIONS, SWIGLU_ALPHA, SWIGLU_LIMIT
from ..problem import ProblemKey
from .base import Backend, BackendConfig, Runner


@dataclass(frozen=True)
class ReferenceConfig:
    #: dequantize this many output rows (N) at a time; 0 = the whole weight at once.
    chunk_n: int = 0


def _dense(prepared: Any, dtype: torch.dtype) -> torch.Tensor:
    return prepared.dequantize(dtype)


def reference_linear(x: torch.Tensor, w: Any, bias: torch.Tensor | None, chunk_n: int = 0) -> torch.Tensor:
    """``x @ dequantize(w).T + bias`` in x's dtype (fp32 accumulation on GPU/CPU matmul)."""
    n = w.shape[-2]
    if chunk_n <= 0 or chunk_n >= n:
        return F.linear(x, _dense(w, x.dtype), bias)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    for s in range(0, n, chunk_n):
        e = min(s + chunk_n, n)
        wd = w.slice_rows(s, e).dequantize(x.dtype)
        out[..., s:e] = F.linear(x, wd, None if bias is None else bias[s:e])
    return out


def reference_linear_w4a4(x: torch.Tensor, w: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """What a W4A4 kernel computes: ``x`` quantized to the weight's format first (NVFP4: with
    the weight's static ``input_scale`` as its global scale when it has one, else the call's
    ``amax / (6 * 448)``; MXFP4: E8M0 block exponents), then ``xq @ dequantize(w).T + bias`` in
    fp32, cast to x's dtype (the oracle of backends whose ``numerics`` is ``"w4a4"``)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if w.fmt == "nvfp4":
        q, s, g = quantize_nvfp4(x2, global_scale=w.input_scale)
    else:
        (q, s), g = quantize_mxfp4(x2), None
    xd = dequantize_blocks(w.fmt, q, s, g, torch.float32)
    out = F.linear(xd, w.dequantize(torch.float32), None if bias is None else bias.float())
    return out.to(x.dtype).reshape(*lead, w.shape[-2])


def reference_runner(numerics: str, key: ProblemKey) -> Runner:
    """The oracle runner for ``key`` of a backend of ``numerics`` (``"w4a16"``: the reference
    backend's default; ``"w4a4"``: :func:`reference_linear_w4a4`; ``"w4a8"``: the reference
    backend's for the ``*_fp8`` ops, whose key says so)."""
    if numerics == "w4a8":
        if key.op not in ("linear_fp8", "moe_fp8"):
            raise ValueError(f"no W4A8 reference for {key.op}")
        b = ReferenceBackend()
        return b.compile(b.default(key), key)
    if numerics == "w4a4":
        if key.op != "linear":
            raise ValueError(f"no W4A4 reference for {key.op}")
        return reference_linear_w4a4
    if numerics != "w4a16":
        raise ValueError(f"numerics must be 'w4a16', 'w4a4' or 'w4a8', got {numerics!r}")
    b = ReferenceBackend()
    return b.compile(b.default(key), key)


def _act(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swigluoai":
        gate, up = gate.clamp(max=SWIGLU_LIMIT), up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
        return gate * torch.sigmoid(SWIGLU_ALPHA * gate) * (up + 1)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def reference_moe(
    x: torch.Tensor,
    w13: Any,
    w2: Any,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    chunk_n: int = 0,
    expert_map: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused-MoE layer, one expert at a time over the tokens routed to it (with
    ``expert_map``: global ids mapped to this slice's experts, pairs routed elsewhere skipped;
    the biases ``[E, 2I]`` and ``[E, H]``, if given, are added in x's dtype)."""
    t, h = x.shape
    e_local = w13.shape[0]
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        flat_ids = expert_map.to(device=x.device, dtype=torch.long)[flat_ids]
        flat_ids = torch.where(flat_ids < 0, torch.full_like(flat_ids, e_local), flat_ids)
    flat_w = topk_weights.reshape(-1).float()
    token_of = torch.arange(t, device=x.device).repeat_interleave(topk_ids.shape[1])
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=e_local + 1).tolist()[:e_local]
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        sel = order[start : start + c]
        start += c
        tok = token_of[sel]
        xe = x[tok]
        b13, b2 = (None if b is None else b[e].to(x.dtype) for b in (w13_bias, w2_bias))
        hmid = _act(reference_linear(xe, w13.expert(e), b13, chunk_n), activation)
        ye = reference_linear(hmid, w2.expert(e), b2, chunk_n)
        out.index_add_(0, tok, ye.float() * flat_w[sel, None])
    return out.to(x.dtype)


def reference_linear_w4a8(x: torch.Tensor, w: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """What a W4A8 kernel computes (the ``*_fp8`` ops): x quantized to E4M3 per token, the FP4
    weight converted to E4M3, float64 math (:func:`autofp4.kernels.sm90_w4a8_gemm.reference`)."""
    from ..kernels.sm90_w4a8_gemm import reference, warn_if_rounded

    warn_if_rounded(w)
    return reference(x, w, bias)

def reference_moe_w4a8(x: torch.Tensor, w13: Any, w2: Any, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  activation: str = "silu", expert_map: torch.Tensor | None = None,
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W4A8 MoE layer in float math on what the kernels multiply: x quantized per token,
    each expert's up product (fp32) through the activation, rounded to x's dtype (as the kernel
    stores h), quantized per row, times the expert's down weight, times the router weight, summed
    over the top-k in fp32 and rounded once. ``w13``/``w2``: stacked FP4Weight experts;
    ``expert_map``: global ids to this slice's experts (-1: another rank's, skipped)."""
    from ..kernels import fp8_act_quant
    from ..kernels.sm90_w4a8_gemm import reference_weight, warn_if_rounded

    warn_if_rounded(w13)
    warn_if_rounded(w2)
    t, top_k = topk_ids.shape
    k = x.shape[1]
    xq, sx = fp8_act_quant.reference_quantize(x, permute=False)
    xv = xq[:, :k].view(torch.float8_e4m3fn).double() * sx.double()[:, None]
    out = torch.zeros(t, w2.n, dtype=torch.float64, device=x.device)
    if expert_map is not None:
        topk_ids = expert_map.long()[topk_ids.long()]
    for e in topk_ids.unique().tolist():
        if e < 0:
            continue
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        q13, f13 = reference_weight(w13.expert(e))
        g = xv[tok] @ q13.double().T * f13
        if w13_bias is not None:
            g = g + w13_bias[e].double()
        inter = w13.n // 2
        hv = _act(g.float(), activation).to(x.dtype)
        hq, sh = fp8_act_quant.reference_quantize(hv, permute=False)
        hd = hq[:, :inter].view(torch.float8_e4m3fn).double() * sh.double()[:, None]
        q2, f2 = reference_weight(w2.expert(e))
        y = hd @ q2.double().T * f2
        if w2_bias is not None:
            y = y + w2_bias[e].double()
        y = (y * topk_weights[tok, slot].double()[:, None]).to(x.dtype)
        out.index_add_(0, tok, y.double())
    return out.to(x.dtype)


class ReferenceBackend(Backend):
    name = "reference"
    ops = frozenset({"linear", "moe", "linear_fp8", "moe_fp8"})
    config_types = {None: ReferenceConfig}

    def applies_to(self, device: torch.device) -> bool:
        return True

    def config_space(self, key: ProblemKey) -> Mapping[str, Sequence[Any]]:
        return {"chunk_n": [0, 1024, 4096]}

    def is_valid(self, config: BackendConfig, key: ProblemKey) -> str | None:
        if not isinstance(config, ReferenceConfig):
            return f"expected a ReferenceConfig, got {type(config).__name__}"
        if config.chunk_n < 0:
            return f"chunk_n must be >= 0, got {config.chunk_n}"
        if config.chunk_n and config.chunk_n >= key.n:
            return f"chunk_n={config.chunk_n} does not split n={key.n}; use 0"
        if config.chunk_n and config.chunk_n % 16:
            return f"chunk_n must be a multiple of 16, got {config.chunk_n}"
        return None

    def default(self, key: ProblemKey, m: int | None = None) -> ReferenceConfig:
        return ReferenceConfig()

    def prepare(self, weight: Any) -> Any:
        return weight

    def compile(self, config: BackendConfig, key: ProblemKey) -> Runner:
        reason = self.is_valid(config, key)
        if reason:
            raise ValueError(f"invalid reference config {config}: {reason}")
        chunk = config.chunk_n  # type: ignore[attr-defined]
        if key.op == "linear_fp8":
            return reference_linear_w4a8
        if key.op == "moe_fp8":
            return lambda x, w13, w2, tw, ti, act, expert_map=None, w13_bias=None, w2_bias=None: reference_moe_w4a8(
                x, w13, w2, tw, ti, act, expert_map, w13_bias, w2_bias)
        if key.op == "linear":
            return lambda x, w, bias: reference_linear(x, w, bias, chunk)
        return lambda x, w13, w2, tw, ti, act, expert_map=None, w13_bias=None, w2_bias=None: reference_moe(
            x, w13, w2, tw, ti, act, chunk, expert_map, w13_bias, w2_bias)
