"""Model shapes from config.json: hand-computed numbers for every supported architecture."""
import json
from pathlib import Path

import pytest

from autofp4.problem import ProblemKey
from autofp4.models import SUPPORTED, ModelShape, load_config, model_shapes, shapes_table

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name):
    return load_config(EXAMPLES / f"{name}.json")


def table(shapes):
    """shapes -> {name: (op, n, k, experts, topk, count)} (names are unique per model)."""
    out = {}
    for s in shapes:
        assert s.name not in out, f"duplicate name {s.name}"
        out[s.name] = (s.op, s.n, s.k, s.experts, s.topk, s.count)
    return out


def lin(n, k, count):
    return ("linear", n, k, 0, 0, count)


def moe(n, k, experts, topk, count):
    return ("moe", n, k, experts, topk, count)


def weight_params(shapes):
    """Parameters one rank holds for the listed shapes (moe: w13 [E, 2I, H] + w2 [E, H, I])."""
    total = 0
    for s in shapes:
        if s.op == "linear":
            total += s.count * s.n * s.k
        else:
            total += s.count * s.experts * (s.n * s.k + s.hidden * s.intermediate)
    return total


# --------------------------------------------------------------------------- dense models


def test_llama_3_1_8b():
    shapes = model_shapes(example("llama-3.1-8b"))
    assert [s.name for s in shapes] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert table(shapes) == {
        "qkv_proj": lin(6144, 4096, 32),
        "o_proj": lin(4096, 4096, 32),
        "gate_up_proj": lin(28672, 4096, 32),
        "down_proj": lin(4096, 14336, 32),
    }


def test_llama_3_1_8b_tp2():
    assert table(model_shapes(example("llama-3.1-8b"), tp=2)) == {
        "qkv_proj": lin(3072, 4096, 32),
        "o_proj": lin(4096, 2048, 32),
        "gate_up_proj": lin(14336, 4096, 32),
        "down_proj": lin(4096, 7168, 32),
    }


def test_llama_3_1_8b_tp8_and_kv_replication_at_tp16():
    assert table(model_shapes(example("llama-3.1-8b"), tp=8)) == {
        "qkv_proj": lin(768, 4096, 32),  # 4 q heads + 2 * 1 kv head, 128 each
        "o_proj": lin(4096, 512, 32),
        "gate_up_proj": lin(3584, 4096, 32),
        "down_proj": lin(4096, 1792, 32),
    }
    # 8 kv heads over 16 ranks: each rank keeps one (replicated) kv head
    assert table(model_shapes(example("llama-3.1-8b"), tp=16)) == {
        "qkv_proj": lin(512, 4096, 32),  # 2 q heads + 2 * 1 kv head
        "o_proj": lin(4096, 256, 32),
        "gate_up_proj": lin(1792, 4096, 32),
        "down_proj": lin(4096, 896, 32),
    }


def test_llama_3_1_70b():
    assert table(model_shapes(example("llama-3.1-70b"))) == {
        "qkv_proj": lin(10240, 8192, 80),
        "o_proj": lin(8192, 8192, 80),
        "gate_up_proj": lin(57344, 8192, 80),
        "down_proj": lin(8192, 28672, 80),
    }
    assert table(model_shapes(example("llama-3.1-70b"), tp=4)) == {
        "qkv_proj": lin(2560, 8192, 80),
        "o_proj": lin(8192, 2048, 80),
        "gate_up_proj": lin(14336, 8192, 80),
        "down_proj": lin(8192, 7168, 80),
    }


def test_qwen2_5_7b():
    assert table(model_shapes(example("qwen2.5-7b"))) == {
        "qkv_proj": lin(4608, 3584, 28),
        "o_proj": lin(3584, 3584, 28),
        "gate_up_proj": lin(37888, 3584, 28),
        "down_proj": lin(3584, 18944, 28),
    }
    assert table(model_shapes(example("qwen2.5-7b"), tp=4)) == {
        "qkv_proj": lin(1152, 3584, 28),  # 7 q heads + 2 * 1 kv head
        "o_proj": lin(3584, 896, 28),
        "gate_up_proj": lin(9472, 3584, 28),
        "down_proj": lin(3584, 4736, 28),
    }
    with pytest.raises(ValueError, match="num_attention_heads=28 is not divisible by tp=8"):
        model_shapes(example("qwen2.5-7b"), tp=8)


