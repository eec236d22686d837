"""Hostile checkpoints, outputs and arguments: overwriting a previous output, compressed-tensors
schemes, config dtypes, float32 through transformers, pickling, missing folders, the hook variable.

Each hostile input is refused with one clear error (or warning) naming the file, field, value or
argument at fault, or handled correctly. Checkpoints are tiny models with fresh random weights,
quantized and written by autofp4 itself, then edited."""
from __future__ import annotations

import copy
import io
import json
import os
import pickle
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import autofp4  # noqa: E402
from autofp4.cli import main as cli_main  # noqa: E402

from tiny_models import tiny_model as _model  # noqa: E402

BF16 = torch.bfloat16
IDS = torch.tensor([[1, 5, 9, 2, 7]])


def _checkpoint(root: Path, layout: str = "modelopt", seed: int = 0, **kw) -> Path:
    model = _model("llama", seed)
    autofp4.quantize_model(model, "nvfp4", skip=["lm_head"])
    return autofp4.save_pretrained(model, root, layout=layout, **kw)


def _edit(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg, msg
    return msg


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


# -- overwrite never deletes a file that is not part of a checkpoint ------------------------
def test_overwrite_refuses_a_previous_output_holding_a_users_file(tmp_path):
    ck = _checkpoint(tmp_path / "ck")
    out = _checkpoint(tmp_path / "out", seed=1)
    (out / "notes.txt").write_text("my notes")
    before = _snapshot(out)
    model = autofp4.from_pretrained(ck)
    with pytest.raises(FileExistsError) as info:
        autofp4.save_pretrained(model, out, overwrite=True)
    msg = _one_line(info.value)
    assert str(out) in msg and "holds 1 file that is not part of a checkpoint ('notes.txt')" in msg, msg
    assert "choose another path" in msg
    assert _snapshot(out) == before  # nothing deleted, nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "out"]  # no temporary directory left
    # the user's file moved out: replaced, and a previous sharded output leaves no stale shard
    (out / "notes.txt").unlink()
    _checkpoint(tmp_path / "sh", seed=2, max_shard_size="20KB")
    assert (tmp_path / "sh" / "model.safetensors.index.json").is_file()
    autofp4.save_pretrained(model, tmp_path / "sh", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "sh").iterdir()) == sorted(p.name for p in ck.iterdir())
    # a model loaded from the directory it is written to: its side files are copied, so kept
    (out / "notes.txt").write_text("my notes")
    autofp4.save_pretrained(autofp4.from_pretrained(ck), out, copy_files_from=out, overwrite=True)
    assert (out / "notes.txt").read_text() == "my notes"
    assert torch.equal(_logits(autofp4.from_pretrained(out)), _logits(model))


def test_a_file_put_in_the_output_while_writing_is_never_deleted(tmp_path):
    out = _checkpoint(tmp_path / "out", seed=1)
    model = autofp4.from_pretrained(_checkpoint(tmp_path / "ck"))

    class Tokenizer:  # a tokenizer whose saving is slow enough for someone to drop a file into out
        def save_pretrained(self, where):
            Path(where, "tokenizer_config.json").write_text("{}")
            (out / "late.txt").write_text("written meanwhile")

    with pytest.raises(FileExistsError) as info:
        autofp4.save_pretrained(model, out, overwrite=True, tokenizer=Tokenizer())
    assert "not part of a checkpoint ('late.txt')" in _one_line(info.value)
    assert (out / "late.txt").read_text() == "written meanwhile" and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "out"]


