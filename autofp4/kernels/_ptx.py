"""Inline-PTX helpers shared by the CuTeDSL kernels (imported only where CuTeDSL is installed)."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

from ._fp4_bits import term_op


def ld_dsmem_f32(addr, rank):
    """fp32 at 32-bit shared-memory address ``addr`` of the CTA of cluster rank ``rank``
    (``mapa`` + ``ld.shared::cluster``; valid between cluster barriers)."""
    return Float32(asm(
        T.f32(), [Int32(addr), Int32(rank)],
        "{ .reg .u32 r; mapa.shared::cluster.u32 r, $1, $2; ld.shared::cluster.f32 $0, [r]; }",
        "=f,r,r", side_effects=True))


def asm(ret, args, text, cons, side_effects=False):
    """Inline PTX ``text`` (AT&T operand syntax, LLVM constraints ``cons``) on the DSL values
    ``args``; returns the raw LLVM value of type ``ret`` (``None``: no result). With
    ``side_effects`` the compiler keeps it, in program order, even when nothing reads a result."""
    return llvm.inline_asm(ret, [a.ir_value() for a in args], text, cons,
                           has_side_effects=side_effects, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT)


def asm_void(text, cons="", *args):
    """Inline PTX without a result, kept in program order (stores, fences, async-copy control)."""
    asm(None, args, text, cons, side_effects=True)


def _asm_u32(text, cons, *args):
    return Uint32(asm(T.i32(), args, text, cons))


def prmt(a, sel: int):
    """Bytes of ``a`` picked by the 4 selector nibbles of ``sel`` (``prmt.b32``): 0x1010
    replicates the low 16 bits into both halves, 0x3232 the high 16 bits."""
    return _asm_u32(f"prmt.b32 $0, $1, $1, {sel:#06x};", "=r,r", Uint32(a))


def mul_x2(a, b, bf16: bool):
    """Lane-wise product of two packed bf16x2 (``bf16``) or f16x2 registers, round to nearest."""
    op = "mul.rn.bf16x2" if bf16 else "mul.rn.f16x2"
    return _asm_u32(f"{op} $0, $1, $2;", "=r,r,r", Uint32(a), Uint32(b))


def ld_global_v4(addr, pred, stream: bool):
    """The four 32-bit words at global address ``addr`` (16-byte aligned) where ``pred`` is
    non-zero, else zeros (``ld.global.nc``; ``stream``: not kept in L1)."""
    hint = ".L1::no_allocate" if stream else ""
    r = asm(llvm.StructType.get_literal([T.i32()] * 4), [Int64(addr), Int32(pred)],
            "{ .reg .pred p; setp.ne.b32 p, $5, 0;\n"
            "mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;\n"
            f"@p ld.global.nc{hint}.v4.u32 {{$0,$1,$2,$3}}, [$4]; }}",
            "=r,=r,=r,=r,l,r")
    return [Uint32(llvm.extractvalue(T.i32(), r, [i])) for i in range(4)]


def mma_m16n8k16(a, b0, b1, c, bf16: bool):
    """``mma.sync.m16n8k16`` with fp32 accumulators ``c`` (4), A fragment ``a`` (4 registers of
    bf16x2 or f16x2) and B fragment ``b0, b1``; returns the 4 new accumulators."""
    text = ("mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 {{$0,$1,$2,$3}}, {{$4,$5,$6,$7}}, "
            "{{$8,$9}}, {{$10,$11,$12,$13}};").format(t="bf16" if bf16 else "f16")
    r = asm(llvm.StructType.get_literal([T.f32()] * 4),
            [Uint32(a[0]), Uint32(a[1]), Uint32(a[2]), Uint32(a[3]), Uint32(b0), Uint32(b1),
             Float32(c[0]), Float32(c[1]), Float32(c[2]), Float32(c[3])],
            text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
    return [Float32(llvm.extractvalue(T.f32(), r, [i])) for i in range(4)]


def make_load_group(slots: int, chunks: int):
    """The loads of one lane's K group in the decode kernel's packed layout: its 16-byte scale
    record (``slots`` records per group) into ``buf[off .. off + 3]``, then its ``chunks`` weight
    chunks (512 bytes apart) into ``buf[off + 4 ..]``, all where ``pred`` is non-zero, streamed
    past L1."""

    @cute.jit
    def load_group(buf: cute.Tensor, off: cutlass.Constexpr, w_base, s_base, gi, pred):
        v = ld_global_v4(s_base + Int64(gi) * (slots * 16), pred, True)
        for i in cutlass.range_constexpr(4):
            buf[off + i] = v[i]
        for c in cutlass.range_constexpr(chunks):
            v = ld_global_v4(w_base + (Int64(gi) * chunks + c) * 512, pred, True)
            for i in cutlass.range_constexpr(4):
                buf[off + 4 + 4 * c + i] = v[i]

    return load_group


def decode_pair(word, terms):
    """``OR(rotl(word, rot) & mask)`` over ``terms`` (:func:`._fp4_bits.decode_terms`), each term
    with its cheapest op: an AND, a shift and an AND, or a funnel shift and an AND."""
    out = None
    for rot, mask in terms:
        op, amount = term_op(rot, mask)
        if op == "and":
            v = word
        elif op == "shl":
            v = word << Uint32(amount)
        elif op == "shr":
            v = word >> Uint32(amount)
        else:
            v = _asm_u32(f"shf.l.wrap.b32 $0, $1, $1, {amount};", "=r,r", Uint32(word))
        v = v & Uint32(mask)
        out = v if out is None else out | v
    return out


# ----------------------------------------------------------------------------- dependent launch
# A kernel launched with programmatic dependent launch (PDL) may start while the kernel before it
# in the stream is still running. Everything before ``griddep_wait`` must therefore neither read
# memory that kernel writes nor write memory it reads; without PDL both instructions are no-ops.


def griddep_launch_dependents():
    """Let the next kernel of the stream launch once every CTA of this one has issued this (or
    exited); only a scheduling hint, it orders no memory."""
    asm_void("griddepcontrol.launch_dependents;", "~{memory}")


def griddep_wait():
    """Wait until the previous kernel of the stream has finished and its writes are visible."""
    asm_void("griddepcontrol.wait;", "~{memory}")


def prefetch_l2(addr, nbytes):
    """Pull ``nbytes`` (a multiple of 16, 16-byte aligned ``addr``) of global memory into L2
    (``cp.async.bulk.prefetch.L2``). L2 is where the GPU's global memory is kept coherent, so
    this is safe before ``griddep_wait`` even over bytes the previous kernel is writing: the
    loads after the wait still see those writes."""
    asm_void("cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r", Int64(addr), Int32(nbytes))
