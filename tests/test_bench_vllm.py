"""scripts/bench_vllm.py's CPU parts: the checkpoints it serves (a shrunken Qwen3-MoE written by
transformers and autofp4, read back by autofp4 and checked against the model it came from), its
word tokenizer, and the comparison of two variants' outputs."""
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_vllm as B  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_the_word_tokenizer_maps_each_word_to_its_id():
    tok = B.word_tokenizer(5000, 3, 4)
    assert tok("t17 t4999 t0")["input_ids"] == [17, 4999, 0]
    assert tok.decode([5, 6]) == "t5 t6" and tok.eos_token_id == 4 and tok.bos_token_id == 3


def test_the_checkpoints_are_a_modelopt_nvfp4_model_and_its_bf16_source(tmp_path):
    import autofp4

    cfg = json.loads((EXAMPLES / "qwen3-30b-a3b.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=3000)
    (tmp_path / "tiny.json").write_text(json.dumps(cfg))
    dirs = B.make_checkpoints(tmp_path / "tiny.json", tmp_path / "ck", bf16_checkpoint=True, device="cpu")
    nv, bf = Path(dirs["nvfp4"]), Path(dirs["bf16"])
    quant = json.loads((nv / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "W4A16_NVFP4" and quant["group_size"] == 16
    assert (nv / "tokenizer.json").exists() and (bf / "tokenizer.json").exists()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(nv))("t17 t2999 t1")["input_ids"] == [17, 2999, 1]
    src = AutoModelForCausalLM.from_pretrained(str(bf), dtype=torch.bfloat16)
    fp4 = autofp4.from_pretrained(str(nv), dtype=torch.bfloat16)
    ids = torch.randint(1000, 2000, (1, 12))
    with torch.no_grad():
        a, b = src(ids).logits.float(), fp4(ids).logits.float()
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert 0.9 < cos < 0.99999  # the FP4 model is its bf16 source, quantized
    # a second call reuses what is there
    assert B.make_checkpoints(tmp_path / "tiny.json", tmp_path / "ck", bf16_checkpoint=True, device="cpu") == \
        {"nvfp4": str(nv), "bf16": str(bf)}


def test_compare_counts_tokens_up_to_the_first_divergence():
    a = [{"tokens": [1, 2, 3, 4], "prompt_logprobs": [None, -1.0, -2.0]},
         {"tokens": [5, 6, 7, 8], "prompt_logprobs": [None, -0.5, -0.25]}]
    b = [{"tokens": [1, 2, 9, 4], "prompt_logprobs": [None, -1.5, -2.0]},
         {"tokens": [5, 6, 7, 8], "prompt_logprobs": [None, -0.5, -0.5]}]
    c = B.compare(a, b)
    assert c["tokens_identical"] == 6 / 8 and c["prompts_identical"] == 0.5
    assert c["logprob_diff_max"] == 0.5 and c["logprob_diff_mean"] == pytest.approx(0.75 / 4)


def test_the_table_gives_the_ratios_and_compares_each_variant_with_the_same_weights_on_another_path():
    def run(d1, d64, p1, tokens=(1, 2), lp=-1.0):
        rows = [{"tokens": list(tokens), "prompt_logprobs": [None, lp]}]
        return {"decode_tok_s": {"1": d1, "8": 1.0, "64": d64}, "prefill_tok_s": {"1": p1, "8": 1.0}, "startup_s": 1.0,
                "batch": rows, "single": rows}

    log = ("INFO 12-04 [gpu_model_runner.py:2001] Model loading took 5.7127 GiB memory and 3.1 seconds\n"
           "INFO 12-04 [gpu_worker.py:300] Available KV cache memory: 98.25 GiB\n"
           "INFO 12-04 [kv_cache_utils.py:1000] GPU KV cache size: 804,864 tokens\n")
    figures = B.log_figures(log)
    assert figures == {"model_gib": 5.7127, "kv_cache_gib": 98.25, "kv_tokens": 804864}
    row = B.summarize("m", {"bf16": run(50.0, 2000.0, 8000.0, (1, 3), -0.5),
                            "vllm-nvfp4": run(100.0, 1000.0, 5000.0),
                            "autofp4-nvfp4": run(150.0, 1200.0, 4000.0, (1, 2), -1.25) | figures,
                            "autofp4-mxfp4": run(160.0, 1300.0, 4100.0, (1, 3), -0.75)})
    assert row["variants"]["autofp4-nvfp4"]["vs_vllm_nvfp4"]["tokens_identical"] == 1.0
    assert row["variants"]["autofp4-nvfp4"]["vs_bf16"]["tokens_identical"] == 0.5
    md = B.table([row])
    # the ModelOpt checkpoint against vLLM's path for it; the weights quantized at load against bf16
    assert "| m | autofp4-nvfp4 | 150 | 1 | 1200 | 4000 | 1 | 1.50 / 1.20 / 0.80 | 3.00 | vllm-nvfp4 | 100% | " \
           "0.250 / 0.250 | 0.000 / 0.000 | 5.7 | 804,864 |" in md
    assert "| m | autofp4-mxfp4 | 160 | 1 | 1300 | 4100 | 1 | 1.60 / 1.30 / 0.82 | 3.20 | bf16 | 100% | " \
           "0.250 / 0.250 | 0.000 / 0.000 | - | - |" in md
    assert "| m | bf16 | 50 | 1 | 2000 | 8000 | 1 | 0.50 / 2.00 / 1.60 | - | vllm-nvfp4 | 50% |" in md
    assert "| m | vllm-nvfp4 | 100 | 1 | 1000 | 5000 | 1 | - | 2.00 | vllm-nvfp4 | - | - | - |" not in md


def test_the_profile_table_gives_the_time_per_token_and_the_top_kernels():
    prof = {"tokens": 64, "wall_ms_per_token": 2.612, "gpu_ms_per_token": 1.984,
            "kernels": [{"name": f"k{i}", "us_per_token": 100.0 - i, "calls_per_token": 32.0} for i in range(8)]}
    md = B.profile_table([{"model": "m", "profiles": {"autofp4-nvfp4": prof}}])
    assert "| m | autofp4-nvfp4 | 2.612 | 1.984 | k0 100; k1 99; k2 98; k3 97; k4 96 |" in md
