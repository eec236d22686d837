"""Hostile arguments of the checkpoint writers and readers: shard sizes, unpickled weights, copied
files, skip patterns, a tied lm_head stored apart.

Each hostile input is refused with one clear error (or warning) naming the argument, field or
file at fault. Models are tiny ones with fresh random weights (tests/tiny_models.py)."""
from __future__ import annotations

import io
import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import autofp4  # noqa: E402
from autofp4.cli import main as cli_main  # noqa: E402
from autofp4.integrations.quantize_checkpoint import quantize_checkpoint  # noqa: E402

from tiny_models import tiny_model  # noqa: E402


def _quantized(seed: int = 0):
    model = tiny_model("llama", seed)
    autofp4.quantize_model(model, "nvfp4", skip=["lm_head"])
    return model


# -- max_shard_size=1.5 (a float) -------------------------------------------------------
@pytest.mark.parametrize("bad", [1.5, True, 2e9])
def test_save_pretrained_refuses_a_non_int_max_shard_size(tmp_path, bad):
    model = _quantized()
    with pytest.raises(TypeError, match=r"max_shard_size must be an int \(bytes\) or a size string") as e:
        autofp4.save_pretrained(model, tmp_path / "o", max_shard_size=bad)
    assert f"{type(bad).__name__} {bad!r}" in str(e.value)
    assert not (tmp_path / "o").exists()


def test_save_pretrained_still_takes_int_and_size_string_shard_sizes(tmp_path):
    model = _quantized()
    autofp4.save_pretrained(model, tmp_path / "a", max_shard_size=10**9)
    autofp4.save_pretrained(model, tmp_path / "b", max_shard_size="5GB")
    for d in ("a", "b"):
        assert [p.name for p in (tmp_path / d).glob("*.safetensors")] == ["model.safetensors"]


# -- an unpickled FP4Weight state is checked ------------------------------------------
def test_unpickling_a_weight_with_a_mis_sized_scale_is_refused_naming_scale():
    w = autofp4.quantize(torch.randn(64, 64), "nvfp4")
    st = w.__getstate__()
    st["scale"] = st["scale"][:32]
    w2 = object.__new__(type(w))
    with pytest.raises(ValueError, match=r"FP4Weight \(unpickled\): nvfp4 scale must have shape \(64, 4\).*"
                                         r"got \(32, 4\)"):
        w2.__setstate__(st)


@pytest.mark.parametrize("field,value,err,msg", [
    ("fmt", "fp5", ValueError, "fmt must be one of"),
    ("global_scale", None, TypeError, "global_scale"),
    ("data", torch.zeros(64, 32, dtype=torch.float32), TypeError, "data"),
])
def test_unpickling_a_bad_state_names_the_field(field, value, err, msg):
    w = autofp4.quantize(torch.randn(64, 64), "nvfp4")
    st = w.__getstate__()
    st[field] = value
    with pytest.raises(err, match=msg):
        pickle.loads(pickle.dumps(w)).__setstate__(st)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_pickle_round_trip_still_works(fmt):
    w = autofp4.quantize(torch.randn(64, 64), fmt)
    back = pickle.loads(pickle.dumps(w))
    assert back.fmt == fmt and torch.equal(back.data, w.data)
    assert torch.equal(back.scale.view(torch.uint8), w.scale.view(torch.uint8))


# -- copy_files_from=123 ----------------------------------------------------------------
def test_save_pretrained_refuses_a_non_path_copy_files_from(tmp_path):
    model = _quantized()
    with pytest.raises(TypeError, match=r"copy_files_from must be a folder path \(str or Path\), got int 123"):
        autofp4.save_pretrained(model, tmp_path / "o", copy_files_from=123)
    assert not (tmp_path / "o").exists()


# -- quantize --skip '' ---------------------------------------------------------------
@pytest.mark.parametrize("pattern", ["", "   "])
def test_quantize_cli_refuses_an_empty_skip_pattern(tmp_path, pattern):
    src = tmp_path / "src"
    tiny_model("llama", 0).save_pretrained(src)
    err = io.StringIO()
    rc = cli_main(["quantize", str(src), "--fmt", "nvfp4", "--out", str(tmp_path / "q"), "--skip", pattern,
                   "--no-progress"], out=io.StringIO(), err=err)
    assert rc == 2
    assert "--skip" in err.getvalue() and f"empty pattern {pattern!r}" in err.getvalue()
    assert len(err.getvalue().strip().splitlines()) == 1
    assert not (tmp_path / "q").exists()
    with pytest.raises(ValueError, match="empty pattern"):
        quantize_checkpoint(src, tmp_path / "q", "nvfp4", skip=["lm_head", pattern], progress=False)


# -- tie_word_embeddings true with a different stored lm_head --------------------------
def test_from_pretrained_warns_when_config_ties_but_a_different_lm_head_is_stored(tmp_path):
    model = _quantized()
    ck = tmp_path / "tied"
    autofp4.save_pretrained(model, ck)
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    cfg["tie_word_embeddings"] = True
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match=r"tie_word_embeddings: true.*stores a lm_head\.weight that differs from "
                                         r"model\.embed_tokens\.weight; the stored lm_head\.weight is used") as rec:
        m = autofp4.from_pretrained(ck)
    assert any(str(ck) in str(r.message) for r in rec)
    assert torch.equal(m.lm_head.weight, model.lm_head.weight)


def test_from_pretrained_does_not_warn_for_a_truly_tied_checkpoint(tmp_path):
    model = tiny_model("llama", 0)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    autofp4.quantize_model(model, "nvfp4", skip=["lm_head"])
    autofp4.save_pretrained(model, tmp_path / "t")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = autofp4.from_pretrained(tmp_path / "t")
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert isinstance(Path(tmp_path / "t"), Path)
