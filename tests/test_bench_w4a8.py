"""CPU checks of ``scripts/bench_w4a8.py``: its config candidates, its table arithmetic and its error
table on the CPU."""
import math
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_w4a8 as B  # noqa: E402


def test_candidates_are_valid_distinct_and_start_with_the_default():
    from autofp4.kernels import sm90_w4a8_gemm as g8
    from autofp4.w4a8 import default_config

    for (n, k) in B.SHAPES.values():
        for m in (512, 8192):
            cands = B.candidates(n, k, "nvfp4", m, 8)
            assert cands[0] == default_config(n, k, "nvfp4", "bfloat16", m)
            assert len(set(cands)) == len(cands) >= 4
            assert all(g8.validate(c, n, k, "nvfp4", "bfloat16") is None for c in cands)
    assert len(B.candidates(4096, 4096, "mxfp4", 2048, 2)) == 2


def _row(shape, m, n, k, us):
    return dict(shape=shape, n=n, k=k, m=m, us=us, tflops={t: B.tflops(m, n, k, v) for t, v in us.items()})


def test_table_ratios_and_geomeans():
    us1 = {"cublas": 100.0, "fp8": 50.0, "nvfp4 w4a16": 105.0, "nvfp4 w4a8": 62.5, "nvfp4 w4a8 gemm": 60.0}
    us2 = {"cublas": 400.0, "fp8": 250.0, "nvfp4 w4a16": 400.0, "nvfp4 w4a8": 200.0, "nvfp4 w4a8 gemm": 190.0}
    rows = [_row("8B o", 2048, 4096, 4096, us1), _row("8B qkv", 2048, 6144, 4096, us2)]
    rows[0]["w4a8"] = {"nvfp4": dict(error_on_operands={"a": 3e-4, "b": 5e-4})}
    rows[1]["w4a8"] = {"nvfp4": dict(error_on_operands={"a": 2e-4})}
    doc = dict(fmts=["nvfp4"], rows=rows,
               errors=[dict(x="random", fmt="nvfp4", w4a16_vs_dequant=1e-3, w4a8_vs_dequant=3e-2,
                            w4a16_vs_bf16_weight=0.1, w4a8_vs_bf16_weight=0.104)],
               gpu="GPU", date="d", torch="t")
    text = B.table(doc)
    lines = text.splitlines()
    first = lines[2].split(" | ")
    assert first[3] == f"{B.tflops(2048, 4096, 4096, 50.0):.0f} (2.00x)"
    assert first[5] == f"{B.tflops(2048, 4096, 4096, 62.5):.0f} (1.60x)"
    gm = lines[4].split(" | ")
    assert gm[5] == f"{math.sqrt(1.6 * 2.0):.2f}x / {math.sqrt(0.8 * 1.25):.2f}x"
    assert "| random | nvfp4 | 1.00e-03 | 3.00e-02 | - | 1.00e-01 | 1.04e-01 |" in text
    assert "relative error 2.00e-04 to 5.00e-04." in text


def test_compile_only_needs_no_gpu(tmp_path, monkeypatch, capsys):
    pytest.importorskip("cutlass")
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(tmp_path))
    assert B.main(["--compile-only", "--shapes", "8B o", "--m", "512", "--fmt", "mxfp4", "--configs", "2"]) == 0
    assert "compiled" in capsys.readouterr().out
    assert sum(p.name.startswith("sm90_w4a8_gemm-") and p.suffix == ".o" for p in tmp_path.iterdir()) == 2


def test_errors_only_on_the_cpu(tmp_path, monkeypatch):
    """The error table from the reference paths: E4M3 activations cost a few percent against the
    dequantized weight (3 mantissa bits), little against the bf16 weight (FP4 dominates), and
    1 x 128 blocks help where a few channels are outliers."""
    import json

    monkeypatch.setitem(B.SHAPES, "8B gate_up", (256, 1024))
    assert B.main(["--errors-only", "--device", "cpu", "--error-m", "96", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "w4a8-errors.json").read_text())
    errs = {(e["x"], e["fmt"]): e for e in doc["errors"]}
    assert set(errs) == {(x, f) for x in ("random", "outliers") for f in ("nvfp4", "mxfp4")}
    for (x, fmt), e in errs.items():
        assert e["m"] == 96 and e["w4a16_vs_dequant"] < 4e-3
        assert 1e-2 < e["w4a8_vs_dequant"] < 6e-2 and e["w4a8_vs_dequant"] > 5 * e["w4a16_vs_dequant"]
        assert e["w4a16_vs_bf16_weight"] < e["w4a8_vs_bf16_weight"] < 1.15 * e["w4a16_vs_bf16_weight"]
        if x == "outliers":
            assert e["blocks128_vs_dequant"] < 0.6 * e["w4a8_vs_dequant"]
    assert "(E4M3 in 1x128 blocks)" in (tmp_path / "w4a8-errors.md").read_text()
    with pytest.raises(SystemExit):
        B.main(["--errors-only", "--error-m", "0"])


def test_bad_options_are_named(tmp_path, capsys):
    import json

    for argv, needle in ((["--errors-only", "--fmt", ""], "--fmt"), (["--compile-only", "--m", "abc"], "--m"),
                         (["--compile-only", "--m", "0,512"], "--m"), (["--errors-only", "--device", "meta"], "--device")):
        with pytest.raises(SystemExit) as e:
            B.main(argv + ["--out", str(tmp_path)])
        assert e.value.code == 2 and needle in capsys.readouterr().err, argv
    if not B.torch.cuda.is_available():
        assert B.main(["--errors-only", "--device", "cuda", "--out", str(tmp_path)]) == 2
        assert "needs a CUDA GPU (or --device cpu)" in capsys.readouterr().err
    # the table of an --errors-only run re-renders
    doc = dict(gpu="cpu", date="d", errors=[dict(x="random", fmt="mxfp4", m=8, w4a16_vs_dequant=1e-3,
                                                  w4a8_vs_dequant=2e-2, blocks128_vs_dequant=2e-2,
                                                  w4a16_vs_bf16_weight=0.1, w4a8_vs_bf16_weight=0.11)])
    (tmp_path / "e.json").write_text(json.dumps(doc))
    assert B.main(["--table", str(tmp_path / "e.json")]) == 0
    out = capsys.readouterr().out
    assert "| random | mxfp4 | 1.00e-03 | 2.00e-02 | 2.00e-02 |" in out and "8 rows" in out
