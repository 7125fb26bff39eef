"""Declarative map from Hugging Face DeepSeek checkpoint names to our fused parameters.

One rule per checkpoint tensor family; the loader applies it to each tensor as it streams
in. The same table tells which fused slice a PEFT module lands in (e.g. q_a_proj → slice 0
of `attn.qkv_a`, kv_a_proj_with_mqa → slice 1), matching the canonical adapter layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from inference_svc.model.config import ModelConfig


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes.

    kind: "param" (copy into `module`.`attr`), "linear" (slice `slice_index` of a fused
    Linear) or "experts" (`which` = w13/w2, expert `expert`, or all experts when None).
    tensor_kind: "weight" or "scale" (an fp8 `weight_scale_inv`).
    """

    module: str
    kind: str
    tensor_kind: str = "weight"
    attr: str = "weight"
    slice_index: int = 0
    which: str = ""
    expert: int | None = None


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_SUFFIX = re.compile(r"^(.*?)(?:\.(weight|weight_scale_inv))?$")
_TOP_LEVEL = {
    "model.embed_tokens.weight": Target("embed", "param"),
    "model.norm.weight": Target("norm", "param"),
    "lm_head.weight": Target("lm_head", "param"),
}
_NORMS = {
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_attn_norm",
    "self_attn.q_a_layernorm": "attn.q_a_norm",
    "self_attn.kv_a_layernorm": "attn.kv_a_norm",
}
_ATTN = {"q_proj": "attn.q", "q_b_proj": "attn.q_b", "kv_b_proj": "attn.kv_b", "o_proj": "attn.o"}
_MLP_SLICES = {
    "gate_proj": ("mlp.gate_up", 0),
    "up_proj": ("mlp.gate_up", 1),
    "down_proj": ("mlp.down", 0),
}
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")
_EXPERT_SLICES = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}


class UnexpectedWeightError(KeyError):
    """A checkpoint tensor that this model has no place for."""


def map_name(name: str, config: ModelConfig) -> Target | None:
    """Target of checkpoint tensor `name`; None for tensors that are deliberately skipped."""
    if name in _TOP_LEVEL:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            return None  # tied to the embedding
        return _TOP_LEVEL[name]
    layer_match = _LAYER.match(name)
    if layer_match is None:
        if name.endswith("rotary_emb.inv_freq"):
            return None  # recomputed from the config
        raise UnexpectedWeightError(name)
    layer = int(layer_match.group(1))
    if layer >= config.num_layers:
        return None  # multi-token-prediction layer(s) of V3 checkpoints
    base, suffix = _SUFFIX.match(layer_match.group(2)).groups()
    tensor_kind = "scale" if suffix == "weight_scale_inv" else "weight"
    prefix = f"layers.{layer}."
    if base in _NORMS and suffix == "weight":
        return Target(prefix + _NORMS[base], "param")
    if base.startswith("self_attn."):
        proj = base.removeprefix("self_attn.")
        if proj == "q_a_proj":
            return Target(prefix + "attn.qkv_a", "linear", tensor_kind)
        if proj == "kv_a_proj_with_mqa":
            kv_slice = 0 if config.q_lora_rank is None else 1
            return Target(prefix + "attn.qkv_a", "linear", tensor_kind, slice_index=kv_slice)
        if proj in _ATTN:
            return Target(prefix + _ATTN[proj], "linear", tensor_kind)
    if base == "mlp.gate" and suffix == "weight":
        return Target(prefix + "moe.gate", "param")
    if base == "mlp.gate.e_score_correction_bias":
        return Target(prefix + "moe.gate", "param", attr="e_score_correction_bias")
    expert_match = _EXPERT.match(base)
    if expert_match:
        which, slice_index = _EXPERT_SLICES[expert_match.group(2)]
        return Target(
            prefix + "moe.experts", "experts", tensor_kind, which=which,
            slice_index=slice_index, expert=int(expert_match.group(1)),
        )  # fmt: skip
    # transformers-5 layout: all experts in one 3-D tensor, gate ⊕ up already fused.
    if base == "mlp.experts.gate_up_proj":
        return Target(prefix + "moe.experts", "experts", tensor_kind, which="w13")
    if base == "mlp.experts.down_proj":
        return Target(prefix + "moe.experts", "experts", tensor_kind, which="w2")
    mlp_proj = base.removeprefix("mlp.shared_experts.").removeprefix("mlp.")
    if mlp_proj in _MLP_SLICES:
        module, slice_index = _MLP_SLICES[mlp_proj]
        return Target(prefix + module, "linear", tensor_kind, slice_index=slice_index)
    raise UnexpectedWeightError(name)