def test_qwen3_dense_uses_head_dim_from_config():
    # Qwen3-0.6B: 16 heads of 128 on a hidden size of 1024 (hidden / heads would give 64)
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "head_dim": 128, "intermediate_size": 3072, "num_attention_heads": 16,
        "num_key_value_heads": 8, "num_hidden_layers": 28, "vocab_size": 151936,
    }
    assert table(model_shapes(cfg)) == {
        "qkv_proj": lin(4096, 1024, 28),
        "o_proj": lin(1024, 2048, 28),
        "gate_up_proj": lin(6144, 1024, 28),
        "down_proj": lin(1024, 3072, 28),
    }
    assert table(model_shapes(cfg, tp=2)) == {
        "qkv_proj": lin(2048, 1024, 28),
        "o_proj": lin(1024, 1024, 28),
        "gate_up_proj": lin(3072, 1024, 28),
        "down_proj": lin(1024, 1536, 28),
    }


def test_mistral_with_and_without_head_dim():
    # Mistral-7B-v0.1 (no head_dim field) and Mistral-Nemo (head_dim 128 on hidden 5120)
    mistral_7b = {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 32, "vocab_size": 32000,
    }
    assert table(model_shapes(mistral_7b)) == {
        "qkv_proj": lin(6144, 4096, 32),
        "o_proj": lin(4096, 4096, 32),
        "gate_up_proj": lin(28672, 4096, 32),
        "down_proj": lin(4096, 14336, 32),
    }
    nemo = dict(mistral_7b, hidden_size=5120, head_dim=128, num_hidden_layers=40)
    assert table(model_shapes(nemo)) == {
        "qkv_proj": lin(6144, 5120, 40),
        "o_proj": lin(5120, 4096, 40),
        "gate_up_proj": lin(28672, 5120, 40),
        "down_proj": lin(5120, 14336, 40),
    }
    # head_dim: null falls back to hidden / heads
    assert table(model_shapes(dict(mistral_7b, head_dim=None)))["qkv_proj"] == lin(6144, 4096, 32)


# --------------------------------------------------------------------------- MoE models


def test_mixtral_8x7b():
    shapes = model_shapes(example("mixtral-8x7b"))
    assert table(shapes) == {
        "qkv_proj": lin(6144, 4096, 32),
        "o_proj": lin(4096, 4096, 32),
        "experts": moe(28672, 4096, 8, 2, 32),
    }
    (m,) = [s for s in shapes if s.op == "moe"]
    assert (m.intermediate, m.hidden) == (14336, 4096)


def test_mixtral_tp_splits_intermediate_ep_splits_experts():
    cfg = example("mixtral-8x7b")
    tp2 = {s.name: s for s in model_shapes(cfg, tp=2)}
    assert tp2["qkv_proj"].n == 3072 and tp2["o_proj"].k == 2048
    e = tp2["experts"]
    assert (e.n, e.k, e.experts, e.topk, e.intermediate, e.hidden, e.count) == (
        14336, 4096, 8, 2, 7168, 4096, 32)

    ep2 = {s.name: s for s in model_shapes(cfg, tp=2, ep=2)}
    assert ep2["qkv_proj"].n == 3072  # attention is still split by tp
    e = ep2["experts"]
    assert (e.n, e.k, e.experts, e.topk, e.intermediate, e.hidden, e.count) == (
        28672, 4096, 4, 2, 14336, 4096, 32)

    # one local expert: a rank sees at most one of a token's two experts
    e = {s.name: s for s in model_shapes(cfg, ep=8)}["experts"]
    assert (e.experts, e.topk, e.n) == (1, 1, 28672)

    with pytest.raises(ValueError, match="number of experts=8 is not divisible by ep=3"):
        model_shapes(cfg, ep=3)


