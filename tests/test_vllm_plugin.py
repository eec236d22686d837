"""The vLLM plugin (autofp4.integrations.vllm) with vLLM's own classes, on the CPU.

vLLM's layers, its ModelOpt config parser, its model config and its model loader are the real
ones; on the CPU autofp4's ops run the reference backend. A ModelOpt NVFP4 checkpoint (dense
linears with q/k/v parts at different global scales, MoE experts whose gate and up scales
differ) and a bf16 checkpoint are written here as safetensors and loaded through vLLM's
``get_model``. Skipped when vLLM (its Python package) cannot be imported.
"""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import types
import weakref

import pytest
import torch

import autofp4
from autofp4.backends.reference import reference_linear, reference_moe
from autofp4.loaders import from_modelopt, fuse_modelopt

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM cannot infer a device otherwise

# vLLM (and the plugin, which imports it) is imported when these tests start, not when pytest
# collects them: importing vLLM patches parts of torch's compiler, which the tests of other
# files should not run under.
vl = types.SimpleNamespace()


def _import_vllm() -> None:
    if not torch.cuda.is_available():
        import vllm.platforms as platforms

        if not platforms.current_platform.device_type:
            # vLLM < 0.27 takes the CPU platform only from a CPU build, not from VLLM_TARGET_DEVICE
            from vllm.platforms.cpu import CpuPlatform

            platforms._current_platform = CpuPlatform()
    from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import cleanup_dist_env_and_memory, init_distributed_environment, initialize_model_parallel
    import vllm.model_executor.layers.fused_moe as fused_moe
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.quantization import get_quantization_config

    from autofp4.integrations.vllm import register
    from autofp4.integrations.vllm.config import AutoFP4Config

    vl.__dict__.update(
        LoadConfig=LoadConfig, ModelConfig=ModelConfig, VllmConfig=VllmConfig,
        set_current_vllm_config=set_current_vllm_config, cleanup_dist_env_and_memory=cleanup_dist_env_and_memory,
        init_distributed_environment=init_distributed_environment, initialize_model_parallel=initialize_model_parallel,
        # the runner's factory: FusedMoEFactory since vLLM 0.27, the function FusedMoE before
        FusedMoEFactory=getattr(fused_moe, "FusedMoEFactory", None) or fused_moe.FusedMoE, QKVParallelLinear=QKVParallelLinear, RowParallelLinear=RowParallelLinear,
        get_quantization_config=get_quantization_config, register=register, AutoFP4Config=AutoFP4Config)
    register()


H, I, E, TOP_K, NH, NKV, HD, V = 64, 32, 4, 2, 4, 2, 16, 256
BF16 = torch.bfloat16
MODELOPT_JSON = {"producer": {"name": "modelopt", "version": "0.29.0"},
                 "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                  "exclude_modules": ["lm_head", "*.mlp.gate"]}}
MODELOPT_IN_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                      "ignore": ["lm_head", "*.mlp.gate"]}


@pytest.fixture(scope="module", autouse=True)
def vllm_world():
    """vLLM imported, and its tensor-parallel group of one rank (gloo), as its own CPU tests set it up."""
    try:
        _import_vllm()
    except Exception as e:  # vLLM's Python package does not import here
        pytest.skip(f"vLLM does not import: {type(e).__name__}: {e}")
    with vl.set_current_vllm_config(vl.VllmConfig()):
        vl.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                       distributed_init_method=f"file://{tempfile.mktemp()}")
        vl.initialize_model_parallel(1, 1)
        yield
    vl.cleanup_dist_env_and_memory()


@pytest.fixture(autouse=True)
def fresh_vllm_config(vllm_world):
    """Each test builds its layers under a config of its own (vLLM refuses a layer name twice)."""
    with vl.set_current_vllm_config(vl.VllmConfig()):
        yield


def _config(path, arch: str = "Qwen3MoeForCausalLM") -> None:
    cfg = {"architectures": [arch], "model_type": "qwen3_moe" if "Moe" in arch else "llama", "hidden_size": H,
           "intermediate_size": 2 * H, "moe_intermediate_size": I, "num_experts": E, "num_experts_per_tok": TOP_K,
           "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_attention_heads": NH,
           "num_key_value_heads": NKV, "head_dim": HD, "num_hidden_layers": 1, "vocab_size": V,
           "max_position_embeddings": 128, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}
    (path / "config.json").write_text(json.dumps(cfg))


