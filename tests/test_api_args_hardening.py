"""Arguments of the public entry points and CLI options that would be ignored or coerced: each is
refused with a TypeError / ValueError (exit 2 on the command line) naming the argument or option,
and the valid calls next to them still work."""
from __future__ import annotations

import io
import json
import math
import random
import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import autofp4  # noqa: E402
from autofp4 import dispatch  # noqa: E402
from autofp4.cli import main as cli_main  # noqa: E402
from autofp4.db import TuningDB  # noqa: E402
from autofp4.integrations.quantize_checkpoint import quantize_checkpoint  # noqa: E402
from autofp4.models import model_shapes  # noqa: E402
from autofp4.nn import FP4FusedLinear, FP4LinearPart  # noqa: E402
from autofp4.patterns import pattern_list  # noqa: E402
from autofp4.tuning.jit import _settings  # noqa: E402

from tiny_models import tiny_model  # noqa: E402

TINY = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
MOE = {"model_type": "mixtral", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 64,
       "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
       "num_experts_per_tok": 2}


@pytest.fixture(autouse=True)
def _reset_db():
    dispatch.set_db(None)
    yield
    dispatch.set_db(None)


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    rc = cli_main([str(a) for a in argv], out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


# -- one check of pattern lists, four callers -----------------------------------------------------
def _vllm_config():
    pytest.importorskip("vllm")
    from autofp4.integrations.vllm.config import AutoFP4Config

    return AutoFP4Config


@pytest.mark.parametrize("caller", ["quantize_model", "quantize_checkpoint", "checkpoint config", "vllm ignore"])
def test_every_pattern_list_is_checked_alike_naming_the_bad_entry(tmp_path, caller):
    rng = random.Random()
    good = [f"*.layers.{rng.randrange(8)}.mlp.*", "lm_head"]
    at = rng.randrange(len(good) + 1)
    bad_item = good[:at] + [rng.choice([7, 1.5, None])] + good[at:]
    empty = good[:at] + [" " * rng.randrange(3)] + good[at:]
    src = tmp_path / "src"
    tiny_model("llama", rng.randrange(100)).save_pretrained(src)
    if caller == "quantize_model":
        def call(v):
            return autofp4.quantize_model(tiny_model("llama", 0), "nvfp4", skip=v)
        name, type_error = "quantize_model: skip", TypeError
    elif caller == "quantize_checkpoint":
        def call(v):
            return quantize_checkpoint(src, tmp_path / "q", "nvfp4", skip=v, progress=False)
        name, type_error = "skip", TypeError
    elif caller == "checkpoint config":
        model = tiny_model("llama", 1)
        autofp4.quantize_model(model, "nvfp4", skip=["lm_head"])
        ck = autofp4.save_pretrained(model, tmp_path / "ck", layout="compressed-tensors")

        def call(v):
            conf = json.loads((ck / "config.json").read_text())
            conf["quantization_config"]["ignore"] = v
            (ck / "config.json").write_text(json.dumps(conf))
            return autofp4.from_pretrained(ck)
        name, type_error = "quantization_config ignore", ValueError
    else:
        config = _vllm_config()

        def call(v):
            return config.from_config({"quant_method": "autofp4", "ignore": v})
        name, type_error = "ignore", TypeError
    with pytest.raises(type_error, match=rf"{name}\[{at}\].* must be a glob pattern \(str\), got "):
        call(bad_item)
    with pytest.raises(ValueError, match=rf"{name}\[{at}\].* is an empty pattern {empty[at]!r}"):
        call(empty)
    with pytest.raises(type_error, match=rf"{name} must be a list of glob patterns \(str\), got \{{"):
        call({p: True for p in good})


def test_pattern_list_keeps_a_generators_items_and_refuses_what_is_no_list():
    pats = [f"*.{random.randrange(100)}.o_proj", "lm_head"]
    assert pattern_list((p for p in pats), "skip") == pats
    assert pattern_list(None, "ignore", from_file=True) == []
    with pytest.raises(ValueError, match=r"ignore\[0\] is an empty pattern 're:'"):
        pattern_list(["re:", "lm_head"], "ignore", from_file=True, regex_prefix="re:")
    with pytest.raises(ValueError, match="ignore must be a list of glob patterns .str., got 'lm_head'"):
        pattern_list("lm_head", "ignore", from_file=True)
    for bad in ("lm_head", b"lm_head", 5, None):
        with pytest.raises(TypeError, match="skip must be a list of glob patterns"):
            pattern_list(bad, "skip")


def test_quantize_model_refuses_an_empty_skip_pattern_and_keeps_valid_ones():
    model = tiny_model("llama", random.randrange(100))
    with pytest.raises(ValueError, match=r"quantize_model: skip\[1\] is an empty pattern ''"):
        autofp4.quantize_model(model, "nvfp4", skip=["lm_head", ""])
    report = autofp4.quantize_model(model, "nvfp4", skip=(p for p in ["lm_head", "*.down_proj"]))
    skipped = dict(report.skipped)
    assert skipped["model.layers.0.mlp.down_proj"] == "matches a skip pattern"
    assert "model.layers.0.self_attn.o_proj" in report.converted


# -- CLI: options the chosen mode would ignore -----------------------------------------------------
@pytest.mark.parametrize("option", [["--budget", "3"], ["--time-budget", "60"], ["--force"], ["--workers", "0"],
                                    ["--storage", "sqlite:///s.db"], ["--gpus", "0"]])
def test_tune_dry_run_refuses_the_options_of_a_run(tmp_path, option):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(TINY))
    rc, out, err = run(["tune", "--model", cfg, "--dry-run", "--device", "cpu", "--db", tmp_path / "t.db", *option])
    assert rc == 2 and out == ""
    assert err.startswith(f"error: {option[0]} goes with a tuning run; --dry-run") and err.count("\n") == 1
    rc, out, err = run(["tune", "--model", cfg, "--dry-run", "--device", "cpu", "--db", tmp_path / "t.db"])
    assert rc == 0 and "(shape, M) jobs" in out, err


