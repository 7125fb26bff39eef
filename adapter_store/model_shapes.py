"""Which canonical LoRA modules a DeepSeek-V3-family base model has, and their shapes.

Read from the HF `config.json` dict only (no weights), so the store can validate uploads and
the inference service can size its slot pool from the same numbers.

A canonical module is a stack of `len(out_slices)` LoRA pairs sharing one input: `lora_A` is
`[stack * r, in_features]` (slice `s` owns rows `s*r : (s+1)*r`) and `lora_B` is
`[sum(out_slices), r]` (slice `s` owns its `out_slices[s]` rows). Expert modules add a
leading expert dim.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from adapter_store.errors import InvalidArgument

CANONICAL_MODULES = (
    "attn.qkv_a",
    "attn.q",
    "attn.q_b",
    "attn.kv_b",
    "attn.o",
    "mlp.gate_up",
    "mlp.down",
    "moe.gate_up",
    "moe.down",
)

# Defaults of the HF config classes for keys that released config.json files sometimes omit:
# (first_k_dense_replace, n_shared_experts).
_FAMILY_DEFAULTS: dict[str, tuple[int, int]] = {
    "deepseek_v3": (3, 1),
    "kimi_k2": (3, 1),
    "deepseek_v2": (0, 2),
}


def is_routed_expert_module(module: str) -> bool:
    """Whether canonical `module` is one of the routed experts' (moe.*: an expert dim)."""
    return module.startswith("moe.")


@dataclass(frozen=True)
class ModuleShape:
    """Shape of one canonical module on the layers listed in `layers`."""

    module: str  # canonical name, e.g. "attn.qkv_a"
    in_features: int
    out_slices: tuple[int, ...]  # output width of each stacked slice
    num_experts: int | None  # None for non-expert modules
    layers: tuple[int, ...]  # decoder layers that have this module with this shape

    def __post_init__(self) -> None:
        if self.module not in CANONICAL_MODULES:
            raise ValueError(f"unknown canonical module {self.module!r}")
        if self.in_features <= 0 or not self.out_slices or min(self.out_slices) <= 0:
            raise ValueError(f"{self.module}: non-positive dims {self}")
        if (self.num_experts is not None) != is_routed_expert_module(self.module):
            raise ValueError(f"{self.module}: num_experts must be set exactly for moe.*")

    @property
    def stack(self) -> int:
        """Number of stacked slices (rows of lora_A = stack * r)."""
        return len(self.out_slices)

    @property
    def out_features(self) -> int:
        return sum(self.out_slices)


@dataclass(frozen=True)
class _MlaDims:
    hidden: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    nope: int
    rope: int
    v: int


