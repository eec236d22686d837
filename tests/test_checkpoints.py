"""autofp4.from_pretrained on tiny Llama checkpoints written here in the ModelOpt NVFP4 and
compressed-tensors nvfp4-pack-quantized layouts (sharded and not), checked against the same
model built with the dequantized weights."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import autofp4  # noqa: E402
from autofp4 import FP4Linear  # noqa: E402

EXCLUDED = "model.layers.1.mlp.down_proj"


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-5,
    )


def _random_tensors(cfg, seed):
    """Random dense weights of the tiny model (fp32) by state-dict name."""
    from transformers import LlamaForCausalLM

    g = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("norm.weight"):
            out[k] = 1 + 0.1 * torch.randn(v.shape, generator=g)
        else:
            out[k] = torch.randn(v.shape, generator=g) * (0.5 if "embed" in k else 0.08)
    return out


def _quantized_names(tensors):
    return [k[: -len(".weight")] for k in tensors
            if k.endswith("proj.weight") and not k.startswith(EXCLUDED + ".")]


_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _write(root: Path, cfg, tensors, layout: str, sharded: bool, dtype=torch.bfloat16, shared: bool = False):
    """Writes the checkpoint; returns (written FP4 tensors by module, dequantized reference weights).
    ``shared``: q/k/v and gate/up of a block quantized together (one global and input scale, as
    an exporter does for layers a serving engine fuses), each stored as its own rows."""
    root.mkdir(parents=True, exist_ok=True)
    stored, written, ref = {}, {}, {}
    qnames = set(_quantized_names(tensors))
    joint: dict[str, tuple] = {}
    for k, v in tensors.items():
        name = k[: -len(".weight")]
        if name not in qnames:
            stored[k] = v.to(dtype)
            ref[k] = stored[k].float()
            continue
        prefix, _, leaf = name.rpartition(".")
        group = next((g for g in _GROUPS if leaf in g), None) if shared else None
        if group is None:
            w = autofp4.quantize(v, "nvfp4")
            ins = torch.rand((), dtype=torch.float32) + 0.01
        else:
            if (prefix, group) not in joint:
                rows = [tensors[f"{prefix}.{g}.weight"] for g in group]
                joint[prefix, group] = (autofp4.quantize(torch.cat(rows), "nvfp4"), [r.shape[0] for r in rows],
                                        torch.rand((), dtype=torch.float32) + 0.01)
            whole, sizes, ins = joint[prefix, group]
            start = sum(sizes[: group.index(leaf)])
            w = whole.slice_rows(start, start + v.shape[0])
            w = type(w)("nvfp4", w.data.clone(), w.scale.clone(), w.global_scale.clone(), check_values=False)
            ins = ins.clone()
        if layout.startswith("modelopt"):
            parts = {"weight": w.data, "weight_scale": w.scale, "weight_scale_2": w.global_scale, "input_scale": ins}
        else:
            parts = {"weight_packed": w.data, "weight_scale": w.scale,
                     "weight_global_scale": torch.reciprocal(w.global_scale).reshape(1),
                     "input_global_scale": torch.reciprocal(ins).reshape(1)}
        for n, t in parts.items():
            stored[f"{name}.{n}"] = t.contiguous()
        written[name] = parts
        ref[k] = autofp4.dequantize(w, torch.float32)
    conf = cfg.to_dict()
    if layout == "modelopt-hf":
        (root / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", EXCLUDED]}}))
    elif layout == "modelopt":
        conf["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                       "exclude_modules": ["lm_head", "model.layers.1.mlp.down*"]}
    else:
        conf["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                          "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                      "group_size": 16}}},
            "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$"]}
    (root / "config.json").write_text(json.dumps(conf))
    if sharded:
        keys = sorted(stored)
        shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
        for f, ks in shards.items():
            safetensors_torch.save_file({k: stored[k] for k in ks}, str(root / f))
        index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        safetensors_torch.save_file(stored, str(root / "model.safetensors"))
    return written, ref


def _reference_logits(cfg, ref, ids):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(cfg).to(torch.float64).eval()
    model.load_state_dict({k: v.double() for k, v in ref.items()})
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("layout,sharded", [
    ("modelopt-hf", False), ("modelopt", True), ("compressed-tensors", False), ("compressed-tensors", True),
])
def test_loads_every_layout_against_the_dequantized_model(tmp_path, layout, sharded):
    cfg = _config()
    seed = torch.randint(0, 2**30, ()).item()
    tensors = _random_tensors(cfg, seed)
    kind = "modelopt" if layout.startswith("modelopt") else "compressed-tensors"
    path = tmp_path / "ckpt"
    written, ref = _write(path, cfg, tensors, layout, sharded)
    model = autofp4.from_pretrained(path, device_map=None, dtype=torch.bfloat16)
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training

    fp4 = {n: m for n, m in model.named_modules() if isinstance(m, FP4Linear)}
    assert set(fp4) == set(written) and len(fp4) == 2 * 7 - 1
    for name, parts in written.items():
        w = fp4[name].fp4_weight()
        if kind == "modelopt":
            data, scale, gs, ins = parts["weight"], parts["weight_scale"], parts["weight_scale_2"], parts["input_scale"]
        else:
            data, scale = parts["weight_packed"], parts["weight_scale"]
            gs = torch.reciprocal(parts["weight_global_scale"]).reshape(())
            ins = torch.reciprocal(parts["input_global_scale"]).reshape(())
        assert torch.equal(w.data, data)
        assert torch.equal(w.scale.view(torch.uint8), scale.view(torch.uint8))
        assert w.global_scale.dtype == torch.float32 and torch.equal(w.global_scale.reshape(()), gs.reshape(()))
        assert torch.equal(w.input_scale.reshape(()), ins.reshape(()))
        assert not any(p.is_meta for p in fp4[name].buffers())

    for name in (EXCLUDED, "lm_head"):
        mod = model.get_submodule(name)
        assert type(mod) is nn.Linear and mod.weight.dtype == torch.bfloat16
        assert torch.equal(mod.weight, tensors[name + ".weight"].to(torch.bfloat16))
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())

    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    with torch.no_grad():
        got = model(ids).logits.double()
    want = _reference_logits(cfg, ref, ids)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 2e-2, rel
    assert want.std() > 0.1  # the comparison is not between two near-zero outputs


def test_a_wrong_reciprocal_convention_would_be_caught(tmp_path):
    """Storing ModelOpt's weight_scale_2 where compressed-tensors expects its reciprocal changes the logits."""
    cfg = _config()
    tensors = _random_tensors(cfg, 1)
    written, ref = _write(tmp_path / "c", cfg, tensors, "compressed-tensors", False)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "c" / "model.safetensors"))
    for k in list(sd):
        if k.endswith("weight_global_scale"):
            sd[k] = torch.reciprocal(sd[k])
    save_file(sd, str(tmp_path / "c" / "model.safetensors"))
    model = autofp4.from_pretrained(tmp_path / "c")
    ids = torch.randint(0, cfg.vocab_size, (1, 5))
    with torch.no_grad():
        got = model(ids).logits.double()
    want = _reference_logits(cfg, ref, ids)
    assert ((got - want).norm() / want.norm()).item() > 0.1


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        autofp4.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        autofp4.from_pretrained(tmp_path / "empty")
    cfg = _config()
    _write(tmp_path / "s", cfg, _random_tensors(cfg, 2), "compressed-tensors", True)
    (tmp_path / "s" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        autofp4.from_pretrained(tmp_path / "s")
    _write(tmp_path / "u", cfg, _random_tensors(cfg, 3), "modelopt", False)
    (tmp_path / "u" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        autofp4.from_pretrained(tmp_path / "u")


def _edit_config(root: Path, fn):
    conf = json.loads((root / "config.json").read_text())
    fn(conf)
    (root / "config.json").write_text(json.dumps(conf))


def test_unknown_or_unsupported_quantization_is_refused(tmp_path):
    cfg = _config()
    _write(tmp_path / "c", cfg, _random_tensors(cfg, 4), "compressed-tensors", False)
    _edit_config(tmp_path / "c", lambda c: c["quantization_config"].update(quant_method="awq"))
    with pytest.raises(ValueError, match="unknown quant_method 'awq'"):
        autofp4.from_pretrained(tmp_path / "c")
    _edit_config(tmp_path / "c", lambda c: c["quantization_config"].update(
        quant_method="compressed-tensors", format="float-quantized",
        config_groups={"group_0": {"targets": ["Linear"], "format": "float-quantized"}}))
    with pytest.raises(ValueError, match="'float-quantized'"):
        autofp4.from_pretrained(tmp_path / "c")
    _edit_config(tmp_path / "c", lambda c: c.update(quantization_config={"quant_method": "modelopt", "quant_algo": "FP8"}))
    with pytest.raises(ValueError, match="quant_algo 'FP8'"):
        autofp4.from_pretrained(tmp_path / "c")
    _edit_config(tmp_path / "c", lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match="not a quantized checkpoint"):
        autofp4.from_pretrained(tmp_path / "c")


def test_a_shape_mismatch_names_the_module(tmp_path):
    cfg = _config()
    _write(tmp_path / "m", cfg, _random_tensors(cfg, 5), "modelopt", False)
    _edit_config(tmp_path / "m", lambda c: c.update(intermediate_size=96))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj.*\[96, 64\]"):
        autofp4.from_pretrained(tmp_path / "m")
    _write(tmp_path / "d", cfg, _random_tensors(cfg, 6), "compressed-tensors", False)
    _edit_config(tmp_path / "d", lambda c: c.update(vocab_size=100))
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight.*\(100, 64\)"):
        autofp4.from_pretrained(tmp_path / "d")


def test_an_excluded_module_stored_quantized_and_a_missing_tensor_are_errors(tmp_path):
    cfg = _config()
    _write(tmp_path / "m", cfg, _random_tensors(cfg, 7), "modelopt", False)
    _edit_config(tmp_path / "m", lambda c: c["quantization_config"].update(exclude_modules=["lm_head", "*.o_proj"]))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj.*excluded"):
        autofp4.from_pretrained(tmp_path / "m")
    _write(tmp_path / "c", cfg, _random_tensors(cfg, 8), "compressed-tensors", False)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "c" / "model.safetensors"))
    del sd["model.layers.1.self_attn.k_proj.weight_global_scale"], sd["model.norm.weight"]
    save_file(sd, str(tmp_path / "c" / "model.safetensors"))
    with pytest.raises(KeyError, match="k_proj.weight_global_scale"):
        autofp4.from_pretrained(tmp_path / "c")


