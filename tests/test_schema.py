"""Validation of everything the tuning database stores, exports and imports."""
from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from autofp4.env import current_environment
from autofp4.schema import (
    EXPORT_SCHEMA_VERSION,
    Environment,
    ExportDoc,
    ExportedRecord,
    TrialRecord,
    TuningRecord,
    config_json,
)

ENV_FIELDS = dict(
    gpu_name="NVIDIA H200",
    sm_count=132,
    compute_capability="9.0",
    driver="570.124.06",
    cuda="12.8",
    torch="2.13.0",
    cutlass_dsl="4.8.1",
    autofp4="0.1.0",
)


def make_env(**over) -> Environment:
    return Environment(**{**ENV_FIELDS, **over})


def record_data(**over) -> dict:
    data = dict(
        op="linear", fmt="nvfp4", dtype="bfloat16", backend="reference", m_bucket=16,
        n=4096, k=7168, config={"chunk_n": 1024}, median_us=41.5, spread_us=0.75, samples=25,
        default_median_us=55.0, backend_source="0123456789abcdef",
        created_at="2025-03-01T12:00:00.000000Z", env=ENV_FIELDS,
    )
    data.update(over)
    return data


def trial_data(**over) -> dict:
    data = dict(
        op="moe", fmt="mxfp4", dtype="float16", backend="reference", m_bucket=64, m=50,
        n=2 * 1408, k=2048, experts=64, topk=6, config={"chunk_n": 512}, outcome="ok",
        median_us=120.0, spread_us=3.0, error="", created_at="2025-03-01T12:00:00Z",
        env_key=make_env().key(), backend_source="abc",
    )
    data.update(over)
    return data


# ---------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------
def test_env_key_is_sha256_of_canonical_json():
    env = make_env()
    canonical = json.dumps(ENV_FIELDS, sort_keys=True, separators=(",", ":"))
    assert env.key() == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert len(env.key()) == 16 and int(env.key(), 16) >= 0


