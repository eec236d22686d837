"""Hostile FP4 checkpoints, configs and arguments of the loading and writing API.

Each is refused with one clear error naming the file, field or argument at fault (or handled
correctly), before anything is built or destroyed. Checkpoints are tiny models with fresh random
weights, quantized and written by autofp4 itself, then edited."""
from __future__ import annotations

import fnmatch
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import autofp4  # noqa: E402
from autofp4.cli import main as cli_main  # noqa: E402
from autofp4.integrations import checkpoints as ck  # noqa: E402
from autofp4.integrations.safetensors_io import read_header  # noqa: E402

from tiny_models import tiny_model as _model  # noqa: E402


@pytest.fixture
def seed():
    s = random.randrange(2**31)
    print(f"random seed: {s}")
    return s


def _checkpoint(root: Path, kind: str, layout: str, seed: int) -> Path:
    fmt = "mxfp4" if layout == "gpt-oss" else "nvfp4"
    model = _model(kind, seed)
    autofp4.quantize_model(model, fmt, skip=["lm_head", "*.self_attn.*"] if layout == "gpt-oss" else ["lm_head"])
    autofp4.save_pretrained(model, root, layout=layout)
    return root


def _edit(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def _edit_header(path: Path, fn) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    fn(header)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h + raw[8 + n:])


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg, msg
    return msg


# -- Q08: pattern lists that grow --------------------------------------------------------------
def test_a_huge_exclude_list_of_module_names_loads_in_bounded_time(tmp_path, seed):
    """~170k plain names in hf_quant_config.json exclude_modules (1.6 MB, under the 2 MiB config
    limit) used to take minutes (fnmatch against every layer); a set lookup now. Run in a child
    with a deadline, so a regression fails instead of hanging."""
    path = _checkpoint(tmp_path / "ck", "llama", "modelopt", seed)
    rng = random.Random(seed)
    base = rng.randrange(10**4)
    names = ["lm_head"] + [f"x{base + i}" for i in range(170_000)]
    doc = json.loads((path / "hf_quant_config.json").read_text())
    doc["quantization"]["exclude_modules"] = names
    (path / "hf_quant_config.json").write_text(json.dumps(doc, separators=(",", ":")))  # ~1.7 MB: under 2 MiB
    code = ("import autofp4, time, warnings\nwarnings.simplefilter('ignore')\nt = time.time()\n"
            f"m = autofp4.from_pretrained({str(path)!r})\nprint('loaded', time.time() - t)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.stdout.startswith("loaded"), r.stdout + r.stderr
    assert float(r.stdout.split()[1]) < 30, r.stdout


def test_too_many_wildcard_patterns_are_refused_naming_the_file_and_count(tmp_path, seed):
    path = _checkpoint(tmp_path / "ck", "llama", "modelopt", seed)
    n = ck.MAX_GLOBS + 1 + random.Random(seed).randrange(100)
    _edit(path / "hf_quant_config.json",
          lambda d: d["quantization"].update(exclude_modules=["lm_head"] + [f"*x{i}" for i in range(n)]))
    t = time.time()
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path)
    msg = _one_line(info.value)
    assert str(path / "hf_quant_config.json") in msg and "exclude_modules" in msg and str(n) in msg
    assert time.time() - t < 10


def _old_modelopt_match(patterns, name):
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*") for p in patterns)


def _old_ct_match(patterns, name, cls):
    return any(p in (name, cls) or name.startswith(p + ".") for p in patterns)


def test_pattern_matching_is_what_fnmatch_and_the_name_rules_say(seed):
    """The grouped matcher against the pattern-by-pattern rules, on random names and patterns
    (globs with *, ?, [...], names, prefixes of names, class names)."""
    rng = random.Random(seed)
    parts = ["model", "layers", "0", "1", "12", "mlp", "gate", "self_attn", "q_proj", "experts", "lm_head", "a.b"]

    def name():
        return ".".join(rng.choice(parts) for _ in range(rng.randint(1, 5)))

    def pattern():
        p = name()
        for _ in range(rng.randint(0, 3)):
            i = rng.randrange(len(p) + 1)
            p = p[:i] + rng.choice(["*", "?", "[0-9]", "[!a]", ".", "*.", "["]) + p[i:]
        return p if p not in ("", "re:") else "x"

    for _ in range(30):
        patterns = [pattern() if rng.random() < 0.5 else name() for _ in range(rng.randint(1, 40))]
        mo = ck._Scheme("modelopt", patterns, None, "test")
        ct = ck._Scheme("compressed-tensors", patterns, None, "test")
        for _ in range(60):
            n = name() if rng.random() < 0.7 else rng.choice(patterns)
            cls = rng.choice(["Linear", "Qwen3MoeExperts"])
            assert mo.excluded(n, cls) == _old_modelopt_match(patterns, n), (patterns, n)
            assert ct.excluded(n, cls) == _old_ct_match(patterns, n, cls), (patterns, n, cls)


# -- compressed-tensors and gpt-oss configs --------------------------------------------------------
@pytest.mark.parametrize("weights", [["num_bits"], "num_bits", 4])
def test_ct_config_group_weights_of_the_wrong_type_are_named(tmp_path, seed, weights):
    path = _checkpoint(tmp_path / "ct", "llama", "compressed-tensors", seed)
    _edit(path / "config.json", lambda d: d["quantization_config"]["config_groups"]["group_0"].update(weights=weights))
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path)
    msg = _one_line(info.value)
    assert "config.json" in msg and "config_groups['group_0'].weights must be an object" in msg


def test_a_ct_sparsity_compression_is_refused_by_name(tmp_path, seed):
    """A compressed-tensors sparsity_config with a storage format other than dense names it (the
    weights would be stored sparse-compressed); 'dense' and an empty one load."""
    path = _checkpoint(tmp_path / "ct", "llama", "compressed-tensors", seed)
    _edit(path / "config.json", lambda d: d["quantization_config"].update(
        sparsity_config={"format": "sparse-24-bitmask", "targets": ["Linear"]}))
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path)
    assert "sparsity_config format 'sparse-24-bitmask'" in _one_line(info.value)
    _edit(path / "config.json", lambda d: d["quantization_config"].update(sparsity_config=["dense"]))
    with pytest.raises(ValueError, match="sparsity_config must be an object or null"):
        autofp4.from_pretrained(path)
    for ok in ({"format": "dense"}, {}, None):
        _edit(path / "config.json", lambda d: d["quantization_config"].update(sparsity_config=ok))
        autofp4.from_pretrained(path)


@pytest.mark.parametrize("entry", ["", "re:"])
def test_an_empty_pattern_is_refused_naming_the_entry(tmp_path, seed, entry):
    path = _checkpoint(tmp_path / "g", "gpt_oss", "gpt-oss", seed)
    layout_key = "modules_to_not_convert"
    if entry == "re:":  # compressed-tensors' empty regex: matches every module too
        path = _checkpoint(tmp_path / "c", "llama", "compressed-tensors", seed)
        layout_key = "ignore"
    at = {}

    def add(d):
        lst = d["quantization_config"][layout_key]
        at["i"] = random.Random(seed).randrange(len(lst) + 1)
        lst.insert(at["i"], entry)

    _edit(path / "config.json", add)
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path)
    msg = _one_line(info.value)
    assert f"config.json quantization_config {layout_key}[{at['i']}] is an empty pattern {entry!r}" in msg