def test_quantize_overwrite_refuses_a_previous_output_holding_a_users_file(tmp_path, capsys):
    src = tmp_path / "src"
    _model("llama", 3).save_pretrained(src)
    (src / "README.md").write_text("model card")
    out = tmp_path / "out"
    assert cli_main(["quantize", str(src), "--fmt", "nvfp4", "--out", str(out), "--no-progress"]) == 0
    assert (out / "README.md").read_text() == "model card"  # copied from the source
    (out / "notes.txt").write_text("my notes")
    before = _snapshot(out)
    capsys.readouterr()
    assert cli_main(["quantize", str(src), "--fmt", "nvfp4", "--out", str(out), "--overwrite", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(out) in err, err
    assert "holds 1 file that is not part of a checkpoint ('notes.txt')" in err and "another out (--out)" in err, err
    assert _snapshot(out) == before
    with pytest.raises(FileExistsError, match=r"\('notes.txt'\)"):
        autofp4.quantize_checkpoint(src, out, "nvfp4", overwrite=True, progress=False)
    assert _snapshot(out) == before
    (out / "notes.txt").unlink()  # README.md is one of the source's files: the output is replaced
    assert cli_main(["quantize", str(src), "--fmt", "nvfp4", "--out", str(out), "--overwrite", "--no-progress"]) == 0
    assert (out / "README.md").is_file() and (out / "quantization_report.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


# -- compressed-tensors weights fields autofp4 cannot read as FP4 --------------------
def test_an_asymmetric_ct_weights_scheme_is_refused(tmp_path):
    path = _checkpoint(tmp_path / "ct", "compressed-tensors")
    _edit(path / "config.json",
          lambda d: d["quantization_config"]["config_groups"]["group_0"]["weights"].update(symmetric=False))
    calls = [lambda: autofp4.from_pretrained(path),
             lambda: transformers.AutoModelForCausalLM.from_pretrained(
                 str(path), config=autofp4.transformers_config(path), dtype=BF16)]
    for call in calls:
        with pytest.raises(ValueError) as info:
            call()
        msg = _one_line(info.value)
        assert "config.json" in msg and "config_groups['group_0'].weights.symmetric is False" in msg, msg
        assert "needs True" in msg and "zero points" in msg, msg
    _edit(path / "config.json",
          lambda d: d["quantization_config"]["config_groups"]["group_0"]["weights"].update(symmetric=True))
    assert isinstance(autofp4.from_pretrained(path).model.layers[0].mlp.down_proj, autofp4.FP4Linear)


@pytest.mark.parametrize("how", ["null", "missing"])
def test_a_ct_group_without_weights_is_refused_naming_it(tmp_path, how):
    path = _checkpoint(tmp_path / "ct", "compressed-tensors")

    def edit(d):
        group = d["quantization_config"]["config_groups"]["group_0"]
        if how == "null":
            group["weights"] = None
        else:
            del group["weights"]

    _edit(path / "config.json", edit)
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path)
    msg = _one_line(info.value)
    assert f"config_groups['group_0'].weights is {how}" in msg and "quantizes no weights" in msg, msg
    assert "'nvfp4-pack-quantized'" in msg and "config.json" in msg, msg


# -- a torch_dtype no torch dtype has ---------------------------------------------------------
@pytest.mark.parametrize("field,value,shown", [("torch_dtype", "float4", "'float4' (a string)"),
                                               ("dtype", "float4", "'float4' (a string)"),
                                               ("torch_dtype", 16, "16")])
def test_a_config_dtype_torch_has_not_is_named(tmp_path, capsys, field, value, shown):
    path = _checkpoint(tmp_path / "ck")
    _edit(path / "config.json", lambda d: d.update({field: value}))
    for call in (lambda: autofp4.from_pretrained(path), lambda: autofp4.transformers_config(path)):
        with pytest.raises(ValueError) as info:
            call()
        msg = _one_line(info.value)
        assert str(path / "config.json") in msg, msg
        assert f"config field {field!r} must name a torch dtype" in msg and f"got {shown}" in msg, msg
    src = tmp_path / "src"
    _model().save_pretrained(src)
    _edit(src / "config.json", lambda d: d.update({field: value}))
    capsys.readouterr()
    assert cli_main(["quantize", str(src), "--fmt", "nvfp4", "--out", str(tmp_path / "q"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert str(src / "config.json") in err and f"{field!r}" in err and shown in err, err
    _edit(path / "config.json", lambda d: d.update({field: "float16"}))  # any torch dtype: autofp4 picks its own
    assert autofp4.from_pretrained(path).model.embed_tokens.weight.dtype == BF16


# -- transformers' from_pretrained with a dtype the FP4 kernels do not compute in ------------
def test_the_transformers_path_refuses_float32_at_load(tmp_path):
    path = _checkpoint(tmp_path / "ck")
    for dtype in (torch.float32, torch.float64):
        with pytest.raises(ValueError) as info:
            transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        msg = _one_line(info.value)
        assert "dtype must be torch.bfloat16 or torch.float16" in msg and f"got {dtype}" in msg, msg
    _edit(path / "config.json", lambda d: d.update(dtype="float32", torch_dtype="float32"))
    with pytest.raises(ValueError, match=r"got torch.float32 .*config.json's for dtype='auto'"):
        transformers.AutoModelForCausalLM.from_pretrained(str(path))
    for dtype in (torch.float16, BF16):  # the kernels' dtypes load and compute what autofp4's loader does
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        assert model.model.embed_tokens.weight.dtype == dtype
        ours = autofp4.from_pretrained(path, dtype=dtype)
        assert torch.equal(_logits(model), _logits(ours))


# -- pickle round trip --------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("shape", [(64, 128), (3, 32, 64)])
def test_an_fp4_weight_pickles_and_loads_back(fmt, shape):
    torch.manual_seed(0)
    w = autofp4.quantize(torch.randn(shape), fmt)
    for blob in (pickle.dumps(w), pickle.dumps(w, protocol=2)):
        r = pickle.loads(blob)
        assert isinstance(r, autofp4.FP4Weight) and r.fmt == fmt
        for field in ("data", "scale", "global_scale", "input_scale"):
            a, b = getattr(w, field), getattr(r, field)
            assert (a is None) == (b is None), field
            if a is not None:
                assert a.dtype == b.dtype and a.shape == b.shape, field
                assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                   b.view(torch.uint8) if b.element_size() == 1 else b), field
        assert torch.equal(autofp4.dequantize(r), autofp4.dequantize(w))
    # copies and torch.save, which go through the same state, still give the same weight
    buf = io.BytesIO()
    torch.save(w, buf)
    buf.seek(0)
    for other in (copy.deepcopy(w), torch.load(buf, weights_only=False)):
        assert other.scale.dtype == w.scale.dtype and torch.equal(autofp4.dequantize(other), autofp4.dequantize(w))
    if len(shape) == 2:
        x = torch.randn(5, shape[1], dtype=BF16)
        assert torch.equal(autofp4.linear(x, pickle.loads(pickle.dumps(w))), autofp4.linear(x, w))


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_an_fp4_model_pickles_and_loads_back(kind):
    model = _model(kind, 4)
    autofp4.quantize_model(model, "nvfp4")
    ref = _logits(model)
    back = pickle.loads(pickle.dumps(model))
    scales = {n: b.dtype for n, b in back.named_buffers() if n.endswith("scale") and "global" not in n}
    assert scales and set(scales.values()) == {torch.float8_e4m3fn}, scales
    assert torch.equal(_logits(back), ref)
    assert torch.equal(_logits(copy.deepcopy(model)), ref)


# -- transformers_config on a folder that does not exist ------------------------------------
def test_transformers_config_names_a_missing_local_folder_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _checkpoint(tmp_path / "ck")
    name = f"nonexistent-{uuid.uuid4().hex[:8]}"
    for path in (f"./{name}", f"{tmp_path}/{name}", f"a/b/{name}", f"ck/{name}", f"~/{name}", Path(name)):
        t0 = time.monotonic()
        with pytest.raises(FileNotFoundError) as info:
            autofp4.transformers_config(path)
        assert time.monotonic() - t0 < 5, path
        msg = _one_line(info.value)
        assert f"no such folder: {path}" in msg and "not a Hugging Face Hub model id" in msg, msg
    with pytest.raises(NotADirectoryError, match="ck/model.safetensors is a file, not a checkpoint folder"):
        autofp4.transformers_config("ck/model.safetensors")
    # a bare name may be a Hub id: said before it is looked up, and the error names both readings
    with warnings.catch_warnings(record=True) as caught, pytest.raises(OSError) as info:
        warnings.simplefilter("always")
        autofp4.transformers_config(name, local_files_only=True)
    said = [str(w.message) for w in caught if "transformers_config" in str(w.message)]
    assert said and f"no folder {name!r} in {tmp_path}" in said[0] and "Hugging Face Hub model id" in said[0], said
    msg = _one_line(info.value)
    assert f"{name!r} is neither a checkpoint folder here ({tmp_path})" in msg and "Hub model id" in msg, msg
    assert type(autofp4.transformers_config("ck")).__name__ == "LlamaConfig"


# -- AUTOFP4_NO_TRANSFORMERS_HOOK read as an on/off flag ------------------------------------
def _hook_run(value: str, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "AUTOFP4_NO_TRANSFORMERS_HOOK": value}
    return subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)


def test_the_no_hook_variable_reads_as_a_flag(tmp_path, monkeypatch):
    path = _checkpoint(tmp_path / "ck")
    load = ("import torch, autofp4; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(path)!r}, dtype=torch.bfloat16); "
            "print(type(m.model.layers[0].mlp.down_proj).__name__)")
    res = _hook_run("0", load)  # 0 asks for no "no hook": the hook stays on and the checkpoint loads
    assert res.returncode == 0 and res.stdout.split()[-1] == "FP4Linear", res.stderr[-2000:]
    assert "AUTOFP4_NO_TRANSFORMERS_HOOK" not in res.stderr
    registered = ("import autofp4; from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as m; "
                  "print('autofp4' in m)")
    res = _hook_run("1", registered)
    assert res.returncode == 0 and res.stdout.split()[-1] == "False", res.stderr[-2000:]
    # what install() reads at import, for the other spellings
    from autofp4.integrations.transformers_hook import hook_disabled

    odd = f"maybe-{uuid.uuid4().hex[:6]}"
    for value, off in (("", False), ("false", False), (" Off ", False), ("no", False), ("0", False),
                       ("1", True), ("yes", True), ("TRUE", True), ("on", True), (odd, False)):
        monkeypatch.setenv("AUTOFP4_NO_TRANSFORMERS_HOOK", value)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert hook_disabled() is off, value
        said = [str(w.message) for w in caught]
        if value == odd:
            assert len(said) == 1 and f"AUTOFP4_NO_TRANSFORMERS_HOOK={odd!r} ignored" in said[0], said
            assert "hook stays on" in said[0] and "\n" not in said[0]
        else:
            assert not said, (value, said)


def test_the_checkpoints_generation_config_is_loaded_kept_and_checked(tmp_path):
    path = _checkpoint(tmp_path / "ck")
    gen = {"eos_token_id": 77, "do_sample": True, "temperature": 0.3, "top_p": 0.9}
    (path / "generation_config.json").write_text(json.dumps(gen))
    model = autofp4.from_pretrained(path)
    g = model.generation_config
    assert (g.eos_token_id, g.do_sample, g.temperature, g.top_p) == (77, True, 0.3, 0.9)
    out = autofp4.save_pretrained(model, tmp_path / "again")
    back = json.loads((out / "generation_config.json").read_text())
    assert back["eos_token_id"] == 77 and back["temperature"] == 0.3  # the round trip keeps it
    (path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path)
    assert "generation_config.json" in _one_line(info.value)


def test_a_ct_group_with_quantized_input_activations_is_said(tmp_path):
    path = _checkpoint(tmp_path / "ct", "compressed-tensors")
    _edit(path / "config.json", lambda d: d["quantization_config"]["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}))
    with pytest.warns(UserWarning, match=r"input_activations asks for 8-bit float activations.*set_activations"):
        model = autofp4.from_pretrained(path)
    assert all(m.act_dtype is None for m in model.modules() if isinstance(m, autofp4.nn.FP4Buffers))
    _edit(path / "config.json", lambda d: d["quantization_config"]["config_groups"]["group_0"].update(
        input_activations=[8]))
    with pytest.raises(ValueError, match=r"input_activations must be an object or null"):
        autofp4.from_pretrained(path)


def test_transformers_config_refuses_unknown_keywords(tmp_path):
    path = _checkpoint(tmp_path / "ck")
    with pytest.raises(TypeError, match="unknown keyword argument act: not a field of LlamaConfig"):
        autofp4.transformers_config(path, act="fp8")
    assert autofp4.transformers_config(path, max_position_embeddings=96).max_position_embeddings == 96


def test_generation_config_files_given_or_broken(tmp_path):
    """An explicit copy_files_from's generation_config.json is the one written; a broken one (not
    JSON, or a link to nothing) is refused naming it, by save_pretrained, quantize_checkpoint and
    from_pretrained, before anything is written."""
    model = autofp4.from_pretrained(_checkpoint(tmp_path / "ck"))
    side = tmp_path / "side"
    side.mkdir()
    (side / "generation_config.json").write_text(json.dumps({"eos_token_id": 55}))
    out = autofp4.save_pretrained(model, tmp_path / "out", copy_files_from=side)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 55
    (side / "generation_config.json").write_text("{broken")
    with pytest.raises(ValueError, match=r"side/generation_config.json: cannot read it as a generation config: invalid"):
        autofp4.save_pretrained(model, tmp_path / "out2", copy_files_from=side)
    assert not (tmp_path / "out2").exists()
    src = tmp_path / "src"
    _model("llama", 3).save_pretrained(src)
    (src / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"src/generation_config.json: cannot read it .* expected a JSON object at the "
                                         r"top level, got list"):
        autofp4.quantize_checkpoint(src, tmp_path / "q", "nvfp4", progress=False)
    assert not (tmp_path / "q").exists()
    ck = _checkpoint(tmp_path / "ck2")
    (ck / "generation_config.json").unlink(missing_ok=True)
    (ck / "generation_config.json").symlink_to(tmp_path / "nowhere.json")
    with pytest.raises(ValueError, match="generation_config.json is a symbolic link to nothing"):
        autofp4.from_pretrained(ck)


def test_generation_config_files_are_read_as_the_loader_reads_them(tmp_path):
    """What from_pretrained refuses in a generation_config.json (values transformers refuses, deep
    nesting, a FIFO), quantize_checkpoint and save_pretrained(copy_files_from=) refuse too, naming
    the file, before anything is written; the loader names it instead of a RecursionError."""
    import os

    model = autofp4.from_pretrained(_checkpoint(tmp_path / "ck"))
    side = tmp_path / "side"
    side.mkdir()
    (side / "generation_config.json").write_text(json.dumps({"max_new_tokens": "abc"}))
    with pytest.raises(ValueError, match=r"side/generation_config.json: cannot read it as a generation config: TypeError"):
        autofp4.save_pretrained(model, tmp_path / "out", copy_files_from=side)
    assert not (tmp_path / "out").exists()
    src = tmp_path / "src"
    _model("llama", 3).save_pretrained(src)
    (src / "generation_config.json").write_text(json.dumps({"max_new_tokens": "abc"}))
    with pytest.raises(ValueError, match=r"src/generation_config.json: cannot read it as a generation config"):
        autofp4.quantize_checkpoint(src, tmp_path / "q", "nvfp4", progress=False)
    (src / "generation_config.json").unlink()
    os.mkfifo(src / "generation_config.json")
    with pytest.raises(ValueError, match=r"src/generation_config.json is not a regular file"):
        autofp4.quantize_checkpoint(src, tmp_path / "q", "nvfp4", progress=False)
    assert not (tmp_path / "q").exists()
    ck = _checkpoint(tmp_path / "ck2")
    (ck / "generation_config.json").write_text("[" * 50000 + "]" * 50000)
    with pytest.raises(ValueError, match=r"generation_config.json: cannot read it .* nested deeper than"):
        autofp4.from_pretrained(ck)


def test_an_empty_input_activations_entry_is_described_as_given(tmp_path):
    path = _checkpoint(tmp_path / "ct", "compressed-tensors")
    _edit(path / "config.json", lambda d: d["quantization_config"]["config_groups"]["group_0"].update(
        input_activations={}))
    with pytest.warns(UserWarning, match=r"input_activations asks for quantized activations \(\{\}\)"):
        autofp4.from_pretrained(path)


def test_the_tuning_worker_does_not_inherit_the_parents_tuner_settings(monkeypatch):
    from autofp4.tuning.worker import _child_env

    monkeypatch.setenv("AUTOFP4_AUTOTUNE", "blocking")
    monkeypatch.setenv("AUTOFP4_AUTOTUNE_BUDGET_S", "5")
    monkeypatch.setenv("AUTOFP4_AUTOTUNE_OPS", "linear")
    monkeypatch.setenv("AUTOFP4_DB", "/tmp/x.db")
    env = _child_env()
    assert not [k for k in env if k.startswith("AUTOFP4_AUTOTUNE")]
    assert env["AUTOFP4_DB"] == "/tmp/x.db"


@pytest.mark.parametrize("name,kind", [("config.json", "device"), ("hf_quant_config.json", "dir"),
                                       ("hf_quant_config.json", "fifo"), ("model.safetensors.index.json", "fifo")])
def test_a_checkpoint_file_that_is_not_a_regular_file_is_named(tmp_path, name, kind):
    """config.json, hf_quant_config.json and the index read as absent when they were a directory,
    FIFO or device (a false "has no config.json", or the other config used without a word)."""
    import os

    path = _checkpoint(tmp_path / "ck")
    (path / name).unlink(missing_ok=True)
    if kind == "device":
        (path / name).symlink_to("/dev/zero")
    elif kind == "dir":
        (path / name).mkdir()
    else:
        os.mkfifo(path / name)
    with pytest.raises(ValueError, match=rf"ck/{name} is not a regular file"):
        autofp4.from_pretrained(path)


def test_bytes_after_the_last_tensor_are_refused_by_every_reader(tmp_path):
    """A safetensors file with bytes appended after its data (the safetensors library refuses
    it): from_pretrained and quantize both name the file and the byte count, and write nothing."""
    from autofp4.integrations.quantize_checkpoint import quantize_checkpoint

    ck = _checkpoint(tmp_path / "ck")
    with open(ck / "model.safetensors", "ab") as f:
        f.write(os.urandom(4000))
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(ck)
    assert "model.safetensors has 4000 bytes after its last tensor's data" in _one_line(info.value)
    src = tmp_path / "src"
    _model("llama", 3).save_pretrained(src)
    with open(src / "model.safetensors", "ab") as f:
        f.write(b"\0" * 17)
    with pytest.raises(ValueError, match="has 17 bytes after its last tensor's data"):
        quantize_checkpoint(src, tmp_path / "out", "nvfp4", progress=False)
    assert not (tmp_path / "out").exists()