def test_cache_refuses_a_zero_valued_warm_option_without_warm(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(tmp_path / "kc"))
    rc, out, err = run(["cache", "--seeds", "0"])
    assert rc == 2 and "--seeds goes with --warm CONFIG" in err


def test_expert_parallelism_without_experts_is_refused(tmp_path):
    dense, moe = tmp_path / "dense.json", tmp_path / "moe.json"
    dense.write_text(json.dumps(TINY))
    moe.write_text(json.dumps(MOE))
    for argv in (["tune", "--model", dense, "--dry-run", "--device", "cpu"], ["explain", "--model", dense, "--device", "cpu"]):
        rc, out, err = run([*argv, "--ep", "2"])
        assert rc == 2 and f"--ep 2 splits the experts of MoE layers, and {dense} has none" in err, err
    rc, out, err = run(["tune", "--model", moe, "--dry-run", "--device", "cpu", "--ep", "2", "--ops", "linear"])
    assert rc == 2 and "--ops linear leaves them out" in err
    rc, out, err = run(["tune", "--model", moe, "--dry-run", "--device", "cpu", "--ep", "2"])
    assert rc == 0 and "ep=2" in out, err


def test_lm_head_with_only_moe_ops_is_refused(tmp_path):
    moe = tmp_path / "moe.json"
    moe.write_text(json.dumps(MOE))
    rc, out, err = run(["tune", "--model", moe, "--dry-run", "--device", "cpu", "--lm-head", "--ops", "moe"])
    assert rc == 2 and "--lm-head adds the lm_head's linear shape, which --ops moe leaves out" in err
    rc, out, err = run(["tune", "--model", moe, "--dry-run", "--device", "cpu", "--lm-head"])
    assert rc == 0 and "lm_head" in out


def test_quantize_cli_names_a_bad_shard_size_once(tmp_path):
    src = tmp_path / "src"
    tiny_model("llama", 0).save_pretrained(src)
    rc, out, err = run(["quantize", src, "--fmt", "nvfp4", "--out", tmp_path / "q", "--max-shard-size", "0"])
    assert rc == 2 and err == "error: --max-shard-size must be a positive size, got '0'\n"


# -- the tuner's Python arguments ------------------------------------------------------------------
def _shapes():
    return model_shapes(TINY)[:1]


