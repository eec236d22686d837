"""Tiny transformers configs (and random bf16 models) of the model kinds the checkpoint tests write and read."""
from __future__ import annotations

import torch
import transformers

ATTN = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, tie_word_embeddings=False)


def tiny_config(kind: str):
    """A two-layer config of ``kind``: llama, qwen3_moe, mixtral, deepseek_v3, gpt_oss (the last)."""
    if kind == "llama":
        return transformers.LlamaConfig(**ATTN, intermediate_size=128)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**ATTN, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                                           num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    if kind == "mixtral":
        return transformers.MixtralConfig(**ATTN, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    if kind == "deepseek_v3":
        return transformers.DeepseekV3Config(**{**ATTN, "num_key_value_heads": 4}, intermediate_size=128,
                                             moe_intermediate_size=32, first_k_dense_replace=1, n_routed_experts=8,
                                             n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                                             q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
                                             qk_nope_head_dim=16, v_head_dim=16)
    return transformers.GptOssConfig(**ATTN, head_dim=16, intermediate_size=64, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=16)


def tiny_model(kind: str = "llama", seed: int = 0):
    """A bf16 model of :func:`tiny_config` with random weights of ``seed`` (norms near 1)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind), dtype=torch.bfloat16)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.05)
            if n.endswith("norm.weight"):
                p.add_(1)
    return model