# -- config.json fields transformers would choke on ------------------------------------------------
@pytest.mark.parametrize("field,value,named", [
    ("head_dim", 0, "'head_dim' must be a positive integer"),  # ZeroDivisionError in rotary init
    ("intermediate_size", None, "'intermediate_size'"),  # huggingface_hub's strict dataclass error
    ("tie_word_embeddings", "yes", "'tie_word_embeddings'"),
    ("torch_dtype", "float8_e4m3fn", "'torch_dtype' must name a floating-point torch dtype"),  # no storage
    ("dtype", "int8", "'dtype' must name a floating-point torch dtype"),
])
def test_config_fields_transformers_refuses_are_named_as_value_errors(tmp_path, seed, field, value, named):
    path = _checkpoint(tmp_path / "ck", "llama", "modelopt", seed)
    _edit(path / "config.json", lambda d: d.update({field: value}))
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path)
    msg = _one_line(info.value)
    assert msg.startswith("autofp4.from_pretrained: ") and str(path / "config.json") in msg and named in msg
    with pytest.raises(ValueError, match=named):
        autofp4.transformers_config(path)


def test_moe_top_k_beyond_the_experts_is_refused_at_load(tmp_path, seed):
    path = _checkpoint(tmp_path / "q", "qwen3_moe", "modelopt", seed)
    k = 5 + random.Random(seed).randrange(20)
    _edit(path / "config.json", lambda d: d.update(num_experts_per_tok=k))
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path)
    msg = _one_line(info.value)
    assert str(path / "config.json") in msg and f"num_experts_per_tok={k}" in msg and "num_local_experts=4" in msg


def test_expert_counts_that_disagree_are_refused(tmp_path, seed):
    path = _checkpoint(tmp_path / "q", "qwen3_moe", "modelopt", seed)
    good = (path / "config.json").read_text()
    _edit(path / "config.json", lambda d: d.update(num_experts=2))  # beside num_local_experts = 4
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path)
    msg = _one_line(info.value)
    assert str(path / "config.json") in msg and "num_experts = 2" in msg and "num_local_experts = 4" in msg
    # fewer experts in the config than the checkpoint stores: the stored expert beyond is named
    (path / "config.json").write_text(good)
    _edit(path / "config.json", lambda d: d.update(num_local_experts=2, num_experts_per_tok=1))
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path)
    msg = _one_line(info.value)
    assert "model.layers.0.mlp.experts.2.gate_proj" in msg and "num_local_experts = 2" in msg


# -- arguments ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float32, torch.float64])
def test_a_dtype_the_model_cannot_run_in_is_refused_at_load(tmp_path, seed, dtype):
    path = _checkpoint(tmp_path / "ck", "llama", "modelopt", seed)
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path, dtype=dtype)
    msg = _one_line(info.value)
    assert "dtype must be torch.bfloat16 or torch.float16" in msg and str(dtype) in msg
    with pytest.raises(TypeError, match="dtype must be torch.bfloat16 or torch.float16"):
        autofp4.from_pretrained(path, dtype="bfloat16")
    model = autofp4.from_pretrained(path, dtype=torch.float16)
    assert model(torch.tensor([[1, 2, 3]])).logits.dtype == torch.float16


def test_a_cuda_device_this_machine_lacks_is_named(tmp_path, seed):
    """device_map (and FP4Weight.to) naming a CUDA device that is not there: said so, not an error
    about reading a tensor into pinned memory (or torch's assertion)."""
    path = _checkpoint(tmp_path / "ck", "llama", "modelopt", seed)
    missing = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path, device_map=missing)
    msg = _one_line(info.value)
    assert f"device_map={missing!r}" in msg and ("no CUDA GPU is available" in msg or "CUDA GPU(s)" in msg), msg
    with pytest.raises(ValueError, match="no CUDA GPU|CUDA GPU\\(s\\)"):
        autofp4.from_pretrained(path, device_map={"": missing})
    w = autofp4.quantize(torch.randn(64, 128, generator=torch.Generator().manual_seed(seed)), "nvfp4")
    with pytest.raises(RuntimeError, match=f"FP4Weight.to\\({missing!r}\\): .*(no CUDA GPU|CUDA GPU\\(s\\))"):
        w.to(missing)
    assert w.to("cpu") is w