def test_qwen3_30b_a3b():
    cfg = example("qwen3-30b-a3b")
    shapes = model_shapes(cfg)
    assert table(shapes) == {
        "qkv_proj": lin(5120, 2048, 48),  # (32 + 2 * 4) * 128
        "o_proj": lin(2048, 4096, 48),  # 32 * 128 = 4096 > hidden 2048
        "experts": moe(1536, 2048, 128, 8, 48),
    }
    e = shapes[-1]
    assert (e.intermediate, e.hidden) == (768, 2048)
    assert table(model_shapes(cfg, tp=4)) == {
        "qkv_proj": lin(1280, 2048, 48),
        "o_proj": lin(2048, 1024, 48),
        "experts": moe(384, 2048, 128, 8, 48),
    }
    assert table(model_shapes(cfg, tp=8)) == {
        "qkv_proj": lin(768, 2048, 48),  # 4 q heads + 2 * 1 replicated kv head
        "o_proj": lin(2048, 512, 48),
        "experts": moe(192, 2048, 128, 8, 48),
    }
    assert table(model_shapes(cfg, tp=1, ep=8))["experts"] == moe(1536, 2048, 16, 8, 48)


def test_qwen3_moe_mlp_only_layers_and_sparse_step():
    cfg = dict(example("qwen3-30b-a3b"), mlp_only_layers=[0, 47])
    assert table(model_shapes(cfg)) == {
        "qkv_proj": lin(5120, 2048, 48),
        "o_proj": lin(2048, 4096, 48),
        "gate_up_proj": lin(12288, 2048, 2),
        "down_proj": lin(2048, 6144, 2),
        "experts": moe(1536, 2048, 128, 8, 46),
    }
    # dense layer 0 comes first, so the dense MLP is listed before the experts
    assert [s.name for s in model_shapes(cfg)] == [
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "experts"]
    cfg = dict(example("qwen3-30b-a3b"), decoder_sparse_step=2)  # MoE on layers 1, 3, ...
    t = table(model_shapes(cfg, tp=2))
    assert t["experts"] == moe(768, 2048, 128, 8, 24)
    assert t["gate_up_proj"] == lin(6144, 2048, 24)
    assert t["down_proj"] == lin(2048, 3072, 24)


def test_deepseek_v3():
    cfg = example("deepseek-v3")
    shapes = model_shapes(cfg)
    assert table(shapes) == {
        "q_a_proj": lin(1536, 7168, 61),
        "q_b_proj": lin(24576, 1536, 61),  # 128 * (128 + 64)
        "kv_a_proj_with_mqa": lin(576, 7168, 61),  # 512 + 64
        "kv_b_proj": lin(32768, 512, 61),  # 128 * (128 + 128)
        "o_proj": lin(7168, 16384, 61),  # 128 * 128
        "gate_up_proj": lin(36864, 7168, 3),
        "down_proj": lin(7168, 18432, 3),
        "experts": moe(4096, 7168, 256, 8, 58),
        "shared_experts.gate_up_proj": lin(4096, 7168, 58),
        "shared_experts.down_proj": lin(7168, 2048, 58),
    }
    e = {s.name: s for s in shapes}["experts"]
    assert (e.intermediate, e.hidden) == (2048, 7168)


def test_deepseek_v3_tp8_and_ep():
    cfg = example("deepseek-v3")
    assert table(model_shapes(cfg, tp=8)) == {
        "q_a_proj": lin(1536, 7168, 61),  # replicated
        "q_b_proj": lin(3072, 1536, 61),
        "kv_a_proj_with_mqa": lin(576, 7168, 61),  # replicated
        "kv_b_proj": lin(4096, 512, 61),
        "o_proj": lin(7168, 2048, 61),
        "gate_up_proj": lin(4608, 7168, 3),
        "down_proj": lin(7168, 2304, 3),
        "experts": moe(512, 7168, 256, 8, 58),
        "shared_experts.gate_up_proj": lin(512, 7168, 58),
        "shared_experts.down_proj": lin(7168, 256, 58),
    }
    t = table(model_shapes(cfg, tp=8, ep=8))
    assert t["experts"] == moe(4096, 7168, 32, 8, 58)
    assert t["shared_experts.gate_up_proj"] == lin(512, 7168, 58)
    assert t["q_b_proj"] == lin(3072, 1536, 61)


