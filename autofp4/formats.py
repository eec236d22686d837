"""NVFP4 and MXFP4: the E2M1 grid, the scale encodings, quantize and dequantize.

Both formats store weights ``[N, K]`` (MoE: ``[E, N, K]``) as E2M1 codes, two per byte along
K (the even K index in the low nibble), plus one scale per block of K values.

E2M1 code (4 bits): bit 3 is the sign, bits 0..2 index the magnitudes
``0, 0.5, 1, 1.5, 2, 3, 4, 6``.

NVFP4 (ModelOpt / TensorRT-LLM convention), block of 16:
    global  = amax(|w|) / (6 * 448)                       fp32, per tensor ([E] for MoE)
    scale_b = E4M3(amax_b / 6 / global)                   torch.float8_e4m3fn, one per block
    code    = E2M1(w / (fp32(scale_b) * global))          nearest, ties to even, saturated
    w      ~= e2m1(code) * scale_b * global
The divisions and the product are fp32, in the order written (as ModelOpt computes them): when
the exact quotient would be an E2M1 tie, the fp32 rounding of ``scale * global`` decides the side.
A block whose E4M3 scale is zero (all-zero block, or a block too small for E4M3) stores zero
codes. A tensor (or expert) that is all zero gets the global scale 1.0.

MXFP4 (OCP Microscaling Formats v1.0), block of 32:
    e       = clamp(floor(log2(amax_b)) - 2, -127, 127)   (-127 for an all-zero block)
    scale_b = uint8(e + 127)                              E8M0: biased exponent, 255 = NaN
    code    = E2M1(w / 2**e)                              nearest, ties to even, saturated
    w      ~= e2m1(code) * 2**e

Everything is vectorized (no Python loop over blocks or experts) and computed in fp32; the
result is identical bit for bit on the CPU and on CUDA.
"""
from __future__ import annotations

import torch

from .problem import BLOCK_SIZE, FORMATS

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "E8M0_BIAS",
    "E8M0_NAN",
    "E2M1_VALUES",
    "e2m1_table",
    "e2m1_encode",
    "e2m1_decode",
    "e8m0_to_float",
    "float_to_e8m0",
    "pack_nibbles",
    "unpack_nibbles",
    "check_fmt",
    "quantize_nvfp4",
    "quantize_mxfp4",
    "dequantize_blocks",
]

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255

#: E2M1 value of each 4-bit code 0..15 (codes 8..15 are the negatives; 8 is -0.0)
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)

# Round-to-nearest-even on the E2M1 magnitudes as a sum of comparisons: the magnitude code of
# |y| is the number of midpoints below it. A tie goes to the even code, so the comparison is
# strict (">") where the lower neighbour has the even code and ">=" where the upper one has.
#   0.25: 0|0.5 -> 0    0.75: 0.5|1 -> 1    1.25: 1|1.5 -> 1    1.75: 1.5|2 -> 2
#   2.5:  2|3   -> 2    3.5:  3|4   -> 4    5:    4|6   -> 4
_MIDPOINTS_STRICT = (0.25, 1.25, 2.5, 5.0)  # tie stays on the lower (even) code
_MIDPOINTS_INCLUSIVE = (0.75, 1.75, 3.5)  # tie moves to the upper (even) code

_FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


def check_fmt(fmt: str, what: str = "") -> None:
    """Raise ``TypeError`` unless ``fmt`` is a str and ``ValueError`` unless it is one of
    :data:`~autofp4.problem.FORMATS`; ``what`` (the calling function) prefixes the message."""
    pre = f"{what}: " if what else ""
    if not isinstance(fmt, str):
        raise TypeError(f"{pre}fmt must be a str, one of {FORMATS}, got {type(fmt).__name__}")
    if fmt not in BLOCK_SIZE:
        raise ValueError(f"{pre}fmt must be one of {FORMATS}, got {fmt!r}")


