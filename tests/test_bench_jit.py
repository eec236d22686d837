"""scripts/bench_jit.py end to end on the CPU (the reference backend, a tiny Llama): every phase
runs, its JSON holds what the table reports, and each phase's rows came from its own tuning."""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_jit as B  # noqa: E402


def test_the_cpu_smoke_run_measures_every_phase(tmp_path, capsys):
    env = {k: os.environ.get(k) for k in B._PHASE_ENV}
    assert B.main(["--device", "cpu", "--out", str(tmp_path), "--reps", "2", "--rounds", "2"]) == 0
    assert {k: os.environ.get(k) for k in B._PHASE_ENV} == env  # the phases' settings do not leak
    doc = json.loads((tmp_path / "jit.json").read_text())
    assert doc["offline"]["tuned"] == doc["offline"]["jobs"] == 4 * len(B.CPU_MS)
    assert doc["offline"]["untuned_calls"] == 0
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


def test_one_phase_runs_alone_and_reads_the_offline_rows_of_a_given_db(tmp_path, capsys):
    """``--phases`` runs a subset (written to its own file); ``--offline-db`` decodes with the
    rows of an export instead of tuning."""
    import autofp4
    from autofp4 import dispatch
    from autofp4.models import model_shapes

    db = tmp_path / "offline.db"
    shapes = [s for s in model_shapes(B.TINY, fmt="nvfp4") if s.op == "linear"]
    autofp4.tune(shapes, m_buckets=[1], fmt="nvfp4", db=db, device="cpu", progress=False)
    export = tmp_path / "offline.json"
    from autofp4.cli import main as cli

    assert cli(["db", "export", "--db", str(db), "--out", str(export)]) == 0
    try:
        assert B.main(["--device", "cpu", "--out", str(tmp_path), "--reps", "2", "--rounds", "2",
                       "--phases", "offline", "--offline-db", str(export)]) == 0
    finally:
        dispatch.set_db(None)
    doc = json.loads((tmp_path / "jit-offline.json").read_text())
    assert set(doc) >= {"offline", "derived"} and "blocking" not in doc and doc["offline"]["tune_s"] is None
    assert doc["offline"]["decode"]["1"]["us"] > 0 and doc["offline"]["untuned_calls"] == 0  # the export's rows ran
    assert not (tmp_path / "jit.json").exists()
    assert "the rows of offline.json" in capsys.readouterr().out
