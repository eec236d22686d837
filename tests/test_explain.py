"""Seeing what a call runs: Dispatcher.explain, autofp4.explain, ``autofp4 explain``, the
``AUTOFP4_LOG`` log of first calls, and get_dispatcher's default device; with rows tuned for real
on the CPU (the reference backend)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autofp4
from autofp4 import dispatch
from autofp4.cli import main
from autofp4.problem import ProblemKey

REPO = Path(__file__).resolve().parents[1]
KEY = ProblemKey("linear", "nvfp4", "bfloat16", 256, 128)


@pytest.fixture
def tuned_db(tmp_path):
    """A user DB with KEY tuned at M bucket 16 (real trials on the CPU), the process's DB."""
    db = tmp_path / "t.db"
    rep = autofp4.tune([KEY], m_buckets=[16], db=db, device="cpu", progress=False)
    assert [r.status for r in rep.results] == ["tuned"]
    dispatch.set_db(db)
    yield db
    dispatch.set_db(None)


def test_explain_names_the_tuned_row_and_its_layer_or_the_default(tuned_db):
    d = dispatch.get_dispatcher("cpu")
    e = d.explain(KEY, 12)
    assert e.tuned and e.row_bucket == 16 and e.bucket == 16 and e.backend == "reference"
    assert e.layer == str(tuned_db) and "tuned row of M bucket 16" in e.why
    assert "M=12 (bucket 16): reference" in str(e) and str(tuned_db) in str(e)
    other = d.explain(KEY, 3)  # bucket 4: the row serves other token counts
    assert not other.tuned and other.row_bucket is None and "M buckets 16" in other.why and "default" in other.why
    none = d.explain(ProblemKey("linear", "nvfp4", "bfloat16", 512, 128), 16)
    assert not none.tuned and "no tuned row" in none.why
    assert d.misses() == []  # explaining counts nothing


def test_autofp4_explain_of_a_call(tuned_db, gen):
    w = autofp4.quantize(torch.randn(KEY.n, KEY.k, generator=gen), "nvfp4")
    e = autofp4.explain(torch.randn(2, 8, KEY.k, generator=gen).bfloat16(), w)  # M = 16 rows
    assert e.key == KEY and e.m == 16 and e.tuned
    w13 = autofp4.quantize(torch.randn(4, 64, 128, generator=gen), "nvfp4")
    e = autofp4.explain(torch.randn(3, 128, generator=gen).bfloat16(), w13, top_k=2)
    assert (e.key.op, e.key.experts, e.key.topk, e.m) == ("moe", 4, 2, 3) and not e.tuned
    with pytest.raises(ValueError, match="needs top_k"):
        autofp4.explain(torch.randn(3, 128).bfloat16(), w13)
    with pytest.raises(TypeError, match="FP4Weight"):
        autofp4.explain(torch.randn(3, 128).bfloat16(), torch.randn(4, 4))
    assert dispatch.get_dispatcher() is dispatch.get_dispatcher(
        "cuda" if torch.cuda.is_available() else "cpu")
    assert "explain" in dir(autofp4) and "from_pretrained" in dir(autofp4) and "autotune" in dir(autofp4)


def test_the_explain_command(tuned_db, tmp_path, capsys):
    assert main(["explain", "--n", "256", "--k", "128", "--m", "1,12", "--db", str(tuned_db), "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 and "M=1 (bucket 1)" in out[0] and "other token counts" in out[1]
    assert "M=12 (bucket 16)" in out[2] and "tuned row of M bucket 16" in out[3] and str(tuned_db) in out[4]
    cfg = tmp_path / "c.json"
    cfg.write_text('{"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, '
                   '"num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 64}')
    assert main(["explain", "--model", str(cfg), "--m", "16", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "qkv_proj: linear" in out and "down_proj: linear" in out
    assert main(["explain", "--device", "cpu"]) == 2
    assert "explain needs --model" in capsys.readouterr().err
    assert main(["explain", "--model", str(cfg), "--n", "4", "--k", "4"]) == 2
    assert "not both" in capsys.readouterr().err


def _run(code: str, log: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "AUTOFP4_LOG": log, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)


CALLS = ("import torch, autofp4; w = autofp4.quantize(torch.randn(64, 128), 'nvfp4'); "
         "[autofp4.linear(torch.randn(m, 128).bfloat16(), w) for m in (5, 6, 5, 16)]")


def test_autofp4_log_reports_first_calls(tmp_path):
    r = _run(CALLS, "info")
    lines = [line for line in r.stderr.splitlines() if line.startswith("autofp4: linear")]
    assert r.returncode == 0 and len(lines) == 2, r.stderr  # buckets 8 and 16, once each
    assert "M=5 (bucket 8)" in lines[0] and "M=16 (bucket 16)" in lines[1] and "on cpu" in lines[0]
    r = _run(CALLS, "debug")
    assert len([line for line in r.stderr.splitlines() if line.startswith("autofp4: linear")]) == 3  # M = 5, 6, 16
    r = _run(CALLS, "loud")
    assert r.returncode == 0 and "AUTOFP4_LOG='loud' ignored" in r.stderr
    assert not any(line.startswith("autofp4: linear") for line in r.stderr.splitlines())
