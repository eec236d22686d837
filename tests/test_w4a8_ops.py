"""The W4A8 problems (ops ``linear_fp8`` / ``moe_fp8``) through the whole system on the CPU: their
keys, a model's FP8 shapes, the CLI, real tuning runs into SQLite files checked against the W4A8
reference, the dispatcher serving the stored rows, and the Hopper backend's config space
(compiled for sm_90a where CuTeDSL is installed)."""
from __future__ import annotations

import importlib.util
import io
import os
import sqlite3

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import autofp4  # noqa: E402
from autofp4.backends import get_backend  # noqa: E402
from autofp4.backends.reference import reference_linear_w4a8, reference_moe_w4a8, reference_runner  # noqa: E402
from autofp4.cli import main as cli_main  # noqa: E402
from autofp4.db import TuningDB  # noqa: E402
from autofp4.env import current_environment  # noqa: E402
from autofp4.models import load_config, model_shapes  # noqa: E402
from autofp4.problem import ProblemKey, op_for  # noqa: E402
from autofp4.tuning import tune  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_cute = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs nvidia-cutlass-dsl")


def test_keys_of_the_fp8_ops():
    assert op_for("linear", "fp8") == "linear_fp8" and op_for("moe", None) == "moe"
    ProblemKey("linear_fp8", "nvfp4", "bfloat16", 256, 128)
    ProblemKey("moe_fp8", "mxfp4", "bfloat16", 256, 128, 8, 2)
    with pytest.raises(ValueError, match="moe_fp8 needs 0 < topk <= experts"):
        ProblemKey("moe_fp8", "mxfp4", "bfloat16", 256, 128)
    with pytest.raises(ValueError, match="linear_fp8 problems have no experts"):
        ProblemKey("linear_fp8", "mxfp4", "bfloat16", 256, 128, 8, 2)
    with pytest.raises(ValueError, match="act must be None or 'fp8'"):
        op_for("linear", "int8")


def test_a_models_fp8_shapes():
    cfg = load_config(os.path.join(ROOT, "examples", "qwen3-30b-a3b.json"))
    plain = model_shapes(cfg)
    fp8 = model_shapes(cfg, act="fp8")
    assert [s.op for s in fp8] == [op_for(s.op, "fp8") for s in plain]
    assert [(s.n, s.k, s.experts, s.topk) for s in fp8] == [(s.n, s.k, s.experts, s.topk) for s in plain]
    assert {s.op for s in fp8} == {"linear_fp8", "moe_fp8"}
    with pytest.raises(ValueError, match="act must be None or 'fp8'"):
        model_shapes(cfg, act="e4m3")


def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = cli_main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_cli_tune_act_fp8_dry_run_and_ops(capsys):
    model = os.path.join(ROOT, "examples", "mixtral-8x7b.json")
    code, out, err = _cli("tune", "--model", model, "--act", "fp8", "--dry-run", "--m", "1,4096")
    assert code == 0, err
    assert "linear_fp8" in out and "moe_fp8" in out and "linear " not in out.replace("linear_fp8", "")
    code, out, err = _cli("tune", "--model", model, "--act", "fp8", "--ops", "moe", "--dry-run")
    assert code == 0 and "moe_fp8" in out and "linear_fp8" not in out
    code, out, err = _cli("tune", "--model", model, "--ops", "linear_fp8", "--dry-run")
    assert code == 2 and "for FP8 activations add --act fp8" in capsys.readouterr().err  # argparse's message
    code, out, err = _cli("tune", "--from-misses", "x.json", "--act", "fp8", "--dry-run")
    assert code == 2 and "--act" in err


