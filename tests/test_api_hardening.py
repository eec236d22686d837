"""The public API on bad input, generated here: wrong Python types, shapes, dtypes and devices,
NaN/inf, out-of-range ids, unknown names, non-contiguous tensors.

Every case must end either in a TypeError/ValueError whose message names the argument, or in a
result that matches float64 math written here (no autofp4 code in the references). Any other
exception, a message that does not name the argument, a bad input that returns, or a wrong
result fails the case.

``python tests/test_api_hardening.py [--seeds N]`` prints the tally per API: cases tried / clear
error / crashed (another exception, or a message not naming the argument, or a valid input
rejected) / accepted silently (a bad input that returned, or a wrong result).
"""
from __future__ import annotations

import os
import random
import re
import string
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import nn

import autofp4
from autofp4 import loaders

FORMATS = ("nvfp4", "mxfp4")
BS = {"nvfp4": 16, "mxfp4": 32}
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------ cases and their outcome
@dataclass
class Err:
    """Expect a TypeError/ValueError whose message names one of ``names``."""

    names: tuple[str, ...]


@dataclass
class Ok:
    """Expect a result; ``check(result)`` raises AssertionError when it is wrong."""

    check: Callable[[Any], None]


@dataclass
class Case:
    api: str
    label: str
    fn: Callable[[], Any]
    expect: Any


def err(*names: str) -> Err:
    return Err(names)


def _names_in(msg: str, names: tuple[str, ...]) -> bool:
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", msg) for n in names)


def outcome(case: Case) -> tuple[str, str]:
    """("error" | "result" | "crash" | "silent", detail)."""
    try:
        result = case.fn()
    except Exception as e:  # noqa: BLE001 - classifying every exception is the point
        msg = str(e)
        if isinstance(case.expect, Ok):
            return "crash", f"valid input rejected: {type(e).__name__}: {msg[:300]}"
        if not isinstance(e, (TypeError, ValueError)):
            return "crash", f"{type(e).__name__}: {msg[:300]}"
        if not _names_in(msg, case.expect.names):
            return "crash", f"{type(e).__name__} not naming {case.expect.names}: {msg[:300]}"
        return "error", ""
    if isinstance(case.expect, Err):
        return "silent", f"returned {type(result).__name__} (expected an error naming {case.expect.names})"
    try:
        case.expect.check(result)
    except AssertionError as e:
        return "silent", f"wrong result: {e}"
    return "result", ""


# ------------------------------------------------------------------ float64 references
def decode64(fmt: str, data: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None) -> torch.Tensor:
    """The dense weight from the raw tensors, in float64."""
    b = data.cpu().long()
    codes = torch.stack((b & 0xF, b >> 4), -1).reshape(*b.shape[:-1], b.shape[-1] * 2)
    mag = torch.tensor(GRID, dtype=torch.float64)[codes & 7]
    vals = torch.where(codes >= 8, -mag, mag)
    if fmt == "nvfp4":
        g = gs.cpu().double()
        s = scale.cpu().float().double() * g.reshape(g.shape + (1, 1))
    else:
        s = torch.exp2(scale.cpu().double() - 127)
    return vals * s.repeat_interleave(BS[fmt], -1)


def dense64(w: autofp4.FP4Weight) -> torch.Tensor:
    return decode64(w.fmt, w.data, w.scale, w.global_scale)


TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-5, torch.float64: 1e-9}


def assert_close(y: Any, ref: torch.Tensor, dtype: torch.dtype, tol: float | None = None) -> None:
    """``y`` has ref's shape and ``dtype``, the same non-finite entries, and a small relative
    Frobenius error on the finite ones."""
    assert isinstance(y, torch.Tensor), f"expected a tensor, got {type(y).__name__}"
    assert tuple(y.shape) == tuple(ref.shape), f"shape {tuple(y.shape)} != {tuple(ref.shape)}"
    assert y.dtype == dtype, f"dtype {y.dtype} != {dtype}"
    y64 = y.detach().cpu().double()
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(y64), fin), "non-finite entries differ from the reference"
    if fin.any():
        a, b = y64[fin], ref[fin]
        scale = float(b.norm()) or 1.0
        e = float((a - b).norm()) / scale
        assert e < (tol or TOL[dtype]), f"relative error {e:.3g}"


def linear64(x: torch.Tensor, w: autofp4.FP4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.detach().cpu().double() @ dense64(w).T
    return y if bias is None else y + bias.detach().cpu().double()


def moe64(x, w13, w2, tw, ti, act) -> torch.Tensor:
    a13, a2 = dense64(w13), dense64(w2)
    inter = a2.shape[-1]
    x64 = x.cpu().double()
    out = torch.zeros(x64.shape, dtype=torch.float64)
    tw, ti = tw.cpu().double(), ti.cpu().long()
    for t in range(x64.shape[0]):
        for j in range(ti.shape[1]):
            e = int(ti[t, j])
            gu = a13[e] @ x64[t]
            g, u = gu[:inter], gu[inter:]
            if act == "silu":
                h = g / (1 + torch.exp(-g)) * u
            else:
                h = 0.5 * g * (1 + torch.tanh(0.7978845608028654 * (g + 0.044715 * g**3))) * u
            out[t] += float(tw[t, j]) * (a2[e] @ h)
    return out


def check_route(logits: torch.Tensor, top_k: int, renormalize: bool):
    def check(res):
        assert isinstance(res, tuple) and len(res) == 2, f"expected (weights, ids), got {type(res).__name__}"
        w, ids = res
        t, e = logits.shape
        assert w.shape == (t, top_k) and ids.shape == (t, top_k), f"shapes {tuple(w.shape)} {tuple(ids.shape)}"
        assert w.dtype == torch.float32 and ids.dtype == torch.int32, f"dtypes {w.dtype} {ids.dtype}"
        if logits.is_meta:
            assert w.is_meta and ids.is_meta
            return
        p = torch.softmax(logits.detach().cpu().double(), dim=-1)
        ids64 = ids.cpu().long()
        assert bool(((ids64 >= 0) & (ids64 < e)).all()), "ids out of range"
        for r in range(t):
            assert len(set(ids64[r].tolist())) == top_k, "repeated id in a row"
        picked = p.gather(1, ids64)
        best = p.topk(top_k, dim=-1).values
        assert torch.allclose(picked.sort(-1, descending=True).values, best, atol=1e-6), "not the top-k experts"
        want = picked / picked.sum(-1, keepdim=True) if renormalize else picked
        assert torch.allclose(w.cpu().double(), want, atol=1e-5), "wrong weights"

    return check


# ------------------------------------------------------------------ input generators
def rand_str(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_letters + string.digits + "_-") for _ in range(rng.randint(0, 9)))


def bad_types(rng: random.Random, like: torch.Tensor | None = None, none_ok: bool = False) -> list[tuple[str, Any]]:
    """Wrong Python types for an argument; the list and the array hold ``like``'s values."""
    arr = like.detach().cpu().float().numpy() if like is not None else np.random.default_rng(rng.randint(0, 2**31)).standard_normal(3)
    lst = arr.tolist()
    out = [
        ("int", rng.randint(-3, 300)),
        ("str", rand_str(rng)),
        ("list", lst if isinstance(lst, list) else [lst]),
        ("ndarray", arr),
        ("dict", {rand_str(rng): rng.random()}),
    ]
    if not none_ok:
        out.insert(0, ("None", None))
    return out


BAD_FLOAT_DTYPES = (torch.int32, torch.int64, torch.bool, torch.uint8, torch.float8_e4m3fn)


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return t > 0
    if not dtype.is_floating_point:
        return t.round().clamp(0, 100).to(dtype)
    return t.to(dtype)