def _modelopt_dir(tmp_path, in_config: bool = False):
    """A one-layer Qwen3-MoE ModelOpt NVFP4 checkpoint; returns (dir, {name: FP4Weight})."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    sd, parts = {}, {}

    def fp4(name, shape, scale):
        w = autofp4.quantize(torch.randn(shape, dtype=BF16) * scale, "nvfp4")
        parts[name] = w
        sd.update({f"{name}.weight": w.data, f"{name}.weight_scale": w.scale,
                   f"{name}.weight_scale_2": w.global_scale.reshape(()), f"{name}.input_scale": torch.tensor(0.01 * scale)})

    p = "model.layers.0."
    for proj, n, scale in (("q", NH, 1.0), ("k", NKV, 4.0), ("v", NKV, 0.5)):  # three different weight_scale_2
        fp4(f"{p}self_attn.{proj}_proj", (n * HD, H), scale)
    fp4(f"{p}self_attn.o_proj", (H, NH * HD), 1.0)
    for e in range(E):  # gate and up scales differ for every expert
        for proj, shape, scale in (("gate", (I, H), 1.0 + e), ("up", (I, H), 2.0), ("down", (H, I), 1.0)):
            fp4(f"{p}mlp.experts.{e}.{proj}_proj", shape, scale)
    sd.update(_dense_rest())
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    _config(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    if in_config:
        cfg["quantization_config"] = MODELOPT_IN_CONFIG
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    else:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(MODELOPT_JSON))
    return tmp_path, parts


def _dense_rest() -> dict[str, torch.Tensor]:
    p = "model.layers.0."
    return {"model.embed_tokens.weight": torch.randn(V, H, dtype=BF16), "lm_head.weight": torch.randn(V, H, dtype=BF16),
            "model.norm.weight": torch.ones(H, dtype=BF16), f"{p}input_layernorm.weight": torch.ones(H, dtype=BF16),
            f"{p}post_attention_layernorm.weight": torch.ones(H, dtype=BF16),
            f"{p}self_attn.q_norm.weight": torch.ones(HD, dtype=BF16),
            f"{p}self_attn.k_norm.weight": torch.ones(HD, dtype=BF16), f"{p}mlp.gate.weight": torch.randn(E, H, dtype=BF16)}


def _bf16_dir(tmp_path):
    """The same model unquantized; returns (dir, state dict)."""
    from safetensors.torch import save_file

    torch.manual_seed(1)
    p = "model.layers.0."
    sd = _dense_rest()
    for proj, n in (("q", NH), ("k", NKV), ("v", NKV)):
        sd[f"{p}self_attn.{proj}_proj.weight"] = torch.randn(n * HD, H, dtype=BF16)
    sd[f"{p}self_attn.o_proj.weight"] = torch.randn(H, NH * HD, dtype=BF16)
    for e in range(E):
        for proj, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            sd[f"{p}mlp.experts.{e}.{proj}_proj.weight"] = torch.randn(shape, dtype=BF16)
    save_file(sd, str(tmp_path / "model.safetensors"))
    _config(tmp_path)
    return tmp_path, sd


def _model_config(path, quantization=None, **kw):
    return vl.ModelConfig(model=str(path), quantization=quantization, skip_tokenizer_init=True, dtype="bfloat16", **kw)


def _load(path, quantization, monkeypatch, load_format="auto", **kw):
    """vLLM's get_model on the checkpoint at ``path``."""
    from vllm.model_executor.model_loader import get_model

    # the loader empties the accelerator's cache; a CPU build of torch has no accelerator
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    # on a CPU with AMX, vLLM prepacks its unquantized layers with its compiled extension, which
    # the Python package installed for these tests does not have
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    vc = vl.VllmConfig(model_config=_model_config(path, quantization, **kw), load_config=vl.LoadConfig(load_format=load_format))
    with vl.set_current_vllm_config(vc):
        return vc, get_model(vllm_config=vc)


def _stack(parts, name, proj) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ws = [parts[f"model.layers.0.mlp.experts.{e}.{proj}_proj"] for e in range(E)]
    return (torch.stack([w.data for w in ws]), torch.stack([w.scale for w in ws]),
            torch.stack([w.global_scale for w in ws]))


# -- registration and claiming ----------------------------------------------------------------
def test_the_entry_point_registers_the_config():
    from importlib.metadata import PackageNotFoundError, distribution, entry_points

    try:
        distribution("autofp4")
    except PackageNotFoundError:
        pytest.skip("autofp4 is not installed (pip install -e .), so it has no entry points")
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "autofp4"]
    assert [ep.value for ep in eps] == ["autofp4.integrations.vllm:register"]
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # vLLM's own plugin loading, as each of its processes runs it
    vl.register()  # idempotent
    assert vl.get_quantization_config("autofp4") is vl.AutoFP4Config


@pytest.mark.parametrize("in_config", [False, True], ids=["hf_quant_config.json", "config.json"])
def test_a_modelopt_nvfp4_checkpoint_is_claimed_only_when_asked(tmp_path, monkeypatch, in_config):
    path, _ = _modelopt_dir(tmp_path, in_config)
    monkeypatch.delenv("AUTOFP4_VLLM_CLAIM", raising=False)
    assert _model_config(path, "autofp4").quantization == "autofp4"
    assert _model_config(path).quantization == "modelopt_fp4"  # not claimed without the opt-in
    monkeypatch.setenv("AUTOFP4_VLLM_CLAIM", "1")
    assert _model_config(path).quantization == "autofp4"
    assert _model_config(path, "modelopt_fp4").quantization == "modelopt_fp4"  # an explicit choice stands


