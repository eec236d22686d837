"""scripts/bench_jit.py on the CPU (the reference backend, a tiny Llama and a tiny Qwen3-MoE):
every phase runs, its JSON holds what the table reports, each phase's rows came from its own
tuning, the per-job comparison times the JIT, offline and default configs with the tuner's trial,
and a warmed kernel cache is copied, not used in place."""
import argparse
import json
import os
import sys
from pathlib import Path

import pytest

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
    # empty caches, and the reference backend compiles nothing into them
    assert doc["blocking"]["kernel_cache"] == doc["background"]["kernel_cache"] == {"state": "cold", "compiled": 0}
    assert set(doc["blocking"]["warmup_s_by_op"]) == {"linear"}  # a model without MoE layers
    assert 0 < doc["blocking"]["warmup_s_by_op"]["linear"] <= doc["blocking"]["warmup_s"]
    assert doc["background"]["moe_tuned_s"] is None and doc["background"]["moe_jobs_expected"] == 0
    # the per-job comparison of both phases, against the rows the offline phase stored (every job
    # has one at its own M): the tiny shapes have one valid reference config, so all three picks
    # are that config, timed once per job: speed 1.0, never slower than the default
    for phase in ("blocking", "background"):
        cmp = doc[phase]["compare"]
        assert cmp["offline_source"] == doc["offline"]["db"] and cmp["rounds"] == 1
        assert len(cmp["jobs"]) == len(doc[phase]["jobs"]) == 4 * len(B.CPU_MS)
        for e in cmp["jobs"]:
            assert e["offline_m"] == e["m"] and e["trials"] >= 1 and e["same_as_offline"] and e["jit_is_default"]
            assert e["picks"]["jit"] == e["picks"]["offline"] == e["picks"]["default"] == {"backend": "reference",
                                                                                           "config": {"chunk_n": 0}}
            assert e["times"]["jit"]["us"] > 0 and e["times"]["jit"] == e["times"]["offline"] == e["times"]["default"]
            assert e["speed_vs_offline"] == 1.0 and e["slower_than_default"] is False
        s = cmp["summary"]
        assert s["by_op"]["linear"]["with_offline_row"] == 12 and s["by_op"]["linear"]["speed_vs_offline_geomean"] == 1.0
        assert s["by_op"]["linear"]["met"] and "moe" not in s["by_op"]
        assert s["slower_than_default"] == 0 and s["same_as_offline"] == s["with_offline_pick"] == 12
        assert s["trials_total"] == sum(j["trials_run"] for j in doc[phase]["jobs"])
    out = capsys.readouterr().out
    assert "blocking warm-up" in out and "target <= 120 s with a cold kernel cache" in out
    assert "kernel cache: cold (empty)" in out
    assert "background jobs (us: kernel time as the tuner times it" in out  # 2 x 16 lines of per-job tables: printed
    lines = out.rstrip().splitlines()
    assert lines[-1].startswith("  picks equal to the offline pick: 12 of 12;")
    assert lines[-2] == "  JIT rows slower than the default beyond the noise: 0 (target 0)"
    assert "linear: speed vs offline 1.000 geomean over 12 of 12 jobs" in lines[-3] and "[met]" in lines[-3]
    md = (tmp_path / "jit.md").read_text()
    assert md.startswith("cpu, ") and "blocking jobs (us: kernel time as the tuner times it" in md


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


def test_the_blocking_phase_can_start_the_worker_ahead_of_the_first_forward(tmp_path, capsys):
    """``--worker-ahead-s S``: the worker is started S seconds before the first forward (as while a
    model loads); the run says so, and the warm-up's jobs are all tuned by it."""
    from autofp4 import dispatch

    try:
        assert B.main(["--device", "cpu", "--out", str(tmp_path), "--reps", "2", "--rounds", "2",
                       "--phases", "blocking", "--no-compare", "--worker-ahead-s", "0.5"]) == 0
    finally:
        dispatch.set_db(None)
    doc = json.loads((tmp_path / "jit-blocking.json").read_text())
    blk = doc["blocking"]
    assert blk["worker_ahead_s"] == 0.5 and blk["jobs_summary"]["jobs"] > 0
    assert set(blk["jobs_summary"]["statuses"]) == {"tuned"}
    assert "the worker started 0.5 s before the first forward" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        B.parse(["--worker-ahead-s", "-1"])


