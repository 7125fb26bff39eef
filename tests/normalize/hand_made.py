"""Build PEFT-style upload folders by hand, for layouts `peft` itself does not produce."""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import save

PREFIX = "base_model.model.model.layers"


def peft_files(tensors: dict[str, torch.Tensor], **config: Any) -> dict[str, bytes]:
    """An upload: adapter_config.json (PEFT defaults + `config`) + adapter_model.safetensors."""
    full = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.05,
        "target_modules": "all-linear",
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "modules_to_save": None,
        **config,
    }
    weights = {key: tensor.contiguous() for key, tensor in tensors.items()}
    return {
        "adapter_config.json": json.dumps(full).encode(),
        "adapter_model.safetensors": save(weights),
        "README.md": b"# a model card\n",
    }


def lora_pair(
    generator: torch.Generator, path: str, rank: int, in_features: int, out_features: int
) -> dict[str, torch.Tensor]:
    """Random lora_A [r, in] / lora_B [out, r] under PEFT's key names for `path`."""
    return {
        f"{path}.lora_A.weight": torch.randn(rank, in_features, generator=generator),
        f"{path}.lora_B.weight": torch.randn(out_features, rank, generator=generator),
    }