@pytest.mark.parametrize("kwargs,error,named", [
    (dict(m_buckets=[True]), TypeError, r"m_buckets\[0\] must be an int >= 1 or None, got the bool True"),
    (dict(m_buckets=[1.0]), TypeError, r"m_buckets\[0\] must be an int >= 1 or None, got float 1.0"),
    (dict(m_buckets=[4, -1]), ValueError, r"m_buckets\[1\] must be an int >= 1"),
    (dict(m_buckets=[]), ValueError, "m_buckets is empty"),
    (dict(m_buckets=16), TypeError, "m_buckets must be a list of token counts"),
    (dict(m_buckets={1: 2}), TypeError, "m_buckets must be a list of token counts"),
    (dict(budget_per_shape=True), TypeError, "budget_per_shape must be an int >= 1 or None, got the bool"),
    (dict(budget_per_shape=1.5), TypeError, "budget_per_shape must be an int >= 1 or None, got float 1.5"),
    (dict(budget_per_shape=0), ValueError, "budget_per_shape must be an int >= 1 or None, got 0"),
    (dict(budget_total_s=True), TypeError, "budget_total_s must be a number of seconds"),
    (dict(budget_total_s="60"), TypeError, "budget_total_s must be a number of seconds"),
    (dict(budget_total_s=math.nan), ValueError, "budget_total_s must be a number of seconds > 0"),
    (dict(force="no"), TypeError, "force must be True or False, got str 'no'"),
    (dict(workers=-1), ValueError, "workers must be an int >= 0 or None, got -1"),
    (dict(workers=True), TypeError, "workers must be an int >= 0 or None, got the bool True"),
    (dict(progress="no"), TypeError, "progress must be True, False or a tqdm-like bar"),
    (dict(isolate="yes"), TypeError, "isolate must be True or False or None"),
    (dict(trial_timeout_s=-1), ValueError, "trial_timeout_s must be a finite number of seconds > 0"),
    (dict(warmup=-1), ValueError, "warmup must be an int >= 0 or None, got -1"),
    (dict(reps=0), ValueError, "reps must be an int >= 1 or None, got 0"),
    (dict(reps=True), TypeError, "reps must be an int >= 1 or None, got the bool"),
    (dict(backends="reference"), TypeError, "backends must be a list of names such as"),
    (dict(backends=[""]), ValueError, r"backends\[0\] is an empty name"),
    (dict(db=123), TypeError, "db must be a tuning DB path, an open TuningDB or None, got int 123"),
    (dict(db=""), ValueError, "db must be a tuning DB path.*empty path"),
    (dict(device="gpu"), ValueError, "device 'gpu' is not a device"),
    (dict(gpus=[True]), TypeError, r"gpus\[0\] must be an int >= 0"),
])
def test_tune_names_an_argument_of_the_wrong_type_or_range(tmp_path, kwargs, error, named):
    db = tmp_path / "t.db"
    args = dict(device="cpu", budget_per_shape=1, progress=False, workers=0, db=db)
    args.update(kwargs)
    with pytest.raises(error, match=named):
        autofp4.tune(_shapes(), args.pop("m_buckets", [1]), **args)
    assert not db.exists() or TuningDB(db, readonly=True).counts()["results"] == 0


@pytest.mark.parametrize("shapes,error,named", [
    ([], ValueError, "shapes is empty"), ("llama", TypeError, "shapes must be a list of ModelShapes"),
    ({"a": 1}, TypeError, "shapes must be a list of ModelShapes"), ([object()], TypeError, r"shapes\[0\]: expected"),
])
def test_tune_names_shapes_that_are_no_list_of_shapes(tmp_path, shapes, error, named):
    with pytest.raises(error, match=named):
        autofp4.tune(shapes, [1], device="cpu", budget_per_shape=1, progress=False, workers=0, db=tmp_path / "t.db")


def test_tune_reads_m_buckets_from_a_generator_and_stores_their_buckets(tmp_path):
    db = tmp_path / "t.db"
    m = random.choice([3, 5, 6, 7])
    report = autofp4.tune(_shapes(), (x for x in [m]), device="cpu", budget_per_shape=1, progress=False, workers=0,
                          db=db)
    assert [(r.job.m, r.status) for r in report.results] == [(8 if m > 4 else 4, "tuned")]
    assert [r.job.m for r in report.results] == [8 if m > 4 else 4]
    with TuningDB(db, readonly=True) as t:
        assert {r.m_bucket for r in t.results()} == {8 if m > 4 else 4}


@pytest.mark.parametrize("kwargs,error,named", [
    (dict(ops="linear"), TypeError, "ops must be a list of ops such as"),
    (dict(ops=None), TypeError, "ops must be a list of ops such as"),
    (dict(ops=[""]), ValueError, r"ops\[0\] is an empty name"),
    (dict(budget_s=True), TypeError, "budget_s must be a number of seconds"),
    (dict(budget_s=math.nan), ValueError, "budget_s must be a number of seconds > 0"),
    (dict(duty=True), TypeError, "duty must be a number in .0.01, 1. or None, got bool"),
    (dict(duty="0.5"), TypeError, "duty must be a number"),
    (dict(backends="reference"), TypeError, "backends must be a list of names"),
    (dict(backends=[]), ValueError, r"backends=\[\] names no backend to tune with: leave it None"),
    (dict(mode=None), ValueError, "mode must be one of"),
])
def test_autotune_names_an_argument_of_the_wrong_type(kwargs, error, named):
    args = dict(mode="blocking", budget_s=None, ops=("linear", "moe"), backends=None, duty=None, workers=None)
    args.update(kwargs)
    with pytest.raises(error, match=named):
        autofp4.autotune(**args)
    ok = _settings("background", 2.5, (o for o in ["moe"]), ["reference"], 0.25, 0)
    assert ok["ops"] == frozenset({"moe"}) and ok["duty"] == 0.25 and ok["budget_s"] == 2.5