def test_env_key_is_stable_across_processes():
    code = (
        "import json,sys; from autofp4.schema import Environment; "
        "print(Environment(**json.loads(sys.argv[1])).key())"
    )
    out = subprocess.run([sys.executable, "-c", code, json.dumps(ENV_FIELDS)],
                         capture_output=True, text=True, check=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == make_env().key()


@pytest.mark.parametrize("field,value", [
    ("gpu_name", "NVIDIA H100 80GB HBM3"), ("sm_count", 114), ("compute_capability", "10.0"),
    ("driver", "570.124.07"), ("cuda", "12.9"), ("torch", "2.13.1"), ("cutlass_dsl", ""),
    ("autofp4", "0.1.1"),
])
def test_env_key_changes_with_every_field(field, value):
    assert make_env(**{field: value}).key() != make_env().key()


def test_env_rejects_bad_fields():
    with pytest.raises(ValidationError):
        make_env(sm_count="132")  # strict: no str -> int coercion
    with pytest.raises(ValidationError):
        make_env(compute_capability="sm90")
    with pytest.raises(ValidationError):
        Environment(**{**ENV_FIELDS, "extra": 1})
    with pytest.raises(ValidationError):
        make_env(gpu_name="x" * 10_000)


def test_current_environment_cpu_is_cached_and_valid():
    env = current_environment("cpu")
    assert env is current_environment("cpu")
    assert env.gpu_name == "cpu" and env.compute_capability == "cpu"
    assert env.driver == "" and env.cuda == ""
    assert env.sm_count >= 1
    import torch

    assert env.torch == torch.__version__
    assert Environment.model_validate_json(env.model_dump_json()).key() == env.key()


# ---------------------------------------------------------------------------------------
# TuningRecord
# ---------------------------------------------------------------------------------------
def test_record_round_trip_json_and_export_form():
    rec = TuningRecord.model_validate(record_data())
    again = TuningRecord.model_validate_json(rec.model_dump_json())
    assert again == rec
    assert rec.env_key == make_env().key()
    exp = rec.to_exported()
    assert isinstance(exp, ExportedRecord) and exp.env_key == rec.env_key
    assert exp.to_record(make_env()) == rec
    with pytest.raises(ValueError):
        exp.to_record(make_env(driver="1"))
    assert rec.speedup == pytest.approx(55.0 / 41.5)
    assert rec.unique_key() == ("linear", "nvfp4", "bfloat16", "reference", 16, 4096, 7168, 0, 0, rec.env_key)


def test_record_config_is_normalized_with_the_backend_model():
    rec = TuningRecord.model_validate(record_data(config={}))
    assert rec.config == {"chunk_n": 0}  # the full, dumped form of ReferenceConfig()
    assert config_json(rec.config) == '{"chunk_n":0}'


def test_created_at_is_normalized_utc():
    rec = TuningRecord.model_validate(record_data(created_at="2025-03-01T13:00:00+00:00"))
    assert rec.created_at == "2025-03-01T13:00:00.000000Z"
    fresh = TuningRecord.model_validate({k: v for k, v in record_data().items() if k != "created_at"})
    assert fresh.created_at.endswith("Z")


@pytest.mark.parametrize("over,needle", [
    (dict(backend="evil"), "unknown backend 'evil'"),
    (dict(n=2**21), "n"),
    (dict(k=0), "k"),
    (dict(m_bucket=0), "m_bucket"),
    (dict(m_bucket=2**30), "m_bucket"),
    (dict(n="4096"), "n"),  # bad type, no coercion from str
    (dict(samples=2.5), "samples"),
    (dict(op="conv"), "op"),
    (dict(fmt="int4"), "fmt"),
    (dict(dtype="float32"), "dtype"),
    (dict(config={"chunk_n": 1024, "stages": 3}), "takes no stages"),
    (dict(config={"chunk_n": [1, 2]}), "config"),
    (dict(config={"chunk_n": 1024, "name": "x" * 65}), "config"),
    (dict(config={"chunk_n": 5000}), "does not split"),  # backend.is_valid rejects it
    (dict(median_us=float("nan")), "median_us must be finite"),
    (dict(median_us=float("inf")), "median_us"),
    (dict(median_us=0.0), "median_us must be > 0"),
    (dict(median_us=-3.0), "median_us"),
    (dict(spread_us=-0.1), "spread_us"),
    (dict(default_median_us=float("nan")), "default_median_us"),
    (dict(created_at="2025-03-01T12:00:00"), "UTC"),
    (dict(created_at="yesterday"), "ISO 8601"),
    (dict(experts=8, topk=2), "linear problems have no experts"),
    (dict(op="moe", experts=8, topk=9), "topk"),
    (dict(backend_source="x; DROP TABLE results"), "backend_source"),
    (dict(surprise=1), "surprise"),
])
def test_record_rejections(over, needle):
    with pytest.raises(ValidationError) as ei:
        TuningRecord.model_validate(record_data(**over))
    assert needle in str(ei.value)


def test_moe_record_accepted():
    rec = TuningRecord.model_validate(record_data(op="moe", experts=128, topk=8, n=2 * 768, k=2048,
                                                  config={"chunk_n": 0}))
    assert (rec.experts, rec.topk) == (128, 8)


# ---------------------------------------------------------------------------------------
# TrialRecord
# ---------------------------------------------------------------------------------------
def test_trial_round_trip_and_error_truncation():
    tr = TrialRecord.model_validate(trial_data(outcome="runtime_fault", median_us=None, spread_us=None,
                                               error="illegal memory access\n" * 500))
    assert len(tr.error) == 2000 and tr.error.startswith("illegal memory access")
    assert TrialRecord.model_validate_json(tr.model_dump_json()) == tr
    assert tr.failed and tr.config_json == '{"chunk_n":512}'


def test_trial_rejections():
    with pytest.raises(ValidationError):
        TrialRecord.model_validate(trial_data(outcome="crashed"))
    with pytest.raises(ValidationError):
        TrialRecord.model_validate(trial_data(env_key="not-a-key"))
    with pytest.raises(ValidationError):
        TrialRecord.model_validate(trial_data(backend="evil"))
    with pytest.raises(ValidationError):
        TrialRecord.model_validate(trial_data(m=0))
    with pytest.raises(ValidationError):
        TrialRecord.model_validate(trial_data(median_us=math.nan))
    # a successful trial must carry a config its backend accepts ...
    with pytest.raises(ValidationError):
        TrialRecord.model_validate(trial_data(config={"chunk_n": 16, "bogus": 1}))
    # ... a failed one may record the config the backend rejected
    tr = TrialRecord.model_validate(trial_data(outcome="invalid", config={"chunk_n": 16, "bogus": 1}))
    assert tr.config == {"chunk_n": 16, "bogus": 1}


# ---------------------------------------------------------------------------------------
# ExportDoc
# ---------------------------------------------------------------------------------------
def doc_data(records=None, **over) -> dict:
    env = make_env()
    recs = records if records is not None else [TuningRecord.model_validate(record_data()).to_exported()]
    data = dict(
        schema_version=EXPORT_SCHEMA_VERSION, exported_at="2025-03-02T00:00:00Z", autofp4="0.1.0",
        environments={env.key(): env.model_dump()},
        records=[r.model_dump() if hasattr(r, "model_dump") else r for r in recs],
    )
    data.update(over)
    return data


def test_export_doc_round_trip():
    doc = ExportDoc.model_validate(doc_data())
    assert ExportDoc.model_validate_json(doc.model_dump_json()) == doc
    (rec,) = doc.tuning_records()
    assert rec == TuningRecord.model_validate(record_data())


def test_export_doc_rejections():
    with pytest.raises(ValidationError, match="schema_version"):
        ExportDoc.model_validate(doc_data(schema_version=99))
    other = make_env(driver="1.0")
    with pytest.raises(ValidationError, match="does not match"):
        ExportDoc.model_validate(doc_data(environments={make_env().key(): other.model_dump()}))
    rec = TuningRecord.model_validate(record_data()).to_exported().model_dump()
    rec["env_key"] = "0" * 16
    with pytest.raises(ValidationError, match="not in environments"):
        ExportDoc.model_validate(doc_data(records=[rec]))
    bad = TuningRecord.model_validate(record_data()).to_exported().model_dump()
    bad["backend"] = "evil"
    with pytest.raises(ValidationError, match="unknown backend 'evil'"):
        ExportDoc.model_validate(doc_data(records=[bad]))
