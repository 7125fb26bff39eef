"""Config parsing of the DeepSeek family, and start-up errors for what we do not implement."""

from __future__ import annotations

import math

import pytest

from inference_svc.model.config import UnsupportedConfigError, parse_config

# Trimmed from deepseek-ai/DeepSeek-V3's config.json (original, pre-transformers-5 keys).
V3_ORIGINAL = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}

V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "max_position_embeddings": 163840,
}


def test_v3_original_config():
    c = parse_config(V3_ORIGINAL)
    assert c.q_lora_rank == 1536 and c.kv_cache_dim == 576
    assert c.routing.method == "noaux_tc" and c.routing.n_group == 8
    assert c.rope.is_yarn and c.rope.factor == 40 and c.rope.interleave
    assert c.quant.method == "fp8_block" and (c.quant.block_n, c.quant.block_k) == (128, 128)
    assert [c.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    mscale = 0.1 * math.log(40) + 1
    assert c.softmax_scale == pytest.approx(192**-0.5 * mscale * mscale)


def test_v2_lite_and_moe_layer_freq():
    c = parse_config({**V2_LITE, "moe_layer_freq": 2})
    assert c.model_type == "deepseek_v2" and c.q_lora_rank is None
    assert c.routing.scoring == "softmax" and c.routing.method == "greedy"
    assert [c.is_moe_layer(i) for i in range(5)] == [False, False, True, False, True]


def test_kimi_k2_text_config_inside_multimodal_wrapper():
    kimi_text = {**V3_ORIGINAL, "model_type": "kimi_k2", "n_group": 1, "topk_group": 1}
    quant = kimi_text.pop("quantization_config")
    wrapper = {"model_type": "kimi_vl", "text_config": kimi_text, "quantization_config": quant}
    c = parse_config(wrapper)
    assert c.model_type == "deepseek_v3" and c.routing.n_group == 1 and c.quant is not None


def test_transformers5_rope_parameters():
    cfg = {k: v for k, v in V3_ORIGINAL.items() if k not in ("rope_scaling", "rope_theta")}
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 5e4, "factor": 4.0,
                              "original_max_position_embeddings": 128}  # fmt: skip
    c = parse_config(cfg)
    assert c.rope.theta == 5e4 and c.rope.factor == 4 and c.rope.original_max_position == 128


@pytest.mark.parametrize(
    "change,message",
    [
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "not a DeepSeek"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 8}, "num_key_value_heads"),
        ({"topk_method": "sinkhorn"}, "topk_method"),
        ({"scoring_func": "softmax"}, "noaux_tc needs scoring_func sigmoid"),
        ({"n_group": 7}, "not divisible by n_group"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type"),
        ({"quantization_config": {"quant_method": "awq"}}, "awq"),
        ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "e4m3"),
        ({"vocab_size": None}, ""),
    ],
)
def test_unsupported_fields_fail_at_start_up(change, message):
    cfg = {**V3_ORIGINAL, **change}
    if change.get("vocab_size", 1) is None:
        del cfg["vocab_size"]
        message = "lacks required key 'vocab_size'"
    with pytest.raises(UnsupportedConfigError, match=message):
        parse_config(cfg)