# -- checkpoint functions ----------------------------------------------------------------------------
@pytest.mark.parametrize("path,error,named", [(None, TypeError, "path must be a folder path .str or Path., got NoneType"),
                                              (123, TypeError, "path must be a folder path .str or Path., got int 123"),
                                              ("", ValueError, "path is an empty path ''")])
def test_from_pretrained_names_a_path_that_is_no_path(path, error, named):
    with pytest.raises(error, match=f"autofp4.from_pretrained: {named}"):
        autofp4.from_pretrained(path)


@pytest.mark.parametrize("kwargs,error,named", [
    (dict(src=""), ValueError, "src is an empty path"),
    (dict(out=None), TypeError, r"out \(--out\) must be a directory path"),
    (dict(progress=2), TypeError, "progress must be True or False, got int 2"),
    (dict(stream=5), TypeError, "stream must be a text stream"),
    (dict(device=0.5), TypeError, "device must be a str such as 'cuda' or a torch.device, got float"),
    (dict(max_shard_size=0), ValueError, "max_shard_size must be a positive number of bytes, got 0"),
    (dict(max_shard_size=""), ValueError, "max_shard_size must be bytes or a number with a unit"),
])
def test_quantize_checkpoint_names_an_argument_before_any_work(tmp_path, kwargs, error, named):
    src = tmp_path / "src"
    tiny_model("llama", random.randrange(100)).save_pretrained(src)
    args = dict(src=src, out=tmp_path / "q", fmt="nvfp4", progress=False)
    args.update(kwargs)
    with pytest.raises(error, match=named):
        quantize_checkpoint(**args)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("size", [0, -5, ""])
def test_save_pretrained_names_max_shard_size_out_of_range(tmp_path, size):
    model = tiny_model("llama", random.randrange(100))
    autofp4.quantize_model(model, "nvfp4")
    with pytest.raises(ValueError, match="autofp4.save_pretrained: max_shard_size must be"):
        autofp4.save_pretrained(model, tmp_path / "o", max_shard_size=size)
    assert not (tmp_path / "o").exists()


def test_fp4_linear_part_checks_its_fused_layer_and_index():
    torch.manual_seed(random.randrange(1000))
    w = autofp4.quantize(torch.randn(96, 64, dtype=torch.bfloat16), "nvfp4")
    fused = FP4FusedLinear(w, None, None, [("q", 64), ("k", 32)])
    with pytest.raises(TypeError, match="fused must be an FP4FusedLinear, got NoneType"):
        FP4LinearPart(None, 0)
    with pytest.raises(TypeError, match="index must be an int"):
        FP4LinearPart(fused, True)
    with pytest.raises(ValueError, match=r"index must be an int in \[0, 2\)"):
        FP4LinearPart(fused, 2)
    part = FP4LinearPart(fused, 1)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    ref = x.float() @ autofp4.dequantize(w)[64:].T
    assert part.out_features == 32
    assert ((part(x).float() - ref).norm() / ref.norm()).item() < 1e-2  # bf16 output of the same FP4 rows


def test_model_shapes_refuses_a_non_bool_lm_head_flag():
    with pytest.raises(TypeError, match="include_lm_head must be True or False, got 'no' .a string."):
        model_shapes(TINY, include_lm_head="no")
    assert len(model_shapes(TINY, include_lm_head=True)) == len(model_shapes(TINY)) + 1


@pytest.mark.parametrize("pattern", [" lm_head", "lm_head\t", "*.o_proj "])
def test_a_pattern_with_surrounding_whitespace_is_refused_naming_it(pattern):
    expected = f"skip[1] {pattern!r} has leading or trailing whitespace, which no module name has; write {pattern.strip()!r}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        autofp4.quantize_model(tiny_model("llama", random.randrange(100)), "nvfp4", skip=["lm_head", pattern])


