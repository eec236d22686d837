"""Tuning one rank's slice of an expert-parallel MoE layer, on the CPU: the trials route each
token's top-k among the layer's experts and run the slice with the rank's expert map (a real
tuning run into a real SQLite file, with a reference backend that records what it was given)."""
from dataclasses import asdict

import pytest
import torch

from autofp4.backends.reference import ReferenceBackend, reference_moe
from autofp4.db import TuningDB
from autofp4.env import current_environment
from autofp4.models import ModelShape, load_config, model_shapes
from autofp4.problem import ProblemKey
from autofp4.tuning import jobs_for, tune_jobs
from autofp4.tuning import trial
from autofp4.tuning.candidates import _cfg_json
from autofp4.tuning.compile_pool import _spec

from test_tuner import _register

SLICE = ProblemKey("moe", "nvfp4", "bfloat16", 128, 64, experts=4, topk=2)


class RecordingBackend(ReferenceBackend):
    """The reference backend; each MoE call's expert ids and expert map are kept."""

    name = "test_ep_recording"
    calls: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def compile(self, config, key):
        inner = super().compile(config, key)

        def run(x, w13, w2, tw, ti, act, expert_map=None, **kw):
            RecordingBackend.calls.append((ti.clone(), None if expert_map is None else expert_map.clone()))
            return inner(x, w13, w2, tw, ti, act, expert_map, **kw)
        return run


def test_the_models_slice_knows_the_layers_experts():
    cfg = load_config("examples/deepseek-v3.json")
    (ep8,) = [s for s in model_shapes(cfg, ep=8) if s.op == "moe"]
    (ep1,) = [s for s in model_shapes(cfg) if s.op == "moe"]
    assert (ep8.experts, ep8.topk, ep8.experts_global) == (32, 8, 256)
    assert (ep1.experts, ep1.experts_global) == (256, 0)
    (job,) = jobs_for([ep8], [16], "nvfp4")
    assert job.experts_global == 256 and job.key.experts == 32
    with pytest.raises(ValueError, match="experts_global"):
        ModelShape("moe", "e", 128, 64, experts=8, topk=2, intermediate=64, hidden=64, experts_global=8)


def test_a_slices_routing_sends_it_its_share_of_the_pairs():
    gen = torch.Generator().manual_seed(5)
    m, eg = 4000, 32
    x, tw, ti, emap = trial._acts_for(SLICE, m, torch.device("cpu"), gen, "uniform", eg)
    assert ti.shape == (m, 2) and int(ti.min()) >= 0 and int(ti.max()) < eg
    assert torch.equal(emap[:4], torch.arange(4, dtype=torch.int32)) and bool((emap[4:] == -1).all())
    local = int((ti < 4).sum())
    assert abs(local - m * 2 * 4 / eg) < 0.1 * m * 2 * 4 / eg  # 1000 expected
    # skewed: the hot experts are drawn among the layer's 32
    assert trial.hot_experts(SLICE, eg) == 8 and trial.hot_experts(SLICE) == 2
    # a whole layer's routing has no map and sends every pair to its own experts
    act = trial._acts_for(SLICE, 16, torch.device("cpu"), gen)
    assert len(act) == 3 and int(act[2].max()) < 4


def test_a_slice_is_tuned_on_its_share_of_the_routing(monkeypatch, tmp_path):
    _register(monkeypatch, RecordingBackend)
    RecordingBackend.calls = []
    (job,) = jobs_for([SLICE], [64])
    job = type(job)(job.key, job.m, "experts", experts_global=16)
    rep = tune_jobs([job], backends=[RecordingBackend.name], db=tmp_path / "t.db", device="cpu", progress=False)
    assert [r.status for r in rep.results] == ["tuned"], rep.table()
    assert RecordingBackend.calls
    for ti, emap in RecordingBackend.calls:
        assert emap is not None and emap.numel() == 16 and int(ti.max()) < 16
    pairs = sum(int((ti < 4).sum()) for ti, _ in RecordingBackend.calls)
    assert pairs < 0.5 * sum(ti.numel() for ti, _ in RecordingBackend.calls)  # about a quarter are local
    with TuningDB(tmp_path / "t.db") as db:
        (row,) = db.results(current_environment(torch.device("cpu")).key())
    assert (row.experts, row.topk, row.m_bucket) == (4, 2, 64)


def test_a_trial_checks_the_slice_against_the_reference_with_its_map():
    b = ReferenceBackend()
    req = {"backend": b.name, "spec": _spec(b), "config": _cfg_json(b, b.default(SLICE, 8)), "key": asdict(SLICE),
           "m": 8, "seed": 3, "device": "cpu", "warmup": 1, "reps": 2, "graph": False, "experts_global": 16}
    res = trial.run_trial(req)
    assert res["outcome"] == "ok", res
    d = trial._DATA
    x, tw, ti, emap = d.acts[8, "uniform"][0]
    ref = d.refs[8, "uniform", "w4a16"].float()
    want = reference_moe(x.float(), *d.weights[0], tw, ti, "silu", expert_map=emap).float()
    assert float((ref - want).norm() / want.norm()) < 1e-2
    # tokens none of whose experts this rank holds add nothing here; the others do
    none_here = ~(ti < 4).any(dim=1)
    assert bool(none_here.any()) and bool((~none_here).any())
    assert bool((ref[none_here] == 0).all()) and bool((ref[~none_here].abs().sum(dim=1) > 0).all())
    bad = trial.run_trial({**req, "experts_global": 4})
    assert bad["outcome"] == "invalid" and "experts_global" in bad["error"]