def test_tuning_a_fp8_problem_on_the_cpu_stores_a_row_the_dispatcher_serves(tmp_path):
    key = ProblemKey("linear_fp8", "nvfp4", "bfloat16", 128, 256)
    path = tmp_path / "t.db"
    rep = tune([key], m_buckets=[4], db=path, device="cpu", progress=False)
    (res,) = rep.results
    assert res.status == "tuned" and res.backend == "reference"
    with TuningDB(path) as db:
        (row,) = db.results(current_environment(torch.device("cpu")).key())
        assert (row.op, row.n, row.k) == ("linear_fp8", 128, 256)
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM results WHERE op = 'linear'").fetchone()[0] == 0
    # the stored row serves a call with act_dtype="fp8"; the bf16 call is another problem
    autofp4.set_db(path)
    try:
        torch.manual_seed(0)
        w = autofp4.quantize(torch.randn(128, 256, dtype=torch.bfloat16), "nvfp4")
        x = torch.randn(4, 256, dtype=torch.bfloat16)
        out = autofp4.linear(x, w, act_dtype="fp8")
        torch.testing.assert_close(out, reference_linear_w4a8(x, w, None), rtol=0, atol=0)
        from autofp4.dispatch import get_dispatcher

        ex = get_dispatcher(torch.device("cpu")).explain(key, 4)
        assert ex.backend == "reference" and str(path) in str(ex), str(ex)  # the row stored by the run
    finally:
        autofp4.set_db(None)


def test_tuning_a_moe_fp8_problem_on_the_cpu(tmp_path):
    key = ProblemKey("moe_fp8", "mxfp4", "bfloat16", 128, 64, 4, 2)
    rep = tune([key], m_buckets=[2], db=tmp_path / "t.db", device="cpu", progress=False)
    assert rep.results[0].status == "tuned"


def test_the_oracle_of_w4a8_backends_is_the_w4a8_reference():
    key = ProblemKey("linear_fp8", "mxfp4", "bfloat16", 64, 128)
    assert reference_runner("w4a8", key) is reference_linear_w4a8
    mkey = ProblemKey("moe_fp8", "mxfp4", "bfloat16", 64, 128, 4, 2)
    torch.manual_seed(1)
    w13 = autofp4.quantize(torch.randn(4, 64, 128, dtype=torch.bfloat16), "mxfp4")
    w2 = autofp4.quantize(torch.randn(4, 128, 32, dtype=torch.bfloat16), "mxfp4")
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    tw, ti = autofp4.route(torch.randn(3, 4), 2)
    run = reference_runner("w4a8", mkey)
    torch.testing.assert_close(run(x, w13, w2, tw, ti, "silu"), reference_moe_w4a8(x, w13, w2, tw, ti), rtol=0, atol=0)
    with pytest.raises(ValueError, match="no W4A8 reference for linear"):
        reference_runner("w4a8", ProblemKey("linear", "mxfp4", "bfloat16", 64, 128))
    assert get_backend("sm90_w4a8").numerics == "w4a8"


def test_the_hopper_w4a8_backend_space():
    b = get_backend("sm90_w4a8")
    assert b.unavailable_reason(torch.device("cpu")) is not None
    dense = ProblemKey("linear_fp8", "nvfp4", "bfloat16", 4096, 4096)
    assert b.supports(ProblemKey("linear", "nvfp4", "bfloat16", 4096, 4096)) is not None
    assert get_backend("sm90_w4a16").supports(dense) is not None  # never serves the other numerics
    for m in (64, 512, 8192):
        cands = b.candidates(dense, m)
        assert cands[0] == b.default(dense, m) and len(cands) > 20
        assert all(b.is_valid(c, dense) is None for c in cands)
        assert all(b.parse_config(b.config_dict(c)) == c for c in cands[:10])
    assert b.default(dense, 512).tile_m == 256 and b.default(dense, 64).tile_m == 64
    # from 1024 tokens on, the cuBLAS path (the whole weight converted at once); a shape it cannot
    # run (N not a multiple of 16) keeps the in-kernel GEMM
    assert type(b.default(dense, 8192)).kernel == "cublas_fp8" and b.default(dense, 8192).chunk_n == 0
    assert b.default(ProblemKey("linear_fp8", "nvfp4", "bfloat16", 1000, 4096), 8192).tile_m == 256
    assert any(type(c).kernel == "cublas_fp8" for c in b.seeds(dense, 512))
    moe = ProblemKey("moe_fp8", "mxfp4", "bfloat16", 5760, 2880, 128, 4)
    assert b.default(moe, 1).tile_m == 64 and b.default(moe, 16384).tile_m == 256
    assert "swizzle" in b.is_valid(b.default(moe, 1).__class__(swizzle=4), moe)
    assert b.seeds(dense, 2048) and all(b.is_valid(c, dense) is None for c in b.seeds(dense, 2048))