def test_compressed_tensors_formats_that_disagree_are_refused(tmp_path):
    model = tiny_model("llama", random.randrange(100))
    autofp4.quantize_model(model, "nvfp4", skip=["lm_head"])
    ck = autofp4.save_pretrained(model, tmp_path / "ck", layout="compressed-tensors")
    ref = autofp4.from_pretrained(ck)
    conf = json.loads((ck / "config.json").read_text())
    conf["quantization_config"]["format"] = "float-quantized"
    (ck / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=r"format 'float-quantized' and config_groups\['group_0'\].format "
                                         r"'nvfp4-pack-quantized' disagree"):
        autofp4.from_pretrained(ck)
    assert isinstance(ref.model.layers[0].mlp.down_proj, autofp4.FP4Linear)


# ------------------------------------------------------------------ settings that would do nothing
def test_set_db_refuses_a_folder(tmp_path):
    before = dispatch._DB_PATH
    with pytest.raises(ValueError, match="that is a folder \\(a directory\\); name the DB file in it"):
        autofp4.set_db(tmp_path)
    assert dispatch._DB_PATH == before
    autofp4.set_db(tmp_path / "t.db")  # a file in it is fine
    try:
        assert dispatch._DB_PATH == tmp_path / "t.db"
    finally:
        autofp4.set_db(before)


@pytest.mark.parametrize("field,value,want", [
    ("rope_theta", "big", "a positive number"), ("rope_theta", -1.0, "a positive number"),
    ("rms_norm_eps", "1e-6", "a positive number"), ("rms_norm_eps", True, "a positive number"),
    ("attention_dropout", 1.5, "a number in \\[0, 1\\]"), ("partial_rotary_factor", [0.5], "a number in"),
])
def test_config_float_fields_are_checked(tmp_path, field, value, want):
    from autofp4.models import check_buildable, load_checked_config

    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96, "rope_theta": 10000.0,
           "rms_norm_eps": 1e-6}
    check_buildable(cfg)  # the valid config passes
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ValueError, match=f"{field}.*must be {want}"):
        load_checked_config(path)


def test_tuner_settings_without_the_tuner_are_named(tmp_path):
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("AUTOFP4_AUTOTUNE")}
    code = "import warnings; warnings.simplefilter('always'); import autofp4"
    run = subprocess.run([sys.executable, "-c", code], env={**env, "AUTOFP4_AUTOTUNE_BUDGET_S": "5",
                                                           "AUTOFP4_AUTOTUNE": "off"},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0
    assert "AUTOFP4_AUTOTUNE_BUDGET_S set, but AUTOFP4_AUTOTUNE is not on" in run.stderr
    quiet = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "AUTOFP4_AUTOTUNE" not in quiet.stderr
    for mode in ("off", "blocking"):  # an unknown knob is named, the tuner on or not
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**env, "AUTOFP4_AUTOTUNE_BACKENDS": "nonexistent", "AUTOFP4_AUTOTUNE": mode,
                                  "AUTOFP4_DB": str(tmp_path / "t.db")})
        assert run.returncode == 0 and ("AUTOFP4_AUTOTUNE_BACKENDS: no such setting of just-in-time tuning"
                                        in run.stderr), run.stderr
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, "AUTOFP4_AUTOTUNEX": "blocking"})  # a typo of the switch itself
    assert "AUTOFP4_AUTOTUNEX: no such setting of just-in-time tuning" in run.stderr, run.stderr


# -- the seventeenth adversarial set ---------------------------------------------------------------
def test_routing_ties_go_to_the_lower_expert_id_on_every_path():
    """route's documented tie rule (the lower id first), for softmax and sigmoid scoring and the
    group-limited choice; torch.topk alone orders ties as it likes."""
    for scoring in ("softmax", "sigmoid"):
        assert autofp4.route(torch.zeros(3, 8), 3, scoring=scoring)[1].tolist() == [[0, 1, 2]] * 3
        assert autofp4.route(torch.tensor([[1., 0, 1, 0, 1, 0, 1, 0]]), 2, scoring=scoring)[1].tolist() == [[0, 2]]
    ids = autofp4.route(torch.zeros(2, 16), 4, scoring="sigmoid", n_group=4, topk_group=2)[1]
    assert ids.tolist() == [[0, 1, 2, 3]] * 2  # groups 0 and 1 (tied), then their lower ids


