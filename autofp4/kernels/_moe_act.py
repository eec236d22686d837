"""The gated activations of the MoE kernels' up-GEMM epilogues, traced into CuTeDSL code.

``activation(kind, gate, up)`` takes the fp32 gate and up values of one output and returns the
gated activation in fp32; ``kind`` is resolved when the kernel is traced:

* ``"silu"``: ``silu(gate) * up`` (SwiGLU);
* ``"gelu"``: ``gelu_tanh(gate) * up``;
* ``"swigluoai"`` (gpt-oss): ``gate = min(gate, 7)``, ``up = clamp(up, -7, 7)``,
  ``(up + 1) * gate * sigmoid(1.702 * gate)``.
"""
from __future__ import annotations

ACTIVATIONS = ("silu", "gelu", "swigluoai")
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0
_LOG2E = 1.4426950408889634


def _sigmoid_scaled(x, scale: float):
    """``sigmoid(scale * x)`` with one ``ex2.approx``."""
    from cutlass import Float32
    from cutlass.cutlass_dsl import T

    from ._ptx import asm

    e = Float32(asm(T.f32(), [Float32(x * Float32(-scale * _LOG2E))], "ex2.approx.ftz.f32 $0, $1;", "=f,f"))
    return Float32(1.0) / (Float32(1.0) + e)


def activation(kind: str, gate, up):
    """The gated activation ``kind`` of fp32 DSL values ``gate`` and ``up``."""
    import cutlass
    from cutlass import Float32
    from cutlass.cutlass_dsl import T

    from ._ptx import asm

    if kind == "silu":
        return gate * _sigmoid_scaled(gate, 1.0) * up
    if kind == "gelu":
        inner = Float32(0.7978845608028654) * (gate + Float32(0.044715) * gate * gate * gate)
        t = Float32(asm(T.f32(), [Float32(inner)], "tanh.approx.f32 $0, $1;", "=f,f"))
        return Float32(0.5) * gate * (Float32(1.0) + t) * up
    if kind == "swigluoai":
        lim = Float32(SWIGLUOAI_LIMIT)
        g = cutlass.min(gate, lim)
        u = cutlass.max(cutlass.min(up, lim), -lim)
        return (u + Float32(1.0)) * g * _sigmoid_scaled(g, SWIGLUOAI_ALPHA)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {kind!r}")