def test_a_moe_model_tunes_its_moe_layers_just_in_time(tmp_path, capsys):
    """``--model tiny-moe --ops moe``: a forward pass runs the MoE layer (random FP4 experts, a
    random top-2 routing per M), the blocking phase tunes its jobs at every M, and they are
    compared with the offline phase's rows."""
    assert B.main(["--device", "cpu", "--model", "tiny-moe", "--ops", "moe", "--phases", "offline,blocking",
                   "--out", str(tmp_path), "--reps", "1", "--rounds", "1", "--compare-rounds", "2"]) == 0
    doc = json.loads((tmp_path / "jit-offline-blocking.json").read_text())
    assert doc["ops"] == ["moe"] and doc["shapes"] == [["experts", 256, 256, 8, 2]]
    assert doc["layers"] == 0 and doc["moe_layers"] == 1
    blk = doc["blocking"]
    assert [(j["op"], j["n"], j["k"], j["experts"], j["topk"]) for j in blk["jobs"]] == [("moe", 256, 256, 8, 2)] * 3
    assert sorted(j["m"] for j in blk["jobs"]) == list(B.CPU_MS) and all(j["status"] == "tuned" for j in blk["jobs"])
    assert set(blk["warmup_s_by_op"]) == {"moe"} and 0 < blk["warmup_s_by_op"]["moe"] <= blk["warmup_s"]
    cmp = blk["compare"]
    assert cmp["rounds"] == 2 and [e["op"] for e in cmp["jobs"]] == ["moe"] * 3
    for e in cmp["jobs"]:
        assert e["offline_m"] == e["m"] and len(e["times"]["jit"]["rounds"]) == 2 and e["times"]["jit"]["us"] > 0
    s = cmp["summary"]
    assert set(s["by_op"]) == {"moe"} and s["by_op"]["moe"]["target"] == 0.95
    assert s["by_op"]["moe"]["speed_vs_offline_geomean"] == 1.0 and s["slower_than_default"] == 0
    out = capsys.readouterr().out
    assert "moe: speed vs offline 1.000 geomean over 3 of 3 jobs with an offline row at their M (target >= 0.95) [met]" in out
    assert out.rstrip().splitlines()[-1].startswith(f"  MoE jobs all tuned after {blk['warmup_s_by_op']['moe']:.1f} s")


def test_the_moe_stack_runs_random_experts_and_routings_per_m():
    import torch

    from autofp4.models import model_shapes

    shapes = model_shapes(B.TINY_MOE, fmt="nvfp4")
    st = B.Stack(shapes, 1, "nvfp4", torch.device("cpu"), moe_copies=2)
    assert len(st.layers) == 1 and len(st.layers[0]) == 2 and len(st.moe_layers) == 2
    w13, w2, topk = st.moe_layers[0][0]
    assert (tuple(w13.shape), tuple(w2.shape), topk) == ((8, 256, 256), (8, 256, 128), 2)
    assert w13.data.any() and w2.data.any()  # random experts, not zeros
    xs, routes = st.inputs(3)
    tw, ti = routes[(8, 2)]
    assert tuple(ti.shape) == (3, 2) and int(ti.min()) >= 0 and int(ti.max()) < 8
    assert torch.allclose(tw.sum(-1), torch.ones(3)) and xs[256].abs().sum() > 0
    assert st.inputs(5)[1][(8, 2)][1].shape == (5, 2) and st.inputs(3)[1][(8, 2)][1] is ti  # fresh per M, kept
    clock: dict = {}
    st.forward(3, clock)
    assert set(clock) == {"linear", "moe"} and clock["moe"] > 0 and st.ops == ("linear", "moe")


def _offline_db(path: Path, rows) -> None:
    """A tuning DB of reference-backend rows: ``(m_bucket, chunk_n, median_us, origin)`` of the
    linear problem 2048 x 256 (NVFP4, bf16)."""
    from autofp4.db import TuningDB
    from autofp4.env import current_environment
    from autofp4.schema import TuningRecord

    env = current_environment("cpu")
    with TuningDB(path) as db:
        db.add_environment(env)
        for m, chunk, us, origin in rows:
            db.upsert_result(TuningRecord(op="linear", fmt="nvfp4", dtype="bfloat16", backend="reference", m_bucket=m,
                                          n=2048, k=256, config={"chunk_n": chunk}, median_us=us, spread_us=0.1,
                                          samples=3, env=env, origin=origin))