def test_a_side_file_that_is_not_a_regular_file_is_warned_about_not_copied(tmp_path, seed):
    """A FIFO named tokenizer.json (or a folder named like a tokenizer file) in the source of
    ``autofp4 quantize`` is left out with a warning naming it; the regular side files are
    copied."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    src = tmp_path / "src"
    _model("llama", seed).save_pretrained(src)
    os.mkfifo(src / "tokenizer.json")
    (src / "vocab.json").mkdir()
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "notes").mkdir()  # a subfolder of someone's: not a checkpoint file, no warning
    out = tmp_path / "out"
    with pytest.warns(RuntimeWarning) as rec:
        autofp4.quantize_checkpoint(src, out, "nvfp4", progress=False)
    said = [str(r.message) for r in rec if "not copied" in str(r.message)]
    assert any(str(src / "tokenizer.json") in m and "a FIFO" in m for m in said), said
    assert any(str(src / "vocab.json") in m and "a directory" in m for m in said), said
    assert not any("notes" in m for m in said)
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}" and not (out / "tokenizer.json").exists()


def test_a_quant_method_that_names_the_tensors_otherwise_is_blamed(tmp_path, seed):
    """A ModelOpt checkpoint whose config says gpt-oss's quant_method 'mxfp4': the packed weight
    and its scale are both there, so the error blames the quantization config, not a missing scale."""
    path = _checkpoint(tmp_path / "ck", "llama", "modelopt", seed)
    _edit(path / "config.json", lambda d: d["quantization_config"].update(quant_method="mxfp4"))
    (path / "hf_quant_config.json").unlink()
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path)
    msg = _one_line(info.value)
    assert "quantization config does not read them as an FP4 weight" in msg and "quant_method" in msg, msg
    assert "is missing" not in msg


@pytest.mark.parametrize("fuse", ["no", 0, None, "False"])
def test_fuse_must_be_a_bool(tmp_path, seed, fuse):
    path = _checkpoint(tmp_path / "ck", "llama", "modelopt", seed)
    with pytest.raises(TypeError, match="from_pretrained: fuse must be True or False"):
        autofp4.from_pretrained(path, fuse=fuse)
    with pytest.raises(TypeError, match="quantize_model: fuse must be True or False"):
        autofp4.quantize_model(nn.Sequential(nn.Linear(64, 64)), "nvfp4", fuse=fuse)


def test_requantizing_an_fp4_model_is_refused_or_reported(seed):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48)).to(torch.bfloat16)
    autofp4.quantize_model(net, "nvfp4")
    before = [b.clone() for b in net.buffers()]
    with pytest.raises(ValueError) as info:
        autofp4.quantize_model(net, "mxfp4")
    msg = _one_line(info.value)
    assert "already quantized" in msg and "nvfp4" in msg and "'0'" in msg and "mxfp4" in msg
    report = autofp4.quantize_model(net, "nvfp4")  # the same format: left as they are, reported
    assert report.converted == [] and dict(report.skipped) == {"0": "already quantized (nvfp4)",
                                                               "2": "already quantized (nvfp4)"}
    assert all(torch.equal(a, b) for a, b in zip(before, net.buffers()))
    model = _model("qwen3_moe", seed)
    autofp4.quantize_model(model, "nvfp4")
    report = autofp4.quantize_model(model, "nvfp4")
    skipped = dict(report.skipped)
    assert skipped["model.layers.0.mlp.experts.gate_up_proj"] == "already quantized (nvfp4)"
    assert skipped["model.layers.1.self_attn.q_proj"] == "already quantized (nvfp4)"  # a fused part
    with pytest.raises(ValueError, match="already quantized"):
        autofp4.quantize_model(model, "mxfp4")


# -- safetensors headers -------------------------------------------------------------------------
_TENSOR = "model.layers.0.mlp.down_proj.weight"


@pytest.mark.parametrize("case,edit,named", [
    ("S03", lambda e: e.update(shape=[str(s) for s in e["shape"]]), "shape must be a list of non-negative integers"),
    ("S04", lambda e: e.update(shape=[float(s) for s in e["shape"]]), "shape must be a list of non-negative integers"),
    ("S05", lambda e: e.update(shape=[True, e["shape"][0] * e["shape"][1]]),  # as many bytes: true counted as 1
     "shape must be a list of non-negative integers"),
    ("S06", lambda e: e.update(data_offsets=[float(v) for v in e["data_offsets"]]),
     "data_offsets must be two non-negative integers"),
    ("offsets-3", lambda e: e.update(data_offsets=e["data_offsets"] + [0]), "data_offsets must be two"),
    ("entry-list", None, "has an entry safetensors does not define"),
])
def test_header_values_of_the_wrong_type_name_the_file_and_tensor(tmp_path, seed, case, edit, named):
    path = _checkpoint(tmp_path / "ck", "llama", "modelopt", seed)
    f = path / "model.safetensors"
    if edit is None:
        _edit_header(f, lambda h: h.update({_TENSOR: [1, 2]}))
    else:
        _edit_header(f, lambda h: edit(h[_TENSOR]))
    for call in (lambda: autofp4.from_pretrained(path), lambda: read_header(f, "autofp4.test")):
        with pytest.raises(ValueError) as info:
            call()
        msg = _one_line(info.value)
        assert str(f) in msg and repr(_TENSOR) in msg and named in msg


@pytest.mark.parametrize("meta,named", [([1, 2], "__metadata__ must be an object of strings"),
                                        ({"format": 5}, "__metadata__['format'] must be a string"),
                                        ({"format": "pt", "n": None}, "__metadata__['n'] must be a string")])
def test_malformed_metadata_is_named(tmp_path, seed, meta, named):
    path = _checkpoint(tmp_path / "ck", "llama", "modelopt", seed)
    f = path / "model.safetensors"
    _edit_header(f, lambda h: h.update(__metadata__=meta))
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path)
    msg = _one_line(info.value)
    assert str(f) in msg and named in msg


def test_a_missing_gpt_oss_bias_is_named(tmp_path, seed):
    path = _checkpoint(tmp_path / "g", "gpt_oss", "gpt-oss", seed)
    f = path / "model.safetensors"
    sd = safetensors_torch.load_file(str(f))
    layer = random.Random(seed).randrange(2)
    name = f"model.layers.{layer}.mlp.experts.{random.Random(seed).choice(['gate_up', 'down'])}_proj_bias"
    del sd[name]
    safetensors_torch.save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(KeyError) as info:
        autofp4.from_pretrained(path)
    assert isinstance(info.value, ValueError)  # autofp4.loaders.MissingKeyError
    msg = info.value.args[0]
    assert "\n" not in msg and str(path) in msg and f"has no tensor {name!r}" in msg


# -- P13, U29: what overwrite may replace ---------------------------------------------------------
def _fp4_llama(seed):
    model = _model("llama", seed)
    autofp4.quantize_model(model, "nvfp4")
    return model


def test_an_empty_output_path_is_refused_and_the_working_directory_kept(tmp_path, seed, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    secret = os.urandom(8).hex()
    (work / "notes.txt").write_text(secret)
    monkeypatch.chdir(work)
    model = _fp4_llama(seed)
    for overwrite in (True, False):
        with pytest.raises(ValueError) as info:
            autofp4.save_pretrained(model, "", overwrite=overwrite)
        assert "save_pretrained: path is empty" in _one_line(info.value)
    src = tmp_path / "src"
    _model("llama", seed).save_pretrained(src)
    with pytest.raises(ValueError, match=r"out \(--out\) is empty"):
        autofp4.quantize_checkpoint(src, "", "nvfp4", overwrite=True, progress=False)
    assert cli_main(["quantize", str(src), "--fmt", "nvfp4", "--out", "", "--overwrite", "--no-progress"]) == 2
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"] and (work / "notes.txt").read_text() == secret
    with pytest.raises(TypeError, match="overwrite must be True or False"):
        autofp4.save_pretrained(model, tmp_path / "o", overwrite="no")


def test_overwrite_replaces_only_a_previous_output(tmp_path, seed, monkeypatch):
    model = _fp4_llama(seed)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError) as info:  # a directory of other files
        autofp4.save_pretrained(model, out, overwrite=True)
    assert str(out) in _one_line(info.value) and "is not a quantized checkpoint" in str(info.value)
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {}}))
    (out / "sub").mkdir()  # a checkpoint holds files only
    with pytest.raises(FileExistsError, match="holds the directory 'sub'"):
        autofp4.save_pretrained(model, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "notes.txt", "sub"]
    (out / "sub").rmdir()
    with pytest.raises(FileExistsError, match=r"not part of a checkpoint \('notes.txt'\)"):  # never deleted
        autofp4.save_pretrained(model, out, overwrite=True)
    (out / "notes.txt").unlink()
    autofp4.save_pretrained(model, out, overwrite=True)  # a quantized checkpoint: replaced
    assert (out / "model.safetensors").is_file()
    autofp4.save_pretrained(model, out, overwrite=True)  # autofp4's own output: replaced again
    # never the working directory (or one holding it), nor the home directory
    monkeypatch.chdir(out)
    for where in (".", str(out), str(tmp_path)):
        with pytest.raises(FileExistsError, match="current working directory"):
            autofp4.save_pretrained(model, where, overwrite=True)
    monkeypatch.chdir(tmp_path)
    home = os.environ.get("HOME")
    monkeypatch.setenv("HOME", str(out))
    with pytest.raises(FileExistsError, match="is the home directory"):
        autofp4.save_pretrained(model, out, overwrite=True)
    if home is None:
        monkeypatch.delenv("HOME")
    else:
        monkeypatch.setenv("HOME", home)
    # the checkpoint a model was loaded from is a previous output: replaced with the same tensors
    loaded = autofp4.from_pretrained(out)
    autofp4.save_pretrained(loaded, out, overwrite=True)
    again = autofp4.from_pretrained(out)
    a, b = (m.model.layers[1].mlp.down_proj.fp4_weight() for m in (loaded, again))
    assert torch.equal(a.data, b.data) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))


# -- mixed sources, missing scales, stored dtypes, compressed-tensors targets and strategies -------------
def _dense_src(root: Path, seed: int, shard: str = "model.safetensors") -> Path:
    model = _model("llama", seed)
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(model.config.to_dict()))
    safetensors_torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / shard))
    return root


def test_a_single_file_next_to_an_index_of_other_shards_is_refused_everywhere(tmp_path, seed):
    """transformers reads model.safetensors when it exists, autofp4's readers read the index: a folder
    holding both (the index listing other shards) would load as a silent mix, so every reader refuses it."""
    sh = tmp_path / "sh"
    model = _model("llama", seed)
    autofp4.quantize_model(model, "nvfp4", skip=["lm_head"])
    autofp4.save_pretrained(model, sh, layout="modelopt", max_shard_size="20KB")
    assert (sh / "model.safetensors.index.json").is_file()
    other = _checkpoint(tmp_path / "other", "llama", "modelopt", seed + 1)
    (sh / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    calls = [lambda: autofp4.from_pretrained(sh),
             lambda: transformers.AutoModelForCausalLM.from_pretrained(str(sh), dtype=torch.bfloat16)]
    for call in calls:
        with pytest.raises(ValueError) as info:
            call()
        msg = _one_line(info.value)
        assert "ambiguous checkpoint" in msg and "model.safetensors and model.safetensors.index.json" in msg, msg
        assert "remove one" in msg
    src = _dense_src(tmp_path / "src", seed)
    _dense_src(tmp_path / "src2", seed + 2, shard="model-00001-of-00001.safetensors")
    (src / "model-00001-of-00001.safetensors").write_bytes(
        (tmp_path / "src2" / "model-00001-of-00001.safetensors").read_bytes())
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in keys}}))
    with pytest.raises(ValueError) as info:
        autofp4.quantize_checkpoint(src, tmp_path / "out", "nvfp4", progress=False)
    msg = _one_line(info.value)
    assert "ambiguous checkpoint" in msg and "model.safetensors.index.json" in msg and str(src) in msg
    assert not (tmp_path / "out" / "model.safetensors").exists()
    # an index that lists model.safetensors itself is not ambiguous
    (src / "model-00001-of-00001.safetensors").unlink()
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model.safetensors" for k in keys}}))
    autofp4.quantize_checkpoint(src, tmp_path / "out", "nvfp4", progress=False)


def test_a_missing_weight_scale_is_refused_by_the_transformers_path_too(tmp_path, seed):
    path = _checkpoint(tmp_path / "ck", "llama", "modelopt", seed)
    f = path / "model.safetensors"
    sd = safetensors_torch.load_file(str(f))
    del sd["model.layers.0.mlp.up_proj.weight_scale"]
    safetensors_torch.save_file(sd, str(f))
    for call in (lambda: autofp4.from_pretrained(path),
                 lambda: transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)):
        with pytest.raises(ValueError) as info:
            call()
        msg = _one_line(info.value)
        assert "'model.layers.0.mlp.up_proj.weight' is stored packed" in msg, msg
        assert "'model.layers.0.mlp.up_proj.weight_scale' is missing" in msg, msg


@pytest.mark.parametrize("layout,fmt,stored,expected", [
    ("modelopt", "nvfp4", torch.uint8, "F8_E4M3"),
    ("compressed-tensors", "nvfp4", torch.uint8, "F8_E4M3"),
    ("compressed-tensors", "mxfp4", torch.float8_e4m3fn, "U8"),
])
def test_a_weight_scale_stored_in_the_wrong_dtype_is_refused(tmp_path, seed, layout, fmt, stored, expected):
    model = _model("llama", seed)
    autofp4.quantize_model(model, fmt, skip=["lm_head"])
    path = autofp4.save_pretrained(model, tmp_path / "ck", layout=layout)
    f = path / "model.safetensors"
    key = "model.layers.0.mlp.up_proj.weight_scale"
    sd = safetensors_torch.load_file(str(f))
    sd[key] = sd[key].view(stored)
    safetensors_torch.save_file(sd, str(f))
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path)
    msg = _one_line(info.value)
    got = {torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}[stored]
    assert repr(key) in msg and str(f) in msg, msg
    assert f"stored as {got}" in msg and f"expected {expected}" in msg, msg


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_a_packed_layer_no_ct_target_covers_is_refused(tmp_path, seed, kind):
    path = _checkpoint(tmp_path / "ct", kind, "compressed-tensors", seed)
    keep = "re:.*self_attn.*" if kind == "qwen3_moe" else "re:.*mlp.*"
    _edit(path / "config.json", lambda d: d["quantization_config"]["config_groups"]["group_0"].update(targets=[keep]))
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path)
    msg = _one_line(info.value)
    assert "stored quantized" in msg and "weight_packed" in msg and keep in msg and "targets" in msg, msg
    assert ("experts" if kind == "qwen3_moe" else "self_attn") in msg


def test_an_empty_ct_targets_list_is_refused_naming_the_group(tmp_path, seed):
    path = _checkpoint(tmp_path / "ct", "llama", "compressed-tensors", seed)
    _edit(path / "config.json", lambda d: d["quantization_config"]["config_groups"]["group_0"].update(targets=[]))
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path)
    msg = _one_line(info.value)
    assert "config.json" in msg and "config_groups['group_0'].targets is empty" in msg


@pytest.mark.parametrize("fmt,field,value,want", [
    ("nvfp4", "strategy", "channel", "tensor_group"),
    ("nvfp4", "strategy", "group", "tensor_group"),
    ("mxfp4", "strategy", "tensor_group", "group"),
    ("mxfp4", "group_size", 16, 32),
])
def test_a_ct_weights_strategy_the_format_does_not_use_is_refused(tmp_path, seed, fmt, field, value, want):
    model = _model("llama", seed)
    autofp4.quantize_model(model, fmt, skip=["lm_head"])
    path = autofp4.save_pretrained(model, tmp_path / "ct", layout="compressed-tensors")
    _edit(path / "config.json",
          lambda d: d["quantization_config"]["config_groups"]["group_0"]["weights"].update({field: value}))
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path)
    msg = _one_line(info.value)
    assert f"config_groups['group_0'].weights.{field} is {value!r}" in msg and f"needs {want!r}" in msg, msg


def _load_warnings(path, needle: str) -> list[str]:
    """The warnings from_pretrained(path) gives whose text holds ``needle``."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autofp4.from_pretrained(path)
    return [str(w.message) for w in caught if needle in str(w.message)]