def test_deepseek_v2_lite_without_q_lora():
    # DeepSeek-V2-Lite: q_lora_rank null -> a plain q_proj, 2 shared experts
    cfg = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
        "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": None,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 102400,
    }
    assert table(model_shapes(cfg)) == {
        "q_proj": lin(3072, 2048, 27),
        "kv_a_proj_with_mqa": lin(576, 2048, 27),
        "kv_b_proj": lin(4096, 512, 27),
        "o_proj": lin(2048, 2048, 27),
        "gate_up_proj": lin(21888, 2048, 1),
        "down_proj": lin(2048, 10944, 1),
        "experts": moe(2816, 2048, 64, 6, 26),
        "shared_experts.gate_up_proj": lin(5632, 2048, 26),
        "shared_experts.down_proj": lin(2048, 2816, 26),
    }
    t = table(model_shapes(cfg, tp=2))
    assert t["q_proj"] == lin(1536, 2048, 27)
    assert t["kv_a_proj_with_mqa"] == lin(576, 2048, 27)
    assert t["o_proj"] == lin(2048, 1024, 27)
    assert t["shared_experts.down_proj"] == lin(2048, 1408, 26)


def test_gpt_oss_20b():
    cfg = example("gpt-oss-20b")
    shapes = model_shapes(cfg)
    assert table(shapes) == {
        "qkv_proj": lin(5120, 2880, 24),  # (64 + 2 * 8) * 64
        "o_proj": lin(2880, 4096, 24),
        "experts": moe(5760, 2880, 32, 4, 24),
    }
    assert (shapes[-1].intermediate, shapes[-1].hidden) == (2880, 2880)
    assert table(model_shapes(cfg, tp=2)) == {
        "qkv_proj": lin(2560, 2880, 24),
        "o_proj": lin(2880, 2048, 24),
        "experts": moe(2880, 2880, 32, 4, 24),
    }
    assert table(model_shapes(cfg, ep=4))["experts"] == moe(5760, 2880, 8, 4, 24)
    # the original config spelling of top-k only
    only_original = {k: v for k, v in cfg.items() if k != "num_experts_per_tok"}
    assert table(model_shapes(only_original))["experts"] == moe(5760, 2880, 32, 4, 24)


# --------------------------------------------------------------------------- invariants


PUBLISHED_PARAMS = {  # total parameters (billions) as published, embeddings included
    "llama-3.1-8b": 8.03,
    "llama-3.1-70b": 70.6,
    "qwen2.5-7b": 7.61,
    "mixtral-8x7b": 46.7,
    "qwen3-30b-a3b": 30.5,
    "deepseek-v3": 671.0,  # without the multi-token-prediction module
    "gpt-oss-20b": 20.9,
    "gpt-oss-120b": 116.8,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_shapes_account_for_published_parameter_count(name):
    cfg = example(name)
    params = weight_params(model_shapes(cfg, include_lm_head=True))
    params += cfg["vocab_size"] * cfg["hidden_size"]  # input embedding
    assert params / 1e9 == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01)


@pytest.mark.parametrize("name,tp", [("llama-3.1-70b", 8), ("qwen2.5-7b", 4),
                                     ("mixtral-8x7b", 8), ("gpt-oss-20b", 8)])
def test_tp_shards_add_up_to_the_whole_model(name, tp):
    # no replication in these cases (kv heads >= tp): the shards partition every weight
    cfg = example(name)
    assert weight_params(model_shapes(cfg, tp=tp)) * tp == weight_params(model_shapes(cfg))


def test_ep_shards_add_up_to_the_experts():
    cfg = example("qwen3-30b-a3b")
    whole = [s for s in model_shapes(cfg) if s.op == "moe"]
    shard = [s for s in model_shapes(cfg, ep=4) if s.op == "moe"]
    assert weight_params(shard) * 4 == weight_params(whole)


def test_lm_head_optional_and_column_parallel():
    cfg = example("llama-3.1-8b")
    assert "lm_head" not in table(model_shapes(cfg))
    assert table(model_shapes(cfg, include_lm_head=True))["lm_head"] == lin(128256, 4096, 1)
    assert table(model_shapes(cfg, tp=8, include_lm_head=True))["lm_head"] == lin(16032, 4096, 1)
    odd = dict(cfg, vocab_size=32001)  # a padded vocabulary: ceil(32001 / 2) rows per rank
    assert table(model_shapes(odd, tp=2, include_lm_head=True))["lm_head"] == lin(16001, 4096, 1)