def test_importing_autofp4_imports_neither_transformers_nor_safetensors():
    code = ("import sys, autofp4; assert callable(autofp4.__dict__.get('quantize'));"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'safetensors')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_tied_embeddings_and_a_dense_stored_linear(tmp_path):
    """tie_word_embeddings without a stored lm_head.weight shares the embedding; a linear that the
    scheme does not exclude but that is stored dense loads dense, with a warning naming it."""
    cfg = _config()
    cfg.tie_word_embeddings = True
    tensors = _random_tensors(cfg, 10)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    written, ref = _write(tmp_path / "t", cfg, tensors, "compressed-tensors", False)
    _edit_config(tmp_path / "t", lambda c: c["quantization_config"].update(ignore=["lm_head"]))
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "t" / "model.safetensors"))
    del sd["lm_head.weight"]
    save_file(sd, str(tmp_path / "t" / "model.safetensors"))
    with pytest.warns(UserWarning, match=r"model\.layers\.1\.mlp\.down_proj"):
        model = autofp4.from_pretrained(tmp_path / "t")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert type(model.model.layers[1].mlp.down_proj) is nn.Linear
    ids = torch.randint(0, cfg.vocab_size, (1, 6))
    with torch.no_grad():
        got = model(ids).logits.double()
    want = _reference_logits(cfg, ref, ids)
    assert ((got - want).norm() / want.norm()).item() < 2e-2