def test_a_kv_cache_quant_algo_is_warned_about_once(tmp_path, seed):
    path = _checkpoint(tmp_path / "ck", "llama", "modelopt", seed)
    hf = path / "hf_quant_config.json"
    for value, n in ((None, 0), ("FP8", 1)):
        _edit(hf, lambda d: d["quantization"].update(kv_cache_quant_algo=value))
        kv = _load_warnings(path, "kv_cache_quant_algo")
        assert len(kv) == n, kv
        if n:
            assert "hf_quant_config.json" in kv[0] and "'FP8'" in kv[0] and "KV cache stays" in kv[0]


# -- the twentieth adversarial set -----------------------------------------------------------------
def test_a_dangling_link_is_named_as_one(tmp_path, seed):
    """A checkpoint file or side file that is a symbolic link to nothing is named as such (not as a
    directory, pipe or device): ``from_pretrained`` refuses the weights, ``quantize`` leaves out the
    side file with a warning saying why."""
    ckpt = _checkpoint(tmp_path / "ck", "llama", "modelopt", seed)
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(ckpt)
    assert "model.safetensors is a symbolic link to nothing reachable" in str(info.value), info.value
    src = tmp_path / "src"
    _model("llama", seed).save_pretrained(src)
    (src / "tokenizer.json").symlink_to(tmp_path / "nowhere.json")
    with pytest.warns(RuntimeWarning) as rec:
        autofp4.quantize_checkpoint(src, tmp_path / "out", "nvfp4", progress=False)
    said = [str(r.message) for r in rec if "not copied" in str(r.message)]
    assert said == [f"{src / 'tokenizer.json'}: not copied to the output: it is a symbolic link to nothing reachable "
                    "(its target is missing, or the links loop or chain through more than 40 links)"], said



