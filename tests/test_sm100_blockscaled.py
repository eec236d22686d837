"""CPU tests of the Blackwell block-scaled W4A4 backend: the scale-factor atom layout, the packed
weight, the activation quantizer's reference, the config rules, compilation for sm_100a (and the
quantizer for sm_90a), the W4A4 tuner oracle and the first-contact guard."""
from __future__ import annotations

import dataclasses
import importlib.util
import warnings

import pytest
import torch

from autofp4 import quantize
from autofp4.backends import get_backend
from autofp4.backends import sm100_blockscaled as B
from autofp4.backends.reference import reference_linear, reference_linear_w4a4, reference_runner
from autofp4.kernels import fp4_act_quant as Q
from autofp4.kernels import sm100_blockscaled_gemm as G
from autofp4.problem import ProblemKey

# compiles CuTeDSL kernels on the CPU (minutes on 2 cores): not in the quick subset
pytestmark = pytest.mark.compile

cute_available = importlib.util.find_spec("cutlass") is not None
needs_cute = pytest.mark.skipif(not cute_available, reason="needs nvidia-cutlass-dsl")
Cfg = G.Sm100BlockScaledConfig


# ------------------------------------------------------------------ the scale-factor atoms
def _atoms_by_reshape(s: torch.Tensor) -> torch.Tensor:
    """The 128 x 4 atom layout built independently: pad, cut into [row atoms, K atoms, 4, 32, 4]
    and order (row atom, K atom, row % 32, row // 32, block)."""
    rows, blocks = s.shape
    rp, bp = -(-rows // 128) * 128, -(-blocks // 4) * 4
    full = torch.zeros(rp, bp, dtype=torch.uint8)
    full[:rows, :blocks] = s
    t = full.view(rp // 128, 4, 32, bp // 4, 4).permute(0, 3, 2, 1, 4)
    return t.reshape(-1)


@pytest.mark.parametrize("rows,blocks", [(128, 4), (200, 5), (1, 1), (384, 48), (130, 7)])
def test_swizzle_matches_the_atom_layout_and_round_trips(rows, blocks):
    s = torch.randint(0, 255, (rows, blocks), dtype=torch.uint8)
    buf = G.swizzle_scales(s)
    assert torch.equal(buf, _atoms_by_reshape(s))
    assert torch.equal(G.unswizzle_scales(buf, rows, blocks), s)
    off = G.swizzle_offsets(rows, blocks).reshape(-1)
    assert off.unique().numel() == off.numel()  # a permutation into the padded buffer


def test_swizzle_offsets_of_known_entries():
    # 300 x 9 blocks pads to 384 x 12: 3 K atoms per row atom
    off = G.swizzle_offsets(300, 9)
    assert int(off[0, 0]) == 0 and int(off[0, 3]) == 3 and int(off[1, 0]) == 16 and int(off[32, 0]) == 4
    assert int(off[0, 4]) == 512 and int(off[128, 0]) == 3 * 512
    assert int(off[129 + 64, 5]) == (1 * 3 + 1) * 512 + 1 * 16 + 2 * 4 + 1


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_pack_weight_keeps_the_values_and_unswizzles_to_the_scales(fmt):
    w = quantize(torch.randn(200, 320), fmt)
    p = G.pack_weight(w)
    raw = w.scale if w.scale.dtype == torch.uint8 else w.scale.view(torch.uint8)
    assert torch.equal(p.data, w.data) and torch.equal(G.unpack_weight_scales(p), raw)
    assert p.scale.numel() == 256 * (-(-(320 // G.BLOCK_SIZE[fmt]) // 4) * 4)
    assert p.global_scale.shape == (1,)


def test_quantize_nvfp4_with_a_given_global_scale():
    from autofp4.formats import quantize_nvfp4

    x = torch.randn(64, 256)
    q0, s0, g0 = quantize_nvfp4(x)
    q1, s1, g1 = quantize_nvfp4(x, global_scale=g0.clone())  # the dynamic one, given: identical
    assert torch.equal(q0, q1) and torch.equal(s0.view(torch.uint8), s1.view(torch.uint8)) and torch.equal(g0, g1)
    q2, s2, _ = quantize_nvfp4(x, global_scale=g0 / 100)  # too small: block scales saturate at 448
    assert float(s2.float().max()) == 448.0


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_activation_reference_equals_autofp4_quantize(fmt):
    x = torch.randn(130, 512).to(torch.bfloat16)
    q, buf = Q.reference_quantize(x, fmt)
    w = quantize(x, fmt)
    raw = w.scale if w.scale.dtype == torch.uint8 else w.scale.view(torch.uint8)
    assert torch.equal(q, w.data)
    assert torch.equal(G.unswizzle_scales(buf, 130, 512 // G.BLOCK_SIZE[fmt]), raw)
    assert buf.numel() == Q.padded_scale_bytes(130, 512, fmt)
    g = Q.dynamic_global_scale(x)
    if fmt == "nvfp4":
        assert torch.equal(g.reshape(()), w.global_scale)


# ------------------------------------------------------------------ W4A4 reference, tuner oracle
def test_w4a4_reference_quantizes_the_activations():
    torch.manual_seed(0)
    w = quantize(torch.randn(64, 256), "nvfp4")
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    xq = quantize(x, "nvfp4").dequantize(torch.float32)
    want = (xq @ w.dequantize(torch.float32).T).to(torch.bfloat16)
    assert torch.equal(reference_linear_w4a4(x, w, None), want)
    assert not torch.equal(reference_linear_w4a4(x, w, None), reference_linear(x, w, None))
    w.input_scale = torch.tensor(0.01)  # a static activation scale is the activation's global scale
    xs = quantize_nvfp4_static(x, 0.01)
    assert torch.equal(reference_linear_w4a4(x, w, None), (xs @ w.dequantize(torch.float32).T).to(torch.bfloat16))


def quantize_nvfp4_static(x, g):
    from autofp4.formats import dequantize_blocks, quantize_nvfp4

    q, s, gs = quantize_nvfp4(x, global_scale=torch.tensor(g))
    return dequantize_blocks("nvfp4", q, s, gs, torch.float32)


def test_the_tuner_checks_a_w4a4_backend_against_the_w4a4_reference():
    from autofp4.tuning import trial

    key = ProblemKey("linear", "mxfp4", "bfloat16", 64, 128)
    d = trial._setup_data(key, 4, 3, torch.device("cpu"), copies_hint=False, numerics="w4a4")
    d = trial._setup_data(key, 4, 3, torch.device("cpu"), copies_hint=False)
    x, bias = d.acts[4, "uniform"][0]
    assert torch.equal(d.refs[4, "uniform", "w4a4"], reference_linear_w4a4(x, d.weights[0], bias))
    assert torch.equal(d.refs[4, "uniform", "w4a16"], reference_linear(x, d.weights[0], bias))
    assert get_backend("sm100_blockscaled").numerics == "w4a4" and get_backend("reference").numerics == "w4a16"
    with pytest.raises(ValueError, match="numerics"):
        reference_runner("w8a8", key)


# ------------------------------------------------------------------ configs
KEY = ProblemKey("linear", "nvfp4", "bfloat16", 4096, 4096)


@pytest.mark.parametrize("cfg,why", [
    (Cfg(tile_m=64), "tile_m must be 128"),
    (Cfg(tile_n=96), "tile_n must be 64, 128 or 256"),
    (Cfg(tile_m=256), "cluster_m must be even"),
    (Cfg(stages=9), "stages must be in 2..8"),
    (Cfg(tile_n=256, stages=8), "shared memory"),
    (Cfg(cluster_m=4, cluster_n=4), "portable size 8"),
    (Cfg(raster="x"), "raster"),
    (Cfg(swizzle=3), "swizzle"),
])
def test_invalid_configs_are_refused_with_a_reason_before_compiling(cfg, why):
    b = get_backend("sm100_blockscaled")
    assert why in b.is_valid(cfg, KEY)
    with pytest.raises(ValueError, match="invalid"):
        b.compile_only(cfg, KEY)


def test_shape_rules():
    assert "multiple of 32" in G.validate(Cfg(), 4096, 4080, "nvfp4", "bfloat16")
    assert "multiple of 8" in G.validate(Cfg(), 4092, 4096, "nvfp4", "bfloat16")
    b = get_backend("sm100_blockscaled")
    assert "moe" in b.supports(ProblemKey("moe", "nvfp4", "bfloat16", 512, 256, 8, 2))


SHAPES = [(4096, 4096), (2880, 2880), (1024, 8192), (14336, 4096)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 64, 512, 4096])
def test_defaults_are_valid_and_candidates_are_valid(n, k, m):
    b = get_backend("sm100_blockscaled")
    for fmt in ("nvfp4", "mxfp4"):
        key = ProblemKey("linear", fmt, "bfloat16", n, k)
        assert b.is_valid(b.default(key, m), key) is None
    cands = b.candidates(ProblemKey("linear", "nvfp4", "float16", n, k), m)
    assert cands[0] == b.default(ProblemKey("linear", "nvfp4", "float16", n, k), m)
    assert all(b.is_valid(c, KEY) is None for c in cands[:50])
    stored = b.config_dict(cands[-1])
    assert stored["kernel"] == "blockscaled" and b.parse_config(stored) == cands[-1]


def test_on_this_machine_the_backend_does_not_apply():
    b = get_backend("sm100_blockscaled")
    assert not b.applies_to(torch.device("cpu"))
    assert "CUDA" in b.unavailable_reason(torch.device("cpu"))
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 10:
        assert "10.x" in b.unavailable_reason(torch.device("cuda"))


# ------------------------------------------------------------------ compilation (sm_100a, sm_90a)
#: (n, k, m) whose default configs are compiled: every kind of default (64-, 128- and 256-row
#: weight tiles, the CTA pair)
DEFAULT_COMPILES = [(2880, 2880, 1), (4096, 4096, 512), (14336, 4096, 4096)]
SAMPLED = [
    Cfg(tile_m=256, tile_n=128, cluster_m=2, stages=5),
    Cfg(tile_m=256, tile_n=256, cluster_m=2, cluster_n=2, stages=3, raster="n", swizzle=4),
    Cfg(tile_n=64, cluster_n=2, stages=6, pdl=True),
    Cfg(tile_n=256, cluster_m=4, stages=3, swizzle=2),
]


@needs_cute
@pytest.mark.parametrize("n,k,m", DEFAULT_COMPILES)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_default_configs_compile_for_sm100a(n, k, m, fmt, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    key = ProblemKey("linear", fmt, "bfloat16", n, k)
    b = get_backend("sm100_blockscaled")
    b.compile_only(b.default(key, m), key)


@needs_cute
@pytest.mark.parametrize("cfg", SAMPLED, ids=repr)
def test_sampled_configs_compile_for_sm100a(cfg, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    for fmt, dtype in (("nvfp4", "float16"), ("mxfp4", "bfloat16")):
        key = ProblemKey("linear", fmt, dtype, 2048, 1536)
        assert get_backend("sm100_blockscaled").is_valid(cfg, key) is None
        G.compile_only(cfg, 2048, 1536, fmt, dtype)


@needs_cute
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_the_activation_quantizer_compiles(arch, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    for fmt in ("nvfp4", "mxfp4"):
        Q.compile_only(1024, fmt, "float16" if fmt == "mxfp4" else "bfloat16", arch)
    assert "multiple of 32" in Q.validate(1000, "nvfp4", "bfloat16", arch)


# ------------------------------------------------------------------ the first-contact guard
class _OnCPU(B.SM100BlockScaledBackend):
    """The backend with its hardware probe passing on the CPU and a stand-in runner: tests the
    guard, not the kernel."""

    def hardware_reason(self, device):
        return None

    def prepare(self, weight):
        return weight

    def compile(self, config, key):
        return reference_linear_w4a4


class _Wrong(_OnCPU):
    def compile(self, config, key):
        return lambda x, w, bias: reference_linear_w4a4(x, w, bias) * 1.1


class _Faulting(_OnCPU):
    def compile(self, config, key):
        def run(x, w, bias):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return run


def test_a_backend_that_matches_the_reference_passes_first_contact():
    b = _OnCPU()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert b.applies_to(torch.device("cpu")) and b.unavailable_reason(torch.device("cpu")) is None


@pytest.mark.parametrize("cls,why", [(_Wrong, "relative error"), (_Faulting, "illegal memory access")])
def test_a_wrong_or_faulting_backend_disables_itself_once_with_one_warning(cls, why):
    b = cls()
    with pytest.warns(RuntimeWarning, match="disabled for the process") as rec:
        assert not b.applies_to(torch.device("cpu"))
    assert len(rec) == 1 and why in str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no second test
        assert not b.applies_to(torch.device("cpu"))
        assert b.unavailable_reason(torch.device("cpu")).startswith("disabled for this process")


def test_a_disabled_backend_hands_the_call_to_the_reference(monkeypatch):
    from autofp4 import backends
    from autofp4.dispatch import Dispatcher

    monkeypatch.setitem(backends._INSTANCES, "sm100_blockscaled", _Wrong())
    with pytest.warns(RuntimeWarning):
        names = [b.name for b in backends.available_backends(torch.device("cpu"))]
    assert "sm100_blockscaled" not in names and names[-1] == "reference"
    d = Dispatcher(torch.device("cpu"))
    backend, _cfg = d.pick(ProblemKey("linear", "nvfp4", "bfloat16", 64, 128), 4)
    assert backend.name == "reference"


def test_self_test_problems_cover_both_formats():
    assert {p[0] for p in B.SELF_TEST_PROBLEMS} == {"nvfp4", "mxfp4"}
    assert all(dataclasses.is_dataclass(B.default_config(n, k, f, "bfloat16", m)) for f, n, k, m in B.SELF_TEST_PROBLEMS)
    tiles = {(B.default_config(n, k, "nvfp4", "bfloat16", m).tile_m, B.default_config(n, k, "nvfp4", "bfloat16", m).tile_n)
             for n, k, m in DEFAULT_COMPILES}
    assert tiles == {(128, 64), (128, 128), (256, 256)}
