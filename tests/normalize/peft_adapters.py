"""Adapters made by `peft` itself on tiny DeepSeek-V3 models, and their ΔW as PEFT computes it."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from tests.fixtures.tiny_models import build_tiny_model

# HF module path inside a decoder layer -> (canonical module, slice) — written out here
# independently of adapter_store.normalize.targets so the test does not grade itself.
HF_TO_CANONICAL = {
    "self_attn.q_a_proj": ("attn.qkv_a", 0),
    "self_attn.q_proj": ("attn.q", 0),
    "self_attn.q_b_proj": ("attn.q_b", 0),
    "self_attn.kv_b_proj": ("attn.kv_b", 0),
    "self_attn.o_proj": ("attn.o", 0),
    "mlp.gate_proj": ("mlp.gate_up", 0),
    "mlp.up_proj": ("mlp.gate_up", 1),
    "mlp.down_proj": ("mlp.down", 0),
    "mlp.shared_experts.gate_proj": ("mlp.gate_up", 0),
    "mlp.shared_experts.up_proj": ("mlp.gate_up", 1),
    "mlp.shared_experts.down_proj": ("mlp.down", 0),
}


def make_peft_adapter(spec: str, seed: int = 0, **lora_kwargs: Any):
    """A PEFT model on a tiny base with random non-zero lora_A/lora_B, and its saved files."""
    from peft import LoraConfig, get_peft_model

    model = build_tiny_model(spec)
    peft_model = get_peft_model(model, LoraConfig(lora_dropout=0.0, **lora_kwargs))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    with tempfile.TemporaryDirectory() as folder:
        peft_model.save_pretrained(folder)
        files = {path.name: path.read_bytes() for path in Path(folder).iterdir()}
    return peft_model.eval(), files


def peft_delta_weights(peft_model) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, HF path or expert parameter) -> ΔW from PEFT's own get_delta_weight."""
    deltas = {}
    for name, module in peft_model.named_modules():
        if not hasattr(module, "get_delta_weight") or "default" not in getattr(
            module, "lora_A", {}
        ):
            continue
        rest = name.split(".layers.", 1)[1]
        layer, path = rest.split(".", 1)
        parameter = getattr(module, "parameter_name", None)
        if parameter is not None:
            path = f"mlp.experts.{parameter}"
        deltas[(int(layer), path)] = module.get_delta_weight("default").detach().float()
    return deltas


def merged_base_model(spec: str, adapter) -> torch.nn.Module:
    """The tiny base model with the canonical adapter's ΔW added to its weights."""
    model = build_tiny_model(spec)
    with torch.no_grad():
        for layer, module in adapter.manifest.modules:
            decoder = model.model.layers[layer]
            delta = adapter.delta_weight(layer, module)
            if module == "moe.gate_up":
                decoder.mlp.experts.gate_up_proj += delta
            elif module == "moe.down":
                decoder.mlp.experts.down_proj += delta
            else:
                for weight in _weights_of(decoder, module):
                    rows, delta = delta[: weight.shape[0]], delta[weight.shape[0] :]
                    weight += rows
                assert delta.numel() == 0, (layer, module)
    return model


def _weights_of(decoder, module: str):
    for path, (name, _) in sorted(HF_TO_CANONICAL.items(), key=lambda kv: kv[1][1]):
        if name == module:
            try:
                yield decoder.get_submodule(path).weight
            except AttributeError:
                continue
    if module == "attn.qkv_a":
        yield decoder.self_attn.kv_a_proj_with_mqa.weight