# -- the twenty-first adversarial set --------------------------------------------------------------
def test_quantize_names_what_it_keeps_a_closed_stream_and_defaulted_sizes(tmp_path, seed):
    """Layers whose K the format's block does not divide are named in a warning (not only in the
    report); a closed progress stream is refused; a config.json without hidden_size is named
    where the shapes then disagree."""
    src = _dense_src(tmp_path / "src", seed)
    c = json.loads((src / "config.json").read_text())
    t = safetensors_torch.load_file(str(src / "model.safetensors"))
    t = {k: (v[:48].contiguous() if ("gate_proj" in k or "up_proj" in k) else v[:, :48].contiguous()
             if "down_proj" in k else v) for k, v in t.items()}
    safetensors_torch.save_file(t, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(dict(c, intermediate_size=48)))
    with pytest.warns(RuntimeWarning, match=r"kept in high precision \(not quantized\), as K is not a multiple of "
                      r"mxfp4's block of 32: model\.layers\.0\.mlp\.down_proj \(K = 48\)"):
        summary = autofp4.quantize_checkpoint(src, tmp_path / "out", "mxfp4", progress=False)
    assert "model.layers.0.mlp.down_proj" in summary.excluded
    import io

    closed = io.StringIO()
    closed.close()
    with pytest.raises(ValueError, match="stream is closed"):
        autofp4.quantize_checkpoint(src, tmp_path / "out2", "nvfp4", stream=closed)
    c.pop("hidden_size")
    (src / "config.json").write_text(json.dumps(dict(c, intermediate_size=48)))
    with pytest.raises(ValueError, match=r"config.json does not set hidden_size \(transformers' default: 4096\)"):
        autofp4.quantize_checkpoint(src, tmp_path / "out3", "nvfp4", progress=False)


@pytest.mark.parametrize("rope,named", [({"rope_type": "llama3", "factor": "abc"}, "rope_scaling.factor must be a number"),
                                        ([8.0], "rope_scaling must be an object"),
                                        ({"rope_type": 3, "factor": 8.0}, "rope_scaling.rope_type must be a name")])
def test_a_rope_scaling_of_the_wrong_types_is_named_before_transformers_builds(tmp_path, seed, rope, named):
    ckpt = _checkpoint(tmp_path / "ck", "llama", "modelopt", seed)
    _edit(ckpt / "config.json", lambda d: d.update(rope_scaling=rope))
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(ckpt)
    assert "config.json: " + named in str(info.value), info.value


def test_a_checkpoint_config_without_its_sizes_names_them_where_shapes_disagree(tmp_path, seed):
    ckpt = _checkpoint(tmp_path / "ck", "llama", "modelopt", seed)
    _edit(ckpt / "config.json", lambda d: d.pop("hidden_size"))
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(ckpt)
    assert str(info.value).endswith("(config.json does not set hidden_size (transformers' default: 4096))"), info.value


