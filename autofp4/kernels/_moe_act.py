"""The gated activations of the MoE kernels' up-GEMM epilogues, traced into CuTeDSL code.

``activation(kind, gate, up)`` takes the fp32 gate and up values of one output and returns
``act(gate) * up`` in fp32; ``kind`` is resolved when the kernel is traced.
"""
from __future__ import annotations

ACTIVATIONS = ("silu", "gelu")


def activation(kind: str, gate, up):
    """``silu(gate) * up`` or ``gelu_tanh(gate) * up`` (fp32 DSL values)."""
    from cutlass import Float32
    from cutlass.cutlass_dsl import T

    from ._ptx import asm

    if kind == "silu":
        e = Float32(asm(T.f32(), [Float32(gate * Float32(-1.4426950408889634))], "ex2.approx.ftz.f32 $0, $1;",
                        "=f,f"))
        return gate / (Float32(1.0) + e) * up
    if kind == "gelu":
        inner = Float32(0.7978845608028654) * (gate + Float32(0.044715) * gate * gate * gate)
        t = Float32(asm(T.f32(), [Float32(inner)], "tanh.approx.f32 $0, $1;", "=f,f"))
        return Float32(0.5) * gate * (Float32(1.0) + t) * up
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {kind!r}")