def _job(m: int, chunk: int, status: str = "tuned") -> dict:
    return {"op": "linear", "fmt": "nvfp4", "dtype": "bfloat16", "n": 2048, "k": 256, "experts": 0, "topk": 0, "m": m,
            "status": status, "backend": "reference", "config": {"chunk_n": chunk}, "default_backend": "reference",
            "default_config": {"chunk_n": 0}, "trials_run": 3, "trials_failed": 0, "wall_s": 1.0}


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"compare_rounds": 1, **kw})


def test_the_comparison_times_each_distinct_config_once_per_round_with_the_tuners_trial(tmp_path, monkeypatch):
    """Three jobs: JIT = offline = default (one config timed), JIT = offline != default, and one
    without an offline row at its M (the next bucket's row stands in). The offline rows of origin
    ``jit`` are left out. Timed for real on the CPU (``run_trial``), rounds interleaved."""
    from autofp4 import dispatch
    from autofp4.tuning import measurer

    off = tmp_path / "off.db"
    _offline_db(off, [(1, 0, 5.0, "offline"), (4, 1024, 6.0, "offline"), (2, 0, 1.0, "jit"), (8, 1024, 7.0, "offline")])
    monkeypatch.setenv("AUTOFP4_SHIPPED_DB", str(tmp_path / "none"))
    dispatch.set_db(tmp_path / "phase.db")  # no rows: the jobs' own picks count
    seen = []
    real = measurer._Measurer.run

    def run(self, req):
        seen.append((req["m"], json.loads(req["config"])["chunk_n"], req["seed"], req["graph"]))
        return real(self, req)

    monkeypatch.setattr(measurer._Measurer, "run", run)
    try:
        cmp = B.compare([_job(1, 0), _job(4, 1024), _job(2, 1024)], off, _args(compare_rounds=2), B.torch.device("cpu"))
    finally:
        dispatch.set_db(None)
    # job M=1: one config; M=4: two (1024 and the default 0); M=2: offline stand-in = M=4's 1024 row
    # (the jit row of M=2 is not offline), so two: 1024 (jit, offline) and 0 -- each twice (2 rounds)
    assert sorted(seen) == sorted([(1, 0, B.COMPARE_SEED, True)] * 2 + [(4, 1024, B.COMPARE_SEED, True), (4, 0, B.COMPARE_SEED, True)] * 2
                                  + [(2, 1024, B.COMPARE_SEED, True), (2, 0, B.COMPARE_SEED, True)] * 2)
    j1, j2, j4 = sorted(cmp["jobs"], key=lambda e: e["m"])
    assert j1["m"] == 1 and j1["offline_m"] == 1 and j1["same_as_offline"] and j1["jit_is_default"]
    assert j1["speed_vs_offline"] == 1.0 and j1["slower_than_default"] is False
    assert j4["m"] == 4 and j4["offline_m"] == 4 and j4["same_as_offline"] and not j4["jit_is_default"]
    assert j4["picks"]["offline"] == {"backend": "reference", "config": {"chunk_n": 1024}}
    assert j4["speed_vs_offline"] == 1.0  # the same config: the same timing
    assert j4["speed_vs_default"] == pytest.approx(j4["times"]["default"]["us"] / j4["times"]["jit"]["us"])
    assert j2["offline_m"] == 4 and j2["same_as_offline"]
    for e in cmp["jobs"]:
        for t in e["times"].values():
            assert t["us"] > 0 and len(t["rounds"]) == 2 and t["spread_us"] >= (max(t["rounds"]) - min(t["rounds"])) / 2
    s = cmp["summary"]["by_op"]["linear"]
    assert (s["jobs"], s["with_offline_row"], s["with_stand_in"]) == (3, 2, 1)
    assert s["speed_vs_offline_geomean"] == 1.0 and cmp["summary"]["same_as_offline"] == 3
    assert cmp["offline_rows_of"] == "this environment" and cmp["offline_source"] == str(off)
    assert cmp["offline_jit_rows_left_out"] == 1