def test_routing_arguments_that_would_be_ignored_are_refused():
    """A correction bias means sigmoid scoring; top_k, renormalize, scoring, groups, scale and bias
    only shape a routing moe() computes from router_logits, so with given ids they are refused."""
    g = torch.Generator().manual_seed(17)
    logits = torch.randn(5, 4, generator=g)
    bias = torch.rand(4, generator=g)
    with pytest.raises(ValueError, match="correction_bias is used by scoring='sigmoid'"):
        autofp4.route(logits, 2, correction_bias=bias)
    w13 = autofp4.quantize(torch.randn(4, 64, 64, generator=g), "nvfp4")
    w2 = autofp4.quantize(torch.randn(4, 64, 32, generator=g), "nvfp4")
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    with pytest.raises(ValueError, match="correction_bias is used by scoring='sigmoid'"):
        autofp4.moe(x, w13, w2, router_logits=logits, top_k=2, correction_bias=bias)
    tw, ti = autofp4.route(logits, 2)
    for extra in ({"top_k": 3}, {"renormalize": False}, {"routed_scaling_factor": 5.0}, {"scoring": "sigmoid"},
                  {"n_group": 2}, {"correction_bias": bias}):
        with pytest.raises(TypeError, match=f"{next(iter(extra))}=.*used only with router_logits"):
            autofp4.moe(x, w13, w2, tw, ti, **extra)
    same = autofp4.moe(x, w13, w2, tw, ti, routed_scaling_factor=1, renormalize=True)  # the defaults: fine
    assert torch.equal(same, autofp4.moe(x, w13, w2, tw, ti))


def test_fused_part_names_must_be_distinct_strings():
    w = autofp4.quantize(torch.randn(96, 64, generator=torch.Generator().manual_seed(1)), "nvfp4")
    with pytest.raises(ValueError, match="the parts' names must differ"):
        FP4FusedLinear(w, None, torch.bfloat16, [("a.q_proj", 64), ("a.q_proj", 32)])
    for bad in (5, "", None):
        with pytest.raises(TypeError, match="each part's name must be a non-empty str"):
            FP4FusedLinear(w, None, torch.bfloat16, [("a.q_proj", 64), (bad, 32)])


def test_devices_and_dtypes_that_do_not_fit_are_named(tmp_path):
    w = autofp4.quantize(torch.randn(64, 128, generator=torch.Generator().manual_seed(2)), "nvfp4")
    with pytest.raises(TypeError, match=r"FP4Weight.to\(torch.float16\): .*no dtype to convert"):
        w.to(torch.float16)
    missing = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=f"device '{missing}': .*CUDA GPU"):
        dispatch.get_dispatcher(missing)
    with pytest.raises(ValueError, match="is not a device"):
        dispatch.get_dispatcher("gpu0")
    m = tiny_model("llama", 3)
    autofp4.quantize_model(m, "nvfp4")
    autofp4.save_pretrained(m, tmp_path / "ck")
    for dm in ("meta", {"": "meta"}):
        with pytest.raises(ValueError, match="device_map=.*meta.*holds no data"):
            autofp4.from_pretrained(tmp_path / "ck", device_map=dm)


def test_a_qwen3_moe_config_may_name_its_experts_num_local_experts(tmp_path):
    """transformers 5 writes Qwen3-MoE's expert count as num_local_experts: the model's shapes
    (tune, explain, cache --warm) read it under either name."""
    cfg = {"model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "moe_intermediate_size": 32,
           "num_experts_per_tok": 2}
    a = model_shapes({**cfg, "num_experts": 8}, fmt="nvfp4")
    b = model_shapes({**cfg, "num_local_experts": 8}, fmt="nvfp4")
    assert a == b and any(s.op == "moe" and s.experts == 8 for s in b)
    with pytest.raises(ValueError, match=r"lacks all of \['num_experts', 'num_local_experts'\]"):
        model_shapes(cfg, fmt="nvfp4")
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 8}))
    rc, out, err = run(["tune", "--model", tmp_path / "config.json", "--dry-run", "--device", "cpu"])
    assert rc == 0 and "jobs" in out, err


def test_quantize_warns_about_skip_patterns_that_match_no_layer(tmp_path):
    """``--skip`` with a typo (or ``[``, a glob fnmatch reads literally) keeps nothing: warned,
    naming the pattern; the default lm_head patterns never warn, a matching pattern does not."""
    src = tmp_path / "src"
    tiny_model("llama", 4).save_pretrained(src)
    with pytest.warns(RuntimeWarning) as rec:
        quantize_checkpoint(src, tmp_path / "out", "nvfp4", skip=["lm_head", "*.lm_head", "model.layer.0.*", "[",
                                                                   "*.mlp.down_proj"], progress=False)
    said = [str(r.message) for r in rec if "matches no layer" in str(r.message)]
    assert len(said) == 2 and any("'model.layer.0.*'" in m for m in said) and any("'['" in m for m in said), said
    report = json.loads((tmp_path / "out" / "quantization_report.json").read_text())
    kept = report["kept_in_high_precision"]
    assert any(k.endswith("mlp.down_proj") for k in kept) and not any(k.endswith("mlp.up_proj") for k in kept), kept


