"""Where the bits of eight E2M1 values sit in one packed 32-bit word (both sm90 kernels).

A word holds the 8 FP4 values one lane decodes for one MMA k16 step, as 4 pairs: pair ``j``
decodes into one 32-bit register of two bf16 (fp16) lanes, value ``h = 0`` in the low half and
``h = 1`` in the high half. Each value's 3 magnitude bits land on the low exponent / top
mantissa bits of its lane and its sign on the lane's bit 15, which is exactly the E2M1 value
times 2**-126 (bf16) or 2**-14 (fp16), subnormals included (the kernels fold the power of two
into the block scale and the epilogue).

Packing happens once, offline, so the word's bits are arranged for the cheapest decode: a pair
is ``OR(rotl(word, rot) & mask)`` over its terms. For bf16, pair 0 is already in place (one AND),
pairs 1 and 2 take one shift or rotate each and pair 3 two: 5 terms per word. (4 is impossible:
the 4 target bits of a lane, {6, 7, 8, 15}, have no 4 translates that tile the 16 bits of a
half.) fp16 lanes need 9 terms with the same packing.

Pure Python: the pack functions and the test emulators use it without CuTeDSL.
"""
from __future__ import annotations

#: (magnitude bit 0, 1, 2, sign) of a 16-bit lane, per activation dtype
LANE_BITS = {"bfloat16": (6, 7, 8, 15), "float16": (9, 10, 11, 15)}
# bf16 decode rotation (left) per pair and nibble bit: pair 3's magnitude bit 2 is its second term
_ROT = ((0, 0, 0, 0), (4, 4, 4, 4), (26, 26, 26, 26), (6, 6, 30, 6))


def word_bit(j: int, h: int, b: int) -> int:
    """The word bit holding nibble bit ``b`` (0-2 magnitude, low first; 3 sign) of value ``h``
    (0: low half, 1: high half) of pair ``j``."""
    return (LANE_BITS["bfloat16"][b] + 16 * h - _ROT[j][b]) % 32


def decode_terms(dtype: str) -> list[list[tuple[int, int]]]:
    """Per pair: ``[(rot, mask)]`` with ``register = OR(rotl(word, rot) & mask)``."""
    lane = LANE_BITS[dtype]
    out = []
    for j in range(4):
        by_rot: dict[int, int] = {}
        for h in range(2):
            for b in range(4):
                dst = lane[b] + 16 * h
                rot = (dst - word_bit(j, h, b)) % 32
                by_rot[rot] = by_rot.get(rot, 0) | (1 << dst)
        out.append(sorted(by_rot.items()))
    return out


def term_op(rot: int, mask: int) -> tuple[str, int]:
    """The cheapest op that equals ``rotl(word, rot) & mask`` before the mask: ``("and", 0)``,
    ``("shl", rot)`` when no kept bit wraps around, ``("shr", 32 - rot)`` when every kept bit
    does, else ``("rot", rot)`` (a funnel shift)."""
    kept = [d for d in range(32) if mask >> d & 1]
    if rot == 0:
        return "and", 0
    if all(d >= rot for d in kept):
        return "shl", rot
    if all(d < rot for d in kept):
        return "shr", 32 - rot
    return "rot", rot


def rotl(word, rot: int):
    """``word`` (a Python int or int64 tensor of 32-bit values) rotated left by ``rot``."""
    if rot == 0:
        return word
    return ((word << rot) | (word >> (32 - rot))) & 0xFFFFFFFF
