"""transformers' AutoModelForCausalLM.from_pretrained on FP4 checkpoints through autofp4's
registered quantizer: ModelOpt's config.json directly, compressed-tensors and gpt-oss MXFP4
through autofp4.transformers_config; the models match autofp4.from_pretrained's."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import autofp4  # noqa: E402
from autofp4 import FP4Linear  # noqa: E402
from autofp4.integrations.transformers import FP4Experts  # noqa: E402

from test_checkpoints_moe import CONFIGS, _random_state, write_checkpoint  # noqa: E402


def _logits(model, vocab):
    ids = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("arch,layout", [("qwen3_moe", "modelopt"), ("mixtral", "modelopt"),
                                         ("qwen3_moe", "compressed-tensors"), ("gpt_oss", "mxfp4")])
def test_auto_model_loads_through_the_autofp4_quantizer(tmp_path, arch, layout):
    cfg = CONFIGS[arch]()
    write_checkpoint(tmp_path / "c", cfg, _random_state(cfg, 7), layout)
    kw = {} if layout == "modelopt" else {"config": autofp4.transformers_config(tmp_path / "c")}
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "c", dtype=torch.bfloat16, **kw)
    assert type(model.hf_quantizer).__name__ == "AutoFP4Quantizer"
    assert isinstance(model.model.layers[0].mlp.experts, FP4Experts)
    assert not isinstance(model.model.layers[1].mlp.experts, FP4Experts)  # excluded by the checkpoint
    assert sum(isinstance(m, FP4Linear) for m in model.modules()) == (0 if layout == "mxfp4" else 8)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    ours = autofp4.from_pretrained(tmp_path / "c", dtype=torch.bfloat16)
    a, b = _logits(model, cfg.vocab_size), _logits(ours, cfg.vocab_size)
    assert torch.equal(a, b), (a - b).abs().max()


def test_registration_waits_for_transformers():
    code = ("import sys, autofp4; assert 'transformers' not in sys.modules;"
            "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as m;"
            "print(m['autofp4'].__name__, m['modelopt'].__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["AutoFP4Quantizer", "AutoFP4Quantizer"]
    env_code = "import os; os.environ['AUTOFP4_NO_TRANSFORMERS_HOOK'] = '1';" + code.replace("print(", "print('modelopt' in m, ")
    res = subprocess.run([sys.executable, "-c", env_code.split("print(")[0] + "print('autofp4' in m)"],
                         capture_output=True, text=True, check=True).stdout
    assert res.strip() == "False"


def test_auto_model_fuses_projections_stored_with_shared_scales(tmp_path):
    """A ModelOpt checkpoint whose q/k/v and gate/up share their scales loads through the
    quantizer with one stacked weight per group, computing what the unfused load computes."""
    from test_checkpoints import _config, _random_tensors, _write

    from autofp4.nn import FP4FusedLinear, FP4LinearPart

    cfg = _config()
    _write(tmp_path / "c", cfg, _random_tensors(cfg, 11), "modelopt", False, shared=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "c", dtype=torch.bfloat16)
    assert isinstance(model.model.layers[1].self_attn.qkv_proj, FP4FusedLinear)
    assert isinstance(model.model.layers[0].mlp.up_proj, FP4LinearPart)
    plain = autofp4.from_pretrained(tmp_path / "c", dtype=torch.bfloat16, fuse=False)
    a, b = _logits(model, cfg.vocab_size), _logits(plain, cfg.vocab_size)
    assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2), (a - b).abs().max()


def test_transformers_config_right_after_import_registers_without_a_warning(tmp_path):
    """``autofp4.transformers_config`` as the first call after ``import autofp4`` (transformers'
    quantizer tables are first loaded by autofp4's own quantizer module) warns nothing and leaves
    both names registered."""
    from pathlib import Path

    (tmp_path / "config.json").write_text('{"model_type": "llama", "quantization_config": '
                                          '{"quant_method": "modelopt", "quant_algo": "NVFP4"}}')
    code = ("import autofp4; c = autofp4.transformers_config(%r); "
            "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as M; "
            "print('autofp4' in M, 'modelopt' in M, c.quantization_config['quant_method'])" % str(tmp_path))
    r = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr
    assert "could not register" not in r.stderr
    assert r.stdout.split() == ["True", "True", "autofp4"]
