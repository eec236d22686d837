"""scripts/bench_model.py end to end on the CPU with shrunken example configs (eager only: compiling
on the CPU takes minutes): every variant runs, the FP4 models agree with their dequantized copies."""
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_model as B  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
#: a tiny Llama, one eager batch-1 step on a 4-token prompt: the arguments the quick runs share
TINY_LLAMA = ["--device", "cpu", "--tiny", "--configs", str(EXAMPLES / "llama-3.1-8b.json"), "--batches", "1",
              "--prefill", "4", "--context", "4", "--steps", "1", "--reps", "1", "--modes", "eager"]


def test_a_tiny_run_writes_every_row(tmp_path, capsys):
    cfgs = ",".join(str(EXAMPLES / f) for f in ("llama-3.1-8b.json", "qwen3-30b-a3b.json", "gpt-oss-20b.json"))
    rc = B.main(["--device", "cpu", "--tiny", "--configs", cfgs, "--batches", "1,2", "--prefill", "16",
                 "--context", "8", "--steps", "2", "--reps", "1", "--modes", "eager", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "model.json").read_text())
    rows = doc["rows"]
    assert [(r["config"], r["variant"]) for r in rows] == [
        (c, v) for c in ("llama-3.1-8b", "qwen3-30b-a3b", "gpt-oss-20b") for v in ("bf16", "nvfp4", "mxfp4")]
    for r in rows:
        assert r["decode_b1"] > 0 and r["decode_b2"] > 0 and r["prefill"] > 0
        if r["variant"] != "bf16":
            assert r["cos_deq"] > 0.999 and r["cos_bf16"] > 0.9, r
    assert capsys.readouterr().out.strip().endswith("cosine of the last-token logits")


def test_autotune_tunes_the_misses_of_the_warm_up_into_the_given_db(tmp_path):
    from autofp4 import dispatch
    from autofp4.db import TuningDB

    db = tmp_path / "model.db"
    try:
        rc = B.main([*TINY_LLAMA, "--fmts", "nvfp4", "--autotune", "5", "--db", str(db), "--out", str(tmp_path)])
    finally:
        dispatch.set_db(None)
    assert rc == 0
    rows = json.loads((tmp_path / "model.json").read_text())["rows"]
    assert rows[0]["autotune_warmup_s"] is None and rows[1]["autotune_warmup_s"] > 0
    with TuningDB(db) as d:
        stored = d.results()
    # q/o, k/v, gate/up and down of the tiny Llama at M = 1 and M = 4 (the warm-up's prefill)
    assert {(r.n, r.k, r.m_bucket, r.origin) for r in stored} >= {(128, 128, 1, "jit"), (128, 128, 4, "jit")}


def test_every_mode_step_matches_a_forward_over_the_whole_sequence():
    """The eager and graph modes' steps (the graph one uncaptured on the CPU: static cache, in-place
    token and position buffers) pick each token from the logits a cache-free forward over the
    whole sequence gives at its position."""
    config, _ = B.load_config(EXAMPLES / "llama-3.1-8b.json", None, True)
    model = B.build(config, "cpu").float()
    for mode in ("eager", "graph"):
        torch.manual_seed(1)
        with torch.no_grad():
            step, last = B.decoder(model, config, 2, 6, 4, mode, torch.device("cpu"))
            toks, logits = [last()[0].clone()], [last()[1].clone()]
            for _ in range(4):
                step()
                toks.append(last()[0].clone())
                logits.append(last()[1].clone())
            torch.manual_seed(1)
            prompt = torch.randint(0, config.vocab_size, (2, 6))
            seq = torch.cat([prompt] + toks, 1)
            want = model(seq).logits[:, 5:10]
        got = torch.stack(logits, 1)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (mode, (got - want).abs().max())
        assert torch.equal(torch.cat(toks, 1), got.argmax(-1))


@pytest.mark.parametrize("bad,named", [(["--modes", "eager,fast"], "'fast'"), (["--fmts", "nvfp4+router"], "nvfp4+router")])
def test_an_unknown_mode_or_variant_is_refused(bad, named, capsys):
    with pytest.raises(SystemExit):
        B.main(["--device", "cpu", *bad])
    assert named in capsys.readouterr().err


def test_skip_and_no_fuse_reach_quantize_model(tmp_path, monkeypatch):
    import autofp4

    seen = []
    real = autofp4.quantize_model
    monkeypatch.setattr(autofp4, "quantize_model", lambda m, fmt, **kw: seen.append(kw) or real(m, fmt, **kw))
    rc = B.main([*TINY_LLAMA, "--fmts", "mxfp4", "--skip", "", "--no-fuse", "--out", str(tmp_path)])
    assert rc == 0 and seen == [{"skip": [], "fuse": False}]
    row = json.loads((tmp_path / "model.json").read_text())["rows"][1]
    assert row["variant"] == "mxfp4" and row["cos_deq"] > 0.999


def test_a_plus_lm_head_variant_quantizes_lm_head_and_the_plain_one_keeps_it(tmp_path, monkeypatch):
    import autofp4

    heads = []
    real = autofp4.quantize_model

    def spy(m, fmt, **kw):
        out = real(m, fmt, **kw)
        heads.append((fmt, type(m.lm_head).__name__))
        return out

    monkeypatch.setattr(autofp4, "quantize_model", spy)
    rc = B.main([*TINY_LLAMA, "--fmts", "nvfp4,nvfp4+lm_head", "--out", str(tmp_path)])
    assert rc == 0 and heads == [("nvfp4", "Linear"), ("nvfp4", "FP4Linear")]
    rows = json.loads((tmp_path / "model.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["bf16", "nvfp4", "nvfp4+lm_head"]
    assert all(r["cos_deq"] > 0.99 for r in rows[1:])


def test_a_run_stopped_part_way_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    calls = []
    real = B.prefill

    def prefill(*a, **kw):
        calls.append(1)
        if len(calls) == 3:  # base logits, the bf16 row, then the FP4 model's reference: stop there
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(B, "prefill", prefill)
    with pytest.raises(KeyboardInterrupt):
        B.main([*TINY_LLAMA, "--fmts", "mxfp4", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "model.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["bf16"] and rows[0]["decode_b1"] > 0
    assert "| llama-3.1-8b | 2 | bf16 | eager |" in (tmp_path / "model.md").read_text()
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_variant_with_fp8_activations(tmp_path, monkeypatch):
    """FORMAT+fp8 quantizes with activations="fp8": every FP4 layer runs W4A8, its logits close to the
    bf16-activation model's on the same weights (cos_deq) but not equal to the plain variant's."""
    import autofp4

    acts = []
    real = autofp4.quantize_model

    def spy(m, fmt, **kw):
        out = real(m, fmt, **kw)
        acts.append({x.act_dtype for x in m.modules() if isinstance(x, autofp4.nn.FP4Buffers)})
        return out

    monkeypatch.setattr(autofp4, "quantize_model", spy)
    rc = B.main([*TINY_LLAMA, "--fmts", "nvfp4,nvfp4+fp8", "--modes", "eager", "--out", str(tmp_path)])
    assert rc == 0 and acts == [{None}, {"fp8"}]
    rows = json.loads((tmp_path / "model.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["bf16", "nvfp4", "nvfp4+fp8"]
    assert rows[1]["cos_deq"] > 0.999 and 0.97 < rows[2]["cos_deq"] < 1.0
    with pytest.raises(SystemExit):  # two activation settings in one variant
        B.main([*TINY_LLAMA, "--fmts", "nvfp4+fp8+fp8-prefill", "--out", str(tmp_path)])
