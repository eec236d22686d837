"""scripts/bench_model.py end to end on the CPU with shrunken example configs (eager only: compiling
on the CPU takes minutes): every variant runs, the FP4 models agree with their dequantized copies."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_model as B  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


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