def text_config(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language-model part of a config (Kimi-style wrappers nest it under text_config)."""
    nested = hf_config.get("text_config")
    return nested if isinstance(nested, Mapping) else hf_config


# Far above any released model (DeepSeek-V3: 61 layers, 256 experts, widths ≤ 18432), low
# enough that a config claiming more cannot make the store allocate without bound.
_MAX_COUNT = {"num_hidden_layers": 4096, "n_routed_experts": 16384, "num_attention_heads": 4096}
_MAX_WIDTH = 1 << 18


def _require(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgument(
            f"base model config: {key!r} must be a positive integer, got {value!r}"
        )
    limit = _MAX_COUNT.get(key, _MAX_WIDTH)
    if value > limit:
        raise InvalidArgument(f"base model config: {key!r} = {value} is above the limit {limit}")
    return value


def _family_default(config: Mapping[str, Any], key: str, index: int) -> int:
    if config.get(key) is not None:
        value = config[key]
        if not isinstance(value, int) or value < 0:
            raise InvalidArgument(
                f"base model config: {key!r} must be an integer >= 0, got {value!r}"
            )
        return value
    model_type = config.get("model_type")
    if model_type not in _FAMILY_DEFAULTS:
        raise InvalidArgument(
            f"base model config: {key!r} is missing and model_type {model_type!r} "
            "has no known default"
        )
    return _FAMILY_DEFAULTS[model_type][index]


def moe_layers(hf_config: Mapping[str, Any]) -> tuple[int, ...]:
    """Decoder layers whose MLP is a routed MoE (DeepSeek rule: after the first k dense layers,
    every `moe_layer_freq`-th layer)."""
    config = text_config(hf_config)
    num_layers = _require(config, "num_hidden_layers")
    if not config.get("n_routed_experts"):
        return ()
    first_dense = _family_default(config, "first_k_dense_replace", 0)
    freq = _require(config, "moe_layer_freq") if config.get("moe_layer_freq") else 1
    return tuple(layer for layer in range(first_dense, num_layers) if layer % freq == 0)


def model_lora_shapes(hf_config: Mapping[str, Any]) -> dict[str, ModuleShape]:
    """Every canonical module of the model, keyed by canonical module name.

    The MLP widths of dense layers (`intermediate_size`) and of MoE layers' shared experts
    (`moe_intermediate_size * n_shared_experts`) usually differ, so when they do, `mlp.*`
    appear twice, keyed `"mlp.gate_up#dense"` / `"mlp.gate_up#shared"` (the value's
    `.module` is still `"mlp.gate_up"`). Use `shape_at(shapes, layer, module)` or
    `iter_layer_modules(shapes)` to look shapes up per layer.
    """
    config = text_config(hf_config)
    dims = _MlaDims(
        hidden=_require(config, "hidden_size"),
        heads=_require(config, "num_attention_heads"),
        q_lora_rank=config.get("q_lora_rank") and _require(config, "q_lora_rank"),
        kv_lora_rank=_require(config, "kv_lora_rank"),
        nope=_require(config, "qk_nope_head_dim"),
        rope=_require(config, "qk_rope_head_dim"),
        v=_require(config, "v_head_dim"),
    )
    all_layers = tuple(range(_require(config, "num_hidden_layers")))
    shapes = _attention_shapes(dims, all_layers)

    routed = moe_layers(config)
    dense = tuple(layer for layer in all_layers if layer not in routed)
    mlp_groups: list[tuple[str, int, tuple[int, ...]]] = []
    if dense:
        mlp_groups.append(("dense", _require(config, "intermediate_size"), dense))
    if routed:
        n_shared = _family_default(config, "n_shared_experts", 1)
        if n_shared:
            moe_inter = _require(config, "moe_intermediate_size")
            mlp_groups.append(("shared", moe_inter * n_shared, routed))
    if len({inter for _, inter, _ in mlp_groups}) == 1:
        # One width everywhere: a single entry under the plain module name.
        merged = tuple(sorted(layer for _, _, layers in mlp_groups for layer in layers))
        mlp_groups = [("", mlp_groups[0][1], merged)]
    for group, inter, layers in mlp_groups:
        suffix = f"#{group}" if group else ""
        shapes[f"mlp.gate_up{suffix}"] = ModuleShape(
            "mlp.gate_up", dims.hidden, (inter, inter), None, layers
        )
        shapes[f"mlp.down{suffix}"] = ModuleShape("mlp.down", inter, (dims.hidden,), None, layers)

    if routed:
        experts = _require(config, "n_routed_experts")
        moe_inter = _require(config, "moe_intermediate_size")
        shapes["moe.gate_up"] = ModuleShape(
            "moe.gate_up", dims.hidden, (moe_inter, moe_inter), experts, routed
        )
        shapes["moe.down"] = ModuleShape("moe.down", moe_inter, (dims.hidden,), experts, routed)
    return shapes


def _attention_shapes(dims: _MlaDims, layers: tuple[int, ...]) -> dict[str, ModuleShape]:
    kv_a_out = dims.kv_lora_rank + dims.rope
    q_out = dims.heads * (dims.nope + dims.rope)
    shapes: dict[str, ModuleShape] = {}
    if dims.q_lora_rank is None:
        # DeepSeek-V2-Lite shape: a plain q_proj, and qkv_a carries kv_a alone.
        shapes["attn.qkv_a"] = ModuleShape("attn.qkv_a", dims.hidden, (kv_a_out,), None, layers)
        shapes["attn.q"] = ModuleShape("attn.q", dims.hidden, (q_out,), None, layers)
    else:
        shapes["attn.qkv_a"] = ModuleShape(
            "attn.qkv_a", dims.hidden, (dims.q_lora_rank, kv_a_out), None, layers
        )
        shapes["attn.q_b"] = ModuleShape("attn.q_b", dims.q_lora_rank, (q_out,), None, layers)
    shapes["attn.kv_b"] = ModuleShape(
        "attn.kv_b", dims.kv_lora_rank, (dims.heads * (dims.nope + dims.v),), None, layers
    )
    shapes["attn.o"] = ModuleShape("attn.o", dims.heads * dims.v, (dims.hidden,), None, layers)
    return shapes


def iter_layer_modules(shapes: Mapping[str, ModuleShape]) -> Iterator[tuple[int, ModuleShape]]:
    """(layer, shape) for every module instance of the model, ordered by layer then module."""
    pairs = [(layer, shape) for shape in shapes.values() for layer in shape.layers]
    order = {module: index for index, module in enumerate(CANONICAL_MODULES)}
    return iter(sorted(pairs, key=lambda pair: (pair[0], order[pair[1].module])))


def shape_at(shapes: Mapping[str, ModuleShape], layer: int, module: str) -> ModuleShape | None:
    """The shape of `module` in decoder `layer`, or None when that layer does not have it."""
    for shape in shapes.values():
        if shape.module == module and layer in shape.layers:
            return shape
    return None
