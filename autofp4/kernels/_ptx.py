"""Inline-PTX helpers shared by the CuTeDSL kernels (imported only where CuTeDSL is installed)."""
from __future__ import annotations

from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T


def ld_dsmem_f32(addr, rank):
    """fp32 at 32-bit shared-memory address ``addr`` of the CTA of cluster rank ``rank``
    (``mapa`` + ``ld.shared::cluster``; valid between cluster barriers)."""
    return Float32(llvm.inline_asm(
        T.f32(), [Int32(addr).ir_value(), Int32(rank).ir_value()],
        "{ .reg .u32 r; mapa.shared::cluster.u32 r, $1, $2; ld.shared::cluster.f32 $0, [r]; }",
        "=f,r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


def _asm_u32(text, cons, *args):
    return Uint32(llvm.inline_asm(T.i32(), [a.ir_value() for a in args], text, cons,
                                  has_side_effects=False, is_align_stack=False,
                                  asm_dialect=llvm.AsmDialect.AD_ATT))


def prmt(a, sel: int):
    """Bytes of ``a`` picked by the 4 selector nibbles of ``sel`` (``prmt.b32``): 0x1010
    replicates the low 16 bits into both halves, 0x3232 the high 16 bits."""
    return _asm_u32(f"prmt.b32 $0, $1, $1, {sel:#06x};", "=r,r", Uint32(a))


def mul_x2(a, b, bf16: bool):
    """Lane-wise product of two packed bf16x2 (``bf16``) or f16x2 registers, round to nearest."""
    op = "mul.rn.bf16x2" if bf16 else "mul.rn.f16x2"
    return _asm_u32(f"{op} $0, $1, $2;", "=r,r,r", Uint32(a), Uint32(b))