@needs_cute
@pytest.mark.compile
def test_the_hopper_w4a8_backend_compiles_its_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(tmp_path))
    b = get_backend("sm90_w4a8")
    for key, m in ((ProblemKey("linear_fp8", "nvfp4", "bfloat16", 1024, 512), 512),
                   (ProblemKey("linear_fp8", "nvfp4", "bfloat16", 1024, 512), 4096),
                   (ProblemKey("moe_fp8", "mxfp4", "bfloat16", 512, 256, 8, 2), 64)):
        b.compile_only(b.default(key, m), key)
    names = {p.name.split("-")[0] for p in tmp_path.iterdir() if p.suffix == ".o"}
    assert {"sm90_w4a8_gemm", "sm90_w4a8_moe", "fp4_to_e4m3", "fp8_act_quant"} <= names


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_a_model_with_fp8_activations(kind):
    """quantize_model(activations="fp8"): every FP4 layer (fused, MoE experts) runs the W4A8 path;
    the logits stay close to the same model's bf16-activation ones, and set_activations switches
    back to exactly those."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tiny_models import tiny_model

    from autofp4.nn import FP4Buffers

    model = tiny_model(kind)
    ref = tiny_model(kind)
    autofp4.quantize_model(ref, "nvfp4")
    report = autofp4.quantize_model(model, "nvfp4", activations="fp8")
    assert report.converted
    layers = [m for m in model.modules() if isinstance(m, FP4Buffers)]
    assert layers and all(m.act_dtype == "fp8" for m in layers)
    if kind == "qwen3_moe":
        assert any(type(m).__name__ == "FP4Experts" for m in layers)
    assert "act_dtype='fp8'" in repr(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = model(ids).logits.double()
        b = ref(ids).logits.double()
        cos = torch.nn.functional.cosine_similarity(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), dim=-1)
        # a tiny model (hidden size 64): few terms per dot product, so a larger spread than real shapes
        assert float(cos.mean()) > 0.99 and float(cos.min()) > 0.97 and not torch.equal(a, b)
        assert autofp4.set_activations(model, None) == len(layers)
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="act_dtype must be None, 'fp8' or 'fp8-prefill'"):
        autofp4.set_activations(model, "int8")
    with pytest.raises(ValueError, match="quantize_model: activations"):
        autofp4.quantize_model(tiny_model(kind), "nvfp4", activations="fp4")


def test_backends_that_run_none_of_the_shapes_ops_are_refused(tmp_path):
    model = os.path.join(ROOT, "examples", "llama-3.1-8b.json")
    code, _, err = _cli("tune", "--model", model, "--act", "fp8", "--backend", "sm90_w4a16", "--dry-run")
    assert code == 2 and "--backend sm90_w4a16 runs linear, moe, none of these shapes' ops (linear_fp8)" in err
    assert "drop --act fp8" in err
    code, _, err = _cli("tune", "--model", model, "--backend", "sm90_w4a8", "--dry-run")
    assert code == 2 and "add --act fp8 for it" in err
    for backend, arch in (("sm100_blockscaled", "sm_100a"), ("sm90_w4a16", "sm_90a")):
        code, out, err = _cli("cache", "--warm", model, "--act", "fp8", "--backend", backend, "--arch", arch,
                              "--m", "1")
        assert code == 2 and f"--backend {backend} runs" in err and "compiled" not in out
    code, out, err = _cli("tune", "--model", model, "--act", "fp8", "--backend", "reference", "--dry-run")
    assert code == 0, err


def test_set_activations_needs_fp4_layers():
    with pytest.raises(ValueError, match="the model has no FP4 layer"):
        autofp4.set_activations(torch.nn.Sequential(torch.nn.Linear(4, 4)), "fp8")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        autofp4.set_activations("model", "fp8")
