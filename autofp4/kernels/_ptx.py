"""Inline-PTX helpers shared by the CuTeDSL kernels (imported only where CuTeDSL is installed)."""
from __future__ import annotations

from cutlass import Float32, Int32
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