# ------------------------------------------------------------------------------ E2M1
def e2m1_table(device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16-entry decode table: ``e2m1_table()[code]`` is the value of a 4-bit code."""
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def _magnitude_codes(a: torch.Tensor) -> torch.Tensor:
    """E2M1 magnitude codes (uint8 0..7) of non-negative fp32 values, saturated at 6."""
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for m in _MIDPOINTS_STRICT:
        code += a > m
    for m in _MIDPOINTS_INCLUSIVE:
        code += a >= m
    return code


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of already-scaled values: nearest, ties to the even code,
    saturated to +-6. The sign bit is set for ``x < 0``: a negative value that rounds to zero
    gives -0 (code 8), -0.0 itself gives code 0. Callers reject NaN beforehand."""
    if not x.is_floating_point():
        raise TypeError(f"e2m1_encode expects a floating-point tensor, got {x.dtype}")
    code = _magnitude_codes(x.abs())
    code |= (x < 0).to(torch.uint8) << 3
    return code


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of E2M1 codes (uint8 0..15, one per element)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"e2m1_decode expects uint8 codes, got {codes.dtype}")
    table = e2m1_table(codes.device, dtype)
    return table.index_select(0, codes.reshape(-1).int()).reshape(codes.shape)


# ------------------------------------------------------------------------------ E8M0
def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 biased exponents) -> fp32 ``2 ** (byte - 127)``; 255 -> NaN.

    Exact for every byte: 0 gives 2**-127 (an fp32 subnormal), 254 gives 2**127."""
    if scale.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8 biased exponents, got {scale.dtype}")
    b = scale.to(torch.int32)
    # fp32 bit pattern of 2**(b - 127): exponent field b for b >= 1; 2**-127 is the subnormal 0x00400000
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    out = bits.view(torch.float32)
    return torch.where(b == E8M0_NAN, torch.full_like(out, float("nan")), out)


def float_to_e8m0(amax: torch.Tensor) -> torch.Tensor:
    """The OCP MX shared-exponent byte of block maxima (fp32, >= 0, finite):
    ``clamp(floor(log2(amax)) - 2, -127, 127) + 127``; 0 (and anything below 2**-125) -> 0."""
    if amax.dtype != torch.float32:
        raise TypeError(f"float_to_e8m0 expects fp32 block maxima, got {amax.dtype}")
    # floor(log2(a)) of a normal fp32 is its exponent field minus 127; zero and subnormals
    # have field 0 and a floor(log2) <= -127, so they clamp to the minimum like the rule says.
    field = (amax.view(torch.int32) >> 23) & 0xFF
    return (field - 2).clamp(0, 254).to(torch.uint8)


# ------------------------------------------------------------------------------ packing
def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., K]`` (values 0..15) -> bytes ``[..., K // 2]``; even K index in the
    low nibble, odd K index in the high nibble."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_nibbles expects uint8 codes, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got shape {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"pack_nibbles expects 4-bit codes (0..15), got a maximum of {int(codes.max())}")
    return _pack(codes)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """bytes ``[..., K // 2]`` -> uint8 codes ``[..., K]`` (inverse of :func:`pack_nibbles`)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_nibbles expects uint8 bytes, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("unpack_nibbles expects at least one dimension, got a scalar")
    out = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ------------------------------------------------------------------------------ quantize
def _check_weight(w: torch.Tensor, fmt: str) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"quantize: w must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"quantize: w must be a bfloat16, float16 or float32 weight, got {w.dtype}")
    if w.dim() not in (2, 3):
        raise ValueError(
            f"quantize: w must be a weight [N, K] or stacked experts [E, N, K], got {w.dim()}-D shape {tuple(w.shape)}"
        )
    if w.numel() == 0:
        raise ValueError(f"quantize: w must not be empty, got an empty weight of shape {tuple(w.shape)}")
    bs = BLOCK_SIZE[fmt]
    if w.shape[-1] % bs:
        raise ValueError(
            f"quantize: {fmt} needs K (the last dimension of w) to be a multiple of its block size {bs}, "
            f"got K={w.shape[-1]} (shape {tuple(w.shape)})"
        )
    if w.is_meta:
        raise ValueError(f"quantize: w is on the meta device, which holds no values to quantize (shape {tuple(w.shape)})")


def _blocks_abs(w: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(|w| as fp32 [..., K/bs, bs], block maxima fp32 [..., K/bs])."""
    a = w.float().abs_() if w.dtype != torch.float32 else w.abs()
    a = a.reshape(*w.shape[:-1], w.shape[-1] // bs, bs)
    return a, a.amax(dim=-1)


def _finish_codes(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Packed codes of the scaled magnitudes ``y`` [..., K/bs, bs] with the sign of ``w`` [..., K]."""
    code = _magnitude_codes(y).reshape(w.shape)
    code |= (w < 0).to(torch.uint8) << 3
    return _pack(code)


def _const(v: float, like: torch.Tensor) -> torch.Tensor:
    """``v`` as a 0-d fp32 tensor on ``like``'s device (a true-division divisor, see quantize_nvfp4)."""
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def _raise_non_finite(w: torch.Tensor) -> None:
    raise ValueError(
        f"quantize: w must hold finite weights, got NaN or inf in a weight of shape {tuple(w.shape)} ({w.dtype})"
    )


@torch.no_grad()
def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` [..., N, K] -> (packed codes uint8 [..., N, K/2], E4M3 scales [..., N, K/16],
    fp32 global scale [] or [E]). See the module docstring for the rules.

    ``global_scale`` (fp32, one value): use it instead of ``amax / (6 * 448)``, as an
    activation quantized with a checkpoint's static input scale is (block scales above 448
    saturate; no host sync)."""
    _check_weight(w, "nvfp4")
    a, bmax = _blocks_abs(w, 16)
    if global_scale is not None:
        gs = global_scale.to(device=w.device, dtype=torch.float32).reshape(())
        g = gs.reshape(1, 1)
        scale = (bmax / _const(E2M1_MAX, bmax) / g).clamp_(max=E4M3_MAX).to(torch.float8_e4m3fn)
        return _nvfp4_codes(w, a, scale, g), scale, gs
    amax = bmax.amax(dim=(-2, -1))  # [] or [E]
    if not bool(torch.isfinite(amax).all()):
        _raise_non_finite(w)
    # Divisors are device tensors, not Python numbers: CUDA turns division by a host scalar into
    # multiplication by its rounded reciprocal, which can differ from true division by one ulp
    # and would make CUDA and CPU quantization disagree.
    gs = amax / _const(E2M1_MAX * E4M3_MAX, amax)
    gs = torch.where(gs > 0, gs, torch.ones_like(gs))  # an all-zero tensor: any positive scale
    g = gs.reshape(gs.shape + (1, 1))  # broadcast over [N, K/16]
    scale = (bmax / _const(E2M1_MAX, bmax) / g).clamp_(max=E4M3_MAX).to(torch.float8_e4m3fn)
    return _nvfp4_codes(w, a, scale, g), scale, gs


def _nvfp4_codes(w: torch.Tensor, a: torch.Tensor, scale: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    denom = scale.float() * g
    # a zero block scale dequantizes the whole block to zero: store zero codes (x / inf = 0)
    denom = torch.where(denom > 0, denom, torch.full_like(denom, float("inf")))
    y = a.div_(denom.unsqueeze(-1))
    return _finish_codes(y, w)


@torch.no_grad()
def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., N, K] -> (packed codes uint8 [..., N, K/2], E8M0 scales uint8 [..., N, K/32])."""
    _check_weight(w, "mxfp4")
    a, bmax = _blocks_abs(w, 32)
    if not bool(torch.isfinite(bmax).all()):
        _raise_non_finite(w)
    scale = float_to_e8m0(bmax)
    y = a.div_(e8m0_to_float(scale).unsqueeze(-1))  # division by a power of two: exact
    return _finish_codes(y, w), scale


# ------------------------------------------------------------------------------ dequantize
@torch.no_grad()
def dequantize_blocks(fmt: str, data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense weight ``[..., N, K]`` of packed codes ``data`` [..., N, K/2] and block scales
    ``scale`` (NVFP4: E4M3, with the fp32 ``global_scale`` [] or [E]; MXFP4: E8M0), computed in
    fp32 and cast to ``dtype``.

    NVFP4: ``(e2m1 * scale) * global`` (the first product is exact, so the fp32 result is the
    correctly rounded value of the exact product). MXFP4: ``e2m1 * 2**e`` (exact)."""
    check_fmt(fmt)
    bs = BLOCK_SIZE[fmt]
    # 256-entry table: byte -> (value of the low nibble, value of the high nibble)
    t = e2m1_table(data.device)
    lut = torch.stack((t.repeat(16), t.repeat_interleave(16)), dim=-1)
    vals = lut.index_select(0, data.reshape(-1).int())
    lead = tuple(data.shape[:-1])
    k = data.shape[-1] * 2
    vals = vals.reshape(*lead, k // bs, bs)
    if fmt == "nvfp4":
        g = global_scale.float().reshape(global_scale.shape + (1, 1, 1))
        out = vals.mul_(scale.float().unsqueeze(-1)).mul_(g)
    else:
        out = vals.mul_(e8m0_to_float(scale).unsqueeze(-1))
    return out.reshape(*lead, k).to(dtype)