def test_tune_refuses_an_in_memory_study_storage(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(TINY))
    for url in ("sqlite:///:memory:", "sqlite://", "SQLITE+pysqlite:///:memory:?x=1"):
        rc, out, err = run(["tune", "--model", tmp_path / "c.json", "--m", "1", "--device", "cpu", "--no-progress",
                            "--db", tmp_path / "t.db", "--storage", url])
        assert rc == 2 and "in-memory SQLite database" in err and "tuned" not in out, (url, err)


# -- the eighteenth adversarial set ----------------------------------------------------------------
def test_a_scale_or_correction_bias_that_breaks_routing_is_refused():
    g = torch.Generator().manual_seed(18)
    logits = torch.randn(6, 8, generator=g)
    for scale in (0.0, -1.0):
        with pytest.raises(ValueError, match="routed_scaling_factor must be a finite positive number"):
            autofp4.route(logits, 2, routed_scaling_factor=scale)
    for bad in (float("nan"), float("inf"), -float("inf")):
        bias = torch.rand(8, generator=g)
        bias[5] = bad
        with pytest.raises(ValueError, match="correction_bias must be finite: entry 5"):
            autofp4.route(logits, 2, scoring="sigmoid", correction_bias=bias)
    w, ids = autofp4.route(logits, 2, scoring="sigmoid", correction_bias=torch.rand(8, generator=g),
                           routed_scaling_factor=2.5)
    assert torch.isfinite(w).all() and (w > 0).all()


def test_module_arguments_of_the_wrong_kind_are_named():
    g = torch.Generator().manual_seed(19)
    w = autofp4.quantize(torch.randn(64, 128, generator=g), "nvfp4")
    with pytest.raises(TypeError, match="non_blocking must be True or False, got str"):
        w.to("cpu", non_blocking="yes")
    fw = autofp4.quantize(torch.randn(96, 64, generator=g), "nvfp4")
    with pytest.raises(TypeError, match="parts must be a list of \\(name, output size\\) pairs, got dict"):
        FP4FusedLinear(fw, None, torch.bfloat16, {"a.q": 64, "a.k": 32})
    with pytest.raises(TypeError, match="output size must be an int"):
        FP4FusedLinear(fw, None, torch.bfloat16, [("a.q", 64.0), ("a.k", 32.0)])
    fused = FP4FusedLinear(fw, None, torch.bfloat16, [("a.q", 64), ("a.k", 32)])
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    for i in (2, -1, "0", 1.0):
        with pytest.raises(IndexError, match=r"part index must be an int in \[0, 2\)"):
            fused.part_forward(i, x)
    assert fused.part_forward(1, x).shape == (3, 32)
    lin = autofp4.FP4Linear(w, None)
    with pytest.raises(ValueError, match="FP4Linear.compute_dtype must be"):
        lin.compute_dtype = torch.float32
    lin.compute_dtype = torch.float16
    assert lin.compute_dtype is torch.float16 and lin(torch.randn(2, 128, generator=g)).dtype == torch.float32
    from autofp4.integrations.hf_quantizer import AutoFP4Config

    for bad in ("str", [1, 2], 3):
        with pytest.raises(TypeError, match="checkpoint_config must be a dict"):
            AutoFP4Config(bad)
        with pytest.raises(TypeError, match="checkpoint_config must be a dict"):
            AutoFP4Config.from_dict({"quant_method": "autofp4", "checkpoint_config": bad})


def test_saving_a_w4a8_model_says_the_setting_is_not_stored(tmp_path):
    m = tiny_model("llama", 5)
    autofp4.quantize_model(m, "nvfp4", activations="fp8")
    with pytest.warns(RuntimeWarning, match="act_dtype='fp8'.*set_activations\\(model, 'fp8'\\)"):
        autofp4.save_pretrained(m, tmp_path / "ck")
    assert (tmp_path / "ck" / "config.json").is_file()


def test_a_misses_file_autofp4_cannot_read_is_kept_and_duplicates_add_up(tmp_path):
    """Flushing misses onto a file of another version (or other data) leaves it as it is, warned;
    a file listing one (problem, M) twice counts it once with the counts added."""
    foreign = tmp_path / "m.json"
    text = json.dumps({"version": 2, "misses": [{"op": "linear", "new_field": 1}]})
    foreign.write_text(text)
    d = dispatch.Dispatcher(torch.device("cpu"), misses_file=foreign)
    d._misses[(dispatch.ProblemKey("linear", "nvfp4", "bfloat16", 64, 64), 4)] = 3  # as a call counts one
    with pytest.warns(RuntimeWarning, match="misses not recorded: .*m.json is left as it is"):
        assert d.flush_misses() is None
    assert foreign.read_text() == text
    entry = {"op": "linear", "fmt": "nvfp4", "dtype": "bfloat16", "n": 64, "k": 64, "m": 4, "count": 2}
    dup = tmp_path / "dup.json"
    dup.write_text(json.dumps({"version": 1, "misses": [entry, dict(entry, count=5)]}))
    ((k, m, c),) = dispatch.load_misses(dup)
    assert (k.n, m, c) == (64, 4, 7)


