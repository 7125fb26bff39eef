"""ΔW of every module and expert from canonical tensors == PEFT's own, on tiny models."""

from __future__ import annotations

import pytest
import torch

from adapter_store.format import deserialize, serialize
from adapter_store.normalize import normalize_peft
from tests.normalize.peft_adapters import (
    HF_TO_CANONICAL,
    make_peft_adapter,
    merged_base_model,
    peft_delta_weights,
)

ATTN = ["q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TOL = dict(atol=1e-6, rtol=1e-5)


def _canonical_slice(adapter, layer: int, path: str) -> torch.Tensor:
    if path.startswith("mlp.experts."):
        module = "moe.gate_up" if path.endswith("gate_up_proj") else "moe.down"
        return adapter.delta_weight(layer, module)
    if path == "self_attn.kv_a_proj_with_mqa":
        module = "attn.qkv_a"
        index = len(adapter.manifest.module_slices[f"layers.{layer}.attn.qkv_a"]) - 1
    else:
        module, index = HF_TO_CANONICAL[path]
    slices = adapter.manifest.module_slices[f"layers.{layer}.{module}"]
    start = sum(slices[:index])
    return adapter.delta_weight(layer, module)[start : start + slices[index]]


def _check_parity(spec: str, **lora_kwargs) -> None:
    peft_model, files = make_peft_adapter(spec, **lora_kwargs)
    config = peft_model.base_model.model.config.to_dict()
    adapter = normalize_peft(files, config, base_model=spec, max_rank=64)
    # and through the serialized form, as the inference service reads it
    adapter = deserialize(*serialize(adapter))
    deltas = peft_delta_weights(peft_model)
    assert deltas, "peft adapted nothing"
    for (layer, path), expected in deltas.items():
        found = _canonical_slice(adapter, layer, path)
        torch.testing.assert_close(found, expected, **TOL, msg=f"layer {layer} {path}")
    adapted = {(layer, module) for layer, module in adapter.manifest.modules}
    expected_modules = set()
    for layer, path in deltas:
        if path.startswith("mlp.experts."):
            expected_modules.add((layer, "moe.gate_up" if "gate_up" in path else "moe.down"))
        elif path == "self_attn.kv_a_proj_with_mqa":
            expected_modules.add((layer, "attn.qkv_a"))
        else:
            expected_modules.add((layer, HF_TO_CANONICAL[path][0]))
    assert adapted == expected_modules


@pytest.mark.parametrize("spec", ["v3_q_lora", "v3_wide"])
def test_attention_and_fused_experts(spec: str) -> None:
    _check_parity(spec, r=4, lora_alpha=8, target_modules=ATTN, target_parameters=EXPERTS)


def test_no_q_lora_model() -> None:
    modules = ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    _check_parity(
        "v3_no_q_lora", r=3, lora_alpha=5, target_modules=modules, target_parameters=EXPERTS
    )


def test_rslora_rank_and_alpha_patterns() -> None:
    _check_parity(
        "v3_q_lora",
        r=4,
        lora_alpha=6,
        use_rslora=True,
        target_modules=ATTN,
        target_parameters=EXPERTS,
        rank_pattern={"q_b_proj": 2, r"layers\.1\.self_attn\.o_proj": 7, "down_proj": 3},
        alpha_pattern={"kv_b_proj": 11, "gate_up_proj": 3},
    )


def test_gate_up_down_names_moved_to_experts_by_peft() -> None:
    """peft 0.21 + transformers 5 turn gate/up/down_proj targets into experts parameters
    (rank and alpha doubled for gate_up through patterns); dense/shared MLPs get nothing."""
    _check_parity(
        "v3_q_lora",
        r=2,
        lora_alpha=4,
        target_modules=["gate_proj", "up_proj", "down_proj", "o_proj"],
    )


def test_half_present_qkv_a() -> None:
    _check_parity("v3_q_lora", r=4, lora_alpha=8, target_modules=["kv_a_proj_with_mqa"])
    _check_parity(
        "v3_q_lora", r=4, lora_alpha=8, target_modules=["q_a_proj"], layers_to_transform=[1]
    )


def test_regex_target_modules() -> None:
    _check_parity(
        "v3_wide", r=2, lora_alpha=2, target_modules=r".*layers\.1\.self_attn\.(q_b|kv_b)_proj"
    )


@pytest.mark.parametrize(
    ("spec", "attention"),
    [
        ("v3_q_lora", ATTN),
        ("v3_no_q_lora", ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]),
    ],
)
def test_model_logits_equal_merged_canonical(spec: str, attention: list[str]) -> None:
    """The PEFT model's logits == the base model with ΔW (from canonical) merged in."""
    peft_model, files = make_peft_adapter(
        spec, r=4, lora_alpha=8, target_modules=attention, target_parameters=EXPERTS
    )
    config = peft_model.base_model.model.config.to_dict()
    adapter = normalize_peft(files, config, base_model=spec, max_rank=16)
    merged = merged_base_model(spec, adapter).eval()
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, config["vocab_size"], (2, 11), generator=generator)
    with torch.no_grad():
        expected = peft_model(input_ids=tokens).logits
        found = merged(input_ids=tokens).logits
        with peft_model.disable_adapter():
            base = peft_model(input_ids=tokens).logits
    assert (expected - base).abs().max() > 0.1, "the adapter should change the logits"
    torch.testing.assert_close(found, expected, atol=2e-5, rtol=1e-4)
