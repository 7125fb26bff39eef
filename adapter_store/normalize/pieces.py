"""PEFT LoRA pairs -> shape-checked, scaled pieces in one uniform layout.

A piece is one LoRA pair as PEFT defines it: `ΔW[g] = scaling · B[g] @ A[g]` over a group
dim `g` that is 1 for plain modules (and for the shared side of a shared-outer MoE pair) or
E for routed experts. Its lora_B rows cover one or more consecutive canonical slices (a
PEFT LoRA on the fused 3D `gate_up_proj` covers both gate and up with one A).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from adapter_store.errors import InvalidArgument
from adapter_store.format import ModuleShape, shape_at
from adapter_store.normalize.settings import LoraSettings
from adapter_store.normalize.targets import Target, parse_peft_key, resolve_target


@dataclass(frozen=True)
class LoraPiece:
    source: str  # PEFT module key, for messages
    layer: int
    target: Target
    lora_A: torch.Tensor  # [G, rank, in] float32
    lora_B: torch.Tensor  # [G, out_covered, rank] float32, scaling folded in

    @property
    def rank(self) -> int:
        return self.lora_A.shape[1]


def build_pieces(
    tensors: Mapping[str, torch.Tensor],
    settings: LoraSettings,
    shapes: Mapping[str, ModuleShape],
    num_layers: int,
) -> list[LoraPiece]:
    """Pair lora_A/lora_B per PEFT module, check shapes against the base model, fold scaling."""
    pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        peft_key = parse_peft_key(key, num_layers)
        pair = pairs.setdefault((peft_key.layer, peft_key.path), {})
        if peft_key.part in pair:
            raise InvalidArgument(f"{key}: duplicate of {pair[peft_key.part][0]}")
        pair[peft_key.part] = (key, tensor)

    pieces = []
    for (layer, path), pair in sorted(pairs.items()):
        missing = {"lora_A", "lora_B"} - set(pair)
        if missing:
            (key, _), *_ = pair.values()
            raise InvalidArgument(f"{key}: its {missing.pop()} is missing")
        (a_key, lora_A), (b_key, lora_B) = pair["lora_A"], pair["lora_B"]
        target = resolve_target(shapes, layer, path)
        if target.kind == "fused_experts":
            target, lora_A, lora_B = _unfold_fused_experts(
                target, a_key, lora_A, b_key, lora_B, shapes, layer, settings
            )
        else:
            shape = shape_at(shapes, layer, target.module)
            assert shape is not None  # resolve_target only returns modules the layer has
            lora_A, lora_B = _check_pair(
                target, shape, a_key, lora_A, b_key, lora_B, settings.rank_for(target.param_key)
            )
        scaling = settings.scaling_for(target.param_key)
        source = a_key.removesuffix(".weight").removesuffix(".lora_A")
        pieces.append(LoraPiece(source, layer, target, lora_A, lora_B * scaling))
    return pieces


def _shape_error(key: str, expected: str, found: torch.Tensor, why: str) -> InvalidArgument:
    return InvalidArgument(f"{key}: expected shape {expected} ({why}), found {list(found.shape)}")


def _check_pair(
    target: Target,
    shape: ModuleShape,
    a_key: str,
    lora_A: torch.Tensor,
    b_key: str,
    lora_B: torch.Tensor,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a plain [r, in]/[out, r] or explicit 3D [G, r, in]/[G, out, r] pair; -> 3D float32."""
    out = sum(shape.out_slices[s] for s in target.slices)
    why = f"{shape.module} of the base model, r={rank} from adapter_config.json"
    checked = []
    for key, tensor, expected in (
        (a_key, lora_A, (rank, shape.in_features)),
        (b_key, lora_B, (out, rank)),
    ):
        if target.kind == "linear":
            groups, shown = (1,), str(list(expected))
            as_3d = tensor.unsqueeze(0)
        else:
            # Explicit expert dim: E, or 1 for a side shared by all experts.
            groups, shown = (
                (1, shape.num_experts),
                f"[1 or {shape.num_experts}, {expected[0]}, {expected[1]}]",
            )
            as_3d = tensor
        if as_3d.dim() != 3 or as_3d.shape[0] not in groups or tuple(as_3d.shape[1:]) != expected:
            raise _shape_error(key, shown, tensor, why)
        checked.append(as_3d.float())
    return checked[0], checked[1]


def _unfold_fused_experts(
    target: Target,
    a_key: str,
    lora_A: torch.Tensor,
    b_key: str,
    lora_B: torch.Tensor,
    shapes: Mapping[str, ModuleShape],
    layer: int,
    settings: LoraSettings,
) -> tuple[Target, torch.Tensor, torch.Tensor]:
    """PEFT `target_parameters` on the fused 3D expert tensors -> per-expert 3D pair.

    PEFT's ParamWrapper (peft 0.21) keeps lora_A `[E*r, in]` expert-major (row e*r + k) and
    lora_B `[out, E*r]` rank-major (column k*E + e), and its ΔW is
    `einsum("o r e, e r i -> e o i", B.view(out, r, E), A.view(E, r, in))`. Nested wrappers
    do not name their parameter in the key, so it is told apart by the (in, out) shape:
    gate_up_proj is (hidden, 2·moe_inter), down_proj is (moe_inter, hidden) — never equal.
    """
    candidates = {
        "gate_up_proj": shape_at(shapes, layer, "moe.gate_up"),
        "down_proj": shape_at(shapes, layer, "moe.down"),
    }
    found_in = lora_A.shape[-1] if lora_A.dim() == 2 else None
    found_out = lora_B.shape[0] if lora_B.dim() == 2 else None
    for param, shape in candidates.items():
        assert shape is not None and shape.num_experts is not None
        if (shape.in_features, shape.out_features) != (found_in, found_out):
            continue
        param_key = f"{target.param_key}.{param}"
        rank, experts = settings.rank_for(param_key), shape.num_experts
        where = f"{param} with {experts} experts, r={rank} from adapter_config.json"
        if lora_A.shape[0] != experts * rank:
            raise _shape_error(a_key, str([experts * rank, shape.in_features]), lora_A, where)
        if lora_B.shape[1] != experts * rank:
            raise _shape_error(b_key, str([shape.out_features, experts * rank]), lora_B, where)
        per_expert_A = lora_A.float().reshape(experts, rank, shape.in_features)  # [E, r, in]
        per_expert_B = (
            lora_B.float().reshape(shape.out_features, rank, experts).permute(2, 0, 1).contiguous()
        )  # [E, out, r]
        slices = tuple(range(shape.stack))
        return (
            Target("experts_3d", shape.module, slices, None, param_key),
            per_expert_A,
            per_expert_B,
        )
    gate_up, down = candidates["gate_up_proj"], candidates["down_proj"]
    raise InvalidArgument(
        f"{a_key} / {b_key}: found lora_A {list(lora_A.shape)} and lora_B {list(lora_B.shape)}, "
        f"which fit neither experts.gate_up_proj (lora_A [E*r, {gate_up.in_features}], lora_B "  # type: ignore[union-attr]
        f"[{gate_up.out_features}, E*r]) nor experts.down_proj (lora_A [E*r, {down.in_features}], "  # type: ignore[union-attr]
        f"lora_B [{down.out_features}, E*r]), E={gate_up.num_experts}"  # type: ignore[union-attr]
    )