def test_dedup_sums_counts_and_joins_names():
    # o_proj and down_proj are both 1024 x 1024 here
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
        "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8,
        "num_hidden_layers": 4,
    }
    shapes = model_shapes(cfg)
    assert [(s.name, s.n, s.k, s.count) for s in shapes] == [
        ("qkv_proj", 3072, 1024, 4),
        ("o_proj+down_proj", 1024, 1024, 8),
        ("gate_up_proj", 2048, 1024, 4),
    ]
    keys = [(s.op, s.n, s.k, s.experts, s.topk) for s in shapes]
    assert len(keys) == len(set(keys))


def test_order_is_stable():
    cfg = example("deepseek-v3")
    assert model_shapes(cfg, tp=4) == model_shapes(dict(reversed(list(cfg.items()))), tp=4)


def test_problem_key():
    s = {x.name: x for x in model_shapes(example("mixtral-8x7b"))}
    assert s["experts"].problem_key("nvfp4", "bfloat16") == ProblemKey(
        "moe", "nvfp4", "bfloat16", 28672, 4096, 8, 2)
    assert s["o_proj"].problem_key("mxfp4", "float16") == ProblemKey(
        "linear", "mxfp4", "float16", 4096, 4096)


def test_model_shape_rejects_inconsistent_moe():
    with pytest.raises(ValueError, match="n == 2 \\* intermediate"):
        ModelShape("moe", "experts", 100, 64, experts=8, topk=2, count=1,
                   intermediate=64, hidden=64)
    with pytest.raises(ValueError, match="topk <= experts"):
        ModelShape("moe", "experts", 128, 64, experts=2, topk=4, count=1,
                   intermediate=64, hidden=64)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("name,tp,message", [
    ("llama-3.1-8b", 3, "num_attention_heads=32 is not divisible by tp=3"),
    ("deepseek-v3", 3, "num_attention_heads=128 is not divisible by tp=3"),
    ("gpt-oss-20b", 5, "num_attention_heads=64 is not divisible by tp=5"),
])
def test_indivisible_tp_heads(name, tp, message):
    with pytest.raises(ValueError, match=message):
        model_shapes(example(name), tp=tp)


def test_indivisible_kv_heads():
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1536,
            "intermediate_size": 4096, "num_hidden_layers": 2}
    with pytest.raises(ValueError, match="num_key_value_heads=6 is not divisible by tp=4"):
        model_shapes(dict(base, num_attention_heads=12, num_key_value_heads=6), tp=4)
    with pytest.raises(ValueError, match="tp=6 is not divisible by num_key_value_heads=4"):
        model_shapes(dict(base, num_attention_heads=24, num_key_value_heads=4), tp=6)


def test_indivisible_intermediate():
    cfg = dict(example("llama-3.1-8b"), intermediate_size=1000)
    with pytest.raises(ValueError, match="intermediate_size=1000 is not divisible by tp=16"):
        model_shapes(cfg, tp=16)
    cfg = dict(example("qwen3-30b-a3b"), moe_intermediate_size=1000)
    with pytest.raises(ValueError, match="moe_intermediate_size=1000 is not divisible by tp=16"):
        model_shapes(cfg, tp=16)
    model_shapes(cfg, tp=16, ep=16)  # with expert parallelism I is not split: fine


