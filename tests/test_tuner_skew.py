"""The MoE pick's check on a skewed routing, on the CPU: real tuning runs into real SQLite files,
with test backends whose fast config is (or is not) slow when the routing is concentrated. Their
kernels declare their cost on a clock the host timing reads (seconds, far above the noise of a
shared CPU) instead of sleeping."""
import time

import pytest
import torch

from autofp4 import timing
from autofp4.backends.reference import ReferenceBackend
from autofp4.db import TuningDB
from autofp4.env import current_environment
from autofp4.problem import ProblemKey
from autofp4.tuning import tune
from autofp4.tuning.trial import SKEWED_TRIAL

from test_tuner import KEY, _register

MOE = ProblemKey("moe", "nvfp4", "bfloat16", 128, 64, experts=8, topk=2)


class _Clock:
    """``time`` as :func:`autofp4.timing.time_cpu` sees it: the host's plus the declared costs."""

    def __init__(self) -> None:
        self.extra = 0.0
        self.seen: list[float] = []  # per MoE call: its busiest expert's pairs, in even shares

    def perf_counter(self) -> float:
        return time.perf_counter() + self.extra


CLOCK = _Clock()


@pytest.fixture(autouse=True)
def _clock(monkeypatch):
    CLOCK.__init__()
    monkeypatch.setattr(timing, "time", CLOCK)


class EvenBackend(ReferenceBackend):
    """chunk_n=64 takes 10 s, chunk_n=32 20 s, the default 30 s, whatever the routing."""

    name = "test_skew_even"
    skew_cost = 0.0  # what chunk_n=64 takes more on a concentrated routing

    def config_space(self, key):
        return {"chunk_n": [0, 32, 64]}

    def compile(self, config, key):
        inner = super().compile(config, key)
        cost = {0: 30.0, 32: 20.0, 64: 10.0}[config.chunk_n]

        def run(*args):
            CLOCK.extra += cost
            if key.op == "moe":
                ti = args[4]
                busiest = float(torch.bincount(ti.flatten().long(), minlength=key.experts).max())
                CLOCK.seen.append(busiest / ti.numel() * key.experts)
                if config.chunk_n == 64 and CLOCK.seen[-1] > 2.5:
                    CLOCK.extra += self.skew_cost
            return inner(*args)
        return run


class CollapsingBackend(EvenBackend):
    """chunk_n=64 is the fastest on the uniform routing but takes 40 s more on a skewed one."""

    name = "test_skew_collapse"
    skew_cost = 40.0


def _run(monkeypatch, tmp_path, cls, key, m):
    _register(monkeypatch, cls)
    rep = tune([key], m_buckets=[m], backends=[cls.name], db=tmp_path / "t.db", device="cpu", progress=False)
    with TuningDB(tmp_path / "t.db") as db:
        env_key = current_environment(torch.device("cpu")).key()
        (res,) = db.results(env_key)
        trials = db.trials(env_key)
    skewed = [(t.config["chunk_n"], t.outcome, t.median_us) for t in trials if t.error.startswith(SKEWED_TRIAL)]
    return rep.results[0], res, trials, skewed


def test_a_pick_fine_under_skew_is_stored_after_its_check(monkeypatch, tmp_path):
    r, res, trials, skewed = _run(monkeypatch, tmp_path, EvenBackend, MOE, 32)
    assert r.status == "tuned" and res.config == {"chunk_n": 64} and "skewed" not in r.note
    # the default, then the pick, timed on the skewed routing: two more trial rows
    assert [(c, o) for c, o, _ in skewed] == [(0, "ok"), (64, "ok")]
    assert len(trials) == 5 and r.trials_run == 5
    assert skewed[0][2] > 30e6 > 20e6 > skewed[1][2] > 10e6
    assert max(CLOCK.seen) > 2.5 > min(CLOCK.seen)  # both routings were run


def test_a_pick_that_collapses_under_skew_gives_way_to_the_next_best(monkeypatch, tmp_path):
    r, res, _, skewed = _run(monkeypatch, tmp_path, CollapsingBackend, MOE, 32)
    assert res.config == {"chunk_n": 32} and r.config == {"chunk_n": 32}
    assert [c for c, _, _ in skewed] == [0, 64, 32]
    assert skewed[1][2] > 50e6
    assert "skewed routing (2 of 8 experts hot)" in r.note and '{"chunk_n":64}' in r.note
    assert r.note.endswith('test_skew_collapse {"chunk_n":32} stored instead')
    assert res.default_median_us is not None and res.median_us < res.default_median_us


def test_the_default_is_stored_when_every_pick_collapses(monkeypatch, tmp_path):
    class AllCollapse(CollapsingBackend):
        name = "test_skew_all"

        def config_space(self, key):
            return {"chunk_n": [0, 64]}

    r, res, _, skewed = _run(monkeypatch, tmp_path, AllCollapse, MOE, 32)
    assert res.config == {"chunk_n": 0} and [c for c, _, _ in skewed] == [0, 64]
    assert r.note.endswith("the default stored instead")


def test_linear_jobs_are_not_checked_on_a_skewed_routing(monkeypatch, tmp_path):
    r, res, trials, skewed = _run(monkeypatch, tmp_path, CollapsingBackend, KEY, 4)
    assert res.config == {"chunk_n": 64} and skewed == [] and len(trials) == 3 and CLOCK.seen == []


def test_a_default_that_fails_on_the_skewed_routing_leaves_the_pick_unchecked(monkeypatch, tmp_path):
    class DefaultFails(EvenBackend):
        name = "test_skew_default_fails"

        def compile(self, config, key):
            run = super().compile(config, key)
            if config.chunk_n:
                return run

            def fails_when_concentrated(*args):
                out = run(*args)
                if CLOCK.seen[-1] > 2.5:
                    raise RuntimeError("kernel exploded")
                return out
            return fails_when_concentrated

    r, res, _, skewed = _run(monkeypatch, tmp_path, DefaultFails, MOE, 32)
    assert res.config == {"chunk_n": 64} and [(c, o) for c, o, _ in skewed] == [(0, "runtime_fault")]
    assert "the default failed on the skewed routing" in r.note and r.trials_failed == 1
