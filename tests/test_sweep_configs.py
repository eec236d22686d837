"""CPU checks of ``scripts/sweep_configs.py``: its grids (the default first, every config valid and
distinct), the ``--vary`` settings over the stored winners, and (with CuTeDSL) that it compiles
what it would time for sm_90a."""
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import _common  # noqa: E402
import sweep_configs as S  # noqa: E402

from autofp4.backends import sm90_heuristics as H  # noqa: E402


@pytest.mark.parametrize("kernel,grid,m", [("decode", "default", 1), ("decode", "default", 16),
                                           ("gemm", "default", 16), ("gemm", "default", 128),
                                           ("gemm", "wide", 128), ("gemm", "swizzle", 2048)])
def test_grids_start_at_the_default_and_hold_valid_distinct_configs(kernel, grid, m):
    mod = S._kernels()[kernel]
    for name in ("8B o", "70B down"):
        n, k = _common.SHAPES[name]
        [(mm, cfgs)] = S.cases(kernel, grid, "nvfp4", n, k, [m])
        assert mm == m and len(cfgs) > 1
        default = (H.decode_default if kernel == "decode" else H.gemm_default)(n, k, "nvfp4", "bfloat16", m)
        assert cfgs[0] == _common.without_pdl(default)
        assert len(set(cfgs)) == len(cfgs)
        assert all(mod.validate(c, n, k, "nvfp4", "bfloat16") is None and not c.pdl for c in cfgs)


def test_the_decode_grid_skips_m_beyond_the_decode_kernel():
    n, k = _common.SHAPES["8B o"]
    assert [m for m, _ in S.cases("decode", "default", "nvfp4", n, k, [16, 128])] == [16]


def test_vary_sets_every_combination_on_each_stored_winner():
    from autofp4.db import read_records

    assert S.parse_vary(["producer=0,1", "split_k=1,2"]) == [
        {"producer": 0, "split_k": 1}, {"producer": 0, "split_k": 2},
        {"producer": 1, "split_k": 1}, {"producer": 1, "split_k": 2}]
    assert S.parse_vary(["split_reduce=kernel,cluster"]) == [{"split_reduce": "kernel"}, {"split_reduce": "cluster"}]
    records = read_records(_common.SHIPPED_DB)[1]
    n, k = _common.SHAPES["8B qkv"]
    winners = dict(_common.stored_winners(records, "gemm", "nvfp4", n, k, [64, 128, 512]))
    assert winners, "the shipped DB has GEMM winners of 8B qkv at M = 64..512"
    got = S.cases("gemm", "default", "nvfp4", n, k, [64, 128, 512], records, S.parse_vary(["producer=0,1"]))
    assert {m for m, _ in got} <= set(winners)
    for m, cfgs in got:
        assert [c.producer for c in cfgs] == [False, True]
        assert all(c == S.varied(winners[m], {"producer": c.producer}) for c in cfgs)
    with pytest.raises(SystemExit):
        S.varied(winners[next(iter(winners))], {"no_such_field": 1})


def test_stored_winners_turn_dependent_launch_off():
    from autofp4.db import read_records

    records = read_records(_common.SHIPPED_DB)[1]
    decode = [r for r in records if r.config.get("kernel") == "decode" and r.config.get("pdl_early")]
    assert decode, "the shipped DB has decode winners with the early trigger"
    r = decode[0]
    got = _common.stored_winners(records, "decode", r.fmt, r.n, r.k, [r.m_bucket], dtype=r.dtype)
    assert got and all(not c.pdl and not c.pdl_early for _, c in got)
    mod = S._kernels()["decode"]
    assert all(mod.validate(c, r.n, r.k, r.fmt, r.dtype) is None for _, c in got)


def test_compile_only_compiles_what_it_would_time(tmp_path, monkeypatch, capsys):
    pytest.importorskip("cutlass")
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(tmp_path / "kc"))
    assert S.main(["--kernel", "gemm", "--m", "64", "--shapes", "8B o", "--vary", "producer=0,1",
                   "--compile-only", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "compiled 2 kernels" in out and "(0 errors)" in out
    assert len(list((tmp_path / "kc").rglob("*.o"))) == 2


def test_without_a_gpu_it_says_so(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert S.main(["--kernel", "decode"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