def non_contiguous(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """The values of ``t`` in a non-contiguous tensor (a strided slice of a wider one, or a
    transposed copy)."""
    out = t
    if t.dim() >= 2 and rng.random() < 0.5:
        out = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if out.is_contiguous():
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        wide[..., ::2] = t
        out = wide[..., ::2]
    assert not out.is_contiguous() or t.numel() <= 1
    return out


def put(t: torch.Tensor, rng: random.Random, value: float) -> torch.Tensor:
    t = t.clone()
    flat = t.view(-1)
    for _ in range(rng.randint(1, 3)):
        flat[rng.randrange(flat.numel())] = value
    return t


def rand_w(gen, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


# ------------------------------------------------------------------ quantize / dequantize
def check_quantized(w: torch.Tensor, fmt: str):
    ref = autofp4.quantize(w.contiguous(), fmt)

    def check(q):
        assert isinstance(q, autofp4.FP4Weight) and q.fmt == fmt and q.shape == w.shape
        for a in ("data", "scale", "global_scale"):
            ta, tb = getattr(q, a), getattr(ref, a)
            assert (ta is None) == (tb is None) and (ta is None or torch.equal(ta.view(torch.uint8) if ta.dtype == torch.float8_e4m3fn else ta,
                                                                                 tb.view(torch.uint8) if tb.dtype == torch.float8_e4m3fn else tb)), a
        # and the dequantized values are within the format's error of w (per block, float64)
        w64 = w.detach().double()
        d = dense64(q)
        bs = BS[fmt]
        amax = w64.abs().reshape(*w64.shape[:-1], -1, bs).amax(-1).repeat_interleave(bs, -1)
        g = w64.abs().amax() / 2688 if fmt == "nvfp4" else 0.0
        bound = (0.19 if fmt == "nvfp4" else 0.51) * amax + 6 * 2**-9 * g + 1e-30
        assert bool(((d - w64).abs() <= bound).all()), "dequantized values off by more than the format's error"

    return check


def quantize_cases(rng: random.Random, gen: torch.Generator) -> list[Case]:
    out = []
    def one(fmt):
        bs = BS[fmt]
        n, k = 16 * rng.randint(1, 4), 32 * rng.randint(1, 4)
        w = rand_w(gen, n, k, dtype=rng.choice([torch.float32, torch.bfloat16, torch.float16]))
        A = f"quantize[{fmt}]"
        for label, v in bad_types(rng, w):
            out.append(Case(A, f"w={label}", lambda v=v: autofp4.quantize(v, fmt), err("w")))
        for label, v in bad_types(rng)[:1] + bad_types(rng)[1:]:
            if label == "str":
                continue
            out.append(Case(A, f"fmt={label}", lambda v=v: autofp4.quantize(w, v), err("fmt")))
        for bad in (rand_str(rng), fmt.upper(), "fp4", "", " " + fmt):
            out.append(Case(A, f"fmt={bad!r}", lambda bad=bad: autofp4.quantize(w, bad), err("fmt")))
        shapes = {
            "0-D": (), "1-D": (k,), "4-D": (2, 1, n, k), "empty N": (0, k), "zero K": (n, 0),
            "zero experts": (0, n, k), "K not a block multiple": (n, k + rng.randint(1, bs - 1)),
        }
        for label, shp in shapes.items():
            out.append(Case(A, f"w {label} {shp}", lambda shp=shp: autofp4.quantize(torch.randn(shp), fmt), err("w")))
        for dt in BAD_FLOAT_DTYPES + (torch.float64, torch.complex64):
            out.append(Case(A, f"w {dt}", lambda dt=dt: autofp4.quantize(cast(w.float(), dt), fmt), err("w")))
        for bad in (float("nan"), float("inf"), float("-inf")):
            out.append(Case(A, f"w with {bad}", lambda bad=bad: autofp4.quantize(put(w, rng, bad), fmt), err("w")))
        out.append(Case(A, "w on meta", lambda: autofp4.quantize(w.to("meta"), fmt), err("w")))
        # valid: non-contiguous 2-D and stacked, zero blocks, all-zero tensor
        wn = non_contiguous(w, rng)
        out.append(Case(A, "w non-contiguous", lambda: autofp4.quantize(wn, fmt), Ok(check_quantized(wn, fmt))))
        ws = rand_w(gen, 3, k, n).transpose(-1, -2)
        out.append(Case(A, "stacked w transposed view", lambda: autofp4.quantize(ws, fmt), Ok(check_quantized(ws, fmt))))
        we = rand_w(gen, 1, k).expand(n, k)
        out.append(Case(A, "w expanded (stride 0)", lambda: autofp4.quantize(we, fmt), Ok(check_quantized(we, fmt))))
        wz = torch.zeros(n, k)
        out.append(Case(A, "w all zero", lambda: autofp4.quantize(wz, fmt), Ok(check_quantized(wz, fmt))))
    for fmt in FORMATS:
        one(fmt)
    return out


def check_dequantized(w: autofp4.FP4Weight, dtype: torch.dtype):
    ref = dense64(w).float().to(dtype)

    def check(d):
        assert isinstance(d, torch.Tensor) and d.dtype == dtype and d.shape == w.shape
        assert torch.equal(d.cpu(), ref), "not the float64 decode of the stored values"

    return check


def dequantize_cases(rng: random.Random, gen: torch.Generator) -> list[Case]:
    out = []
    def one(fmt):
        lead = rng.choice([(), (rng.randint(1, 3),)])
        w = autofp4.quantize(rand_w(gen, *lead, 16 * rng.randint(1, 3), 32 * rng.randint(1, 3)), fmt)
        A = f"dequantize[{fmt}]"
        dense = w.dequantize()
        for label, v in bad_types(rng, dense) + [("tensor", dense), ("FP4Linear", autofp4.FP4Linear(w) if not lead else dense)]:
            out.append(Case(A, f"w={label}", lambda v=v: autofp4.dequantize(v), err("w")))
        for label, v in bad_types(rng) + [("str 'float32'", "float32"), ("python float type", float)]:
            out.append(Case(A, f"dtype={label}", lambda v=v: autofp4.dequantize(w, v), err("dtype")))
            out.append(Case(A, f"w.dequantize(dtype={label})", lambda v=v: w.dequantize(v), err("dtype")))
        for dt in (torch.int32, torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.complex64):
            out.append(Case(A, f"dtype={dt}", lambda dt=dt: autofp4.dequantize(w, dt), err("dtype")))
        for dt in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            out.append(Case(A, f"dtype={dt}", lambda dt=dt: autofp4.dequantize(w, dt), Ok(check_dequantized(w, dt))))
        wn = autofp4.FP4Weight(fmt, non_contiguous(w.data, rng), non_contiguous(w.scale, rng), w.global_scale)
        out.append(Case(A, "non-contiguous data and scale", lambda: autofp4.dequantize(wn), Ok(check_dequantized(wn, torch.float32))))
    for fmt in FORMATS:
        one(fmt)
    return out


# ------------------------------------------------------------------ FP4Weight(...)
def fp4weight_cases(rng: random.Random, gen: torch.Generator) -> list[Case]:
    out = []
    def one(fmt):
        lead = rng.choice([(), (rng.randint(1, 3),)])
        n, k = 16 * rng.randint(1, 3), 32 * rng.randint(1, 3)
        q = autofp4.quantize(rand_w(gen, *lead, n, k), fmt)
        d, s, g = q.data, q.scale, q.global_scale
        ins = torch.rand(lead, generator=gen) + 0.05
        A = f"FP4Weight[{fmt}]"
        W = autofp4.FP4Weight

        def ok_weight(fmt_, d_, s_, g_, ins_=None):
            def check(w):
                assert isinstance(w, W) and w.shape == torch.Size((*d_.shape[:-1], d_.shape[-1] * 2))
                if not d_.is_meta:
                    assert torch.equal(w.dequantize(torch.float64), decode64(fmt_, d_, s_, g_).float().double())

            return Ok(check)

        for label, v in bad_types(rng):
            if label != "str":
                out.append(Case(A, f"fmt={label}", lambda v=v: W(v, d, s, g), err("fmt")))
        for bad in (rand_str(rng), fmt.upper(), "nvfp8"):
            out.append(Case(A, f"fmt={bad!r}", lambda bad=bad: W(bad, d, s, g), err("fmt")))
        for label, v in bad_types(rng, d):
            out.append(Case(A, f"data={label}", lambda v=v: W(fmt, v, s, g), err("data")))
        for dt in (torch.int8, torch.float32, torch.bool, torch.float8_e4m3fn, torch.int32):
            dd = d.view(torch.int8) if dt == torch.int8 else cast(d.float(), dt)
            out.append(Case(A, f"data {dt}", lambda dd=dd: W(fmt, dd, s, g), err("data")))
        bad_shapes = {
            "1-D": d.reshape(-1), "4-D": d.reshape(1, *d.shape) if lead else d.reshape(1, 1, *d.shape),
            "empty": d[..., :0, :], "zero K": d[..., :0], "K not a block multiple": d[..., : d.shape[-1] - rng.randint(1, BS[fmt] // 2 - 1)],
        }
        for label, dd in bad_shapes.items():
            out.append(Case(A, f"data {label} {tuple(dd.shape)}", lambda dd=dd: W(fmt, dd, s, g), err("data", "scale")))
        for label, v in bad_types(rng, s.float()):
            out.append(Case(A, f"scale={label}", lambda v=v: W(fmt, d, v, g), err("scale")))
        wrong_dts = (torch.uint8, torch.float32, torch.bfloat16) if fmt == "nvfp4" else (torch.float8_e4m3fn, torch.int8, torch.float32)
        for dt in wrong_dts:
            ss = s.view(dt) if s.element_size() == 1 and dt.itemsize == 1 else s.float().to(dt)
            out.append(Case(A, f"scale {dt}", lambda ss=ss: W(fmt, d, ss, g), err("scale")))
        for label, ss in {"one block short": s[..., :-1], "extra dim": s.unsqueeze(0), "rows short": s[..., :-1, :]}.items():
            out.append(Case(A, f"scale {label}", lambda ss=ss: W(fmt, d, ss, g), err("scale")))
        if fmt == "nvfp4":
            for label, v in bad_types(rng, g):
                out.append(Case(A, f"global_scale={label}", lambda v=v: W(fmt, d, s, v), err("global_scale")))
            out.append(Case(A, "global_scale=python float", lambda: W(fmt, d, s, 0.5), err("global_scale")))
            for dt in (torch.float64, torch.bfloat16, torch.int32):
                out.append(Case(A, f"global_scale {dt}", lambda dt=dt: W(fmt, d, s, cast(g, dt)), err("global_scale")))
            out.append(Case(A, "global_scale wrong shape", lambda: W(fmt, d, s, g.reshape(-1).repeat(2)), err("global_scale")))
            for bad in (float("nan"), float("inf"), 0.0, -rng.random()):
                out.append(Case(A, f"global_scale {bad}", lambda bad=bad: W(fmt, d, s, put(g.reshape(-1), rng, bad).reshape(g.shape)), err("global_scale")))
            for byte in (0x7F, 0xFF, 0x80 | rng.randint(1, 0x7E)):
                sb = s.view(torch.uint8).clone()
                sb.view(-1)[rng.randrange(sb.numel())] = byte
                out.append(Case(A, f"scale byte {byte:#x}", lambda sb=sb: W(fmt, d, sb.view(torch.float8_e4m3fn), g), err("scale")))
            out.append(Case(A, "global_scale on meta", lambda: W(fmt, d, s, g.to("meta")), err("global_scale")))
        else:
            out.append(Case(A, "global_scale given", lambda: W(fmt, d, s, torch.tensor(1.0)), err("global_scale")))
            sb = s.clone()
            sb.view(-1)[rng.randrange(sb.numel())] = 255
            out.append(Case(A, "scale 255 (NaN)", lambda: W(fmt, d, sb), err("scale")))
        gg = g if fmt == "nvfp4" else None
        for label, v in bad_types(rng, ins, none_ok=True) + [("python float", 0.5)]:
            out.append(Case(A, f"input_scale={label}", lambda v=v: W(fmt, d, s, gg, v), err("input_scale")))
        for bad in (float("nan"), 0.0, -1.0, float("inf")):
            out.append(Case(A, f"input_scale {bad}", lambda bad=bad: W(fmt, d, s, gg, torch.tensor(bad)), err("input_scale")))
        out.append(Case(A, "input_scale wrong shape", lambda: W(fmt, d, s, gg, torch.ones(7)), err("input_scale")))
        out.append(Case(A, "input_scale float64", lambda: W(fmt, d, s, gg, torch.ones((), dtype=torch.float64)), err("input_scale")))
        out.append(Case(A, "input_scale on meta", lambda: W(fmt, d, s, gg, ins.to("meta")), err("input_scale")))
        out.append(Case(A, "scale on meta", lambda: W(fmt, d, s.to("meta"), gg), err("scale")))
        for label, v in [("None", None), ("str", rand_str(rng)), ("list", [True]), ("ndarray", np.array([1])), ("dict", {})]:
            out.append(Case(A, f"check_values={label}", lambda v=v: W(fmt, d, s, gg, check_values=v), err("check_values")))
        # valid
        out.append(Case(A, "valid", lambda: W(fmt, d, s, gg, ins), ok_weight(fmt, d, s, gg)))
        dn, sn = non_contiguous(d, rng), non_contiguous(s, rng)
        out.append(Case(A, "non-contiguous data and scale", lambda: W(fmt, dn, sn, gg), ok_weight(fmt, dn, sn, gg)))
        dm, sm = d.to("meta"), s.to("meta")
        gm = None if gg is None else gg.to("meta")
        out.append(Case(A, "all on meta", lambda: W(fmt, dm, sm, gm), ok_weight(fmt, dm, sm, gm)))
    for fmt in FORMATS:
        one(fmt)
    return out


# ------------------------------------------------------------------ linear
def linear_cases(rng: random.Random, gen: torch.Generator, device: str = "cpu") -> list[Case]:
    out = []
    dev = torch.device(device)
    def one(fmt):
        n, k = 16 * rng.randint(1, 4), 32 * rng.randint(1, 4)
        dt = rng.choice([torch.bfloat16, torch.float16])
        other = torch.float16 if dt == torch.bfloat16 else torch.bfloat16
        m = rng.randint(1, 5)
        w = autofp4.quantize(rand_w(gen, n, k).to(dev), fmt)
        x = rand_w(gen, m, k).to(dev, dt)
        bias = rand_w(gen, n).to(dev, dt)
        def add(warm):
            A = f"linear[{fmt}{',warm' if warm else ''}]"

            def call(xx, ww=w, bb=None, warm=warm, use_bias=False):
                if warm and isinstance(ww, autofp4.FP4Weight):
                    # the fast path: the same M/dtype/device as the bad call, with and without bias
                    autofp4.linear(x, ww, bias if use_bias else None)
                return autofp4.linear(xx, ww, bb)

            def ok(xx, bb=None, ww=w):
                ref = linear64(xx, ww, bb)
                return Ok(lambda y: assert_close(y, ref, xx.dtype))

            for label, v in bad_types(rng, x):
                out.append(Case(A, f"x={label}", lambda v=v: call(v), err("x")))
            for label, v in bad_types(rng, w.dequantize()) + [("dense tensor", w.dequantize().to(dt))]:
                out.append(Case(A, f"w={label}", lambda v=v: call(x, v), err("w")))
            for label, v in bad_types(rng, bias, none_ok=True):
                out.append(Case(A, f"bias={label}", lambda v=v: call(x, bb=v, use_bias=True), err("bias")))
            stacked = autofp4.quantize(rand_w(gen, 2, n, k).to(dev), fmt)
            out.append(Case(A, "w stacked", lambda: call(x, stacked), err("w")))
            for label, xx in {
                "0-D": x[0, 0], "K short": x[:, : k - 16], "K long": torch.cat([x, x[:, :16]], 1), "K zero": x[:, :0],
                "K mismatch 3-D": x.reshape(m, 1, k)[..., : k // 2],
            }.items():
                out.append(Case(A, f"x {label} {tuple(xx.shape)}", lambda xx=xx: call(xx), err("x")))
            for bdt in (torch.float32, torch.float64, torch.int32, torch.bool, torch.float8_e4m3fn, torch.uint8):
                xx = cast(x.float(), bdt)
                out.append(Case(A, f"x {bdt}", lambda xx=xx: call(xx), err("x")))
            for label, bb in {
                "short": bias[:-1], "long": torch.cat([bias, bias[:1]]), "2-D": bias[None], "0-D": bias[0],
            }.items():
                out.append(Case(A, f"bias {label}", lambda bb=bb: call(x, bb=bb, use_bias=True), err("bias")))
            for bdt in (torch.float32, other, torch.int32, torch.float64, torch.bool):
                bb = cast(bias.float(), bdt)
                out.append(Case(A, f"bias {bdt}", lambda bb=bb: call(x, bb=bb, use_bias=True), err("bias")))
            out.append(Case(A, "x on meta", lambda: call(x.to("meta")), err("x")))
            out.append(Case(A, "bias on meta", lambda: call(x, bb=bias.to("meta"), use_bias=True), err("bias")))
            if CUDA and dev.type == "cpu":
                out.append(Case(A, "x on cuda, w on cpu", lambda: call(x.cuda()), err("x")))
                out.append(Case(A, "bias on cuda", lambda: call(x, bb=bias.cuda(), use_bias=True), err("bias")))
            if dev.type == "cuda":
                out.append(Case(A, "x on cpu, w on cuda", lambda: call(x.cpu()), err("x")))
                out.append(Case(A, "bias on cpu", lambda: call(x, bb=bias.cpu(), use_bias=True), err("bias")))
            # valid: other ranks, empty batches, NaN/inf pass through, non-contiguous, Parameter bias
            for label, xx in {
                "1-D": x[0], "3-D": x.reshape(m, 1, k), "4-D": x.reshape(1, m, 1, k), "empty": x[:0],
                "zero-size middle dim": x.reshape(m, 1, k)[:, :0], "x with NaN": put(x, rng, float("nan")),
                "x with inf": put(x, rng, float("inf")), "x non-contiguous": non_contiguous(x, rng),
                "x expanded (stride 0)": x[:1].expand(m, k),
            }.items():
                out.append(Case(A, label, lambda xx=xx: call(xx), ok(xx)))
            out.append(Case(A, "with bias", lambda: call(x, bb=bias, use_bias=True), ok(x, bias)))
            bn = non_contiguous(bias, rng)
            out.append(Case(A, "bias non-contiguous", lambda: call(x, bb=bn, use_bias=True), ok(x, bn)))
            bp = nn.Parameter(bias.clone(), requires_grad=False)
            out.append(Case(A, "bias a Parameter", lambda: call(x, bb=bp, use_bias=True), ok(x, bp)))
            wn = autofp4.FP4Weight(fmt, non_contiguous(w.data, rng), non_contiguous(w.scale, rng), w.global_scale)
            out.append(Case(A, "w non-contiguous", lambda: call(x, wn), ok(x, ww=wn)))
        for warm in (False, True):
            add(warm)
        if dev.type == "cpu":
            wm = autofp4.FP4Weight(fmt, w.data.to("meta"), w.scale.to("meta"), None if w.global_scale is None else w.global_scale.to("meta"))
            xm = x.to("meta")

            def meta_ok(y, m=m, n=n, dt=dt):
                assert y.is_meta and y.shape == (m, n) and y.dtype == dt

            out.append(Case(f"linear[{fmt}]", "x and w on meta", lambda: autofp4.linear(xm, wm), Ok(meta_ok)))
            out.append(Case(f"linear[{fmt}]", "x on cpu, w on meta", lambda: autofp4.linear(x, wm), err("x")))
    for fmt in FORMATS:
        one(fmt)
    return out


# ------------------------------------------------------------------ moe and route
def moe_cases(rng: random.Random, gen: torch.Generator, device: str = "cpu") -> list[Case]:
    out = []
    dev = torch.device(device)
    def one(fmt):
        e, h, inter, t = rng.randint(2, 5), 32 * rng.randint(1, 3), 32 * rng.randint(1, 2), rng.randint(1, 5)
        top_k = rng.randint(1, e)
        dt = rng.choice([torch.bfloat16, torch.float16])
        w13 = autofp4.quantize(rand_w(gen, e, 2 * inter, h).to(dev), fmt)
        w2 = autofp4.quantize(rand_w(gen, e, h, inter).to(dev), fmt)
        x = rand_w(gen, t, h).to(dev, dt)
        logits = rand_w(gen, t, e).to(dev)
        tw, ti = autofp4.route(logits, top_k)
        A = f"moe[{fmt}]"
        M = autofp4.moe

        def ok(xx=x, tw_=tw, ti_=ti, act="silu"):
            ref = moe64(xx, w13, w2, tw_, ti_, act)
            return Ok(lambda y: assert_close(y, ref, xx.dtype, 2e-2))

        for label, v in bad_types(rng, x):
            out.append(Case(A, f"x={label}", lambda v=v: M(v, w13, w2, tw, ti), err("x")))
        for label, v in bad_types(rng) + [("dense tensor", w13.dequantize())]:
            out.append(Case(A, f"w13={label}", lambda v=v: M(x, v, w2, tw, ti), err("w13")))
            out.append(Case(A, f"w2={label}", lambda v=v: M(x, w13, v, tw, ti), err("w2")))
        for label, v in bad_types(rng, tw):
            out.append(Case(A, f"topk_weights={label}", lambda v=v: M(x, w13, w2, v, ti), err("topk_weights")))
        for label, v in bad_types(rng, ti.float()):
            out.append(Case(A, f"topk_ids={label}", lambda v=v: M(x, w13, w2, tw, v), err("topk_ids")))
        for label, v in bad_types(rng) + [("str", rand_str(rng) + "x"), ("relu", "relu"), ("SILU", "SILU"), ("", "")]:
            out.append(Case(A, f"activation={label!s}", lambda v=v: M(x, w13, w2, tw, ti, v), err("activation")))
        # shapes
        for label, xx in {"0-D": x[0, 0], "1-D": x[0], "3-D": x[None], "H mismatch": x[:, : h - 16], "H zero": x[:, :0]}.items():
            out.append(Case(A, f"x {label} {tuple(xx.shape)}", lambda xx=xx: M(xx, w13, w2, tw, ti), err("x")))
        two_d = w13.expert(0)
        out.append(Case(A, "w13 2-D", lambda: M(x, two_d, w2, tw, ti), err("w13")))
        out.append(Case(A, "w2 2-D", lambda: M(x, w13, w2.expert(0), tw, ti), err("w2")))
        w2_few = autofp4.quantize(rand_w(gen, e + 1, h, inter).to(dev), fmt)
        out.append(Case(A, "w2 other E", lambda: M(x, w13, w2_few, tw, ti), err("w2")))
        w2_i = autofp4.quantize(rand_w(gen, e, h, inter + 32).to(dev), fmt)
        out.append(Case(A, "w2 other I", lambda: M(x, w13, w2_i, tw, ti), err("w2")))
        w2_f = autofp4.quantize(rand_w(gen, e, h, inter).to(dev), "mxfp4" if fmt == "nvfp4" else "nvfp4")
        out.append(Case(A, "w2 other format", lambda: M(x, w13, w2_f, tw, ti), err("w2")))
        w13_odd = autofp4.quantize(rand_w(gen, e, 2 * inter + 1, h).to(dev), "nvfp4") if fmt == "nvfp4" else None
        if w13_odd is not None:
            out.append(Case(A, "w13 odd middle dim", lambda: M(x, w13_odd, w2, tw, ti), err("w13")))
        for label, tt in {"1-D": tw[:, 0], "T short": tw[:-1] if t > 1 else tw[:0], "top_k+1": torch.cat([tw, tw[:, :1]], 1)}.items():
            out.append(Case(A, f"topk_weights {label}", lambda tt=tt: M(x, w13, w2, tt, ti), err("topk_weights", "topk_ids")))
        for bdt in (torch.int32, torch.bool, torch.int64):
            tt = cast(tw * 10, bdt)
            out.append(Case(A, f"topk_weights {bdt}", lambda tt=tt: M(x, w13, w2, tt, ti), err("topk_weights")))
        for label, ii in {"1-D": ti[:, 0], "T short": ti[:-1] if t > 1 else ti[:0], "3-D": ti[None], "top_k 0": ti[:, :0]}.items():
            out.append(Case(A, f"topk_ids {label}", lambda ii=ii: M(x, w13, w2, tw[:, : ii.shape[-1]] if ii.dim() == 2 else tw, ii), err("topk_ids")))
        ids_more = torch.arange(e + 1, device=dev).repeat(t, 1).to(torch.int32) % e
        out.append(Case(A, "top_k > E", lambda: M(x, w13, w2, torch.rand(t, e + 1, device=dev), ids_more), err("topk_ids")))
        for bdt in (torch.float32, torch.bool, torch.int16, torch.uint8, torch.int8, torch.float64):
            ii = cast(ti.float(), bdt)
            out.append(Case(A, f"topk_ids {bdt}", lambda ii=ii: M(x, w13, w2, tw, ii), err("topk_ids")))
        for label, bad in (("negative", -rng.randint(1, 5)), ("== E", e), ("> E", e + rng.randint(1, 100))):
            ii = put(ti, rng, bad)
            out.append(Case(A, f"topk_ids {label}", lambda ii=ii: M(x, w13, w2, tw, ii), err("topk_ids")))
        for label, call in {
            "x on meta": lambda: M(x.to("meta"), w13, w2, tw, ti),
            "topk_weights on meta": lambda: M(x, w13, w2, tw.to("meta"), ti),
            "topk_ids on meta": lambda: M(x, w13, w2, tw, ti.to("meta")),
        }.items():
            out.append(Case(A, label, call, err(label.split()[0])))
        if CUDA and dev.type == "cpu":
            out.append(Case(A, "x on cuda", lambda: M(x.cuda(), w13, w2, tw, ti), err("x")))
            out.append(Case(A, "topk_ids on cuda", lambda: M(x, w13, w2, tw, ti.cuda()), err("topk_ids")))
            out.append(Case(A, "topk_weights on cuda", lambda: M(x, w13, w2, tw.cuda(), ti), err("topk_weights")))
        if dev.type == "cuda":
            out.append(Case(A, "topk_ids on cpu", lambda: M(x, w13, w2, tw, ti.cpu()), err("topk_ids")))
            out.append(Case(A, "topk_weights on cpu", lambda: M(x, w13, w2, tw.cpu(), ti), err("topk_weights")))
        # valid
        out.append(Case(A, "valid", lambda: M(x, w13, w2, tw, ti), ok()))
        out.append(Case(A, "gelu", lambda: M(x, w13, w2, tw, ti, "gelu"), ok(act="gelu")))
        out.append(Case(A, "empty T", lambda: M(x[:0], w13, w2, tw[:0], ti[:0]), ok(x[:0], tw[:0], ti[:0])))
        ti64 = ti.long()
        out.append(Case(A, "topk_ids int64", lambda: M(x, w13, w2, tw, ti64), ok(ti_=ti64)))
        for bdt in (torch.float64, torch.float16, torch.bfloat16):
            tt = tw.to(bdt)
            out.append(Case(A, f"topk_weights {bdt}", lambda tt=tt: M(x, w13, w2, tt, ti), ok(tw_=tt)))
        xn, twn, tin = non_contiguous(x, rng), non_contiguous(tw, rng), non_contiguous(ti, rng)
        out.append(Case(A, "non-contiguous x, topk_weights, topk_ids", lambda: M(xn, w13, w2, twn, tin), ok(xn, twn, tin)))
        xnan = put(x, rng, float("nan"))
        out.append(Case(A, "x with NaN", lambda: M(xnan, w13, w2, tw, ti), ok(xnan)))
        dup = ti.clone()
        dup[:, :] = dup[:, :1]
        out.append(Case(A, "repeated expert in a row", lambda: M(x, w13, w2, tw, dup), ok(ti_=dup)))
    for fmt in FORMATS:
        one(fmt)
    return out


def route_cases(rng: random.Random, gen: torch.Generator, device: str = "cpu") -> list[Case]:
    out = []
    dev = torch.device(device)
    A = "route"
    R = autofp4.route
    def one():
        t, e = rng.randint(1, 6), rng.randint(2, 12)
        top_k = rng.randint(1, e)
        logits = rand_w(gen, t, e).to(dev, rng.choice([torch.float32, torch.bfloat16, torch.float16]))
        for label, v in bad_types(rng, logits):
            out.append(Case(A, f"router_logits={label}", lambda v=v: R(v, top_k), err("router_logits")))
        for label, v in bad_types(rng) + [("float", float(top_k)), ("1-element tensor list", [top_k])]:
            if label == "int":
                continue
            out.append(Case(A, f"top_k={label}", lambda v=v: R(logits, v), err("top_k")))
        for label, v in bad_types(rng) + [("int 2", 2)]:
            if label == "int":
                continue
            out.append(Case(A, f"renormalize={label}", lambda v=v: R(logits, top_k, v), err("renormalize")))
        for bad in (0, -rng.randint(1, 9), e + rng.randint(1, 9)):
            out.append(Case(A, f"top_k={bad} (E={e})", lambda bad=bad: R(logits, bad), err("top_k")))
        for label, ll in {"0-D": logits[0, 0], "1-D": logits[0], "3-D": logits[None], "E zero": logits[:, :0]}.items():
            out.append(Case(A, f"router_logits {label}", lambda ll=ll: R(ll, 1), err("router_logits", "top_k")))
        for bdt in (torch.int32, torch.int64, torch.bool, torch.uint8):
            ll = cast(logits.float() * 5, bdt)
            out.append(Case(A, f"router_logits {bdt}", lambda ll=ll: R(ll, top_k), err("router_logits")))
        for bad in (float("nan"), float("inf")):
            ll = put(logits, rng, bad)
            out.append(Case(A, f"router_logits with {bad}", lambda ll=ll: R(ll, top_k), err("router_logits")))
        allneg = logits.clone()
        allneg[rng.randrange(t)] = float("-inf")
        out.append(Case(A, "a row of -inf", lambda: R(allneg, top_k), err("router_logits")))
        # valid: -inf masks, other dtypes, non-contiguous, numpy int top_k, meta, empty T
        masked = logits.clone()
        for r in range(t):
            cols = rng.sample(range(e), rng.randint(0, e - 1))
            masked[r, cols] = float("-inf")
        for renorm in (True, False):
            out.append(Case(A, f"-inf masks, renormalize={renorm}", lambda renorm=renorm: R(masked, top_k, renorm), Ok(check_route(masked, top_k, renorm))))
        for dt in (torch.float64, torch.float32):
            ll = logits.to(dt)
            out.append(Case(A, f"router_logits {dt}", lambda ll=ll: R(ll, top_k), Ok(check_route(ll, top_k, True))))
        ln = non_contiguous(logits, rng)
        out.append(Case(A, "non-contiguous", lambda: R(ln, top_k), Ok(check_route(ln, top_k, True))))
        out.append(Case(A, "top_k numpy int", lambda: R(logits, np.int64(top_k)), Ok(check_route(logits, top_k, True))))
        out.append(Case(A, "empty T", lambda: R(logits[:0], top_k), Ok(check_route(logits[:0], top_k, True))))
        lm = logits.to("meta")
        out.append(Case(A, "meta", lambda: R(lm, top_k), Ok(check_route(lm, top_k, True))))
    for _ in range(2):
        one()
    return out


# ------------------------------------------------------------------ quantize_model / FP4Linear
class _Net(nn.Module):
    def __init__(self, k, n, gen):
        super().__init__()
        self.a = nn.Linear(k, n)
        self.b = nn.Linear(n, k, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, x):
        return self.b(self.a(x))


def nn_cases(rng: random.Random, gen: torch.Generator) -> list[Case]:
    out = []
    def one(fmt):
        n, k = 32 * rng.randint(1, 3), 32 * rng.randint(1, 3)
        dt = rng.choice([torch.bfloat16, torch.float16])
        w = autofp4.quantize(rand_w(gen, n, k), fmt)
        bias = rand_w(gen, n).to(dt)
        x = rand_w(gen, 3, k).to(dt)
        A = f"FP4Linear[{fmt}]"
        L = autofp4.FP4Linear
        for label, v in bad_types(rng) + [("dense tensor", w.dequantize()), ("stacked", autofp4.quantize(rand_w(gen, 2, n, k), fmt))]:
            out.append(Case(A, f"weight={label}", lambda v=v: L(v), err("weight")))
        for label, v in bad_types(rng, bias, none_ok=True):
            out.append(Case(A, f"bias={label}", lambda v=v: L(w, v), err("bias")))
        for label, bb in {"short": bias[:-1], "2-D": bias[None], "int": bias.int(), "meta": bias.to("meta")}.items():
            out.append(Case(A, f"bias {label}", lambda bb=bb: L(w, bb), err("bias")))
        for label, v in bad_types(rng, x):
            out.append(Case(A, f"forward x={label}", lambda v=v: L(w)(v), err("x")))
        out.append(Case(A, "forward x float32", lambda: L(w)(x.float()), err("x")))
        ref = linear64(x, w, bias)
        out.append(Case(A, "forward", lambda: L(w, bias)(x), Ok(lambda y: assert_close(y, ref, dt))))
        for label, v in bad_types(rng):
            out.append(Case(A, f"from_linear linear={label}", lambda v=v: L.from_linear(v, fmt), err("linear")))
        lin = nn.Linear(k, n)
        for label, v in bad_types(rng)[:1] + [("list", [fmt]), ("unknown", rand_str(rng) + "4")]:
            out.append(Case(A, f"from_linear fmt={label}", lambda v=v: L.from_linear(lin, v), err("fmt")))
        # quantize_model
        A = f"quantize_model[{fmt}]"
        Q = autofp4.quantize_model
        for label, v in bad_types(rng) + [("a tensor", w.dequantize())]:
            out.append(Case(A, f"model={label}", lambda v=v: Q(v, fmt), err("model")))
        for label, v in bad_types(rng)[:1] + [("list", [fmt]), ("ndarray", np.array([1.0])), ("dict", {fmt: 1}), ("unknown", fmt + "x")]:
            out.append(Case(A, f"fmt={label}", lambda v=v: Q(_Net(k, n, gen), v), err("fmt")))
        for label, v in [("None", None), ("int", rng.randint(0, 9)), ("str", "a"), ("list of int", [1, 2]),
                         ("ndarray", np.array([1.0])), ("dict", {"a": 1}), ("list with None", ["a", None])]:
            out.append(Case(A, f"skip={label}", lambda v=v: Q(_Net(k, n, gen), fmt, v), err("skip")))
        net = _Net(k, n, gen).to(dt)
        xin = rand_w(gen, 2, k).to(dt)

        def convert_and_run(net=net, skip=("lm_head",)):
            rep = Q(net, fmt, skip)
            return rep, net(xin)

        def check_model(res, net=net):
            rep, y = res
            assert sorted(rep.converted) == ["a", "b"], rep.converted
            h = linear64(xin, net.a.fp4_weight(), net.a.bias)
            ref = h.to(dt).double() @ dense64(net.b.fp4_weight()).T
            assert_close(y, ref, dt, 2e-2)

        out.append(Case(A, "valid", convert_and_run, Ok(check_model)))
        net2 = _Net(k, n, gen).to(dt)
        out.append(Case(A, "skip a generator", lambda: convert_and_run(net2, (p for p in ["x"])), Ok(lambda r, net2=net2: check_model(r, net2))))
    for fmt in FORMATS:
        one(fmt)
    return out


# ------------------------------------------------------------------ loaders
def loader_cases(rng: random.Random, gen: torch.Generator) -> list[Case]:
    out = []
    lead = rng.choice([(), (rng.randint(2, 3),)])
    n, k = 16 * rng.randint(1, 3), 32 * rng.randint(1, 3)
    q = autofp4.quantize(rand_w(gen, *lead, n, k), "nvfp4")
    d, s, g = q.data, q.scale, q.global_scale
    ins = torch.rand((), generator=gen) + 0.05
    A = "from_modelopt"
    F = loaders.from_modelopt

    def same_as(ref):
        def check(w):
            assert isinstance(w, autofp4.FP4Weight) and w.shape == ref.shape
            assert torch.equal(dense64(w), dense64(ref))

        return Ok(check)

    for label, v in bad_types(rng, d):
        out.append(Case(A, f"weight={label}", lambda v=v: F(v, s, g), err("weight")))
    for label, v in bad_types(rng, s.float()):
        out.append(Case(A, f"weight_scale={label}", lambda v=v: F(d, v, g), err("weight_scale")))
    for label, v in bad_types(rng, g):
        if label != "int":  # a Python number is a valid scale
            out.append(Case(A, f"weight_scale_2={label}", lambda v=v: F(d, s, v), err("weight_scale_2")))
    for label, v in bad_types(rng, ins, none_ok=True):
        if label != "int":
            out.append(Case(A, f"input_scale={label}", lambda v=v: F(d, s, g, v), err("input_scale")))
    for dt in (torch.int8, torch.float32, torch.bool):
        dd = d.view(torch.int8) if dt == torch.int8 else cast(d.float(), dt)
        out.append(Case(A, f"weight {dt}", lambda dd=dd: F(dd, s, g), err("weight")))
    for label, dd in {"1-D": d.reshape(-1), "4-D": d.reshape(1, 1, *d.shape) if not lead else d[None], "empty": d[..., :0, :],
                      "K not a multiple of 16": d[..., :-4]}.items():
        out.append(Case(A, f"weight {label}", lambda dd=dd: F(dd, s, g), err("weight")))
    for dt in (torch.float32, torch.bfloat16, torch.int8):
        out.append(Case(A, f"weight_scale {dt}", lambda dt=dt: F(d, s.float().to(dt), g), err("weight_scale")))
    for label, ss in {"one block short": s[..., :-1], "rows short": s[..., :-1, :], "3-D for 2-D": s[None] if not lead else s[0]}.items():
        out.append(Case(A, f"weight_scale {label}", lambda ss=ss: F(d, ss, g), err("weight_scale")))
    sb = s.view(torch.uint8).clone()
    sb.view(-1)[rng.randrange(sb.numel())] = 0x7F
    out.append(Case(A, "weight_scale NaN byte", lambda: F(d, sb, g), err("weight_scale")))
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        out.append(Case(A, f"weight_scale_2 {bad}", lambda bad=bad: F(d, s, bad), err("weight_scale_2")))
        out.append(Case(A, f"input_scale {bad}", lambda bad=bad: F(d, s, g, bad), err("input_scale")))
    out.append(Case(A, "weight_scale_2 int tensor", lambda: F(d, s, torch.tensor(1)), err("weight_scale_2")))
    out.append(Case(A, "weight_scale_2 wrong size", lambda: F(d, s, torch.ones(7)), err("weight_scale_2")))
    out.append(Case(A, "weight_scale on meta", lambda: F(d, s.to("meta"), g), err("weight_scale")))
    out.append(Case(A, "weight_scale_2 on meta", lambda: F(d, s, g.to("meta")), err("weight_scale_2")))
    out.append(Case(A, "valid", lambda: F(d, s, g, ins), same_as(q)))
    out.append(Case(A, "valid, uint8 scale bytes, python float scale", lambda: F(d, s.view(torch.uint8), g.reshape(-1)[0].item() if not lead else g), same_as(q) if not lead else same_as(q)))
    dn, sn = non_contiguous(d, rng), non_contiguous(s, rng)
    out.append(Case(A, "non-contiguous", lambda: F(dn, sn, g), same_as(q)))

    # fuse_modelopt
    A = "fuse_modelopt"
    qs = [autofp4.quantize(rand_w(gen, 16 * rng.randint(1, 2), k) * rng.choice([0.1, 1.0, 5.0]), "nvfp4") for _ in range(rng.randint(2, 3))]
    parts = [(p.data, p.scale, p.global_scale) for p in qs]
    for label, v in bad_types(rng) + [("empty list", []), ("tensor", d)]:
        out.append(Case(A, f"parts={label}", lambda v=v: loaders.fuse_modelopt(v), err("parts")))
    out.append(Case(A, "part of length 2", lambda: loaders.fuse_modelopt([parts[0], parts[1][:2]]), err("parts")))
    out.append(Case(A, "part not a tuple", lambda: loaders.fuse_modelopt([parts[0], rand_str(rng)]), err("parts")))
    out.append(Case(A, "part with bad weight_scale", lambda: loaders.fuse_modelopt([parts[0], (parts[1][0], parts[1][1].float(), parts[1][2])]), err("parts")))
    other_k = autofp4.quantize(rand_w(gen, 16, k + 32), "nvfp4")
    out.append(Case(A, "parts with other K", lambda: loaders.fuse_modelopt([parts[0], (other_k.data, other_k.scale, other_k.global_scale)]), err("parts")))
    for label, v in bad_types(rng, ins, none_ok=True):
        if label != "int":
            out.append(Case(A, f"input_scale={label}", lambda v=v: loaders.fuse_modelopt(parts, v), err("input_scale")))

    def fused_ok(f):
        assert isinstance(f, autofp4.FP4Weight) and f.shape == (sum(p.n for p in qs), k)
        gmax = max(float(p.global_scale) for p in qs)
        ref = torch.cat([dense64(p) for p in qs])
        assert bool(((dense64(f) - ref).abs() <= 2**-4 * ref.abs() + 6 * gmax * 2**-10 + 1e-30).all())

    out.append(Case(A, "valid", lambda: loaders.fuse_modelopt(parts), Ok(fused_ok)))
    out.append(Case(A, "valid, list parts", lambda: loaders.fuse_modelopt([list(p) for p in parts]), Ok(fused_ok)))

    # from_mxfp4_blocks
    A = "from_mxfp4_blocks"
    mq = autofp4.quantize(rand_w(gen, *lead, n, k), "mxfp4")
    blocks = mq.data.reshape(*mq.data.shape[:-1], k // 32, 16)
    B = loaders.from_mxfp4_blocks
    for label, v in bad_types(rng, blocks):
        out.append(Case(A, f"blocks={label}", lambda v=v: B(v, mq.scale), err("blocks")))
    for label, v in bad_types(rng, mq.scale.float()):
        out.append(Case(A, f"scales={label}", lambda v=v: B(blocks, v), err("scales")))
    for dt in (torch.int8, torch.float32):
        out.append(Case(A, f"blocks {dt}", lambda dt=dt: B(blocks.to(dt), mq.scale), err("blocks")))
        out.append(Case(A, f"scales {dt}", lambda dt=dt: B(blocks, mq.scale.to(dt)), err("scales")))
    for label, (bb, ss) in {
        "blocks last dim 8": (blocks[..., :8], mq.scale), "blocks one block more": (torch.cat([blocks, blocks[..., :1, :]], -2), mq.scale),
        "scales 1-D": (blocks, mq.scale.reshape(-1)), "scales one block short": (mq.data, mq.scale[..., :-1]) if k > 32 else (mq.data, mq.scale[..., :0]),
        "blocks 5-D": (blocks[..., None], mq.scale), "blocks empty": (mq.data[..., :0, :], mq.scale[..., :0, :]),
        "scales 4-D": (blocks, mq.scale[None, None]),
    }.items():
        out.append(Case(A, label, lambda bb=bb, ss=ss: B(bb, ss), err("blocks", "scales")))
    sbad = mq.scale.clone()
    sbad.view(-1)[rng.randrange(sbad.numel())] = 255
    out.append(Case(A, "scales 255", lambda: B(blocks, sbad), err("scales")))
    out.append(Case(A, "scales on meta", lambda: B(blocks, mq.scale.to("meta")), err("scales")))
    out.append(Case(A, "gpt-oss layout", lambda: B(blocks, mq.scale), same_as(mq)))
    out.append(Case(A, "packed layout", lambda: B(mq.data, mq.scale), same_as(mq)))
    bn = non_contiguous(blocks, rng)
    out.append(Case(A, "non-contiguous blocks", lambda: B(bn, mq.scale), same_as(mq)))

    # load_state_dict_weight
    A = "load_state_dict_weight"
    S = loaders.load_state_dict_weight
    pre = "model.layers.%d.%s" % (rng.randint(0, 30), rand_str(rng) or "p")
    sd_nv = {f"{pre}.weight": d, f"{pre}.weight_scale": s, f"{pre}.weight_scale_2": g, f"{pre}.input_scale": ins}
    sd_oss = {f"{pre}_blocks": blocks, f"{pre}_scales": mq.scale}
    for label, v in bad_types(rng)[:-1] + [("list of pairs", list(sd_nv.items()))]:
        out.append(Case(A, f"state_dict={label}", lambda v=v: S(v, pre), err("state_dict")))
    for label, v in bad_types(rng) + [("bytes", pre.encode())]:
        if label == "str":
            continue
        out.append(Case(A, f"prefix={label}", lambda v=v: S(sd_nv, v), err("prefix")))
    out.append(Case(A, "no such prefix", lambda: S(sd_nv, pre + "x"), err(pre + "x")))
    out.append(Case(A, "missing weight_scale", lambda: S({f"{pre}.weight": d}, pre), err(pre)))
    out.append(Case(A, "missing _scales", lambda: S({f"{pre}_blocks": blocks}, pre), err(f"{pre}_scales")))
    out.append(Case(A, "both layouts", lambda: S({**sd_nv, **sd_oss}, pre), err(pre)))
    for key, bad in ((f"{pre}.weight", d.float()), (f"{pre}.weight_scale", s.float()), (f"{pre}.weight_scale_2", "1.0"),
                     (f"{pre}.input_scale", [0.5]), (f"{pre}.weight", None)):
        sd = dict(sd_nv)
        sd[key] = bad
        out.append(Case(A, f"{key.rsplit('.', 1)[1]} bad ({type(bad).__name__})", lambda sd=sd: S(sd, pre), err(key)))
    for key in (f"{pre}_blocks", f"{pre}_scales"):
        sd = dict(sd_oss)
        sd[key] = sd[key].float()
        out.append(Case(A, f"{key} float32", lambda sd=sd: S(sd, pre), err(key)))
    out.append(Case(A, "modelopt", lambda: S(sd_nv, pre), same_as(q)))
    out.append(Case(A, "modelopt, prefix with a dot", lambda: S(sd_nv, pre + "."), same_as(q)))
    out.append(Case(A, "gpt-oss", lambda: S(sd_oss, pre), same_as(mq)))
    return out


GROUPS = {
    "quantize": quantize_cases,
    "dequantize": dequantize_cases,
    "FP4Weight": fp4weight_cases,
    "linear": linear_cases,
    "moe": moe_cases,
    "route": route_cases,
    "nn": nn_cases,
    "loaders": loader_cases,
}
DEVICE_GROUPS = {"linear", "moe", "route"}


def _cases(group: str, seed: int, device: str = "cpu") -> list[Case]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    make = GROUPS[group]
    return make(rng, gen, device) if group in DEVICE_GROUPS else make(rng, gen)


def _failures(cases: list[Case]) -> list[str]:
    bad = []
    for c in cases:
        kind, detail = outcome(c)
        if kind in ("crash", "silent"):
            bad.append(f"{c.api} / {c.label}: {kind}: {detail}")
    return bad


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_bad_input_fails_clearly_and_good_input_is_right(group, gen):
    seed = gen.initial_seed()
    for rnd in range(2):
        cases = _cases(group, seed + rnd)
        assert len(cases) > 20
        bad = _failures(cases)
        assert not bad, f"seed {seed + rnd}: {len(bad)} of {len(cases)} cases failed:\n" + "\n".join(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("group", sorted(DEVICE_GROUPS))
def test_bad_input_on_cuda(group, gen):
    seed = gen.initial_seed()
    cases = _cases(group, seed, "cuda")
    bad = _failures(cases)
    assert not bad, f"seed {seed}: {len(bad)} of {len(cases)} cases failed:\n" + "\n".join(bad)


def test_outcome_classifier_can_fail():
    """The classifier itself: each kind of wrong outcome is caught."""
    def raise_(e):
        raise e

    assert outcome(Case("t", "", lambda: raise_(ValueError("x must be 2-D, got 3-D")), err("x")))[0] == "error"
    assert outcome(Case("t", "", lambda: raise_(ValueError("xs must be 2-D")), err("x")))[0] == "crash"
    assert outcome(Case("t", "", lambda: raise_(AttributeError("x has no attribute")), err("x")))[0] == "crash"
    assert outcome(Case("t", "", lambda: raise_(IndexError("x out of range")), err("x")))[0] == "crash"
    assert outcome(Case("t", "", lambda: 1, err("x")))[0] == "silent"
    assert outcome(Case("t", "", lambda: torch.ones(2), Ok(lambda y: assert_close(y, torch.ones(2, dtype=torch.float64) * 2, torch.float32))))[0] == "silent"
    assert outcome(Case("t", "", lambda: raise_(ValueError("x")), Ok(lambda y: None)))[0] == "crash"


def test_route_rejects_non_finite_logits_in_every_row_position(gen):
    rng = random.Random(gen.initial_seed())
    for _ in range(20):
        t, e = rng.randint(1, 8), rng.randint(2, 16)
        logits = torch.randn(t, e, generator=gen)
        r, c = rng.randrange(t), rng.randrange(e)
        logits[r, c] = rng.choice([float("nan"), float("inf")])
        with pytest.raises(ValueError, match=rf"router_logits .*row {r}\b"):
            autofp4.route(logits, rng.randint(1, e))


def test_quantize_names_a_sparse_tensor(gen):
    w = torch.randn(64, 64, generator=gen)
    for sparse in (w.to_sparse(), w.to_sparse_csr()):
        with pytest.raises(ValueError, match=r"quantize: w must be a dense tensor, got layout torch.sparse"):
            autofp4.quantize(sparse, "nvfp4")


def test_moe_from_non_finite_logits_is_refused_as_route_does(gen):
    rng = random.Random(gen.initial_seed())
    x = torch.randn(6, 64, generator=gen).to(torch.bfloat16)
    w13 = autofp4.quantize(torch.randn(4, 128, 64, generator=gen), "nvfp4")
    w2 = autofp4.quantize(torch.randn(4, 64, 64, generator=gen), "nvfp4")
    for _ in range(5):
        logits = torch.randn(6, 4, generator=gen)
        r = rng.randrange(6)
        logits[r, rng.randrange(4)] = rng.choice([float("nan"), float("inf")])
        with pytest.raises(ValueError, match=rf"moe: router_logits must be finite .*row {r}\b"):
            autofp4.moe(x, w13, w2, router_logits=logits, top_k=2)
    assert torch.isfinite(autofp4.moe(x, w13, w2, router_logits=torch.randn(6, 4, generator=gen), top_k=2)).all()


def test_route_under_torch_compile_fullgraph(gen):
    torch._dynamo.reset()
    logits = torch.randn(5, 8, generator=gen)
    f = torch.compile(lambda z: autofp4.route(z, 3), fullgraph=True, backend="aot_eager")
    w, ids = f(logits)
    w0, ids0 = autofp4.route(logits, 3)
    assert torch.equal(ids, ids0) and torch.allclose(w, w0)


@pytest.mark.gpu
def test_route_check_is_skipped_during_cuda_graph_capture(gen):
    logits = torch.randn(4, 8, generator=gen).cuda()
    autofp4.route(logits, 2)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w, ids = autofp4.route(logits, 2)
    logits.copy_(torch.randn(4, 8, generator=gen).cuda())
    g.replay()
    torch.cuda.synchronize()
    w0, ids0 = autofp4.route(logits, 2)
    assert torch.equal(ids, ids0) and torch.allclose(w, w0)


# ------------------------------------------------------------------ tally
COLUMNS = ("tried", "error", "result", "crash", "other exception", "msg not naming", "rejected valid", "silent")


def tally(seeds: int, base_seed: int, device: str = "cpu") -> dict[str, dict[str, int]]:
    res: dict[str, dict[str, int]] = {}
    for group in GROUPS:
        if device != "cpu" and group not in DEVICE_GROUPS:
            continue
        row = res.setdefault(group, dict.fromkeys(COLUMNS, 0))
        for i in range(seeds):
            for c in _cases(group, base_seed + i, device):
                kind, detail = outcome(c)
                row["tried"] += 1
                row[kind] += 1
                if kind == "crash":
                    sub = ("rejected valid" if detail.startswith("valid input") else
                           "msg not naming" if " not naming " in detail else "other exception")
                    row[sub] += 1
                if kind in ("crash", "silent") and os.environ.get("VERBOSE"):
                    print(f"  {c.api} / {c.label}: {kind}: {detail}")
    return res


if __name__ == "__main__":
    import argparse
    import warnings

    warnings.simplefilter("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    rows = tally(a.seeds, a.seed, a.device)
    rows["total"] = {k: sum(r[k] for r in rows.values()) for k in COLUMNS}
    print(f"{'api':12} " + " ".join(f"{c:>15}" for c in COLUMNS))
    for g, r in rows.items():
        print(f"{g:12} " + " ".join(f"{r[c]:15}" for c in COLUMNS))
    sys.exit(0)


def test_wrong_python_types_under_torch_compile(gen):
    """Compiled code raises the eager TypeError naming the argument (fullgraph=True wraps it in
    dynamo's error, with the same message)."""
    w = autofp4.quantize(torch.randn(32, 64, generator=gen), "nvfp4")
    w13 = autofp4.quantize(torch.randn(2, 64, 64, generator=gen), "nvfp4")
    w2 = autofp4.quantize(torch.randn(2, 64, 32, generator=gen), "nvfp4")
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    tw, ti = autofp4.route(torch.randn(3, 2, generator=gen), 1)
    cases = [
        ("bias", lambda z: autofp4.linear(z, w, [1.0] * 32)),
        ("topk_ids", lambda z: autofp4.moe(z, w13, w2, tw, ti.tolist())),
        ("activation", lambda z: autofp4.moe(z, w13, w2, tw, ti, 3)),
        ("w", lambda z: autofp4.linear(z, z)),
    ]
    for name, f in cases:
        torch._dynamo.reset()
        with pytest.raises(TypeError, match=rf"\b{name} must be"):
            torch.compile(f, backend="aot_eager")(x)
        torch._dynamo.reset()
        with pytest.raises(Exception, match=rf"\b{name} must be"):
            torch.compile(f, fullgraph=True, backend="aot_eager")(x)


# ------------------------------------------------------------------ the thirty-second adversarial set
def _compiled(f):
    torch._dynamo.reset()
    return torch.compile(f, backend="aot_eager", fullgraph=True)


@pytest.mark.parametrize("act_dtype", [None, "fp8"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_gradient_goes_straight_through_the_fp8_rounding(fmt, act_dtype, gen):
    """linear(act_dtype="fp8") with x (and the bias) requiring grad: the gradient is the one of
    the call with x's dtype, ``grad @ W`` (and the bias's: grad summed over the rows), eagerly, as
    an FP4Linear's and under torch.compile (the custom op's backward); with x's dtype the same.
    Backward used to go through the per-token E4M3 rounding (derivative 0): x's gradient was zero
    but for the amax element of each row, and the compiled calls had no backward at all."""
    n, k = 32 * (1 + int(torch.randint(3, (1,), generator=gen))), 64
    w = autofp4.quantize(rand_w(gen, n, k), fmt)
    x0, b0 = rand_w(gen, 2, 5, k, dtype=torch.bfloat16), rand_w(gen, n, dtype=torch.bfloat16)
    gy = rand_w(gen, 2, 5, n, dtype=torch.bfloat16)
    want_x = gy.double() @ dense64(w)
    want_b = gy.double().sum((0, 1))
    layer = autofp4.FP4Linear(w, b0)
    layer.bias.requires_grad_(True)
    layer.act_dtype = act_dtype
    runs = {"eager": lambda x, b: autofp4.linear(x, w, b, act_dtype=act_dtype),
            "compiled": _compiled(lambda x, b: autofp4.linear(x, w, b, act_dtype=act_dtype)),
            "FP4Linear": lambda x, b: layer(x),
            "FP4Linear compiled": _compiled(lambda x, b: layer(x))}
    if act_dtype:
        runs["fp8-prefill (bf16 below its rows)"] = lambda x, b: autofp4.linear(x, w, b, act_dtype="fp8-prefill")
    for label, f in runs.items():
        x, b = x0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
        layer.bias.grad = None
        y = f(x, b)
        assert y.requires_grad, label
        y.backward(gy)
        assert_close(x.grad, want_x, torch.bfloat16)
        assert int((x.grad == 0).sum()) < x.numel() // 4, (label, x.grad)
        assert_close(layer.bias.grad if label.startswith("FP4Linear") else b.grad, want_b, torch.bfloat16)
    with torch.no_grad():  # nothing for autograd without gradients: the plain call
        assert not autofp4.linear(x0.clone().requires_grad_(True), w, act_dtype="fp8").requires_grad


def _moe64_autograd(x, w13, w2, tw, ti, act, b13, b2):
    """The MoE layer in float64 on leaves that autograd differentiates (moe64 with biases)."""
    a13, a2 = dense64(w13), dense64(w2)
    inter = a2.shape[-1]
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for j in range(ti.shape[1]):
            e = int(ti[t, j])
            gu = a13[e] @ x[t] + b13[e]
            g, u = gu[:inter], gu[inter:]
            if act == "silu":
                h = g / (1 + torch.exp(-g)) * u
            else:
                h = 0.5 * g * (1 + torch.tanh(0.7978845608028654 * (g + 0.044715 * g**3))) * u
            acc = acc + tw[t, j] * (a2[e] @ h + b2[e])
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("act_dtype", [None, "fp8"])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_moe_gradient_goes_straight_through_the_fp8_roundings(act, act_dtype, gen):
    """moe(act_dtype="fp8") with x, the router weights and the biases requiring grad: the
    gradients are those of the layer with x's dtype (both FP8 quantizations taken as the
    identity), eagerly and under torch.compile, and with x's dtype the same (from router logits
    too: x's gradient, routed as given); they were the derivative of the roundings (x's zero but
    for one element per row)."""
    fmt = FORMATS[int(torch.randint(2, (1,), generator=gen))]
    e, h, inter, t, top_k = 3, 64, 32, 6, 2
    w13 = autofp4.quantize(rand_w(gen, e, 2 * inter, h), fmt)
    w2 = autofp4.quantize(rand_w(gen, e, h, inter), fmt)
    x0 = rand_w(gen, t, h, dtype=torch.bfloat16)
    tw0, ti = autofp4.route(rand_w(gen, t, e), top_k)
    b13, b2 = rand_w(gen, e, 2 * inter), rand_w(gen, e, h, dtype=torch.bfloat16)
    gy = rand_w(gen, t, h, dtype=torch.bfloat16)
    leaves = [v.double().requires_grad_(True) for v in (x0, tw0, b13, b2)]
    ref = _moe64_autograd(leaves[0], w13, w2, leaves[1], ti, act, leaves[2], leaves[3])
    want = torch.autograd.grad(ref, leaves, gy.double())

    def call(x, tw, bb13, bb2):
        return autofp4.moe(x, w13, w2, tw, ti, act, w13_bias=bb13, w2_bias=bb2, act_dtype=act_dtype)

    for label, f in (("eager", call), ("compiled", _compiled(call))):
        args = [v.clone().requires_grad_(True) for v in (x0, tw0, b13, b2)]
        f(*args).backward(gy)
        for name, a, wnt in zip(("x", "topk_weights", "w13_bias", "w2_bias"), args, want):
            assert a.grad is not None, (label, name)
            assert_close(a.grad, wnt, a.dtype, 2e-2)
        assert int((args[0].grad == 0).sum()) < x0.numel() // 4, (label, args[0].grad)
    logits = rand_w(gen, t, e)
    tw_l, ti_l = autofp4.route(logits, top_k)
    ref = _moe64_autograd(leaves[0], w13, w2, tw_l.double(), ti_l, act, leaves[2], leaves[3])
    want_x = torch.autograd.grad(ref, leaves[0], gy.double())[0]

    def from_logits(x, lg):
        return autofp4.moe(x, w13, w2, activation=act, w13_bias=b13, w2_bias=b2, router_logits=lg, top_k=top_k,
                           act_dtype=act_dtype)

    for label, f in (("eager, logits", from_logits), ("compiled, logits", _compiled(from_logits))):
        x = x0.clone().requires_grad_(True)
        f(x, logits.clone().requires_grad_(True)).backward(gy)
        assert_close(x.grad, want_x, x.dtype, 2e-2)


@pytest.mark.parametrize("act_dtype", [None, "fp8"])
def test_functorch_transforms_and_forward_mode_through_linear_and_moe(act_dtype, gen):
    """torch.func.grad / vjp through linear and moe give the layers' gradients; forward mode
    (torch.func.jvp, forward_ad) through linear gives ``t @ W^T`` (it went through the FP8
    rounding: a tangent 100% off), through moe a clear refusal; torch.func.grad used to fail
    with torch's message about a setup_context of an internal class."""
    import torch.autograd.forward_ad as fwAD

    w = autofp4.quantize(rand_w(gen, 48, 64), "nvfp4")
    x, t = rand_w(gen, 5, 64, dtype=torch.bfloat16), rand_w(gen, 5, 64, dtype=torch.bfloat16)
    want_t = t.double() @ dense64(w).T
    _, tan = torch.func.jvp(lambda a: autofp4.linear(a, w, act_dtype=act_dtype), (x,), (t,))
    assert_close(tan, want_t, torch.bfloat16)
    with fwAD.dual_level():
        tan2 = fwAD.unpack_dual(autofp4.linear(fwAD.make_dual(x, t), w, act_dtype=act_dtype)).tangent
    assert tan2 is not None
    assert_close(tan2, want_t, torch.bfloat16)
    gy = rand_w(gen, 5, 48, dtype=torch.bfloat16)
    gx = torch.func.grad(lambda a: (autofp4.linear(a, w, act_dtype=act_dtype).float() * gy.float()).sum())(x)
    assert_close(gx, gy.double() @ dense64(w), torch.bfloat16)
    torch._dynamo.reset()  # under torch.compile the transformed calls run eagerly (a zero tangent, or torch's error)
    comp = torch.compile(lambda a, b: torch.func.jvp(lambda z: autofp4.linear(z, w, act_dtype=act_dtype), (a,), (b,)),
                         backend="aot_eager")
    assert_close(comp(x, t)[1], want_t, torch.bfloat16)
    loss = lambda a: (autofp4.linear(a, w, act_dtype=act_dtype).float() * gy.float()).sum()  # noqa: E731
    comp = torch.compile(torch.func.grad(loss), backend="aot_eager")
    assert_close(comp(x), gy.double() @ dense64(w), torch.bfloat16)
    e, h, inter = 3, 64, 32
    w13 = autofp4.quantize(rand_w(gen, e, 2 * inter, h), "nvfp4")
    w2 = autofp4.quantize(rand_w(gen, e, h, inter), "nvfp4")
    tw, ti = autofp4.route(rand_w(gen, 5, e), 2)
    b13, b2 = rand_w(gen, e, 2 * inter), rand_w(gen, e, h, dtype=torch.bfloat16)
    leaf = x.double().requires_grad_(True)
    ref = _moe64_autograd(leaf, w13, w2, tw.double(), ti, "silu", b13.double(), b2.double())
    gym = rand_w(gen, 5, h, dtype=torch.bfloat16)
    (want_x,) = torch.autograd.grad(ref, leaf, gym.double())

    def call(a):
        return autofp4.moe(a, w13, w2, tw, ti, w13_bias=b13, w2_bias=b2, act_dtype=act_dtype)

    gx = torch.func.grad(lambda a: (call(a).float() * gym.float()).sum())(x)
    assert_close(gx, want_x, torch.bfloat16, 2e-2)
    _, vjp = torch.func.vjp(call, x)
    assert_close(vjp(gym)[0], want_x, torch.bfloat16, 2e-2)
    with pytest.raises(NotImplementedError, match=r"autofp4.moe: forward-mode differentiation .* not supported"):
        torch.func.jvp(call, (x,), (t,))
    for transform in (lambda: torch.func.vmap(call)(x[None].expand(2, -1, -1)),  # the layer batched
                      lambda: torch.func.jacrev(lambda a: call(a).float().sum(0))(x)):  # its gradient batched
        with pytest.raises(NotImplementedError, match=r"autofp4.moe: torch.vmap is not supported .*once per batch"):
            transform()
    torch._dynamo.reset()  # compiled, the transformed moe runs eagerly too: its gradient, its refusal
    loss_m = lambda a: (call(a).float() * gym.float()).sum()  # noqa: E731
    assert_close(torch.compile(torch.func.grad(loss_m), backend="aot_eager")(x), want_x, torch.bfloat16, 2e-2)
    with pytest.raises(NotImplementedError, match=r"autofp4.moe: forward-mode differentiation"):
        torch.compile(lambda a, b: torch.func.jvp(call, (a,), (b,)), backend="aot_eager")(x, t)
    if act_dtype:
        with pytest.raises(NotImplementedError, match=r"torch.vmap of a call with act_dtype='fp8' is not supported"):
            torch.func.vmap(lambda a: autofp4.linear(a, w, act_dtype=act_dtype))(x[None].expand(2, -1, -1))
    jac = torch.func.jacrev(lambda a: autofp4.linear(a, w, act_dtype=act_dtype).float().sum(0))(x)  # [N, 5, K]
    assert_close(jac, dense64(w)[:, None, :].expand(-1, 5, -1), torch.bfloat16)  # d out[n] / d x[m, k] = W[n, k]


def test_set36_a_meta_state_dict_is_named_by_torch_and_a_compiled_module_gives_its_tangent(gen):
    """A state dict on the meta device gets torch's error naming the buffer (the values check
    copied it first: "Cannot copy out of meta tensor", no key); compiled jvp through an FP4Linear
    module (bf16 and FP8) gives ``t @ W^T`` (a zero tangent: the module called the op directly);
    vmap of an fp8-prefill call names that value."""
    w = autofp4.quantize(rand_w(gen, 48, 64), "nvfp4")
    layer = autofp4.FP4Linear(w)
    meta = {k: torch.empty_like(v, device="meta") for k, v in layer.state_dict().items()}
    with pytest.raises(RuntimeError, match=r'While copying the parameter named "weight_'):
        layer.load_state_dict(meta)
    x, t = rand_w(gen, 5, 64, dtype=torch.bfloat16), rand_w(gen, 5, 64, dtype=torch.bfloat16)
    for act in (None, "fp8"):
        layer.act_dtype = act
        torch._dynamo.reset()
        comp = torch.compile(lambda a, b: torch.func.jvp(layer, (a,), (b,)), backend="aot_eager")
        assert_close(comp(x, t)[1], t.double() @ dense64(w).T, torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"act_dtype='fp8-prefill' is not supported"):
        torch.func.vmap(lambda a: autofp4.linear(a, w, act_dtype="fp8-prefill"))(x[None].expand(2, -1, -1))


class _Attn(nn.Module):
    """q/k/v projections that quantize_model fuses into one ``qkv_proj``, and an ``o_proj``."""

    def __init__(self, gen):
        super().__init__()
        self.q_proj = nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)
        self.k_proj = nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
        self.v_proj = nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
        self.o_proj = nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))


def _fused_attn(gen) -> nn.Module:
    model = nn.Module()
    model.attn = _Attn(gen)
    rep = autofp4.quantize_model(model, "nvfp4")
    assert rep.fused == {"attn.qkv_proj": ["attn.q_proj", "attn.k_proj", "attn.v_proj"]}, rep.fused
    return model


def test_act_dtype_of_a_fused_part_is_its_fused_layers(gen):
    """An FP4LinearPart's act_dtype is its FP4FusedLinear's (one call runs every part): reading it
    says what the part runs; setting another value is refused, naming the fused layer to set
    (it used to be stored as a plain attribute with no effect, "int8" included); setting the
    fused layer's changes the part."""
    model = _fused_attn(gen)
    q, fused = model.attn.q_proj, model.attn.qkv_proj
    assert type(q).__name__ == "FP4LinearPart"
    x = rand_w(gen, 4, 64, dtype=torch.bfloat16)
    y0 = q(x)
    assert q.act_dtype is None
    q.act_dtype = None  # what it runs: accepted
    with pytest.raises(AttributeError) as info:
        q.act_dtype = "fp8"
    msg = str(info.value)
    assert ("attn.q_proj is rows 0:64 of an FP4FusedLinear that computes all its parts (q_proj, k_proj, v_proj)" in msg
            and "set act_dtype on the FP4FusedLinear (attn.qkv_proj" in msg
            and "autofp4.set_activations(model, 'fp8')" in msg), msg
    with pytest.raises(ValueError, match=r"FP4LinearPart.act_dtype: act_dtype must be None, 'fp8' or 'fp8-prefill', "
                                         r"got 'int8'"):
        q.act_dtype = "int8"
    assert "act_dtype" not in q.__dict__ and fused.act_dtype is None and q.act_dtype is None
    assert torch.equal(q(x), y0)
    fused.act_dtype = "fp8"
    assert q.act_dtype == "fp8" and model.attn.v_proj.act_dtype == "fp8"
    y8 = q(x)
    assert torch.equal(y8, autofp4.linear(x, fused.fp4_weight(), act_dtype="fp8")[:, :64])
    assert not torch.equal(y8, y0)
    q.act_dtype = "fp8"  # now what it runs
    with pytest.raises(AttributeError, match=r"act_dtype='fp8'\) and cannot have its own None"):
        q.act_dtype = None


def test_set_activations_on_a_fused_part_names_its_fused_layer(gen):
    """set_activations(an FP4LinearPart) said "the model has no FP4 layer (quantize it first ...)"
    of an FP4 layer: now it names the part and the fused layer that runs it, and changes nothing;
    on a module holding the fused layer it switches the part too."""
    model = _fused_attn(gen)
    q = model.attn.q_proj
    with pytest.raises(ValueError) as info:
        autofp4.set_activations(q, "fp8")
    msg = str(info.value)
    assert "no FP4 layer" not in msg and "quantize it first" not in msg, msg
    assert ("the module given is an FP4LinearPart (attn.q_proj is rows 0:64 of an FP4FusedLinear" in msg
            and "call set_activations on a module that holds the fused layer (attn.qkv_proj)" in msg), msg
    assert model.attn.qkv_proj.act_dtype is None
    assert autofp4.set_activations(model.attn, "fp8") == 2  # qkv_proj and o_proj
    assert q.act_dtype == "fp8" and model.attn.o_proj.act_dtype == "fp8"


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_fp4_tensor_of_the_wrong_dtype_is_not_also_called_missing(fmt, gen):
    """load_state_dict with the block scales present but of another dtype: one error, the dtype's,
    not also "Missing key(s) ... weight_scale" for a key that is in the dict (strict or not, in a
    layer at the top or inside a model); the buffer keeps its values."""
    w = autofp4.quantize(rand_w(gen, 32, 64), fmt)
    for model in (autofp4.FP4Linear(w), nn.Sequential(nn.Identity(), autofp4.FP4Linear(w))):
        prefix = "" if isinstance(model, autofp4.FP4Linear) else "1."
        layer = model if not prefix else model[1]
        before = layer.weight_scale.clone()
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        key = f"{prefix}weight_scale"
        wrong = torch.int8 if sd[key].dtype == torch.uint8 else torch.uint8
        sd[key] = sd[key].view(wrong)
        for strict in (True, False):
            with pytest.raises(RuntimeError) as info:
                model.load_state_dict(sd, strict=strict)
            msg = str(info.value)
            assert "Missing key" not in msg and "missing" not in msg.lower(), msg
            assert f"{key}: stored as {wrong}, but the layer's buffer is {before.dtype}" in msg, msg
        assert torch.equal(layer.weight_scale.view(torch.uint8), before.view(torch.uint8))


def test_a_state_dict_of_the_other_format_is_named_and_a_refused_weight_is_not_copied(gen):
    """An MXFP4 layer's state dict loaded into an NVFP4 layer (and back) names the two formats,
    not only the scales' dtypes; a weight refused for its values (a NaN E4M3 block scale, a
    negative global scale) is not copied: the layer keeps computing what it did (it computed NaN
    in every row after the error)."""
    dense = rand_w(gen, 32, 64)
    nv, mx = autofp4.FP4Linear(autofp4.quantize(dense, "nvfp4")), autofp4.FP4Linear(autofp4.quantize(dense, "mxfp4"))
    x = rand_w(gen, 3, 64, dtype=torch.bfloat16)
    for dst, src, other in ((nv, mx, "mxfp4 (E8M0 block scales, uint8) model"),
                            (mx, nv, "nvfp4 (E4M3 block scales) model")):
        y = dst(x)
        for strict in (True, False):
            with pytest.raises(RuntimeError) as info:
                dst.load_state_dict(src.state_dict(), strict=strict)
            assert f"this layer is {dst.fmt}: the state dict is of an {other}" in str(info.value), str(info.value)
            assert torch.equal(dst(x), y)  # nothing of the refused weight copied (its codes were)
    before = nv(x)
    for key, bad in (("weight_scale", lambda t: t.view(torch.uint8).clone().fill_(0x7F).view(t.dtype)),
                     ("weight_global_scale", lambda t: -t.clone())):
        sd = {k: v.clone() for k, v in nv.state_dict().items()}
        sd[key] = bad(sd[key])
        with pytest.raises(RuntimeError, match="NaN|negative|not finite and positive"):
            nv.load_state_dict(sd)
        after = nv(x)
        assert torch.isfinite(after).all() and torch.equal(after, before), key