def test_other_checkpoints_are_not_claimed(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFP4_VLLM_CLAIM", "1")
    fp8 = {"quant_method": "modelopt", "quant_algo": "FP8"}
    assert vl.AutoFP4Config.override_quantization_method(fp8, "autofp4") is None
    assert vl.AutoFP4Config.override_quantization_method({"quant_method": "compressed-tensors"}, None) is None
    path, _ = _bf16_dir(tmp_path)
    assert _model_config(path).quantization is None


# -- pre-quantized ModelOpt NVFP4 ---------------------------------------------------------------
def test_a_modelopt_checkpoint_loads_into_autofp4_methods(tmp_path, monkeypatch):
    path, parts = _modelopt_dir(tmp_path)
    vc, model = _load(path, "autofp4", monkeypatch)
    assert isinstance(vc.quant_config, vl.AutoFP4Config) and vc.quant_config.checkpoint is not None
    layer = model.model.layers[0]
    methods = {n: type(m.quant_method).__name__ for n, m in model.named_modules() if hasattr(m, "quant_method")}
    assert methods == {
        "model.embed_tokens": "UnquantizedEmbeddingMethod",
        "model.layers.0.self_attn.qkv_proj": "AutoFP4ModelOptLinearMethod",
        "model.layers.0.self_attn.o_proj": "AutoFP4ModelOptLinearMethod",
        "model.layers.0.self_attn.attn": "ModelOptKVCacheMethod",  # vLLM's own
        "model.layers.0.mlp.gate": "UnquantizedLinearMethod",  # excluded by the checkpoint
        "model.layers.0.mlp.experts.routed_experts": "AutoFP4ModelOptMoEMethod",
        "lm_head": "UnquantizedLinearMethod",
    }
    x = torch.randn(5, H, dtype=BF16)

    # qkv: three parts at different global scales, folded to the largest
    qkv = layer.self_attn.qkv_proj
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    folded = fuse_modelopt([(parts[n].data, parts[n].scale, parts[n].global_scale) for n in names])
    assert len({parts[n].global_scale.item() for n in names}) == 3
    assert torch.equal(qkv.quant_method.apply(qkv, x), autofp4.linear(x, folded))
    assert [n for n, _ in qkv.named_parameters()] == []  # the loaded parameters are gone
    assert qkv.weight.numel() == 0
    assert qkv.autofp4_input_scale.item() == pytest.approx(0.04)  # W4A4's input scale kept (max of the parts)

    # o_proj: one part, the stored tensors used as they are
    o = layer.self_attn.o_proj
    w = parts["model.layers.0.self_attn.o_proj"]
    assert torch.equal(o.quant_method.apply(o, x), autofp4.linear(x, from_modelopt(w.data, w.scale, w.global_scale)))

    # experts: gate and up at different global scales per expert
    ex = layer.mlp.experts.routed_experts
    w13 = fuse_modelopt([_stack(parts, "w13", "gate"), _stack(parts, "w13", "up")])
    w2 = from_modelopt(*_stack(parts, "w2", "down"))
    tw, ti = autofp4.route(torch.randn(5, E), TOP_K)
    assert torch.equal(ex.quant_method.apply(ex, x, tw, ti, None, None), reference_moe(x, w13, w2, tw, ti, "silu"))
    assert [n for n, _ in ex.named_parameters()] == []
    assert ex.autofp4_w13_packed.shape == (E, 2 * I, H // 2) and ex.w13_weight.numel() == 0


def _qkv(quant_config, bias=True):
    return vl.QKVParallelLinear(H, HD, NH, NKV, bias=bias, params_dtype=BF16, quant_config=quant_config,
                             prefix="model.layers.0.self_attn.qkv_proj")


@pytest.mark.parametrize("same_scale", [False, True], ids=["scales-differ", "scales-equal"])
def test_modelopt_qkv_layer_folds_the_scales_adds_the_bias_and_frees_the_originals(same_scale):
    qc = vl.AutoFP4Config.from_config(MODELOPT_IN_CONFIG)
    layer = _qkv(qc)
    torch.manual_seed(2)
    parts = []
    for shard, n, scale in (("q", NH, 1.0), ("k", NKV, 3.0), ("v", NKV, 0.25)):
        w = autofp4.quantize(torch.randn(n * HD, H, dtype=BF16) * (1.0 if same_scale else scale), "nvfp4")
        parts.append(w)
        for param, t in ((layer.weight, w.data), (layer.weight_scale, w.scale), (layer.weight_scale_2, w.global_scale),
                         (layer.input_scale, torch.tensor(0.1))):
            layer.weight_loader_v2(param, t, shard)
    if same_scale:  # quantize gives each part its own amax: give them one global scale
        for i in range(3):
            layer.weight_scale_2.data[i] = parts[0].global_scale
        parts = [autofp4.FP4Weight("nvfp4", p.data, p.scale, parts[0].global_scale) for p in parts]
    bias = torch.randn(layer.bias.shape, dtype=BF16)
    layer.bias.data.copy_(bias)
    originals = [weakref.ref(layer.weight), weakref.ref(layer.weight_scale)]
    packed_ptr = layer.weight.data_ptr()
    layer.quant_method.process_weights_after_loading(layer)
    gc.collect()
    assert all(r() is None for r in originals)  # freed
    assert [n for n, _ in layer.named_parameters()] == ["bias"]
    assert (layer.autofp4_packed.data_ptr() == packed_ptr) == same_scale  # equal scales: no copy
    x = torch.randn(3, 2, H, dtype=BF16)
    want = autofp4.linear(x, fuse_modelopt([(p.data, p.scale, p.global_scale) for p in parts]), bias)
    out, _ = layer(x)
    assert torch.equal(out, want)


def test_modelopt_w4a16_checkpoint_has_no_input_scale_and_unloaded_scales_are_caught():
    qc = vl.AutoFP4Config.from_config(dict(MODELOPT_IN_CONFIG, quant_algo="W4A16_NVFP4"))
    layer = vl.RowParallelLinear(H, H, bias=False, params_dtype=BF16, quant_config=qc, prefix="model.layers.0.mlp.down_proj")
    assert not hasattr(layer, "input_scale")
    w = autofp4.quantize(torch.randn(H, H, dtype=BF16), "nvfp4")
    layer.weight_loader_v2(layer.weight, w.data)
    layer.weight_loader_v2(layer.weight_scale_2, w.global_scale)
    with pytest.raises(RuntimeError, match="weight_scale was never loaded"):
        layer.quant_method.process_weights_after_loading(layer)
    layer.weight_loader_v2(layer.weight_scale, w.scale)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(4, H, dtype=BF16)
    assert torch.equal(layer(x)[0], autofp4.linear(x, w))


def _experts(quant_config, activation="silu"):
    runner = vl.FusedMoEFactory(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I, params_dtype=BF16,
                             quant_config=quant_config, prefix="model.layers.0.mlp.experts", activation=activation)
    return runner.routed_experts


def _load_experts(ex) -> dict:
    """Random ModelOpt NVFP4 experts (gate and up at different scales) through vLLM's expert
    loader; returns {(expert, proj): FP4Weight}."""
    ws = {}
    prefix = "model.layers.0.mlp.experts.routed_experts."
    for e in range(E):
        for proj, shard, stem, shape, scale in (("gate", "w1", "w13_", (I, H), 1.0), ("up", "w3", "w13_", (I, H), 5.0),
                                                ("down", "w2", "w2_", (H, I), 1.0)):
            w = ws[(e, proj)] = autofp4.quantize(torch.randn(shape, dtype=BF16) * scale * (e + 1), "nvfp4")
            for suffix, t in (("weight", w.data), ("weight_scale", w.scale), ("weight_scale_2", w.global_scale),
                              ("input_scale", torch.tensor(0.1 + e + (shard == "w3")))):
                ex.weight_loader(getattr(ex, stem + suffix), t, prefix + stem + suffix, shard, e)
    return ws


def test_modelopt_experts_layer_matches_the_reference_moe():
    ex = _experts(vl.AutoFP4Config.from_config(MODELOPT_IN_CONFIG))
    torch.manual_seed(3)
    ws = _load_experts(ex)
    originals = [weakref.ref(ex.w13_weight), weakref.ref(ex.w13_weight_scale)]
    ex.quant_method.process_weights_after_loading(ex)
    gc.collect()
    assert all(r() is None for r in originals) and [n for n, _ in ex.named_parameters()] == []
    assert torch.equal(ex.autofp4_w13_input_scale, torch.tensor([1.1, 2.1, 3.1, 4.1]))  # max of gate's and up's

    def stack(proj):
        return (torch.stack([ws[(e, proj)].data for e in range(E)]), torch.stack([ws[(e, proj)].scale for e in range(E)]),
                torch.stack([ws[(e, proj)].global_scale for e in range(E)]))

    w13, w2 = fuse_modelopt([stack("gate"), stack("up")]), from_modelopt(*stack("down"))
    x = torch.randn(6, H, dtype=BF16)
    tw, ti = autofp4.route(torch.randn(6, E), TOP_K)
    assert torch.equal(ex.quant_method.apply(ex, x, tw, ti, None, None), reference_moe(x, w13, w2, tw, ti, "silu"))
    # under torch.compile the method calls the custom op on the layer's buffers
    compiled = torch.compile(lambda x: ex.quant_method.apply(ex, x, tw, ti, None, None), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), reference_moe(x, w13, w2, tw, ti, "silu"))
    # the load-time warm-up's call: random tokens to top_k distinct experts
    y = ex.quant_method._run_random(ex, 5, BF16)
    assert y.shape == (5, H) and bool(y.isfinite().all()) and float(y.abs().amax()) > 0


def _graph_config(sizes):
    """A VllmConfig that captures piecewise CUDA graphs for ``sizes`` tokens (set after
    construction: without a model, vLLM's config turns graphs off)."""
    from vllm.config import CUDAGraphMode

    vc = vl.VllmConfig()
    vc.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    vc.compilation_config.cudagraph_capture_sizes = list(sizes)
    return vc


def test_the_graph_sizes_are_read_from_the_config_being_loaded():
    from autofp4.integrations.vllm._layer import graph_sizes

    with vl.set_current_vllm_config(vl.VllmConfig()):
        assert graph_sizes() == ([], BF16)  # a config that captures no graphs
    with vl.set_current_vllm_config(_graph_config([16, 1, 4, 4])):
        assert graph_sizes() == ([1, 4, 16], BF16)


def test_the_compiled_graph_cache_is_keyed_on_the_online_format(tmp_path, monkeypatch):
    """vLLM's torch.compile cache key leaves out a quantization config's settings: without the
    format in it, serving a checkpoint in NVFP4 after MXFP4 reused the MXFP4 graph and failed."""
    path, _ = _bf16_dir(tmp_path)
    hashes = {}
    for fmt in ("mxfp4", "nvfp4", "mxfp4"):
        monkeypatch.setenv("AUTOFP4_VLLM_FORMAT", fmt)
        vc, _ = _load(path, "autofp4", monkeypatch)
        hashes.setdefault(fmt, set()).add(vc.compute_hash())
    assert len(hashes["mxfp4"]) == 1 and hashes["mxfp4"] != hashes["nvfp4"]


def test_bad_quantization_configs_are_named():
    """The plugin's config reads what vLLM hands it: anything it cannot use is named, never
    dropped or read as something else (a generator read once, a dict not taken for its keys)."""
    assert vl.AutoFP4Config(ignore=(p for p in ["*.o_proj"])).ignore == ["*.o_proj"]
    ct = {"quant_method": "autofp4"}
    with pytest.raises(TypeError, match="a quantization config must be a dict, got NoneType"):
        vl.AutoFP4Config.from_config(None)
    with pytest.raises(TypeError, match=r"ignore must be a list of glob patterns \(str\), got \{"):
        vl.AutoFP4Config.from_config({**ct, "ignore": {"*.o_proj": True}})
    with pytest.raises(TypeError, match="ignore must be a list of glob patterns .str., got None"):
        vl.AutoFP4Config.from_config({**ct, "ignore": None})
    with pytest.raises(ValueError, match=r"ignore\[1\] is an empty pattern"):
        vl.AutoFP4Config.from_config({**ct, "ignore": ["*.o_proj", " "]})
    with pytest.raises(TypeError, match="checkpoint must be vLLM's ModelOptNvFp4Config, got object"):
        vl.AutoFP4Config(checkpoint=object())
    bad = {**MODELOPT_JSON, "quantization": {**MODELOPT_JSON["quantization"], "exclude_modules": ["lm_head", 7]}}
    with pytest.raises(TypeError, match=r"the checkpoint's exclude_modules\[1\] must be a glob pattern .str., got 7"):
        vl.AutoFP4Config.from_config({**bad, "quant_method": "modelopt"})
    ok = vl.AutoFP4Config.from_config({**MODELOPT_JSON, "quant_method": "modelopt"})
    assert ok.checkpoint.exclude_modules == ["lm_head", "*.mlp.gate"]


def test_keep_loaded_is_read_when_the_config_is_made(monkeypatch):
    monkeypatch.setenv("AUTOFP4_VLLM_KEEP_LOADED", "1")
    assert vl.AutoFP4Config.from_config(MODELOPT_IN_CONFIG).keep_loaded is True
    monkeypatch.setenv("AUTOFP4_VLLM_KEEP_LOADED", "keep")
    with pytest.raises(ValueError, match="AUTOFP4_VLLM_KEEP_LOADED must be 1 or 0, got 'keep'"):
        vl.AutoFP4Config.from_config(MODELOPT_IN_CONFIG)
    monkeypatch.delenv("AUTOFP4_VLLM_KEEP_LOADED")
    assert vl.AutoFP4Config().keep_loaded is False


@pytest.mark.gpu
@pytest.mark.parametrize("keep", [False, True], ids=["freed", "kept"])
def test_on_a_gpu_the_layers_run_at_load_for_each_graph_size_then_free_the_loaded_bytes(monkeypatch, keep):
    """vLLM captures some sizes with no eager call before; a weight packed during capture fails
    (host-to-device copies are refused there), so the methods run each size at load. Then, with
    both kernels' layouts built, the loaded bytes are freed (unless AUTOFP4_VLLM_KEEP_LOADED=1):
    graph replays, eager calls past the captured sizes (the GEMM kernels) and torch.compile still
    match the reference of the checkpoint's weights."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("AUTOFP4_VLLM_KEEP_LOADED", "1" if keep else "0")
    qc = vl.AutoFP4Config.from_config(MODELOPT_IN_CONFIG)
    torch.manual_seed(5)
    parts = []
    with vl.set_current_vllm_config(_graph_config([1, 4, 16])), torch.device("cuda"):
        lin = _qkv(qc)
        for shard, n in (("q", NH), ("k", NKV), ("v", NKV)):
            w = autofp4.quantize(torch.randn(n * HD, H, dtype=BF16), "nvfp4")
            parts.append(w)
            for param, t in ((lin.weight, w.data), (lin.weight_scale, w.scale), (lin.weight_scale_2, w.global_scale),
                             (lin.input_scale, torch.tensor(0.1))):
                lin.weight_loader_v2(param, t.cuda(), shard)
        lin.bias.data.normal_()
        lin.quant_method.process_weights_after_loading(lin)
        ex = _experts(qc)
        ws = _load_experts(ex)
        ex.quant_method.process_weights_after_loading(ex)
    w_lin = fuse_modelopt([(p.data, p.scale, p.global_scale) for p in parts])  # what the layer holds, kept apart

    def stack(proj):
        return tuple(torch.stack([getattr(ws[(e, proj)], f) for e in range(E)]) for f in ("data", "scale", "global_scale"))

    w13, w2 = fuse_modelopt([stack("gate"), stack("up")]), from_modelopt(*stack("down"))
    for t in (lin.autofp4_packed, lin.autofp4_scale, ex.autofp4_w13_packed, ex.autofp4_w2_scale):
        assert (t.untyped_storage().nbytes() <= t.element_size()) != keep  # a one-element placeholder
    assert tuple(lin.autofp4_packed.shape) == tuple(w_lin.data.shape)
    if not keep:
        with pytest.raises(autofp4.weights.LoadedTensorsFreed, match="AUTOFP4_VLLM_KEEP_LOADED=1"):
            lin._autofp4_weights[""].dequantize()

    def lin_ref(x):
        return reference_linear(x, w_lin.to("cuda"), lin.bias)

    def moe_ref(x, tw, ti):
        return reference_moe(x, w13.to("cuda"), w2.to("cuda"), tw, ti, "silu")

    def close(got, want):  # the kernels' bf16 rounding against the reference's
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert float(err) < 1e-2, float(err)

    for m in (1, 4, 16):
        x = torch.randn(m, H, dtype=BF16, device="cuda")
        tw, ti = autofp4.route(torch.randn(m, E, device="cuda"), TOP_K)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = lin.quant_method.apply(lin, x, lin.bias)
            z = ex.quant_method.apply(ex, x, tw, ti)
        x.copy_(torch.randn_like(x))
        tw2, ti2 = autofp4.route(torch.randn(m, E, device="cuda"), TOP_K)
        tw.copy_(tw2)
        ti.copy_(ti2)
        g.replay()
        close(y, lin_ref(x))
        close(z, moe_ref(x, tw, ti))
    for m in (64, 300):  # past the captured sizes: eager, on the GEMM kernels' layouts
        x = torch.randn(m, H, dtype=BF16, device="cuda")
        tw, ti = autofp4.route(torch.randn(m, E, device="cuda"), TOP_K)
        close(lin.quant_method.apply(lin, x, lin.bias), lin_ref(x))
        close(ex.quant_method.apply(ex, x, tw, ti), moe_ref(x, tw, ti))
        compiled = torch.compile(lambda x: (lin.quant_method.apply(lin, x, lin.bias), ex.quant_method.apply(ex, x, tw, ti)),
                                 backend="eager", fullgraph=True)
        y, z = compiled(x)
        close(y, lin_ref(x))
        close(z, moe_ref(x, tw, ti))


# -- online quantization ----------------------------------------------------------------------------
def test_a_dummy_load_of_a_modelopt_checkpoint_gives_valid_fp4_weights(tmp_path, monkeypatch):
    path, _ = _modelopt_dir(tmp_path)
    _, model = _load(path, "autofp4", monkeypatch, load_format="dummy")  # random bytes, fixed scales
    layer = model.model.layers[0]
    x = torch.randn(2, H, dtype=BF16)
    assert torch.isfinite(layer.self_attn.qkv_proj.quant_method.apply(layer.self_attn.qkv_proj, x)).all()
    assert torch.equal(layer.mlp.experts.routed_experts.autofp4_w13_global_scale, torch.full((E,), 1e-3))


@pytest.mark.parametrize("how", ["mxfp4", "nvfp4", "hf-overrides"])
def test_online_quantization_of_a_bf16_checkpoint(tmp_path, monkeypatch, how):
    path, sd = _bf16_dir(tmp_path)
    monkeypatch.delenv("AUTOFP4_VLLM_FORMAT", raising=False)  # the default is MXFP4
    kw, fmt = {}, "nvfp4" if how != "mxfp4" else "mxfp4"
    if how == "nvfp4":
        monkeypatch.setenv("AUTOFP4_VLLM_FORMAT", "nvfp4")
    elif how == "hf-overrides":  # --hf-overrides '{"quantization_config": {...}}'
        kw["hf_overrides"] = {"quantization_config": {"quant_method": "autofp4", "format": "nvfp4",
                                                      "ignore": ["*.o_proj"]}}
    vc, model = _load(path, "autofp4", monkeypatch, **kw)
    assert vc.quant_config.checkpoint is None and vc.quant_config.fmt == fmt
    assert vc.additional_config["autofp4"]["fmt"] == fmt  # in the hash vLLM keys its compiled graphs on
    layer = model.model.layers[0]
    o_method = type(layer.self_attn.o_proj.quant_method).__name__
    assert o_method == ("UnquantizedLinearMethod" if how == "hf-overrides" else "AutoFP4OnlineLinearMethod")
    assert type(layer.mlp.gate.quant_method).__name__ == "UnquantizedLinearMethod"  # the router stays bf16
    assert type(model.lm_head.quant_method).__name__ == "UnquantizedEmbeddingMethod"
    p = "model.layers.0."

    qkv = layer.self_attn.qkv_proj
    want = autofp4.quantize(torch.cat([sd[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]), fmt)
    assert torch.equal(qkv.autofp4_packed, want.data)
    assert torch.equal(qkv.autofp4_scale.view(torch.uint8), want.scale.view(torch.uint8))
    assert [n for n, _ in qkv.named_parameters()] == []
    x = torch.randn(5, H, dtype=BF16)
    assert torch.equal(qkv.quant_method.apply(qkv, x), autofp4.linear(x, want))
    compiled = torch.compile(lambda x: qkv.quant_method.apply(qkv, x), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), autofp4.linear(x, want))

    ex = layer.mlp.experts.routed_experts

    def stacked(*projs):
        return torch.stack([torch.cat([sd[f"{p}mlp.experts.{e}.{q}_proj.weight"] for q in projs]) for e in range(E)])

    w13, w2 = autofp4.quantize(stacked("gate", "up"), fmt), autofp4.quantize(stacked("down"), fmt)
    assert torch.equal(ex.autofp4_w13_packed, w13.data) and torch.equal(ex.autofp4_w2_packed, w2.data)
    assert [n for n, _ in ex.named_parameters()] == []
    tw, ti = autofp4.route(torch.randn(5, E), TOP_K)
    assert torch.equal(ex.quant_method.apply(ex, x, tw, ti, None, None), reference_moe(x, w13, w2, tw, ti, "silu"))


@pytest.mark.parametrize("how", ["env", "hf-overrides", "modelopt", "tied"])
def test_lm_head_is_quantized_only_when_asked(tmp_path, monkeypatch, how):
    """AUTOFP4_VLLM_LM_HEAD=1 (or "lm_head": true) quantizes the lm_head stored in the model's dtype
    at load: online in the online format, NVFP4 beside a ModelOpt checkpoint; a tied head from the
    embedding's weight, which the embedding keeps. vLLM's logits processor then runs it."""
    from safetensors.torch import load_file

    monkeypatch.delenv("AUTOFP4_VLLM_FORMAT", raising=False)
    monkeypatch.setenv("AUTOFP4_VLLM_LM_HEAD", "0" if how == "hf-overrides" else "1")
    kw, fmt = {}, "mxfp4"
    if how == "modelopt":
        path, _ = _modelopt_dir(tmp_path)
        fmt = "nvfp4"
    else:
        path, _ = _bf16_dir(tmp_path)
    if how == "hf-overrides":
        kw["hf_overrides"] = {"quantization_config": {"quant_method": "autofp4", "format": "nvfp4", "lm_head": True}}
        fmt = "nvfp4"
    sd = load_file(str(path / "model.safetensors"))
    if how == "tied":  # a tied checkpoint stores no lm_head
        from safetensors.torch import save_file

        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
        del sd["lm_head.weight"]
        save_file(sd, str(path / "model.safetensors"))
    vc, model = _load(path, "autofp4", monkeypatch, **kw)
    assert vc.additional_config["autofp4"]["lm_head"] is True  # in the hash of the compiled graphs
    head = model.lm_head
    assert type(head.quant_method).__name__ == "AutoFP4LMHeadMethod"
    want = autofp4.quantize(sd["model.embed_tokens.weight" if how == "tied" else "lm_head.weight"], fmt)
    assert torch.equal(head.autofp4_packed, want.data)
    assert torch.equal(head.autofp4_scale.view(torch.uint8), want.scale.view(torch.uint8))
    assert [n for n, _ in head.named_parameters()] == [] and head.weight.numel() == 0
    embed = model.model.embed_tokens.weight
    assert embed.dtype == BF16 and torch.equal(embed, sd["model.embed_tokens.weight"])  # the embedding untouched
    x = torch.randn(3, H, dtype=BF16)
    logits = model.logits_processor(head, x)
    assert torch.equal(logits, autofp4.linear(x, want))
    ref = (x.double() @ want.dequantize().double().T).float()
    assert (logits.float() - ref).norm() / ref.norm() < 1e-2


def test_lm_head_stays_as_vllm_has_it_when_ignored_and_bad_values_are_refused(tmp_path, monkeypatch):
    path, _ = _bf16_dir(tmp_path)
    monkeypatch.setenv("AUTOFP4_VLLM_LM_HEAD", "1")
    ov = {"quantization_config": {"quant_method": "autofp4", "ignore": ["lm_head"]}}
    _, model = _load(path, "autofp4", monkeypatch, hf_overrides=ov)
    assert type(model.lm_head.quant_method).__name__ == "UnquantizedLinearMethod"
    with pytest.raises(TypeError, match="lm_head must be true or false, got 'yes'"):
        vl.AutoFP4Config.from_config({"quant_method": "autofp4", "lm_head": "yes"})
    monkeypatch.setenv("AUTOFP4_VLLM_LM_HEAD", "maybe")
    with pytest.raises(ValueError, match="AUTOFP4_VLLM_LM_HEAD must be 1 or 0, got 'maybe'"):
        vl.AutoFP4Config()
    monkeypatch.delenv("AUTOFP4_VLLM_LM_HEAD")
    assert vl.AutoFP4Config().lm_head is False and vl.AutoFP4Config(lm_head=True).hash_factors()["lm_head"] is True


def test_online_quantization_checks_the_sizes_and_the_activation():
    mx = vl.AutoFP4Config(fmt="mxfp4")
    with pytest.raises(ValueError, match=r"MXFP4 requires the input size per partition \(48\) to be divisible by 32"):
        vl.RowParallelLinear(48, H, bias=False, params_dtype=BF16, quant_config=mx, prefix="model.layers.0.o_proj")
    vl.RowParallelLinear(48, H, bias=False, params_dtype=BF16, quant_config=vl.AutoFP4Config(fmt="nvfp4"), prefix="o")
    with pytest.raises(ValueError, match="MoE activation 'gelu'"):
        _experts(mx, activation="gelu")
    with pytest.raises(ValueError, match="must be one of"):
        vl.AutoFP4Config(fmt="fp8")
    assert vl.AutoFP4Config.from_config({"quant_method": "autofp4", "format": "nvfp4"}).fmt == "nvfp4"


def test_online_swigluoai_experts_are_deinterleaved():
    ex = _experts(vl.AutoFP4Config(fmt="mxfp4"), activation="swigluoai")
    torch.manual_seed(4)
    w13 = torch.randn(E, 2 * I, H, dtype=BF16)  # rows g0, u0, g1, u1, ... as gpt-oss stores them
    ex.w13_weight.data.copy_(w13)
    ex.w2_weight.data.copy_(torch.randn(E, H, I, dtype=BF16))
    w2 = autofp4.quantize(ex.w2_weight.data.clone(), "mxfp4")
    ex.quant_method.process_weights_after_loading(ex)
    packed = autofp4.quantize(torch.cat([w13[:, 0::2], w13[:, 1::2]], dim=1), "mxfp4")
    assert torch.equal(ex.autofp4_w13_packed, packed.data)
    x = torch.randn(4, H, dtype=BF16)
    tw, ti = autofp4.route(torch.randn(4, E), TOP_K)
    want = reference_moe(x, packed, w2, tw, ti, "swigluoai")
    assert torch.equal(ex.quant_method.apply(ex, x, tw, ti, None, None), want)


def test_importing_autofp4_never_imports_vllm():
    code = ("import sys, autofp4, autofp4.integrations.vllm; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'vllm'], 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- checkpoints autofp4 writes ---------------------------------------------------------------------
def _written(tmp_path, fmt, layout):
    """A bf16 one-layer Qwen3-MoE checkpoint quantized by ``autofp4 quantize``; returns (dir, bf16 state)."""
    src, sd = _bf16_dir(tmp_path / "src")
    out = tmp_path / f"{fmt}-{layout}"
    autofp4.quantize_checkpoint(src, out, fmt, layout, progress=False)
    return out, sd


@pytest.fixture
def _src_dir(tmp_path):
    (tmp_path / "src").mkdir()


def test_vllm_serves_the_modelopt_checkpoint_autofp4_writes(tmp_path, monkeypatch, _src_dir):
    path, sd = _written(tmp_path, "nvfp4", "modelopt")
    assert _model_config(path).quantization == "modelopt_fp4"  # vLLM's own detection
    own = vl.get_quantization_config("modelopt_fp4").from_config(
        json.loads((path / "hf_quant_config.json").read_text()))
    assert own.quant_method == "W4A16_NVFP4" and "model.layers.0.mlp.gate" in own.exclude_modules
    vc, model = _load(path, "autofp4", monkeypatch)  # vLLM's loader: every stored tensor accepted
    layer = model.model.layers[0]
    p = "model.layers.0."
    want = autofp4.quantize(torch.cat([sd[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]), "nvfp4")
    x = torch.randn(3, H, dtype=BF16)
    qkv = layer.self_attn.qkv_proj
    assert torch.equal(qkv.quant_method.apply(qkv, x), autofp4.linear(x, want))  # one shared scale: exact

    def stacked(*projs):
        return torch.stack([torch.cat([sd[f"{p}mlp.experts.{e}.{q}_proj.weight"] for q in projs]) for e in range(E)])

    w13, w2 = autofp4.quantize(stacked("gate", "up"), "nvfp4"), autofp4.quantize(stacked("down"), "nvfp4")
    ex = layer.mlp.experts.routed_experts
    tw, ti = autofp4.route(torch.randn(3, E), TOP_K)
    assert torch.equal(ex.quant_method.apply(ex, x, tw, ti, None, None), reference_moe(x, w13, w2, tw, ti, "silu"))


class _NoKernel:
    """Stands in for the GPU GEMM kernel vLLM picks when a scheme is built (none exists on a CPU)."""

    def input_quant_key(self):
        return None


def test_vllms_own_modelopt_method_loads_the_stored_tensors(tmp_path, monkeypatch, _src_dir):
    """vLLM's own ModelOpt NVFP4 linear method (``modelopt_fp4``, W4A16 for this checkpoint) and
    its weight loaders take the fused q/k/v tensors autofp4 writes."""
    from safetensors import safe_open
    from vllm.model_executor.layers.quantization import modelopt as mo_mod

    monkeypatch.setattr(mo_mod, "init_nvfp4_linear_kernel", lambda **kw: _NoKernel())
    if hasattr(mo_mod, "MarlinNvFp4LinearKernel"):  # vLLM 0.26 builds its W4A16 kernel directly
        monkeypatch.setattr(mo_mod, "MarlinNvFp4LinearKernel", lambda *a, **kw: _NoKernel())
    path, _ = _written(tmp_path, "nvfp4", "modelopt")
    own = vl.get_quantization_config("modelopt_fp4").from_config(json.loads((path / "hf_quant_config.json").read_text()))
    layer = vl.QKVParallelLinear(H, HD, NH, NKV, bias=False, params_dtype=BF16, quant_config=own,
                                 prefix="model.layers.0.self_attn.qkv_proj")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys() if k.split(".")[-2] in ("q_proj", "k_proj", "v_proj")}
    params = dict(layer.named_parameters())
    names = sorted({k.rpartition(".")[2] for k in stored})
    # W4A16 as genuine exports: no input_scale stored (vLLM registers one for older exports that
    # carry it, and drops it after loading)
    assert set(params) - set(names) == {"input_scale"} and set(names) <= set(params)
    for shard in "qkv":
        for name in names:
            t = stored[f"model.layers.0.self_attn.{shard}_proj.{name}"]
            assert t.dtype == params[name].dtype, name
            layer.weight_loader_v2(params[name], t, shard)
    assert torch.equal(params["weight"].data, torch.cat([stored[f"model.layers.0.self_attn.{s}_proj.weight"] for s in "qkv"]))
    assert torch.equal(params["weight_scale_2"].data, stored["model.layers.0.self_attn.q_proj.weight_scale_2"].expand(3))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_vllm_reads_the_compressed_tensors_checkpoint_autofp4_writes(tmp_path, fmt, monkeypatch, _src_dir):
    """vLLM's compressed-tensors config picks its weights-only FP4 scheme for the layers, and its
    weight loaders take the stored tensors of the fused q/k/v layer as they are."""
    from safetensors import safe_open
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a4_mxfp4 as mx_mod, compressed_tensors_w4a4_nvfp4 as nv_mod,
    )

    monkeypatch.setattr(nv_mod, "init_nvfp4_linear_kernel", lambda **kw: _NoKernel())
    monkeypatch.setattr(mx_mod, "init_mxfp4_linear_kernel", lambda *a, **kw: _NoKernel())
    path, _ = _written(tmp_path, fmt, "compressed-tensors")
    assert _model_config(path).quantization == "compressed-tensors"
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    ct = vl.get_quantization_config("compressed-tensors").from_config(qc)
    prefix = "model.layers.0.self_attn.qkv_proj"
    layer = vl.QKVParallelLinear(H, HD, NH, NKV, bias=False, params_dtype=BF16, quant_config=ct, prefix=prefix)
    scheme = layer.scheme
    assert type(scheme).__name__ == ("CompressedTensorsW4A4Fp4" if fmt == "nvfp4" else "CompressedTensorsW4A4Mxfp4")
    assert fmt == "mxfp4" or scheme.use_a16  # NVFP4 weights only: vLLM's W4A16 path
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys() if k.split(".")[-2] in ("q_proj", "k_proj", "v_proj")}
    params = dict(layer.named_parameters())
    names = sorted({k.rpartition(".")[2] for k in stored})
    assert names == sorted(params)  # every tensor the scheme loads is stored, nothing else
    for shard in "qkv":
        for name in names:
            t = stored[f"model.layers.0.self_attn.{shard}_proj.{name}"]
            assert t.dtype == params[name].dtype, name
            layer.weight_loader_v2(params[name], t, shard)
    rows = [stored[f"model.layers.0.self_attn.{s}_proj.weight_packed"] for s in "qkv"]
    assert torch.equal(params["weight_packed"].data, torch.cat(rows))
    scales = [stored[f"model.layers.0.self_attn.{s}_proj.weight_scale"].view(torch.uint8) for s in "qkv"]
    assert torch.equal(params["weight_scale"].data.view(torch.uint8), torch.cat(scales))
    if fmt == "nvfp4":  # one global scale (the reciprocal) per part, all equal: the q/k/v share one
        g = params["weight_global_scale"].data
        assert g.shape == (3,) and torch.equal(g, g[:1].expand(3))
    gate = vl.RowParallelLinear(H, E, bias=False, params_dtype=BF16, quant_config=ct, prefix="model.layers.0.mlp.gate")
    assert type(gate.quant_method).__name__ == "UnquantizedLinearMethod"  # the router is in "ignore"


@pytest.mark.parametrize("how", ["env", "hf-overrides"])
def test_fp8_activations_only_when_asked(tmp_path, monkeypatch, how):
    """AUTOFP4_VLLM_ACT=fp8 (or "act": "fp8") runs the model's FP4 linears and experts with FP8
    activations (W4A8), in the hash of the compiled graphs; without it the activations stay bf16."""
    from autofp4.integrations.vllm._layer import fp4_weight
    from autofp4.w4a8 import reference_linear, reference_moe

    monkeypatch.delenv("AUTOFP4_VLLM_FORMAT", raising=False)
    path, _ = _bf16_dir(tmp_path)
    kw = {}
    if how == "env":
        monkeypatch.setenv("AUTOFP4_VLLM_ACT", "fp8")
    else:
        monkeypatch.delenv("AUTOFP4_VLLM_ACT", raising=False)
        kw["hf_overrides"] = {"quantization_config": {"quant_method": "autofp4", "act": "fp8"}}
    vc, model = _load(path, "autofp4", monkeypatch, **kw)
    assert vc.additional_config["autofp4"]["act"] == "fp8"
    layer = model.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert qkv.autofp4_act == "fp8"
    w = fp4_weight(qkv, "")
    x = torch.randn(5, H, dtype=BF16)
    got = qkv.quant_method.apply(qkv, x)
    assert torch.equal(got, reference_linear(x, w, None)) and not torch.equal(got, autofp4.linear(x, w))
    compiled = torch.compile(lambda x: qkv.quant_method.apply(qkv, x), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), got)
    ex = layer.mlp.experts.routed_experts
    w13, w2 = fp4_weight(ex, "w13_"), fp4_weight(ex, "w2_")
    tw, ti = autofp4.route(torch.randn(5, E), TOP_K)
    assert torch.equal(ex.quant_method.apply(ex, x, tw, ti, None, None), reference_moe(x, w13, w2, tw, ti, "silu"))


def test_fp8_activation_settings_are_checked(monkeypatch):
    monkeypatch.setenv("AUTOFP4_VLLM_ACT", "int8")
    with pytest.raises(ValueError, match="AUTOFP4_VLLM_ACT must be fp8, fp8-prefill or unset, got 'int8'"):
        vl.AutoFP4Config()
    monkeypatch.delenv("AUTOFP4_VLLM_ACT")
    assert vl.AutoFP4Config().act is None and vl.AutoFP4Config().hash_factors()["act"] is None
    assert vl.AutoFP4Config(act="fp8-prefill").hash_factors()["act"] == "fp8-prefill"
    with pytest.raises(ValueError, match="quantization_config act must be fp8, fp8-prefill or null, got 'e4m3'"):
        vl.AutoFP4Config.from_config({"quant_method": "autofp4", "act": "e4m3"})
    assert "act='fp8'" in repr(vl.AutoFP4Config(act="fp8"))


def test_act_in_a_modelopt_config_is_refused_naming_the_variable():
    for where in ("top", "section"):
        cfg = {**json.loads(json.dumps(MODELOPT_JSON)), "quant_method": "modelopt"}  # as vLLM hands it over
        (cfg if where == "top" else cfg["quantization"])["act"] = "fp8"
        with pytest.raises(ValueError, match="'act' in a ModelOpt checkpoint's quantization config is not read.*"
                                             "AUTOFP4_VLLM_ACT=fp8"):
            vl.AutoFP4Config.from_config(cfg)
