"""CPU checks of ``scripts/bench_ceiling.py``: its TFLOP/s arithmetic and table, the GEMM config it
takes from a tuning export, its results files, and (with CuTeDSL) that it compiles what it would
time for sm_90a."""
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_ceiling as C  # noqa: E402


def test_tflops_is_two_mnk_per_call():
    # 2 * 2048 * 4096 * 4096 flops in 100 us
    assert C.tflops(2048, 4096, 4096, 100.0) == pytest.approx(2 * 2048 * 4096 * 4096 / 1e-4 / 1e12)


def _row(shape, m, n, k, us):
    return dict(shape=shape, n=n, k=k, m=m, us=us, tflops={t: C.tflops(m, n, k, v) for t, v in us.items()})


def test_table_ratios_need_and_geomean():
    rows = [_row("8B o", 2048, 4096, 4096, {"cublas": 100.0, "fp8": 55.0, "nvfp4 ours": 104.0}),
            _row("8B qkv", 8192, 6144, 4096, {"cublas": 600.0, "fp8": 330.0, "nvfp4 ours": 640.0})]
    doc = dict(fmts=["nvfp4"], rows=rows, card={"bf16": 700.0, "fp8": 1300.0}, gpu="GPU", date="d", torch="t")
    text = C.table(doc)
    lines = text.splitlines()
    first = lines[2].split(" | ")
    cub = C.tflops(2048, 4096, 4096, 100.0)
    assert first[2] == f"{cub:.0f}" and first[3] == f"{1.1 * cub:.0f}"
    assert first[4].endswith(f"({100 / 104:.2f}x)") and first[5].rstrip(" |").endswith(f"({100 / 55:.2f}x)")
    gm = lines[4].split(" | ")
    assert gm[4] == f"{math.sqrt(100 / 104 * 600 / 640):.2f}x"
    assert gm[5].rstrip(" |") == f"{math.sqrt(100 / 55 * 600 / 330):.2f}x"
    assert "bf16 700, fp8 1300 TFLOP/s" in text
    at_card = math.sqrt(700 / C.tflops(2048, 4096, 4096, 100.0) * 700 / C.tflops(8192, 6144, 4096, 600.0))
    assert f"would be {at_card:.2f}x cuBLAS" in text


def test_picked_gemm_takes_the_stored_winner_without_pdl():
    from autofp4.backends import sm90_heuristics as H
    from autofp4.db import read_records

    _, records = read_records(C.SHIPPED)
    gemm = [r for r in records if r.config.get("kernel") == "gemm" and r.m_bucket == 2048 and r.dtype == "bfloat16"]
    assert gemm, "the shipped DB has GEMM rows at M = 2048"
    r = gemm[0]
    cfg, source = C.picked_gemm(records, r.fmt, r.n, r.k, 2048)
    assert source == "tuned" and cfg.pdl is False
    assert cfg.tile_n == r.config["tile_n"]
    # a shape the DB does not hold falls back to the GEMM's default
    cfg, source = C.picked_gemm(records, "nvfp4", 1024, 1024, 2048)
    assert source == "default"
    assert cfg == dataclasses.replace(H.gemm_default(1024, 1024, "nvfp4", "bfloat16", 2048), pdl=False)


def test_compile_only_builds_the_pick(tmp_path, monkeypatch, capsys):
    pytest.importorskip("cutlass")
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(tmp_path / "kc"))
    monkeypatch.setattr(sys, "argv", ["bench_ceiling.py", "--compile-only", "--fmt", "mxfp4", "--shapes", "8B o",
                                      "--m", "2048"])
    assert C.main() == 0
    assert "compiled" in capsys.readouterr().out
    # the pick: one GEMM binary (bias or not, dependent launch or not)
    assert len([p for p in (tmp_path / "kc").rglob("*.o")]) == 1


def test_without_a_gpu_it_says_so(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["bench_ceiling.py"])
    assert C.main() == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_table_mode_writes_the_markdown_next_to_the_json(tmp_path, capsys):
    rows = [_row("8B o", 2048, 4096, 4096, {"cublas": 100.0, "fp8": 55.0, "nvfp4 ours": 104.0})]
    doc = dict(fmts=["nvfp4"], rows=rows, card={"bf16": 700.0, "fp8": 1300.0}, gpu="GPU", date="d", torch="t",
               command="python scripts/bench_ceiling.py --fmt nvfp4")
    path = tmp_path / "ceiling.json"
    path.write_text(json.dumps(doc))
    assert C.main(["--table", str(path)]) == 0
    md = (tmp_path / "ceiling.md").read_text()
    assert md.strip() == C.table(doc).strip() and md.strip() in capsys.readouterr().out
    assert "Reproduce: `python scripts/bench_ceiling.py --fmt nvfp4`" in md
