"""scripts/bench_jit.py end to end on the CPU (the reference backend, a tiny Llama): every phase
runs, its JSON holds what the table reports, and each phase's rows came from its own tuning."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_jit as B  # noqa: E402


def test_the_cpu_smoke_run_measures_every_phase(tmp_path, capsys):
    assert B.main(["--device", "cpu", "--out", str(tmp_path), "--reps", "2", "--rounds", "2"]) == 0
    doc = json.loads((tmp_path / "jit.json").read_text())
    assert doc["offline"]["tuned"] == doc["offline"]["jobs"] == 4 * len(B.CPU_MS)
    assert list(doc["blocking"]["first_forward_s"]) == [str(m) for m in B.CPU_MS]
    assert doc["background"]["all_tuned"] and doc["background"]["duty"] == 0.5
    for phase in ("offline", "blocking", "background"):
        d = doc[phase]["decode"]["1"]
        assert d["us"] > 0 and len(d["windows"]) == 2
    assert doc["background"]["decode_meanwhile"]["1"]["windows"] is not None
    assert set(doc["derived"]["decode"]["1"]) == {"blocking_over_offline", "within_noise", "background_cost"}
    out = capsys.readouterr().out
    assert out.rstrip().endswith("target <= 10%)") and "blocking warm-up" in out
    assert (tmp_path / "jit.md").read_text().startswith("cpu, ")