@pytest.mark.parametrize("layout", ["modelopt-hf", "compressed-tensors"])
def test_projections_stored_with_shared_scales_load_fused_and_exact(tmp_path, layout):
    """q/k/v and gate/up written with one global and input scale per group load as one stacked
    weight each (its parts' rows exactly the stored tensors), and compute what the unfused load
    computes; independently quantized layers stay separate."""
    from autofp4.nn import FP4FusedLinear, FP4LinearPart

    cfg = _config()
    tensors = _random_tensors(cfg, torch.randint(0, 2**30, ()).item())
    written, ref = _write(tmp_path / "s", cfg, tensors, layout, False, shared=True)
    fused = autofp4.from_pretrained(tmp_path / "s", dtype=torch.bfloat16)
    plain = autofp4.from_pretrained(tmp_path / "s", dtype=torch.bfloat16, fuse=False)
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[1].mlp
    assert isinstance(attn.qkv_proj, FP4FusedLinear) and isinstance(attn.v_proj, FP4LinearPart)
    assert isinstance(mlp.gate_up_proj, FP4FusedLinear) and isinstance(mlp.up_proj, FP4LinearPart)
    assert type(mlp.down_proj) is nn.Linear  # the excluded one
    for name in written:
        a, b = fused.get_submodule(name).fp4_weight(), plain.get_submodule(name).fp4_weight()
        assert torch.equal(a.data, b.data) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
        assert torch.equal(a.global_scale.reshape(()), b.global_scale.reshape(()))
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    with torch.no_grad():
        got, want = fused(ids).logits, plain(ids).logits
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert ((got.double() - _reference_logits(cfg, ref, ids)).norm() / want.double().norm()).item() < 2e-2

    _write(tmp_path / "i", cfg, tensors, layout, False)  # every layer its own scales: nothing to fuse exactly
    separate = autofp4.from_pretrained(tmp_path / "i", dtype=torch.bfloat16)
    assert not any(isinstance(m, (FP4FusedLinear, FP4LinearPart)) for m in separate.modules())


