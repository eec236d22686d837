"""The gated activations of the MoE kernels' up-GEMM epilogues: ``h = act(gate, up)`` in fp32.

* ``"silu"``: ``silu(gate) * up``.
* ``"gelu"``: ``gelu_tanh(gate) * up`` (the tanh approximation).
* ``"swigluoai"`` (gpt-oss): ``gate = min(gate, 7)``, ``up = clamp(up, -7, 7)``,
  ``(up + 1) * gate * sigmoid(1.702 * gate)``.

The sigmoid is ``1 / (1 + 2**(-x log2 e))`` with ``ex2.approx`` and the GELU's tanh is
``tanh.approx``. CuTeDSL is imported when :func:`activation` is traced, so the names here
(:data:`ACTIVATIONS`, the constants) are importable without it.
"""
from __future__ import annotations

ACTIVATIONS = ("silu", "gelu", "swigluoai")
#: gpt-oss's SwiGLU: the sigmoid's slope and the clamp of the gate (above) and of up (both sides)
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0

_LOG2E = 1.4426950408889634
_SQRT_2_OVER_PI = 0.7978845608028654


def _f32_op(text: str, v):
    """The fp32 result of the one-operand PTX instruction ``text`` on ``v``."""
    from cutlass import Float32
    from cutlass.cutlass_dsl import T

    from ._ptx import asm

    return Float32(asm(T.f32(), [Float32(v)], f"{text} $0, $1;", "=f,f"))


def ex2(v):
    """``2**v`` (``ex2.approx.ftz.f32``)."""
    return _f32_op("ex2.approx.ftz.f32", v)


def tanh(v):
    """``tanh(v)`` (``tanh.approx.f32``)."""
    return _f32_op("tanh.approx.f32", v)


def _x_sigmoid(x, slope: float):
    """``x * sigmoid(slope * x)``."""
    from cutlass import Float32

    return x / (Float32(1.0) + ex2(x * Float32(-slope * _LOG2E)))


def activation(kind: str, gate, up):
    """``act(gate, up)`` on fp32 values (``cutlass.Float32``) inside a CuTeDSL kernel, fp32 out;
    ``kind`` (one of :data:`ACTIVATIONS`) is resolved when the kernel is traced."""
    import cutlass
    from cutlass import Float32

    if kind == "silu":
        return _x_sigmoid(gate, 1.0) * up
    if kind == "gelu":
        inner = Float32(_SQRT_2_OVER_PI) * (gate + Float32(0.044715) * gate * gate * gate)
        return Float32(0.5) * gate * (Float32(1.0) + tanh(inner)) * up
    if kind == "swigluoai":
        gate = cutlass.min(gate, Float32(SWIGLU_LIMIT))
        up = cutlass.max(cutlass.min(up, Float32(SWIGLU_LIMIT)), Float32(-SWIGLU_LIMIT))
        return _x_sigmoid(gate, SWIGLU_ALPHA) * (up + Float32(1.0))
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {kind!r}")
