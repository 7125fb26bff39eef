"""`--model tiny`: the small trained DeepSeek-V3 shipped in `inference_svc/embedded/base`
(see docs/demo_model.md); plus a tiny random DeepSeek-V3 built in memory for tests that
want one without a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from inference_svc.model.config import parse_config
from inference_svc.model.loader import LoadedModel, build_model
from inference_svc.model.tokenizer import ByteTokenizer

# What `--model tiny` serves: an HF folder with config.json, safetensors and tokenizer.json.
EMBEDDED_BASE_DIR = Path(__file__).resolve().parents[1] / "embedded" / "base"
EMBEDDED_ADAPTERS_DIR = EMBEDDED_BASE_DIR.parent / "adapters"
TINY_MODEL_NAME = "tiny"


def model_folder(model: str) -> Path:
    """The HF folder `--model` names: the embedded demo model for "tiny", else the path."""
    return EMBEDDED_BASE_DIR if model == TINY_MODEL_NAME else Path(model)


TINY_CONFIG = {
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "rope_theta": 10000.0,
}


def load_tiny_model(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> LoadedModel:
    """A random-weight tiny DeepSeek-V3 (std 0.08, norms 1) with a byte-level tokenizer."""
    config = parse_config(TINY_CONFIG)
    model = build_model(config, device, dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                values = torch.randn(param.shape, generator=generator) * 0.08
                param.copy_(values.to(param.dtype))
    tokenizer = ByteTokenizer(config.bos_token_id, config.eos_token_ids)
    return LoadedModel(config, model, tokenizer)