def test_the_comparison_counts_jit_rows_slower_than_the_default_beyond_the_noise(tmp_path, monkeypatch):
    """The verdicts from given timings: a JIT row slower than the default beyond the noise is
    counted (and named); one within the noise is not; the speed is offline us / JIT us; a job that
    stored no row runs (and is timed as) its default; a failed timing is reported, not a ratio."""
    from autofp4 import dispatch
    from autofp4.tuning import measurer

    off = tmp_path / "off.db"
    _offline_db(off, [(1, 512, 5.0, "offline"), (2, 0, 5.0, "offline"), (4, 0, 5.0, "offline"),
                      (8, 0, 5.0, "offline")])
    times = {(1, 1024): (10.0, 0.1), (1, 512): (9.0, 0.1), (1, 0): (8.0, 0.1),  # jit slower than the default
             (2, 1024): (10.0, 1.0), (2, 0): (9.5, 1.0),  # within the noise
             (4, 0): (7.0, 0.1),  # no row stored: the default is the JIT row
             (8, 1024): None, (8, 0): (7.0, 0.1)}  # the JIT config fails

    def run(self, req):
        t = times[(req["m"], json.loads(req["config"])["chunk_n"])]
        if t is None:
            return {"outcome": "runtime_fault", "error": "boom", "median_us": None}
        return {"outcome": "ok", "median_us": t[0], "spread_us": t[1], "samples": 3}

    monkeypatch.setattr(measurer._Measurer, "run", run)
    monkeypatch.setenv("AUTOFP4_SHIPPED_DB", str(tmp_path / "none"))
    dispatch.set_db(tmp_path / "phase.db")
    try:
        jobs = [_job(1, 1024), _job(2, 1024), {**_job(4, 0, "out_of_time"), "backend": "", "config": {}}, _job(8, 1024)]
        cmp = B.compare(jobs, off, _args(), B.torch.device("cpu"))
    finally:
        dispatch.set_db(None)
    by_m = {e["m"]: e for e in cmp["jobs"]}
    assert by_m[1]["slower_than_default"] is True and by_m[1]["speed_vs_offline"] == pytest.approx(9.0 / 10.0)
    assert by_m[1]["speed_vs_default"] == pytest.approx(0.8) and by_m[1]["same_as_offline"] is False
    assert by_m[2]["slower_than_default"] is False and by_m[2]["speed_vs_offline"] == pytest.approx(9.5 / 10.0)
    assert by_m[4]["jit_from"] == "none" and by_m[4]["jit_is_default"] and by_m[4]["speed_vs_offline"] == 1.0
    assert by_m[8]["times"]["jit"] == {"us": None, "spread_us": None, "error": "runtime_fault: boom"}
    assert by_m[8]["speed_vs_offline"] is None and by_m[8]["slower_than_default"] is None
    s = cmp["summary"]
    assert s["slower_than_default"] == 1 and s["slower_jobs"] == ["linear 2048x256 M=1"] and s["failed_timings"] == 1
    g = s["by_op"]["linear"]
    assert g["with_offline_row"] == 3 and g["speed_vs_offline_geomean"] == pytest.approx((0.9 * 0.95 * 1.0) ** (1 / 3))
    assert g["met"] is False  # 0.949 < 0.97
    text = "\n".join(B.compare_lines("blocking", {**cmp, "seconds": 1.0}, None))
    assert "speed vs offline 0.949 geomean over 3 of 4 jobs" in text and "[MISSED]" in text
    assert "slower than the default beyond the noise: 1 (target 0): linear 2048x256 M=1" in text
    assert "1 timings failed" in text
    table = "\n".join(B.job_table(cmp))
    assert "SLOWER" in table and "fail" in table