# -- the twenty-second adversarial set -------------------------------------------------------------
def test_load_errors_name_the_model_class_and_leave_out_aliased_sizes(tmp_path, seed):
    """A sequence-classification architectures entry on a causal-LM checkpoint is named where its
    head is missing; a gpt-oss size error does not blame num_experts, which config.json sets as
    num_local_experts."""
    ckpt = _checkpoint(tmp_path / "ck", "llama", "modelopt", seed)
    _edit(ckpt / "config.json", lambda d: d.update(architectures=["LlamaForSequenceClassification"]))
    with pytest.raises(KeyError) as info:
        autofp4.from_pretrained(ckpt)
    assert "config.json's architectures[0], LlamaForSequenceClassification, not a causal LM" in str(info.value)
    _edit(ckpt / "config.json", lambda d: d.update(architectures=["LlamaModel"]))  # no head, no "model." prefix
    with pytest.raises(KeyError) as info:
        autofp4.from_pretrained(ckpt)
    assert "architectures[0], LlamaModel, not a causal LM: its tensors are named or shaped otherwise" in str(info.value)
    gpt = _checkpoint(tmp_path / "gpt", "gpt_oss", "gpt-oss", seed)
    t = safetensors_torch.load_file(str(gpt / "model.safetensors"))
    k = next(k for k in t if k.endswith("router.bias"))
    t[k] = torch.cat([t[k], t[k][:1]])
    safetensors_torch.save_file(t, str(gpt / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(gpt)
    assert "router.bias" in str(info.value) and "does not set" not in str(info.value), info.value


def test_a_skip_pattern_for_one_expert_and_a_binary_stream_are_named(tmp_path, seed):
    import io

    src = tmp_path / "src"
    _model("qwen3_moe", seed).save_pretrained(src)
    with pytest.warns(RuntimeWarning, match=r"names single experts, but the routed experts of "
                      r"'model.layers.0.mlp.experts' are one stacked layer"):
        autofp4.quantize_checkpoint(src, tmp_path / "out", "nvfp4", skip=["lm_head", "*.mlp.experts.0.*"],
                                    progress=False)
    with pytest.raises(TypeError, match="stream must be a text stream .* got the binary BytesIO"):
        autofp4.quantize_checkpoint(src, tmp_path / "out2", "nvfp4", stream=io.BytesIO())


# -- the twenty-third adversarial set --------------------------------------------------------------
def test_an_index_whose_shards_are_not_file_names_is_named(tmp_path, seed):
    sh = tmp_path / "sh"
    model = _model("llama", seed)
    autofp4.quantize_model(model, "nvfp4", skip=["lm_head"])
    autofp4.save_pretrained(model, sh, layout="modelopt", max_shard_size="20KB")
    _edit(sh / "model.safetensors.index.json",
          lambda d: d["weight_map"].update({k: [v] for k, v in list(d["weight_map"].items())[:1]}))
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: weight_map\['[^']+'\] is a list \(\['model-"):
        autofp4.from_pretrained(sh)


def test_a_skip_pattern_for_any_one_expert_is_named(tmp_path, seed):
    src = tmp_path / "src"
    _model("qwen3_moe", seed).save_pretrained(src)
    for i, pattern in enumerate(("*.experts.1", "*.mlp.experts.[0-1].down_proj")):
        with pytest.warns(RuntimeWarning, match="names single experts"):
            autofp4.quantize_checkpoint(src, tmp_path / f"out{i}", "nvfp4", skip=["lm_head", pattern], progress=False)


# -- the twenty-fourth adversarial set -------------------------------------------------------------
def test_quantize_model_warns_about_skip_patterns_that_match_nothing(tmp_path, seed):
    import warnings

    with pytest.warns(RuntimeWarning, match=r"quantize_model: skip pattern '\*.experts.2.gate_proj' names single "
                      r"experts, but the routed experts of 'model.layers.0.mlp.experts'"):
        report = autofp4.quantize_model(_model("qwen3_moe", seed), "nvfp4", skip=["*.experts.2.gate_proj"])
    assert "model.layers.0.mlp.experts.gate_up_proj" in report.converted
    with pytest.warns(RuntimeWarning, match=r"quantize_model: skip pattern '\*.experts.0' names single experts"):
        autofp4.quantize_model(_model("gpt_oss", seed), "mxfp4", skip=["*.experts.0"])
    with pytest.warns(RuntimeWarning, match=r"skip pattern 'model.layers.0.self_attn.q_prj' matches no layer"):
        autofp4.quantize_model(_model("llama", seed), "nvfp4", skip=["model.layers.0.self_attn.q_prj"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the patterns that match: no warning
        autofp4.quantize_model(_model("qwen3_moe", seed), "nvfp4", skip=["lm_head", "*.mlp.experts", "*.q_proj"])
    src = tmp_path / "src"
    _model("qwen3_moe", seed).save_pretrained(src)
    with pytest.warns(RuntimeWarning, match="names single experts"):  # the stacked tensor's own name, one expert
        autofp4.quantize_checkpoint(src, tmp_path / "out", "nvfp4", skip=["lm_head", "*.experts.1.gate_up_proj"],
                                    progress=False)


def test_quantize_refuses_a_config_whose_class_is_not_the_causal_lm_it_quantizes(tmp_path, seed):
    src = tmp_path / "src"
    _model("llama", seed).save_pretrained(src)
    _edit(src / "config.json", lambda c: c.update(architectures=["LlamaModel"]))
    with pytest.raises(ValueError, match=r"architectures\[0\] is LlamaModel, not the causal LM LlamaForCausalLM .* "
                                         r"set architectures to \['LlamaForCausalLM'\]"):
        autofp4.quantize_checkpoint(src, tmp_path / "out", "nvfp4", progress=False)
    assert not (tmp_path / "out").exists()


def test_stored_experts_the_config_does_not_build_are_named(tmp_path, seed):
    import re

    from safetensors import torch as safetensors_torch

    ckpt = _checkpoint(tmp_path / "q", "qwen3_moe", "modelopt", seed)
    for field, value in (("mlp_only_layers", [0]), ("decoder_sparse_step", 2)):
        (tmp_path / field).mkdir()
        for f in ckpt.iterdir():
            (tmp_path / field / f.name).write_bytes(f.read_bytes())
        _edit(tmp_path / field / "config.json", lambda c: c.update({field: value}))
        with pytest.raises(KeyError, match=rf"dense MLP at model.layers.0.mlp where the checkpoint stores routed "
                                           rf"experts .*{field} = {re.escape(repr(value))}"):
            autofp4.from_pretrained(tmp_path / field)
    t = safetensors_torch.load_file(str(ckpt / "model.safetensors"))
    t = {re.sub(r"experts\.(\d+)\.", lambda m: f"experts.{int(m.group(1)) + 1}.", k): v for k, v in t.items()}
    safetensors_torch.save_file(t, str(ckpt / "model.safetensors"), {"format": "pt"})
    with pytest.raises(KeyError, match=r"model.layers.0.mlp.experts stores experts 1, 2, 3, 4, where config.json's "
                                       r"expert count 4 means experts 0..3; expert\(s\) 0 missing; expert\(s\) 4 beyond"):
        autofp4.from_pretrained(ckpt)


def test_a_linear_weight_stored_3d_is_blamed_not_its_scale(tmp_path, seed):
    from safetensors import torch as safetensors_torch

    ckpt = _checkpoint(tmp_path / "ct", "llama", "compressed-tensors", seed)
    t = safetensors_torch.load_file(str(ckpt / "model.safetensors"))
    k = "model.layers.0.self_attn.o_proj.weight_packed"
    t[k] = t[k].unsqueeze(0).contiguous()
    safetensors_torch.save_file(t, str(ckpt / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.o_proj.weight_packed' must be \[N, K/2\] = "
                                         r"\(\d+, \d+\) for the Linear layer .* got shape \(1, \d+, \d+\)"):
        autofp4.from_pretrained(ckpt)


def test_fused_parts_of_no_rows_and_a_meta_tuning_worker_are_refused():
    w = autofp4.quantize(torch.randn(64, 64, dtype=torch.bfloat16), "nvfp4")
    with pytest.raises(ValueError, match=r"part 'k' has size -16; every part needs a positive number of rows"):
        autofp4.FP4FusedLinear(w, None, None, [("q", 80), ("k", -16)])
    with autofp4.autotune(mode="background"):
        with pytest.raises(ValueError, match=r"device 'meta' cannot run kernels; autofp4 tunes on cuda or cpu"):
            autofp4.autotune.start("meta")


# -- the twenty-fifth adversarial set --------------------------------------------------------------
def test_skip_patterns_that_keep_nothing_are_named(tmp_path, seed):
    import warnings

    with pytest.warns(RuntimeWarning, match=r"skip pattern '\*.mlp' matches 'model.layers.0.mlp', a module that "
                                            r"holds layers but is none: .* '\*.mlp.\*'"):
        report = autofp4.quantize_model(_model("llama", seed), "nvfp4", skip=["lm_head", "*.mlp"])
    assert any(n.endswith("mlp.down_proj") for n in report.converted)
    with pytest.warns(RuntimeWarning, match=r"skip pattern 'model.layers.0' matches 'model.layers.0', a module"):
        autofp4.quantize_model(_model("qwen3_moe", seed), "nvfp4", skip=["lm_head", "model.layers.0"])
    # the default patterns say nothing, but '*.lm_head' alone, which misses a top-level lm_head, does
    with pytest.warns(RuntimeWarning, match=r"skip pattern '\*.lm_head' matches no layer"):
        report = autofp4.quantize_model(_model("llama", seed), "nvfp4", skip=["*.lm_head"])
    assert "lm_head" in report.converted
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        autofp4.quantize_model(_model("llama", seed), "nvfp4")
        shared = nn.Module()
        shared.a = shared.b = nn.Linear(64, 64).bfloat16()
        autofp4.quantize_model(shared, "nvfp4", skip=["b"])  # a layer's second name is one of its names
    src = tmp_path / "src"
    _model("llama", seed).save_pretrained(src)
    with pytest.warns(RuntimeWarning, match=r"autofp4 quantize: skip pattern 'model.layers.1' matches 'model.layers.1'"):
        autofp4.quantize_checkpoint(src, tmp_path / "out", "nvfp4", skip=["lm_head", "model.layers.1"], progress=False)


def test_one_stacked_expert_tensor_skipped_says_why_the_other_is_kept(seed):
    report = autofp4.quantize_model(_model("qwen3_moe", seed), "nvfp4", skip=["lm_head", "*.experts.gate_up_proj"])
    why = dict(report.skipped)
    assert why["model.layers.0.mlp.experts.gate_up_proj"] == "matches a skip pattern"
    assert why["model.layers.0.mlp.experts.down_proj"].startswith("kept with gate_up_proj (the experts are quantized "
                                                                  "or kept whole)"), why


def test_expert_indices_that_are_no_index_are_named(tmp_path, seed):
    import re

    from safetensors import torch as safetensors_torch

    base = _checkpoint(tmp_path / "q", "qwen3_moe", "modelopt", seed)
    for label, rename in (("zero", lambda i: "00" if i == 0 else str(i)), ("sup", lambda i: "\u00b2" if i == 0 else str(i)),
                          ("letters", lambda i: "abcd"[i])):
        ck = tmp_path / label
        ck.mkdir()
        for f in base.iterdir():
            (ck / f.name).write_bytes(f.read_bytes())
        t = safetensors_torch.load_file(str(ck / "model.safetensors"))
        t = {re.sub(r"layers\.0\.mlp\.experts\.(\d+)\.", lambda m: f"layers.0.mlp.experts.{rename(int(m.group(1)))}.", k): v
             for k, v in t.items()}
        safetensors_torch.save_file(t, str(ck / "model.safetensors"), {"format": "pt"})
        odd = {"zero": "'00'", "sup": "'\u00b2'", "letters": "'a', 'b', 'c', 'd'"}[label]
        with pytest.raises(KeyError, match=rf"{odd} under it (is|are) no expert index"):
            autofp4.from_pretrained(ck)


def test_the_transformers_path_refuses_what_the_checkpoint_does_not_store(tmp_path, seed):
    import re

    import transformers
    from safetensors import torch as safetensors_torch

    base = _checkpoint(tmp_path / "q", "qwen3_moe", "modelopt", seed)
    dense = tmp_path / "dense"
    dense.mkdir()
    for f in base.iterdir():
        (dense / f.name).write_bytes(f.read_bytes())
    _edit(dense / "config.json", lambda c: c.update(mlp_only_layers=[0]))
    with pytest.raises(KeyError, match=r"stores no weight for 3 module\(s\) the model builds .*mlp_only_layers = \[0\]"):
        transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.bfloat16)
    t = safetensors_torch.load_file(str(base / "model.safetensors"))
    t = {re.sub(r"experts\.(\d+)\.", lambda m: f"experts.{int(m.group(1)) + 1}.", k): v for k, v in t.items()}
    safetensors_torch.save_file(t, str(base / "model.safetensors"), {"format": "pt"})
    with pytest.raises(KeyError, match=r"FP4 experts stored under .* are not where the model reads them .*expert\(s\) 0 "
                                       r"missing"):
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)


def test_an_expert_weight_stored_3d_is_blamed(tmp_path, seed):
    from safetensors import torch as safetensors_torch

    ck = _checkpoint(tmp_path / "q", "qwen3_moe", "modelopt", seed)
    t = safetensors_torch.load_file(str(ck / "model.safetensors"))
    k = next(k for k in t if k.endswith("experts.0.gate_proj.weight"))
    t[k] = t[k].unsqueeze(0).contiguous()
    safetensors_torch.save_file(t, str(ck / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ValueError, match=rf"'{k}' must be 2-D, \[N, K/2\] .* got shape \(1, \d+, \d+\)"):
        autofp4.from_pretrained(ck)


# -- the twenty-sixth adversarial set --------------------------------------------------------------
def test_the_transformers_path_refuses_a_dense_layer_without_its_weight(tmp_path, seed):
    import transformers
    from safetensors import torch as safetensors_torch

    ck = _checkpoint(tmp_path / "q", "llama", "modelopt", seed)
    t = safetensors_torch.load_file(str(ck / "model.safetensors"))
    del t["lm_head.weight"]
    safetensors_torch.save_file(t, str(ck / "model.safetensors"), {"format": "pt"})
    with pytest.raises(KeyError, match=r"stores no weight for 1 module\(s\) the model builds \(transformers would "
                                       r"initialize them at random\): \['lm_head'\]"):
        transformers.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.bfloat16)


def test_skip_patterns_for_modules_never_quantized_say_nothing_and_long_paths_are_named(tmp_path, seed):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a norm, gpt-oss's router: kept anyway
        autofp4.quantize_model(_model("llama", seed), "nvfp4", skip=["lm_head", "*.input_layernorm", "model.norm"])
        autofp4.quantize_model(_model("gpt_oss", seed), "mxfp4", skip=["lm_head", "*.mlp.router"])
    with pytest.raises(ValueError, match=r"autofp4.from_pretrained: path=.* is 300 bytes long, more than the 255"):
        autofp4.from_pretrained(tmp_path / ("L" * 300))
    model = _model("llama", seed)
    autofp4.quantize_model(model, "nvfp4")
    with pytest.raises(ValueError, match=r"autofp4.save_pretrained: path=.* give a name of at most 231 bytes"):
        autofp4.save_pretrained(model, tmp_path / ("o" * 240))
    assert not any(tmp_path.iterdir())


def test_flattened_gpt_oss_scales_are_blamed_not_the_blocks(tmp_path, seed):
    from safetensors import torch as safetensors_torch

    ck = _checkpoint(tmp_path / "g", "gpt_oss", "gpt-oss", seed)
    t = safetensors_torch.load_file(str(ck / "model.safetensors"))
    k = next(k for k in t if k.endswith("gate_up_proj_scales"))
    t[k] = t[k].reshape(t[k].shape[0], -1).contiguous()
    safetensors_torch.save_file(t, str(ck / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ValueError, match=rf"'{k}' must be \(\d+, \d+, \d+\) \(one E8M0 exponent per 32 values of"):
        autofp4.from_pretrained(ck)


def test_nothing_left_to_quantize_names_the_skip_patterns(tmp_path, seed):
    src = tmp_path / "src"
    _model("gpt_oss", seed).save_pretrained(src)
    with pytest.raises(ValueError, match=r"nothing in .* to quantize to mxfp4 in the gpt-oss layout \(no linear layer or "
                                         r"routed experts it can convert that the skip patterns \['\*.mlp.experts'\] "
                                         r"leave: \d+ kept\)"):
        autofp4.quantize_checkpoint(src, tmp_path / "out", "mxfp4", skip=["lm_head", "*.mlp.experts"], progress=False)


def test_the_transformers_path_refuses_a_norm_stored_as_integers(tmp_path, seed):
    """A floating-point parameter other than a Linear weight (a norm) stored as uint8: refused
    on the transformers path as by from_pretrained (transformers would cast the bytes)."""
    import transformers
    from safetensors import torch as safetensors_torch

    ck = _checkpoint(tmp_path / "q", "llama", "modelopt", seed)
    t = safetensors_torch.load_file(str(ck / "model.safetensors"))
    t["model.norm.weight"] = t["model.norm.weight"].view(torch.uint8)[::2].contiguous()
    safetensors_torch.save_file(t, str(ck / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.norm.weight' is stored as uint8"):
        autofp4.from_pretrained(ck)
    with pytest.raises(ValueError, match=r"'model.norm.weight' is stored as U8 \(quantized\?\), but the model's "
                                         r"parameter is floating point"):
        transformers.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.bfloat16)


# -- the thirty-second adversarial set -------------------------------------------------------------
def test_a_ct_kv_cache_scheme_is_warned_about_once(tmp_path, seed):
    """A compressed-tensors kv_cache_scheme (an FP8 KV cache) is said once, as ModelOpt's
    kv_cache_quant_algo is: autofp4 does not apply it (it loaded without a word); one that is no
    object is refused, naming it."""
    path = _checkpoint(tmp_path / "ck", "llama", "compressed-tensors", seed)
    bits = random.Random(seed).choice([8, 4])
    for value, n in ((None, 0), ({"num_bits": bits, "type": "float", "strategy": "tensor", "dynamic": False}, 1),
                     ({"strategy": "tensor"}, 1)):
        _edit(path / "config.json", lambda d: d["quantization_config"].update(kv_cache_scheme=value))
        kv = _load_warnings(path, "kv_cache")
        assert len(kv) == n, kv
        if n:
            assert kv[0].startswith("autofp4: config.json quantization_config: kv_cache_scheme asks for "), kv[0]
            assert "which autofp4 does not apply: the model's KV cache stays in the model's dtype" in kv[0], kv[0]
            what = f"a KV cache in {bits}-bit float" if "num_bits" in value else "a quantized KV cache ({\"strategy\""
            assert what in kv[0], kv[0]
    _edit(path / "config.json", lambda d: d["quantization_config"].update(kv_cache_scheme=[8]))
    with pytest.raises(ValueError, match=r"config.json quantization_config: kv_cache_scheme must be an object "
                                         r"\(num_bits, type, strategy, \.\.\.\) or null, got \[8\]"):
        autofp4.from_pretrained(path)


def test_ct_output_activations_are_warned_about_as_input_activations_are(tmp_path, seed):
    """A compressed-tensors group's output_activations (quantized layer outputs) is said once, as
    its input_activations is (it was dropped without a word); the layers' outputs are those of the
    checkpoint without it; one that is no object is refused, naming it."""
    import warnings

    path = _checkpoint(tmp_path / "ck", "llama", "compressed-tensors", seed)
    plain = autofp4.from_pretrained(path)
    ids = torch.randint(0, plain.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = plain(ids).logits
    group = lambda d: d["quantization_config"]["config_groups"]["group_0"]  # noqa: E731
    bits = random.Random(seed).choice([8, 4])
    _edit(path / "config.json", lambda d: group(d).update(output_activations={"num_bits": bits, "type": "float"},
                                                          input_activations=None))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = autofp4.from_pretrained(path)
    said = [str(w.message) for w in caught if "activations" in str(w.message)]
    assert said == [f"autofp4: config.json quantization_config config_groups['group_0'].output_activations asks for "
                    f"{bits}-bit float output activations, which loading does not apply: the layers' outputs stay in "
                    "the model's dtype (autofp4 has no output quantization)"], said
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    _edit(path / "config.json", lambda d: group(d).update(output_activations="fp8"))
    with pytest.raises(ValueError, match=r"config_groups\['group_0'\]\.output_activations must be an object or null, "
                                         r"got 'fp8'"):
        autofp4.from_pretrained(path)


# -- the thirty-fifth adversarial set ---------------------------------------------------------------
@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_a_packed_weight_of_another_shape_than_its_layer_is_named(tmp_path, seed, layout):
    """A stored FP4 weight that lost a row (its scales intact) is compared with its Linear layer's
    shape first: the error names the weight, its shape and the config's (it blamed the intact scales)."""
    from safetensors.torch import load_file, save_file

    path = _checkpoint(tmp_path / "ck", "llama", layout, seed)
    shard = next(path.glob("*.safetensors"))
    t = load_file(shard)
    key = next(k for k in t if k.endswith("q_proj.weight" if layout == "modelopt" else "q_proj.weight_packed"))
    rows, half = t[key].shape
    t[key] = t[key][:-1].clone()
    save_file(t, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError) as info:
        autofp4.from_pretrained(path)
    msg = str(info.value)
    assert f"is stored as an FP4 weight of shape ({rows - 1}, {2 * half}) ([N, K])" in msg, msg
    assert f"config wants [{rows}, {2 * half}] ({key!r} ({rows - 1}, {half}))" in msg and "weight_scale" not in msg, msg


def test_a_packed_weight_of_another_dtype_is_named_as_such_not_as_a_shape(tmp_path, seed):
    """A packed weight stored as int32 (a quarter of the rows' bytes in each element) is named for
    its dtype, not reported as a weight of an invented shape."""
    from safetensors.torch import load_file, save_file

    path = _checkpoint(tmp_path / "ck", "llama", "compressed-tensors", seed)
    shard = next(path.glob("*.safetensors"))
    t = load_file(shard)
    key = next(k for k in t if k.endswith("q_proj.weight_packed"))
    t[key] = t[key].view(torch.int32).clone()
    save_file(t, shard, metadata={"format": "pt"})
    with pytest.raises(TypeError, match=rf"{key}.* must be a uint8 tensor .*got torch.int32"):
        autofp4.from_pretrained(path)
