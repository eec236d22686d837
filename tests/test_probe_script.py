"""CPU checks of ``scripts/gpu_probe_decode.py``: its kernel variants still apply to the kernel
sources (it edits them in memory) and compile for sm_90a."""
import os
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


@pytest.mark.parametrize("tag", sorted(P.GEMM_VARIANTS))
@pytest.mark.parametrize("scale_select", [False, True])
def test_gemm_variants_apply_and_compile(tag, scale_select):
    mod = P.variant(tag, G, P._GEMM_SCALED, P.GEMM_VARIANTS)
    cfg = mod.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=128, stages=4, scale_select=scale_select)
    mod._compile(cfg, 1024, 1024, "nvfp4", "bfloat16")


@pytest.mark.parametrize("kernel", ["decode", "gemm"])
def test_ab_script_compiles_both_versions(kernel, tmp_path, monkeypatch, capsys):
    """``scripts/gpu_ab_decode.py --kernel K --compile-only``: the older copy of the kernel
    module (here: the current source under another name) and the current one each compile the
    default config of a shape at an M bucket."""
    import gpu_ab_decode as AB

    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(tmp_path / "kc"))
    mod = {"decode": D, "gemm": G}[kernel]
    old = tmp_path / f"old_{kernel}.py"
    old.write_text(Path(mod.__file__).read_text())
    m = "16" if kernel == "decode" else "64"
    monkeypatch.setattr(sys, "argv", ["gpu_ab_decode.py", "--kernel", kernel, "--old", str(old), "--fmt", "nvfp4",
                                      "--m", m, "--shapes", "8B o", "--compile-only"])
    try:
        AB.main()
        assert AB.NEW is mod
        assert AB.load_old(str(old)).__name__ == f"autofp4.kernels.{mod.__name__.rsplit('.', 1)[1]}_ab_old"
    finally:
        AB.use_kernel("decode")
    assert "compiled 2 kernels" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["post", "pre", "pfall", "post+pfall"])
def test_pdl_probe_gemm_variants_apply_and_compile(where):
    """``scripts/gpu_probe_pdl.py`` moves the GEMM's trigger after or before its wait (a second
    trigger call may not stay behind) and widens its L2 prefetch (``pfall``), editing the source
    in memory; every variant compiles for sm_90a."""
    import gpu_probe_pdl as PDL

    mod = PDL.placed(G, where)
    assert mod is not G and mod.__name__.endswith("_pdl_" + where.replace("+", "_"))
    src = Path(mod.__file__).read_text()
    assert src.count("griddep_launch_dependents()") == Path(G.__file__).read_text().count("griddep_launch_dependents()")
    wait = src.index("griddep_wait()\n")
    trig = src.index("griddep_launch_dependents()\n")
    assert (trig < wait) == (where == "pre")
    assert (trig < src.index("pipe.consumer_release(rel_state)")) == (where != "pfall")  # before the main loop
    assert ("k_tiles_split * w_copy_bytes" in src) == ("pfall" in where)
    cfg = mod.Sm90GemmConfig(tile_n=128, tile_m=64, tile_k=128, stages=4, pdl=True)
    mod._compile(cfg, 1024, 1024, "nvfp4", "bfloat16")
