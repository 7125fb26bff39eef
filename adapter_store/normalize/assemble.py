"""Pieces -> canonical tensors: stack slices, zero-pad to the adapter rank, lay out experts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from adapter_store.errors import InvalidArgument
from adapter_store.format import CANONICAL_MODULES, ModuleShape, module_key, shape_at, tensor_name
from adapter_store.model_shapes import is_routed_expert_module
from adapter_store.normalize.pieces import LoraPiece


@dataclass(frozen=True)
class CanonicalTensors:
    tensors: dict[str, torch.Tensor]  # float32, tensor_name(...) -> tensor
    module_ranks: dict[str, int]  # "layers.L.module" -> true rank
    module_slices: dict[str, list[int]]
    moe_layout: str


def moe_layout_of(pieces: Sequence[LoraPiece]) -> str:
    """ "shared_outer" when every routed-expert piece shares gate_up's A and down's B across
    experts (leading dim 1); "per_expert" for any other MoE LoRA; "none" without MoE LoRA."""
    moe = [p for p in pieces if is_routed_expert_module(p.target.module)]
    if not moe:
        return "none"
    shared = all(
        p.target.expert is None
        and (p.lora_A if p.target.module == "moe.gate_up" else p.lora_B).shape[0] == 1
        for p in moe
    )
    return "shared_outer" if shared else "per_expert"


def float32_bytes_bound(
    pieces: Sequence[LoraPiece], shapes: Mapping[str, ModuleShape], rank: int
) -> int:
    """An upper bound of the bytes `assemble` allocates (float32, zeros included), known before
    allocating: a tiny upload can claim one expert of a huge MoE, or a small rank padded to a
    large one, so the canonical size is not bounded by the upload's size."""
    total = 0
    for layer, module in {(piece.layer, piece.target.module) for piece in pieces}:
        shape = shape_at(shapes, layer, module)
        assert shape is not None  # pieces only target modules the layer has
        experts = shape.num_experts or 1
        total += experts * rank * (shape.stack * shape.in_features + shape.out_features)
    return 4 * total


def assemble(
    pieces: Sequence[LoraPiece], shapes: Mapping[str, ModuleShape], rank: int
) -> CanonicalTensors:
    """Place every piece into its module's stacked, rank-`rank` tensors (zeros elsewhere)."""
    layout = moe_layout_of(pieces)
    by_module: dict[tuple[int, str], list[LoraPiece]] = {}
    for piece in pieces:
        by_module.setdefault((piece.layer, piece.target.module), []).append(piece)
    order = {module: index for index, module in enumerate(CANONICAL_MODULES)}

    result = CanonicalTensors({}, {}, {}, layout)
    for (layer, module), group in sorted(
        by_module.items(), key=lambda kv: (kv[0][0], order[kv[0][1]])
    ):
        shape = shape_at(shapes, layer, module)
        assert shape is not None  # pieces only target modules the layer has
        lora_A, lora_B = _module_tensors(group, shape, rank, layout)
        result.tensors[tensor_name(layer, module, "lora_A")] = lora_A
        result.tensors[tensor_name(layer, module, "lora_B")] = lora_B
        result.module_ranks[module_key(layer, module)] = max(p.rank for p in group)
        result.module_slices[module_key(layer, module)] = list(shape.out_slices)
    return result


def _module_tensors(
    group: Sequence[LoraPiece], shape: ModuleShape, rank: int, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> lora_A [G_A, stack*r, in], lora_B [G_B, out, r] (G squeezed for non-expert modules)."""
    experts = shape.num_experts or 1
    shared_a = layout == "shared_outer" and shape.module == "moe.gate_up"
    shared_b = layout == "shared_outer" and shape.module == "moe.down"
    lora_A = torch.zeros(1 if shared_a else experts, shape.stack * rank, shape.in_features)
    lora_B = torch.zeros(1 if shared_b else experts, shape.out_features, rank)
    offsets = [sum(shape.out_slices[:s]) for s in range(shape.stack + 1)]

    whole: dict[int, str] = {}  # slice -> source of a piece covering it for every expert
    per_expert: dict[tuple[int, int | None], str] = {}  # (slice, expert) -> source
    for piece in group:
        target = piece.target
        for s in target.slices:
            clash = whole.get(s) or (
                per_expert.get((s, target.expert))
                if target.expert is not None
                else next((src for (cs, _), src in per_expert.items() if cs == s), None)
            )
            if clash is not None:
                raise InvalidArgument(
                    f"{piece.source} and {clash} both adapt slice {s} of {shape.module} "
                    f"in layer {piece.layer}"
                )
            if target.expert is None:
                whole[s] = piece.source
            else:
                per_expert[(s, target.expert)] = piece.source
        # Expert rows this piece writes: one expert, or all (a group dim of 1 broadcasts).
        rows = slice(None) if target.expert is None else slice(target.expert, target.expert + 1)
        for s in target.slices:
            lora_A[rows, s * rank : s * rank + piece.rank] = piece.lora_A
        b_rows = slice(offsets[target.slices[0]], offsets[target.slices[-1] + 1])
        lora_B[rows, b_rows, : piece.rank] = piece.lora_B
    if shape.num_experts is None:
        return lora_A[0], lora_B[0]
    return lora_A, lora_B
