"""model_lora_shapes against the real HF modules of every tiny variant."""

from __future__ import annotations

import pytest

from adapter_store.errors import InvalidArgument
from adapter_store.format import CANONICAL_MODULES, iter_layer_modules, model_lora_shapes, shape_at
from tests.fixtures.tiny_models import TINY_SPECS, build_tiny_model

# canonical module -> HF weights (relative to the decoder layer) whose [out, in] it stacks
_HF_SOURCES = {
    "attn.qkv_a": ["self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"],
    "attn.q": ["self_attn.q_proj"],
    "attn.q_b": ["self_attn.q_b_proj"],
    "attn.kv_b": ["self_attn.kv_b_proj"],
    "attn.o": ["self_attn.o_proj"],
}


def _hf_weight_shapes(model, layer: int, module: str) -> list[tuple[int, ...]]:
    decoder = model.model.layers[layer]
    if module in _HF_SOURCES:
        names = _HF_SOURCES[module]
    else:
        mlp = "mlp.shared_experts" if hasattr(decoder.mlp, "experts") else "mlp"
        names = {
            "mlp.gate_up": [f"{mlp}.gate_proj", f"{mlp}.up_proj"],
            "mlp.down": [f"{mlp}.down_proj"],
            "moe.gate_up": ["mlp.experts.gate_up_proj"],
            "moe.down": ["mlp.experts.down_proj"],
        }[module]
    shapes = []
    for name in names:
        try:
            target = decoder.get_submodule(name)
        except AttributeError:
            try:
                target = decoder.get_parameter(name)
            except AttributeError:
                continue
        shapes.append(tuple(getattr(target, "weight", target).shape))
    return shapes


@pytest.mark.parametrize("name", sorted(TINY_SPECS))
def test_shapes_match_hf_modules(name: str) -> None:
    model = build_tiny_model(name)
    shapes = model_lora_shapes(model.config.to_dict())
    seen = set()
    for layer, shape in iter_layer_modules(shapes):
        seen.add((layer, shape.module))
        hf = _hf_weight_shapes(model, layer, shape.module)
        if shape.num_experts is None:
            assert hf == [(width, shape.in_features) for width in shape.out_slices]
        else:
            assert hf == [(shape.num_experts, shape.out_features, shape.in_features)]
    # every HF module that LoRA can target is covered
    for layer in range(model.config.num_hidden_layers):
        for module in CANONICAL_MODULES:
            if _hf_weight_shapes(model, layer, module):
                assert (layer, module) in seen, (layer, module)
                assert shape_at(shapes, layer, module) is not None


def test_no_q_lora_has_single_slice_qkv_a() -> None:
    shapes = model_lora_shapes(build_tiny_model("v3_no_q_lora").config.to_dict())
    assert shapes["attn.qkv_a"].out_slices == (32 + 8,)
    assert "attn.q" in shapes and "attn.q_b" not in shapes


def test_text_config_and_moe_layer_freq() -> None:
    config = build_tiny_model("v3_q_lora").config.to_dict()
    config.update(num_hidden_layers=6, moe_layer_freq=2, first_k_dense_replace=1)
    shapes = model_lora_shapes({"model_type": "kimi_vl", "text_config": config})
    assert shapes["moe.gate_up"].layers == (2, 4)
    assert shapes["mlp.gate_up#dense"].layers == (0, 1, 3, 5)
    assert shape_at(shapes, 3, "moe.down") is None


def test_missing_key_is_refused() -> None:
    config = build_tiny_model("v3_q_lora").config.to_dict()
    del config["kv_lora_rank"]
    with pytest.raises(InvalidArgument, match="kv_lora_rank"):
        model_lora_shapes(config)