def test_modelopt_variants_a_config_that_disagrees_and_a_missing_scale(tmp_path):
    """A ``W4A16_NVFP4`` ModelOpt checkpoint loads (the same weights; Hopper runs every NVFP4
    checkpoint W4A16); config.json's quantization_config disagreeing with hf_quant_config.json is
    warned about (the latter is used); a weight stored packed without its ``weight_scale`` is
    named as such."""
    import warnings

    from safetensors import torch as safetensors_torch

    cfg = _config()
    tensors = _random_tensors(cfg, int(torch.randint(0, 2**30, ()).item()))
    path = tmp_path / "ckpt"
    written, _ = _write(path, cfg, tensors, "modelopt-hf", False)
    hf = path / "hf_quant_config.json"
    doc = json.loads(hf.read_text())
    doc["quantization"]["quant_algo"] = "W4A16_NVFP4"
    hf.write_text(json.dumps(doc))
    model = autofp4.from_pretrained(path, device_map=None, dtype=torch.bfloat16)
    assert {n for n, m in model.named_modules() if isinstance(m, FP4Linear)} == set(written)
    conf = json.loads((path / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}
    (path / "config.json").write_text(json.dumps(conf))
    with pytest.warns(UserWarning, match="hf_quant_config.json differ.*hf_quant_config.json is used"):
        autofp4.from_pretrained(path, device_map=None, dtype=torch.bfloat16)
    conf.pop("quantization_config")
    (path / "config.json").write_text(json.dumps(conf))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # agreeing (or absent) configs: nothing to say
        autofp4.from_pretrained(path, device_map=None, dtype=torch.bfloat16)
    victim = sorted(written)[0]
    stored = safetensors_torch.load_file(str(path / "model.safetensors"))
    del stored[f"{victim}.weight_scale"]
    safetensors_torch.save_file(stored, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{victim}\.weight'.*is stored packed.*{victim}\.weight_scale' is missing"):
        autofp4.from_pretrained(path, device_map=None, dtype=torch.bfloat16)


@pytest.mark.parametrize("case", ["parent shard", "absolute shard", "index is a list", "directory shard",
                                  "truncated shard", "shard name too long", "shape against bytes"])
def test_shards_are_files_of_the_checkpoint_only(tmp_path, case):
    """What ``model.safetensors.index.json`` lists must be a file name in the checkpoint (no
    ``..``, no absolute path: a shard outside it is never opened), every shard a regular file,
    and a file safetensors cannot read is named."""
    cfg = _config()
    tensors = _random_tensors(cfg, int(torch.randint(0, 2**30, ()).item()))
    path = tmp_path / "ckpt"
    _write(path, cfg, tensors, "modelopt", True)
    index = path / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    first = sorted(set(doc["weight_map"].values()))[0]
    if case == "parent shard":  # a real shard, moved next to the checkpoint
        (path / first).rename(tmp_path / first)
        doc["weight_map"] = {k: (f"../{v}" if v == first else v) for k, v in doc["weight_map"].items()}
        match = r"lists the shard '\.\./"
    elif case == "absolute shard":
        doc["weight_map"] = {k: (str(path / v) if v == first else v) for k, v in doc["weight_map"].items()}
        match = "lists the shard '/"
    elif case == "index is a list":
        doc = [doc]
        match = "has no 'weight_map'"
    elif case == "directory shard":
        (path / first).unlink()
        (path / first).mkdir()
        match = "is not a regular file"
    elif case == "shape against bytes":  # a header whose shape does not match its byte range
        raw = (path / first).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        name = sorted(k for k in header if k != "__metadata__")[0]
        header[name]["shape"] = [1] + header[name]["shape"]
        header[name]["shape"][-1] += 1
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        (path / first).write_bytes(len(h).to_bytes(8, "little") + h + raw[8 + n:])
        match = rf"tensor '{name}' has \d+ bytes for"
    elif case == "shard name too long":
        doc["weight_map"] = {k: ("x" * 300 if v == first else v) for k, v in doc["weight_map"].items()}
        match = r"lists the shard 'x{80}'\.\.\.: .*at most 255 bytes"
    else:
        data = (path / first).read_bytes()
        (path / first).write_bytes(data[: len(data) // 3])
        match = r"is truncated \(or its header is wrong\): tensor '.*' ends at byte"
    index.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match) as err:
        autofp4.from_pretrained(path, device_map=None, dtype=torch.bfloat16)
    assert str(path) in str(err.value) or first in str(err.value)


def test_a_pipe_named_like_a_shard_is_refused_not_read(tmp_path):
    """A FIFO named ``model.safetensors`` would block a reader forever: it is named and refused
    (run in a child with a deadline, so a regression fails rather than hangs)."""
    import subprocess
    import sys

    cfg = _config()
    path = tmp_path / "ckpt"
    _write(path, cfg, _random_tensors(cfg, 3), "modelopt", False)
    (path / "model.safetensors").unlink()
    os.mkfifo(path / "model.safetensors")
    code = ("import autofp4, torch\n"
            f"try:\n    autofp4.from_pretrained({str(path)!r}, device_map=None, dtype=torch.bfloat16)\n"
            "except ValueError as e:\n    print('refused:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert "refused:" in r.stdout and "is not a regular file" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("entry,match", [
    ("re:(.|.)*Z", None),  # exponential for a backtracking engine: matched in bounded time (or refused)
    ("re:(a|", "is not a valid regular expression"),
])
def test_hostile_ignore_patterns_neither_hang_nor_escape(tmp_path, entry, match):
    """A compressed-tensors ``ignore`` entry is matched against every layer name in bounded time;
    a malformed one is named (run in a child with a deadline, so a regression fails, not hangs)."""
    import subprocess
    import sys

    cfg = _config()
    path = tmp_path / "ckpt"
    _write(path, cfg, _random_tensors(cfg, 5), "compressed-tensors", False)
    conf = json.loads((path / "config.json").read_text())
    conf["quantization_config"]["ignore"].append(entry)
    (path / "config.json").write_text(json.dumps(conf))
    code = ("import autofp4, torch, time\nt = time.time()\n"
            f"try:\n    autofp4.from_pretrained({str(path)!r}, device_map=None, dtype=torch.bfloat16)\n"
            "    print('loaded', time.time() - t)\n"
            "except ValueError as e:\n    print('refused:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    out = r.stdout
    if match is None:
        assert out.startswith("loaded") or ("refused:" in out and "backtracks" in out), out + r.stderr
    else:
        assert "refused:" in out and match in out and repr(entry) in out, out + r.stderr


@pytest.mark.parametrize("change,match", [
    (("config.json", "num_attention_heads", 0), "'num_attention_heads' must be a positive integer"),
    (("config.json", "hidden_size", 2**40), "'hidden_size' must be a positive integer up to"),
    (("config.json", "quantization_config", [1]), "quantization_config must be an object"),
    (("hf_quant_config.json", None, None), "nested deeper than"),
    (("config.json", "rms_norm_eps", float("nan")), "config.json: rms_norm_eps is NaN"),
])
def test_broken_configs_are_named_before_anything_is_built(tmp_path, change, match):
    """Sizes out of bounds, a quantization_config of the wrong type, a JSON nested a million deep:
    each named as a ValueError, before transformers builds (or allocates) anything."""
    cfg = _config()
    path = tmp_path / "ckpt"
    _write(path, cfg, _random_tensors(cfg, 7), "modelopt-hf", False)
    name, key, value = change
    if key is None:
        (path / name).write_text("[" * 10**6 + "]" * 10**6)
    else:
        conf = json.loads((path / name).read_text())
        conf[key] = value
        (path / name).write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=match):
        autofp4.from_pretrained(path, device_map=None, dtype=torch.bfloat16)


def test_dense_tensors_of_the_wrong_kind_or_with_nan_are_named(tmp_path):
    """An integer tensor where the model has a floating-point parameter is refused; NaN in a
    dense tensor is warned about with its name and count."""
    from safetensors import torch as safetensors_torch

    cfg = _config()
    path = tmp_path / "ckpt"
    _write(path, cfg, _random_tensors(cfg, 11), "modelopt-hf", False)
    stored = safetensors_torch.load_file(str(path / "model.safetensors"))
    good = dict(stored)
    emb = stored["model.embed_tokens.weight"]
    stored["model.embed_tokens.weight"] = torch.randint(-5, 5, emb.shape, dtype=torch.int32)
    safetensors_torch.save_file(stored, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' is stored as torch.int32, but the model's"):
        autofp4.from_pretrained(path, device_map=None, dtype=torch.bfloat16)
    bad = emb.clone()
    bad[3, :5] = float("nan")
    good["model.embed_tokens.weight"] = bad
    safetensors_torch.save_file(good, str(path / "model.safetensors"))
    with pytest.warns(UserWarning, match="'model.embed_tokens.weight' holds 5 non-finite value"):
        autofp4.from_pretrained(path, device_map=None, dtype=torch.bfloat16)
    # a dense tensor stored in float8 (no isfinite there) is checked and upcast like any other
    fp8 = emb.to(torch.float8_e4m3fn)
    good["model.embed_tokens.weight"] = fp8
    safetensors_torch.save_file(good, str(path / "model.safetensors"))
    model = autofp4.from_pretrained(path, device_map=None, dtype=torch.bfloat16)
    assert torch.equal(model.get_input_embeddings().weight.data, fp8.to(torch.bfloat16))


def test_a_config_that_is_not_a_file_is_named_by_transformers_config(tmp_path):
    import os

    fifo, dev = tmp_path / "fifo", tmp_path / "dev"
    fifo.mkdir()
    dev.mkdir()
    os.mkfifo(fifo / "config.json")
    (dev / "config.json").symlink_to("/dev/zero")
    for d in (fifo, dev):
        with pytest.raises(ValueError, match=f"{d / 'config.json'} is not a regular file"):
            autofp4.transformers_config(d)


def test_a_safetensors_header_nested_too_deeply_is_named(tmp_path):
    from autofp4.integrations.safetensors_io import read_header

    h = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    f = tmp_path / "model.safetensors"
    f.write_bytes(len(h).to_bytes(8, "little") + h)
    with pytest.raises(ValueError, match=f"{f} is not a readable safetensors file: its header is nested too deeply"):
        read_header(f)
