"""Random canonical adapters for a base model config (what the store would write), for tests
and benchmarks: both import this one generator."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from adapter_store.format import (
    FORMAT_VERSION,
    CanonicalAdapter,
    Manifest,
    iter_layer_modules,
    model_lora_shapes,
    module_key,
    tensor_name,
)


def random_adapter(
    hf_config: Mapping[str, Any],
    rank: int,
    *,
    modules: Iterable[str] | None = None,
    moe_layout: str = "per_expert",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    base_model: str = "tiny",
    std: float = 1.0,
    device: str = "cpu",
) -> CanonicalAdapter:
    """An adapter of rank `rank` on every layer of `modules` (default: all of them).

    Values are random (normal, standard deviation `std`) and non-zero everywhere, so a test
    sees any misplaced row or column; benchmarks pass a small `std` so a random model's
    activations stay finite. `device="cuda"` draws the values there (much faster for
    adapters of GBs; other values than the CPU's for the same seed); tensors end on the CPU.
    `moe_layout="shared_outer"` gives moe.gate_up lora_A and moe.down lora_B a leading 1.
    """
    wanted = None if modules is None else set(modules)
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    module_ranks: dict[str, int] = {}
    module_slices: dict[str, list[int]] = {}
    has_moe = False
    for layer, shape in iter_layer_modules(model_lora_shapes(hf_config)):
        if wanted is not None and shape.module not in wanted:
            continue
        a_experts = b_experts = () if shape.num_experts is None else (shape.num_experts,)
        if shape.num_experts is not None:
            has_moe = True
            if moe_layout == "shared_outer":
                shared = (1,)
                a_experts = shared if shape.module == "moe.gate_up" else a_experts
                b_experts = shared if shape.module == "moe.down" else b_experts
        a_shape = (*a_experts, shape.stack * rank, shape.in_features)
        b_shape = (*b_experts, shape.out_features, rank)
        tensors[tensor_name(layer, shape.module, "lora_A")] = _randn(a_shape, generator, dtype, std)
        tensors[tensor_name(layer, shape.module, "lora_B")] = _randn(b_shape, generator, dtype, std)
        module_ranks[module_key(layer, shape.module)] = rank
        module_slices[module_key(layer, shape.module)] = list(shape.out_slices)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        base_model=base_model,
        rank=rank,
        module_ranks=module_ranks,
        moe_layout=moe_layout if has_moe else "none",
        dtype=str(dtype).removeprefix("torch."),
        sha256="",
        size_bytes=0,
        source_peft_config={"r": rank},
        module_slices=module_slices,
    )
    return CanonicalAdapter(manifest, tensors)


def _randn(shape: tuple[int, ...], generator: torch.Generator, dtype: torch.dtype, std: float):
    values = torch.randn(shape, generator=generator, device=generator.device)
    return values.mul_(std).to(dtype).cpu()
