"""CPU checks of ``scripts/gpu_probe_decode.py``: its kernel variants still apply to the kernel
sources (it edits them in memory) and compile for sm_90a, and the GEMM ``hsel`` variant keeps
the product while dropping the byte permutes from the PTX."""
import os
import re
import sys
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

pytest.importorskip("cutlass")

import gpu_probe_decode as P  # noqa: E402
from autofp4.kernels import sm90_w4a16_gemm as G  # noqa: E402
from autofp4.kernels import w4a16_decode as D  # noqa: E402


@pytest.mark.parametrize("tag", sorted(P.VARIANTS))
def test_decode_variants_apply_and_compile(tag):
    mod = P.variant(tag)
    assert mod.__name__.endswith(f"_probe_{tag}") and mod is not D
    cfg = mod.DecodeConfig(4, 2, 16, x_smem=True)
    mod._compile(cfg, 4096, 4096, "nvfp4", "bfloat16", False)


def _gemm_ptx(mod, out: Path) -> str:
    """PTX of one GEMM config built from ``mod`` (compiled as its ``_compile`` does, plus a dump)."""
    import cutlass.cute as cute

    out.mkdir(parents=True)
    kern = mod._Sm90W4A16Kernel(mod.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=128, stages=4), 1024, 1024,
                                "nvfp4", "bfloat16")
    cute.compile(kern.build(), *kern.fake_args(),
                 options=f"--enable-tvm-ffi --gpu-arch sm_90a --keep-ptx --dump-dir={out}")
    files = list(out.glob("*.ptx"))
    assert len(files) == 1
    return files[0].read_text()


def test_gemm_hsel_variant_broadcasts_by_moves(tmp_path):
    """As is, each k16 step's two scale broadcasts are PRMTs; ``hsel`` has none and the same
    number of bf16x2 multiplies, each on a {half, half} built by moves (which ptxas folds into
    the multiply's operand select on sm_90a)."""
    base = _gemm_ptx(G, tmp_path / "a")
    hsel = _gemm_ptx(P.variant("hsel", G, P._GEMM_SCALED, P.GEMM_VARIANTS), tmp_path / "b")
    muls = len(re.findall(r"mul\.rn\.bf16x2", base))
    assert muls > 0 and len(re.findall(r"mul\.rn\.bf16x2", hsel)) == muls
    assert len(re.findall(r"prmt\.b32", base)) == muls // 2
    assert "prmt.b32" not in hsel
    assert len(re.findall(r"mov\.b32 s, \{l, l\}", hsel)) == len(re.findall(r"mov\.b32 s, \{h, h\}", hsel)) == muls // 2
