"""Point a model's LoRA-carrying modules at the slot pool's buffers of their layer.

The modules keep views of the pool's fixed allocations, so loading or unloading a slot takes
effect without re-attaching, and captured CUDA graphs keep reading the right memory.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from inference_svc.layers.linear import Linear
from inference_svc.lora.apply import LoraWeights
from inference_svc.lora.pool import LoraPool
from inference_svc.models.deepseek_v3 import DeepseekV3Model

_ATTN = ("qkv_a", "q", "q_b", "kv_b", "o")


def attach_lora_pool(model: DeepseekV3Model, pool: LoraPool) -> None:
    """Give every canonical LoRA module of `model` its pool buffers.

    Raises ValueError when the pool was sized for another model (a module missing or extra,
    another width) or lives on another device / in another dtype than the model.
    """
    device = model.embed.weight.device
    # Compare where the tensors actually live: a pool made for "cuda" sits on "cuda:0".
    pool_device = pool.slot_rank.device
    if pool.dtype != model.dtype or pool_device != device:
        raise ValueError(
            f"LoRA pool is {pool.dtype} on {pool_device}, the model {model.dtype} on {device}"
        )
    held = set(pool.module_instances())
    targets = list(lora_targets(model))
    missing = [(layer, module) for layer, module, _, _ in targets if (layer, module) not in held]
    extra = held - {(layer, module) for layer, module, _, _ in targets}
    if missing or extra:
        raise ValueError(
            f"LoRA pool does not fit the model: lacks {missing[:5]}, has extra {sorted(extra)[:5]}"
        )
    for layer, module, owner, attribute in targets:
        weights = LoraWeights(
            pool.lora_a(layer, module), pool.lora_b(layer, module), pool.rank_of(layer, module)
        )
        if isinstance(owner, Linear):
            _check_linear(owner, weights, layer, module)
        setattr(owner, attribute, weights)


def lora_targets(model: DeepseekV3Model) -> Iterator[tuple[int, str, nn.Module, str]]:
    """(layer, canonical module, owning nn.Module, attribute that holds its LoraWeights)."""
    for index, layer in enumerate(model.layers):
        for name in _ATTN:
            linear = getattr(layer.attn, name, None)
            if linear is not None:
                yield index, f"attn.{name}", linear, "lora"
        if layer.mlp is not None:  # dense MLP or shared experts
            yield index, "mlp.gate_up", layer.mlp.gate_up, "lora"
            yield index, "mlp.down", layer.mlp.down, "lora"
        if layer.moe is not None:
            yield index, "moe.gate_up", layer.moe, "lora_gate_up"
            yield index, "moe.down", layer.moe, "lora_down"


def _check_linear(linear: Linear, weights: LoraWeights, layer: int, module: str) -> None:
    if (
        weights.a.shape[2] != linear.in_features
        or weights.b.shape[1] != linear.out_features
        or weights.a.shape[1] != len(linear.output_sizes) * weights.b.shape[2]
    ):
        raise ValueError(
            f"layers.{layer}.{module}: pool A {tuple(weights.a.shape)} / B "
            f"{tuple(weights.b.shape)} do not fit the layer (in {linear.in_features}, "
            f"out slices {linear.output_sizes})"
        )
