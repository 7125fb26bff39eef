"""The LoRA bytes a decode step must read (bench/lora_floor.py), against hand counts."""

from __future__ import annotations

import pytest

from adapter_store.model_shapes import ModuleShape
from bench.lora_floor import lora_step_bytes, tokens_per_slot

SHAPES = {
    # Two stacked slices (A has 2·rank rows), on two layers.
    "attn.qkv_a": ModuleShape("attn.qkv_a", 10, (3, 5), None, (0, 1)),
    # 4 routed experts, one layer.
    "moe.down": ModuleShape("moe.down", 4, (6,), 4, (1,)),
}


def test_linear_modules_count_each_adapter_once_per_layer():
    # Per adapter and layer: rank 2 · (2 slices · 10 in + 8 out) elements of 2 bytes.
    got = lora_step_bytes({"attn.qkv_a": SHAPES["attn.qkv_a"]}, 2, 2, [1, 3], top_k=2)
    assert got == {"linear": 2 * 2 * 112, "routed": 0.0}


def test_routed_experts_count_the_expected_distinct_keys():
    # Per key: 2 · (4 + 6) · 2 = 40 bytes. Keys under a uniform top-2 of 4 experts: one
    # token touches 4·(1 − 0.5) = 2 experts, three touch 4·(1 − 0.5³) = 3.5.
    got = lora_step_bytes(SHAPES, 2, 2, [1, 3, 0], top_k=2)
    assert got["linear"] == 448
    assert got["routed"] == pytest.approx((2 + 3.5) * 40)


def test_tokens_per_slot_leaves_out_the_base_model():
    assert sorted(tokens_per_slot([0, 0, -1, 3, 0, -1])) == [1, 3]
    assert tokens_per_slot([-1, -1]) == []
