"""Where each PEFT key lands in the canonical layout: key parsing and the per-layer target map.

The map is declarative: for a decoder layer of the base model it lists every HF module path
that can carry LoRA and the canonical (module, slices) it feeds. Anything not in it is a
module the base model does not have at that layer and is refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from adapter_store.errors import InvalidArgument
from adapter_store.format import ModuleShape, shape_at

LoraPart = Literal["lora_A", "lora_B"]
TargetKind = Literal["linear", "experts_3d", "fused_experts"]

_PEFT_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(.+)\.(lora_A|lora_B)(?:\.weight)?$"
)
_PER_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(\w+)$")
# PEFT `target_parameters` on the fused 3D expert tensors saves one pair per parameter on the
# experts module itself, nesting wrappers: "mlp.experts", "mlp.experts.base_layer", ...
_FUSED_EXPERTS = re.compile(r"^mlp\.experts(?:\.base_layer)*$")

# Messages for keys that are recognisably something we do not support.
_KNOWN_UNSUPPORTED = (
    ("lora_magnitude_vector", "DoRA magnitude vectors are not supported"),
    ("lora_embedding_", "LoRA on embeddings is not supported"),
    ("trainable_tokens", "trainable/added tokens are not supported"),
    ("embed_tokens", "embedding weights (added tokens) are not supported"),
    ("lm_head", "lm_head weights (added tokens) are not supported"),
    ("modules_to_save", "full copies of modules (modules_to_save) are not supported"),
    ("lora_B.bias", "LoRA bias (lora_bias) is not supported"),
)


@dataclass(frozen=True)
class PeftKey:
    layer: int
    path: str  # module path inside the decoder layer, e.g. "self_attn.q_a_proj"
    part: LoraPart


@dataclass(frozen=True)
class Target:
    """Where one PEFT module's LoRA pair goes."""

    kind: TargetKind
    module: str  # canonical module
    slices: tuple[int, ...]  # canonical slices its lora_B rows cover, in order
    expert: int | None = None  # per-expert keys: the expert index
    param_key: str = ""  # PEFT's name for rank/alpha_pattern matching (model.layers.L....)


def parse_peft_key(key: str, num_layers: int) -> PeftKey:
    match = _PEFT_KEY.match(key)
    if not match:
        for needle, message in _KNOWN_UNSUPPORTED:
            if needle in key:
                raise InvalidArgument(f"{key}: {message}")
        raise InvalidArgument(
            f"{key}: not a LoRA weight of a decoder layer "
            "(expected base_model.model.model.layers.L.<module>.lora_A/lora_B[.weight])"
        )
    layer = int(match.group(1))
    if layer >= num_layers:
        raise InvalidArgument(
            f"{key}: layer {layer} is beyond the base model's {num_layers} layers"
        )
    return PeftKey(layer=layer, path=match.group(2), part=match.group(3))  # type: ignore[arg-type]


def _layer_targets(shapes: Mapping[str, ModuleShape], layer: int) -> dict[str, Target]:
    """HF module path -> target, for every module of this layer (experts as `mlp.experts.*.x`)."""

    def linear(module: str, *slices: int) -> Target:
        return Target("linear", module, slices or (0,))

    targets: dict[str, Target] = {}
    qkv_a = shape_at(shapes, layer, "attn.qkv_a")
    if qkv_a is not None:
        if qkv_a.stack == 2:
            targets["self_attn.q_a_proj"] = linear("attn.qkv_a", 0)
        targets["self_attn.kv_a_proj_with_mqa"] = linear("attn.qkv_a", qkv_a.stack - 1)
    for path, module in (
        ("self_attn.q_proj", "attn.q"),
        ("self_attn.q_b_proj", "attn.q_b"),
        ("self_attn.kv_b_proj", "attn.kv_b"),
        ("self_attn.o_proj", "attn.o"),
    ):
        if shape_at(shapes, layer, module) is not None:
            targets[path] = linear(module)
    has_moe = shape_at(shapes, layer, "moe.gate_up") is not None
    if shape_at(shapes, layer, "mlp.gate_up") is not None:
        mlp = "mlp.shared_experts" if has_moe else "mlp"
        targets[f"{mlp}.gate_proj"] = linear("mlp.gate_up", 0)
        targets[f"{mlp}.up_proj"] = linear("mlp.gate_up", 1)
        targets[f"{mlp}.down_proj"] = linear("mlp.down")
    if has_moe:
        for names, module, slices in (
            (("gate_proj", "w1"), "moe.gate_up", (0,)),
            (("up_proj", "w3"), "moe.gate_up", (1,)),
            (("down_proj", "w2"), "moe.down", (0,)),
        ):
            for name in names:
                targets[f"mlp.experts.*.{name}"] = Target("linear", module, slices)
        # Explicit 3D tensors with an expert dim (E, or 1 for the shared side).
        targets["mlp.experts.gate_up_proj"] = Target("experts_3d", "moe.gate_up", (0, 1))
        targets["mlp.experts.down_proj"] = Target("experts_3d", "moe.down", (0,))
    return targets


def resolve_target(shapes: Mapping[str, ModuleShape], layer: int, path: str) -> Target:
    """The target of the PEFT module at `path` in `layer`, with its pattern-matching key."""
    prefix = f"model.layers.{layer}."
    if _FUSED_EXPERTS.match(path) and shape_at(shapes, layer, "moe.gate_up") is not None:
        # Which parameter it adapts is decided from the tensor shapes (see pieces.py).
        return Target("fused_experts", "moe.gate_up", (0, 1), param_key=prefix + "mlp.experts")
    targets = _layer_targets(shapes, layer)
    expert = None
    lookup = path
    per_expert = _PER_EXPERT.match(path)
    if per_expert:
        expert, lookup = int(per_expert.group(1)), f"mlp.experts.*.{per_expert.group(2)}"
    target = targets.get(lookup)
    if path == "mlp.gate":
        raise InvalidArgument(
            f"model.layers.{layer}.mlp.gate: LoRA on the MoE router is not supported "
            "(PEFT adds it for target_modules='all-linear'; exclude 'gate' to train without it)"
        )
    if target is None:
        known = ", ".join(sorted(targets))
        raise InvalidArgument(
            f"model.layers.{layer}.{path}: the base model has no such LoRA-able module in "
            f"layer {layer} (it has: {known})"
        )
    if expert is not None:
        experts = shape_at(shapes, layer, target.module).num_experts  # type: ignore[union-attr]
        if expert >= experts:  # type: ignore[operator]
            raise InvalidArgument(
                f"model.layers.{layer}.{path}: expert {expert} is beyond the model's "
                f"{experts} experts"
            )
    return Target(target.kind, target.module, target.slices, expert, prefix + path)