@pytest.mark.parametrize("tp,ep", [(0, 1), (1, 0), (-2, 1), (2.0, 1)])
def test_bad_parallel_sizes(tp, ep):
    with pytest.raises(ValueError, match="must be a positive integer"):
        model_shapes(example("llama-3.1-8b"), tp=tp, ep=ep)


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError) as info:
        model_shapes({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    msg = str(info.value)
    assert "'gpt2'" in msg and "GPT2LMHeadModel" in msg
    for model_type in SUPPORTED:
        assert model_type in msg
    with pytest.raises(ValueError, match="supported model types"):
        model_shapes({"hidden_size": 4096})


def test_missing_field_is_named():
    cfg = {k: v for k, v in example("llama-3.1-8b").items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match="lacks 'intermediate_size'"):
        model_shapes(cfg)
    with pytest.raises(ValueError, match="'hidden_size' must be an integer"):
        model_shapes(dict(example("llama-3.1-8b"), hidden_size="4096"))


def test_supported_covers_the_brief():
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe",
                       "deepseek_v3", "gpt_oss"):
        assert model_type in SUPPORTED


# --------------------------------------------------------------------------- loading


def test_load_config_file_directory_and_dict(tmp_path):
    cfg = example("mixtral-8x7b")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_config(tmp_path) == cfg
    assert load_config(str(tmp_path / "config.json")) == cfg
    copy = load_config(cfg)
    assert copy == cfg and copy is not cfg


def test_load_config_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_config(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_config(tmp_path)  # a directory without config.json


def test_load_config_invalid_json(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama",\n "hidden_size": }')
    with pytest.raises(ValueError, match=r"invalid JSON in .*config.json.*line 2"):
        load_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_config(bad)
    with pytest.raises(TypeError):
        load_config(42)


EXAMPLE_FILES = sorted(EXAMPLES.glob("*.json"))


def test_all_examples_present():
    assert {p.stem for p in EXAMPLE_FILES} >= set(PUBLISHED_PARAMS)


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_examples_parse_and_produce_shapes(path):
    raw = json.loads(path.read_text())
    assert isinstance(raw["architectures"], list) and raw["architectures"]
    cfg = load_config(path)
    assert cfg["model_type"] in SUPPORTED
    shapes = model_shapes(cfg)
    assert shapes and all(isinstance(s, ModelShape) for s in shapes)
    assert all(s.count >= 1 for s in shapes)
    assert {s.op for s in shapes} <= {"linear", "moe"}
    text = shapes_table(shapes)
    lines = text.splitlines()
    assert len(lines) == len(shapes) + 2
    assert len({len(line) for line in lines[:2]}) == 1  # header and rule have equal width


def test_shapes_table_contents():
    shapes = model_shapes(example("mixtral-8x7b"), tp=2)
    lines = shapes_table(shapes).splitlines()
    assert lines[0].split() == ["op", "name", "N", "K", "experts", "topk", "I", "H", "count"]
    assert lines[2].split() == ["linear", "qkv_proj", "3072", "4096", "-", "-", "-", "-", "32"]
    assert lines[4].split() == ["moe", "experts", "14336", "4096", "8", "2", "7168", "4096", "32"]
    # right-aligned numeric columns: the N column ends at the same offset on every row
    ends = {line.index(tok) + len(tok) for line, tok in zip(lines[2:], ["3072", "4096", "14336"])}
    assert len(ends) == 1


# --------------------------------------------------------------------------- layouts


def test_llama_3_1_8b_transformers_layout():
    shapes = model_shapes(example("llama-3.1-8b"), layout="transformers")
    # q and o are both 4096 x 4096, k and v 1024 x 4096, gate and up 14336 x 4096
    assert table(shapes) == {
        "q_proj+o_proj": lin(4096, 4096, 64),
        "k_proj+v_proj": lin(1024, 4096, 64),
        "gate_proj+up_proj": lin(14336, 4096, 64),
        "down_proj": lin(4096, 14336, 32),
    }
    assert model_shapes(example("llama-3.1-8b"), layout="vllm") == model_shapes(example("llama-3.1-8b"))


def test_llama_3_1_8b_transformers_layout_tp2_and_kv_replication():
    assert table(model_shapes(example("llama-3.1-8b"), tp=2, layout="transformers")) == {
        "q_proj": lin(2048, 4096, 32),
        "k_proj+v_proj": lin(512, 4096, 64),
        "o_proj": lin(4096, 2048, 32),
        "gate_proj+up_proj": lin(7168, 4096, 64),
        "down_proj": lin(4096, 7168, 32),
    }
    # 8 kv heads over 16 ranks: one replicated kv head each, as in the fused layout
    assert table(model_shapes(example("llama-3.1-8b"), tp=16, layout="transformers")) == {
        "q_proj": lin(256, 4096, 32),
        "k_proj+v_proj": lin(128, 4096, 64),
        "o_proj": lin(4096, 256, 32),
        "gate_proj+up_proj": lin(896, 4096, 64),
        "down_proj": lin(4096, 896, 32),
    }


@pytest.mark.parametrize("name,tp", [("llama-3.1-8b", 1), ("llama-3.1-70b", 8), ("qwen2.5-7b", 4),
                                     ("mixtral-8x7b", 2), ("qwen3-30b-a3b", 4), ("deepseek-v3", 8),
                                     ("gpt-oss-20b", 1)])
def test_both_layouts_hold_the_same_parameters(name, tp):
    # fusing splits no weight differently: the same parameters per rank in either layout
    cfg = example(name)
    assert weight_params(model_shapes(cfg, tp=tp, layout="transformers")) == \
        weight_params(model_shapes(cfg, tp=tp))


@pytest.mark.parametrize("name,tp,ep", [("llama-3.1-8b", 1, 1), ("llama-3.1-8b", 2, 1),
                                        ("qwen3-30b-a3b", 2, 2), ("deepseek-v3", 8, 8)])
def test_both_is_the_union(name, tp, ep):
    cfg = example(name)
    vllm = model_shapes(cfg, tp=tp, ep=ep)
    hf = model_shapes(cfg, tp=tp, ep=ep, layout="transformers")
    both = model_shapes(cfg, tp=tp, ep=ep, layout="both")
    keys = [s.dedup_key for s in both]
    assert len(keys) == len(set(keys))
    assert set(keys) == {s.dedup_key for s in vllm} | {s.dedup_key for s in hf}
    assert keys[: len(vllm)] == [s.dedup_key for s in vllm]  # the default's shapes first
    for s in both:
        counts = [x.count for x in vllm + hf if x.dedup_key == s.dedup_key]
        names = {x.name for x in vllm + hf if x.dedup_key == s.dedup_key}
        assert s.count == max(counts)
        assert set(s.name.split("+")) == {p for n in names for p in n.split("+")}


def test_llama_3_1_8b_both():
    assert table(model_shapes(example("llama-3.1-8b"), layout="both")) == {
        "qkv_proj": lin(6144, 4096, 32),
        "o_proj+q_proj": lin(4096, 4096, 64),
        "gate_up_proj": lin(28672, 4096, 32),
        "down_proj": lin(4096, 14336, 32),
        "k_proj+v_proj": lin(1024, 4096, 64),
        "gate_proj+up_proj": lin(14336, 4096, 64),
    }


def test_deepseek_v3_transformers_layout():
    # MLA projections as DeepseekV3Attention names them (the same in both layouts), MLPs unfused,
    # the experts one fused MoE shape
    assert table(model_shapes(example("deepseek-v3"), layout="transformers")) == {
        "q_a_proj": lin(1536, 7168, 61),
        "q_b_proj": lin(24576, 1536, 61),
        "kv_a_proj_with_mqa": lin(576, 7168, 61),
        "kv_b_proj": lin(32768, 512, 61),
        "o_proj": lin(7168, 16384, 61),
        "gate_proj+up_proj": lin(18432, 7168, 6),
        "down_proj": lin(7168, 18432, 3),
        "experts": moe(4096, 7168, 256, 8, 58),
        "shared_experts.gate_proj+shared_experts.up_proj": lin(2048, 7168, 116),
        "shared_experts.down_proj": lin(7168, 2048, 58),
    }
    t = table(model_shapes(example("deepseek-v3"), tp=8, ep=8, layout="transformers"))
    assert t["experts"] == moe(4096, 7168, 32, 8, 58)
    assert t["shared_experts.gate_proj+shared_experts.up_proj"] == lin(256, 7168, 116)
    assert t["q_b_proj"] == lin(3072, 1536, 61)


def test_transformers_layout_block_check_and_errors():
    cfg = dict(example("llama-3.1-8b"), intermediate_size=14352)  # 16 * 897: whole nvfp4 blocks, not mxfp4
    model_shapes(cfg, fmt="nvfp4", layout="transformers")
    with pytest.raises(ValueError, match="intermediate_size = 14352.*down_proj.*mxfp4"):
        model_shapes(cfg, fmt="mxfp4", layout="both")
    for bad in ("vLLM", "hf", "", None, 1):
        with pytest.raises(ValueError, match="layout must be one of"):
            model_shapes(example("llama-3.1-8b"), layout=bad)
