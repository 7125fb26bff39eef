"""Point a model's LoRA-carrying modules at the slot pool's buffers of their layer.

The modules keep views of the pool's fixed allocations, so loading or unloading a slot takes
effect without re-attaching, and captured CUDA graphs keep reading the right memory. Some
dense linears' bf16 base weights move into the pool's allocations (`CARRIED_MODULES`), each
above its A buffer.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor, nn

from inference_svc.layers.linear import Linear
from inference_svc.lora.apply import LoraWeights
from inference_svc.lora.pool import LoraPool
from inference_svc.models.deepseek_v3 import DeepseekV3Model

_ATTN = ("qkv_a", "q", "q_b", "kv_b", "o")
# The modules whose bf16 base weights the pool carries (`LoraPool.carry_base_weights`), so
# that a short step's shrink rides in the base product (lora_apply.shrinks_in_product).
# Not q_b: carried too, it took back 20-40 µs of the gain of an 8-layer decode step at
# B=64 / 128 × 32 adapters (H200, docs/benchmarks.md, fortieth session). Not kv_b (its
# linear runs only on prompts' context rows) nor q (models without q_lora_rank): unmeasured.
CARRIED_MODULES = frozenset({"attn.qkv_a", "attn.o", "mlp.gate_up", "mlp.down"})


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
    for layer, module, owner, _ in targets:
        if isinstance(owner, Linear):
            a, b = pool.lora_a(layer, module), pool.lora_b(layer, module)
            _check_linear(owner, a, b, layer, module)
    pool.carry_base_weights(
        {
            (layer, module): owner
            for layer, module, owner, _ in targets
            if module in CARRIED_MODULES and isinstance(owner, Linear) and owner.has_plain_weight()
        }
    )
    for layer, module, owner, attribute in targets:
        weights = LoraWeights(
            pool.lora_a(layer, module), pool.lora_b(layer, module), pool.rank_of(layer, module),
            pool.carrier(layer, module),
        )  # fmt: skip
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


def _check_linear(linear: Linear, a: Tensor, b: Tensor, layer: int, module: str) -> None:
    if (
        a.shape[2] != linear.in_features
        or b.shape[1] != linear.out_features
        or a.shape[1] != len(linear.output_sizes) * b.shape[2]
    ):
        raise ValueError(
            f"layers.{layer}.{module}: pool A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
            f"the layer (in {linear.in_features}, out slices {linear.output_sizes})"
        )