# -- the nineteenth adversarial set ----------------------------------------------------------------
def test_the_tuner_refuses_problem_keys_and_formats_no_call_can_have(tmp_path):
    from autofp4.problem import ProblemKey

    key = ProblemKey("linear", "nvfp4", "bfloat16", 64, 64)
    kw = dict(device="cpu", progress=False, m_buckets=[1], budget_per_shape=1, db=tmp_path / "t.db")
    with pytest.raises(ValueError, match="fmt='fp4' is not one of nvfp4, mxfp4"):
        autofp4.tune([key], fmt="fp4", **kw)
    with pytest.raises(ValueError, match="dtype='int3' is not one of"):
        autofp4.tune([key], dtype="int3", **kw)
    # (a ProblemKey checks its op, format, dtype and sizes itself; not that K fits the format's block)
    for bad, said in ((ProblemKey("linear", "nvfp4", "bfloat16", 64, 40), "k=40 is not a multiple of nvfp4's block"),
                      (ProblemKey("moe", "mxfp4", "bfloat16", 96, 64, 4, 2), "n=96")):
        with pytest.raises(ValueError, match=f"shapes\\[0\\]: {said}"):
            autofp4.tune([bad], **kw)
    assert not (tmp_path / "t.db").exists() or not TuningDB(tmp_path / "t.db").results(None)


def test_a_worker_whose_parent_is_gone_exits_quietly(tmp_path):
    """The tuning worker writing to a status pipe nobody reads any more (its parent exited)
    returns without a BrokenPipeError traceback."""
    import os
    import subprocess
    import sys

    r, w = os.pipe()
    os.close(r)  # the parent's end: gone
    (tmp_path / "f").write_text("a file, so no DB can be made under it")
    settings = {"device": "cpu", "db": str(tmp_path / "f" / "t.db"), "budget_s": None,
                "backends": None, "duty": 1.0, "fd": w, "sys_path": [], "workers": 0}
    proc = subprocess.run([sys.executable, "-m", "autofp4.tuning.worker", json.dumps(settings)], pass_fds=(w,),
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    os.close(w)
    assert proc.returncode == 3 and "BrokenPipeError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# -- the twentieth adversarial set -----------------------------------------------------------------
def test_tune_on_a_gpu_this_machine_lacks_and_set_db_of_bytes_are_named():
    from autofp4.problem import ProblemKey

    key = ProblemKey("linear", "nvfp4", "bfloat16", 64, 64)
    gone = f"cuda:{torch.cuda.device_count() + 7}"
    for kw, named in ((dict(device=gone), f"device {gone!r}: "), (dict(devices=["cpu", gone]), f"devices[1] {gone!r}: ")):
        with pytest.raises(ValueError) as info:
            autofp4.tune([key], m_buckets=[1], budget_per_shape=1, progress=False, **kw)
        assert str(info.value).startswith(named), info.value
    with pytest.raises(TypeError, match=r"set_db\(path\): path must be a str, os.PathLike or None, got bytes"):
        autofp4.set_db(b"x.db")


# -- the twenty-first adversarial set ----------------------------------------------------------------
def test_tune_takes_a_torch_dtype_and_route_names_a_bias_dtype(tmp_path):
    from autofp4.models import ModelShape

    rep = autofp4.tune([ModelShape("linear", "x", 64, 64)], m_buckets=[1], dtype=torch.bfloat16, device="cpu",
                       db=str(tmp_path / "t.db"), progress=False)
    assert [r.job.key.dtype for r in rep.results] == ["bfloat16"]
    with pytest.raises(ValueError, match=r"dtype=torch.float32 is not one of bfloat16, float16 \(names, as strings\)"):
        autofp4.tune([ModelShape("linear", "x", 64, 64)], m_buckets=[1], dtype=torch.float32, device="cpu",
                     db=str(tmp_path / "t.db"), progress=False)
    logits = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"correction_bias must be a float tensor \[E=4\], got \(4,\) torch.int64"):
        autofp4.route(logits, top_k=2, scoring="sigmoid", correction_bias=torch.arange(4))