def test_a_warmed_kernel_cache_is_copied_for_the_jit_phases(tmp_path, monkeypatch):
    """``--kernel-cache DIR``: the blocking and background phases start from a copy of DIR (DIR
    itself is never written), the offline phase from an empty cache; without it every phase's
    cache is empty."""
    from autofp4 import dispatch

    import hashlib

    from autofp4.env import cutlass_dsl_version
    from autofp4.kernel_cache import kernel_source

    warm = tmp_path / "warm"
    warm.mkdir()
    mod = "autofp4.kernels.sm90_w4a16_gemm"
    rec = {"arch": "sm_90a", "cutlass_dsl": cutlass_dsl_version(), "module": mod, "name": "sm90_w4a16_gemm",
           "params": "()", "source": hashlib.sha256(kernel_source(mod).encode()).hexdigest()}
    for name, r in (("a", rec), ("b", {**rec, "cutlass_dsl": "0.0.1"}), ("c", {**rec, "source": "0" * 64}), ("d", {})):
        (warm / f"sm90_w4a16_gemm-{name}.o").write_bytes(b"x" * 1000)
        (warm / f"sm90_w4a16_gemm-{name}.json").write_text(json.dumps(r))
    for k in B._PHASE_ENV:
        monkeypatch.setenv(k, "unset-by-the-test")
    work = tmp_path / "work"
    work.mkdir()
    args = B.parse(["--device", "cpu", "--kernel-cache", str(warm)])
    try:
        info = B.fresh(work, "blocking", args)
        here = Path(os.environ["AUTOFP4_KERNEL_CACHE"])
        assert here == work / "kernels-blocking" and sorted(p.name for p in here.iterdir()) == sorted(
            p.name for p in warm.iterdir())
        size = sum(p.stat().st_size for p in warm.iterdir())
        # one kernel this run can load; one of another CuTeDSL, one of an older kernel source, one unreadable
        assert info == {"state": "warmed", "from": str(warm.resolve()), "kernels": 4, "mib": round(size / 2**20, 2),
                        "usable": 1, "other_cutlass_dsl": 1, "other_source": 1, "other_arch": 0, "unreadable": 1}
        (here / "sm90_w4a16_gemm-e.o").write_bytes(b"y")  # compiled during the phase
        B._compiled_since(info)
        assert info["compiled"] == 1 and not (warm / "sm90_w4a16_gemm-e.o").exists()
        line = B.cache_line(info)
        assert line.startswith(f"kernel cache: warmed (a copy of {warm.resolve()}: 4 kernels, 0.0 MiB, 1 usable here,"
                               " NOT usable: {'other_cutlass_dsl': 1, 'other_source': 1, 'unreadable': 1})")
        assert line.endswith("; 1 kernels compiled in the phase")
        assert B.fresh(work, "offline", args) == {"state": "cold"}
        assert not any(Path(os.environ["AUTOFP4_KERNEL_CACHE"]).iterdir())
        assert B.fresh(work, "background", B.parse(["--device", "cpu"])) == {"state": "cold"}
    finally:
        dispatch.set_db(None)
    with pytest.raises(SystemExit):
        B.parse(["--device", "cpu", "--kernel-cache", str(tmp_path / "missing")])
    with pytest.raises(SystemExit):
        B.parse(["--device", "cpu", "--kernel-cache", str(warm), "--keep-kernel-cache"])
    with pytest.raises(SystemExit):
        B.parse(["--device", "cpu", "--ops", "attention"])
    assert B.parse(["--device", "cpu", "--ops", "moe,linear"]).ops == ("linear", "moe")


def test_the_phases_see_the_shipped_rows_of_other_shapes_only(tmp_path):
    """A user of a model the DB does not cover has the winners of other shapes (which its jobs try
    first), not rows of its own shapes (hits: nothing to tune)."""
    own = {("linear", 6144, 4096, 0, 0)}
    d = B._shipped_others(tmp_path, _args(shipped="others", own_problems=own))
    shipped = json.loads((B.ROOT / "tuning_db" / "nvidia-h200.json").read_text())["records"]
    kept = json.loads((d / "nvidia-h200.json").read_text())["records"]
    mine = [r for r in shipped if (r["op"], r["n"], r["k"], r["experts"], r["topk"]) in own]
    assert mine and len(kept) == len(shipped) - len(mine)
    assert not any((r["op"], r["n"], r["k"], r["experts"], r["topk"]) in own for r in kept)
    assert not list(B._shipped_others(tmp_path, _args(shipped="none")).iterdir())
