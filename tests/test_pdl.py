"""Programmatic dependent launch: the switch (CPU) and, on a GPU, that a kernel started early
still reads what the kernel before it wrote."""
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import autofp4
from autofp4 import pdl


def test_switch_and_context_restore():
    old = autofp4.pdl_enabled()
    try:
        assert autofp4.set_pdl(False) == old
        assert not autofp4.pdl_enabled() and pdl.launch_flag(True) == 0
        with pdl.pdl(True):
            assert autofp4.pdl_enabled() and pdl.launch_flag(True) == 1
            assert pdl.launch_flag(False) == 0  # a config that does not ask for it
            with pdl.pdl(False):
                assert pdl.launch_flag(True) == 0
            assert pdl.launch_flag(True) == 1
        assert not autofp4.pdl_enabled()
    finally:
        autofp4.set_pdl(old)


def test_configs_with_and_without_pdl_share_one_binary():
    from autofp4.kernels.sm90_w4a16_gemm import Sm90GemmConfig
    from autofp4.kernels.w4a16_decode import DecodeConfig

    for cfg in (DecodeConfig(warps=8, pdl=True), Sm90GemmConfig(tile_m=64, pdl=True)):
        key = pdl.binary_config(cfg)
        assert key == pdl.binary_config(type(cfg)(**{**cfg.__dict__, "pdl": False}))
        assert not key.pdl and key != cfg and type(key) is type(cfg)


@pytest.mark.parametrize("value, expected", [("0", False), ("off", False), ("1", True), ("", True)])
def test_environment_variable(value, expected):
    env = dict(os.environ, AUTOFP4_PDL=value)
    out = subprocess.run([sys.executable, "-c", "import autofp4; print(autofp4.pdl_enabled())"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(expected)


@pytest.mark.parametrize("value, expected", [("maybe", True), (" OFF ", False), ("No", False)])
def test_an_unknown_value_warns_naming_the_variable(value, expected):
    """Only the on / off spellings are read; another value warns once, naming AUTOFP4_PDL, its value
    and the accepted ones (read once at import: no cost per launch)."""
    env = dict(os.environ, AUTOFP4_PDL=value)
    r = subprocess.run([sys.executable, "-c", "import autofp4; print(autofp4.pdl_enabled())"],
                       env=env, capture_output=True, text=True, check=True)
    assert r.stdout.strip() == str(expected)
    warned = [line for line in r.stderr.splitlines() if "AUTOFP4_PDL" in line]
    if value.strip().lower() in pdl.PDL_CHOICES:
        assert not warned, r.stderr
    else:
        assert len(warned) == 1 and f"AUTOFP4_PDL={value!r} ignored: use one of 1, true, on" in warned[0], r.stderr


@pytest.mark.parametrize("bad", ["no", "0", 1, 0, None])
def test_set_pdl_takes_a_bool(bad):
    old = autofp4.pdl_enabled()
    with pytest.raises(TypeError, match="set_pdl takes True or False"):
        autofp4.set_pdl(bad)
    with pytest.raises(TypeError):
        with pdl.pdl(bad):
            pass
    assert autofp4.pdl_enabled() == old


def test_info_says_whether_dependent_launch_is_on():
    import io

    from autofp4.cli import main

    old = autofp4.set_pdl(False)
    try:
        out = io.StringIO()
        assert main(["info", "--device", "cpu"], out=out, err=io.StringIO()) == 0
        assert "dependent launch: off" in out.getvalue()
        autofp4.set_pdl(True)
        out = io.StringIO()
        assert main(["info", "--device", "cpu"], out=out, err=io.StringIO()) == 0
        assert "dependent launch: on where a config asks for it" in out.getvalue()
    finally:
        autofp4.set_pdl(old)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _layers(ws, m, pdl_on, early=True):
    """Runner + prepared weight per layer: the backend's default config for M with dependent
    launch forced on or off (both kernels: the decode kernel up to M = 16, the GEMM above); a
    decode kernel with it on lets the next kernel launch right after its own wait (``early``)
    or after its main loop."""
    from autofp4.backends import get_backend
    from autofp4.problem import ProblemKey

    b = get_backend("sm90_w4a16")
    out = []
    for w in ws:
        key = ProblemKey("linear", w.fmt, "bfloat16", w.shape[0], w.shape[1])
        cfg = b.default(key, m)
        update = {"pdl": pdl_on}
        if cfg.kernel == "decode":
            update["pdl_early"] = bool(pdl_on and early)
        cfg = dataclasses.replace(cfg, **update)
        out.append((b.compile(cfg, key), w.packed(b.name, b.prepare)))
    return out


def _chain(x, layers):
    for run, prep in layers:
        x = run(x, prep, None)
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("m,early", [(1, True), (1, False), (16, True), (16, False), (64, True), (300, True)])
def test_layer_chain_with_and_without_pdl(m, early, gen):
    """Four layers that feed each other (every kernel reads the previous one's output), eager
    and in a CUDA graph, with dependent launch on: the same results as with it off and as
    float64 math."""
    dev = torch.device("cuda")
    d = 2048
    ws = [autofp4.quantize((torch.randn(d, d, generator=gen) / d ** 0.5).to(dev), fmt)
          for fmt in ("nvfp4", "mxfp4", "nvfp4", "mxfp4")]
    on, off = _layers(ws, m, True, early), _layers(ws, m, False)
    dq = [w.dequantize(torch.float32).double() for w in ws]
    assert autofp4.pdl_enabled()
    for _ in range(3):
        x = torch.randn(m, d, generator=gen).to(dev, torch.bfloat16)
        y_on, y_off = _chain(x, on), _chain(x, off)
        ref = x.double()
        for w in dq:
            ref = (ref @ w.T).to(torch.bfloat16).double()
        assert _rel(y_on, y_off) < 1e-3
        assert _rel(y_on, ref) < 3e-2
    xg = torch.randn(m, d, generator=gen).to(dev, torch.bfloat16)
    _chain(xg, on)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = _chain(xg, on)
    for _ in range(3):
        xg.copy_(torch.randn(m, d, generator=gen).to(dev, torch.bfloat16))
        g.replay()
        want = _chain(xg, off)
        torch.cuda.synchronize()
        assert _rel(yg, want) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [8, 16])
def test_decode_kernel_waits_for_a_long_gemm(rows, gen):
    """A long GEMM writes y; the decode kernel right after it reads y's last rows (the ones
    written last). Started early it must still see this iteration's y, not the last one's."""
    dev = torch.device("cuda")
    big = autofp4.quantize(torch.randn(8192, 4096, generator=gen).to(dev), "nvfp4")
    small = autofp4.quantize((torch.randn(1024, 8192, generator=gen) / 90).to(dev), "nvfp4")
    (gemm, pbig), = _layers([big], 4096, True)
    (dec_on, psmall), = _layers([small], rows, True)
    (dec_off, _), = _layers([small], rows, False)
    for _ in range(6):
        x = torch.randn(4096, 4096, generator=gen).to(dev, torch.bfloat16)
        y = gemm(x, pbig, None)
        z = dec_on(y[-rows:], psmall, None)
        torch.cuda.synchronize()
        want = dec_off(y[-rows:].clone(), psmall, None)
        torch.cuda.synchronize()
        assert _rel(z, want) < 1e-3
