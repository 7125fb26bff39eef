"""Canonical format: round trip, sha check, malformed input, ΔW from its definition."""

from __future__ import annotations

import json

import pytest
import torch

from adapter_store.errors import InvalidArgument
from adapter_store.format import (
    FORMAT_VERSION,
    CanonicalAdapter,
    Manifest,
    deserialize,
    parse_tensor_name,
    serialize,
    tensor_name,
)

RANK = 4


def _adapter(moe_layout: str = "shared_outer") -> CanonicalAdapter:
    g = torch.Generator().manual_seed(0)
    experts, hidden, inter = 3, 10, 6
    shared = moe_layout == "shared_outer"
    tensors = {
        tensor_name(0, "attn.qkv_a", "lora_A"): torch.randn(2 * RANK, hidden, generator=g),
        tensor_name(0, "attn.qkv_a", "lora_B"): torch.randn(5 + 7, RANK, generator=g),
        tensor_name(1, "moe.gate_up", "lora_A"): torch.randn(
            1 if shared else experts, 2 * RANK, hidden, generator=g
        ),
        tensor_name(1, "moe.gate_up", "lora_B"): torch.randn(experts, 2 * inter, RANK, generator=g),
        tensor_name(1, "moe.down", "lora_A"): torch.randn(experts, RANK, inter, generator=g),
        tensor_name(1, "moe.down", "lora_B"): torch.randn(
            1 if shared else experts, hidden, RANK, generator=g
        ),
    }
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        base_model="tiny",
        rank=RANK,
        module_ranks={
            "layers.0.attn.qkv_a": RANK,
            "layers.1.moe.gate_up": 3,
            "layers.1.moe.down": 2,
        },
        moe_layout=moe_layout,
        dtype="float32",
        sha256="",
        size_bytes=0,
        source_peft_config={"r": RANK},
        module_slices={
            "layers.0.attn.qkv_a": [5, 7],
            "layers.1.moe.gate_up": [inter, inter],
            "layers.1.moe.down": [hidden],
        },
    )
    return CanonicalAdapter(manifest, tensors)


def test_tensor_names() -> None:
    assert tensor_name(3, "attn.kv_b", "lora_B") == "layers.3.attn.kv_b.lora_B"
    assert parse_tensor_name("layers.3.attn.kv_b.lora_B") == (3, "attn.kv_b", "lora_B")
    for bad in ("layers.3.attn.kv.lora_B", "layers.x.attn.o.lora_A", "layers.1.attn.o.weight"):
        with pytest.raises(InvalidArgument):
            parse_tensor_name(bad)


@pytest.mark.parametrize("layout", ["shared_outer", "per_expert"])
def test_round_trip_and_sha(layout: str) -> None:
    adapter = _adapter(layout)
    weights, manifest_json = serialize(adapter)
    manifest = json.loads(manifest_json)
    assert manifest["size_bytes"] == len(weights) and len(manifest["sha256"]) == 64
    back = deserialize(weights, manifest_json)
    assert back.manifest == adapter.manifest
    assert back.tensors.keys() == adapter.tensors.keys()
    for name, tensor in adapter.tensors.items():
        assert torch.equal(back.tensors[name], tensor)
    # serializing twice gives the same bytes (content addressing relies on it)
    assert serialize(back)[0] == weights


def test_sha_mismatch_is_refused() -> None:
    weights, manifest_json = serialize(_adapter())
    tampered = bytearray(weights)
    tampered[-1] ^= 1
    with pytest.raises(InvalidArgument, match="sha256"):
        deserialize(bytes(tampered), manifest_json)
    deserialize(bytes(tampered), manifest_json, verify=False)  # bytes still parse


def test_malformed_inputs_are_refused() -> None:
    weights, manifest_json = serialize(_adapter())
    with pytest.raises(InvalidArgument, match="malformed"):
        deserialize(weights[: len(weights) // 2], manifest_json, verify=False)
    with pytest.raises(InvalidArgument, match="JSON"):
        deserialize(weights, b"{not json")
    raw = json.loads(manifest_json)
    for field, value, message in [
        ("format_version", 99, "format_version"),
        ("moe_layout", "weird", "moe_layout"),
        ("rank", 0, "rank"),
        ("module_ranks", {"layers.0.attn.qkv_a": 99}, "module_ranks"),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            deserialize(weights, json.dumps({**raw, field: value}).encode(), verify=False)
    del raw["dtype"]
    with pytest.raises(InvalidArgument, match="dtype"):
        deserialize(weights, json.dumps(raw).encode(), verify=False)


def test_tensor_shape_mismatch_is_refused() -> None:
    adapter = _adapter()
    adapter.tensors[tensor_name(0, "attn.qkv_a", "lora_B")] = torch.zeros(12, RANK + 1)
    with pytest.raises(InvalidArgument, match="layers.0.attn.qkv_a"):
        serialize(adapter)


def test_delta_weight_from_definition() -> None:
    adapter = _adapter("shared_outer")
    t = adapter.tensors
    a, b = t["layers.0.attn.qkv_a.lora_A"], t["layers.0.attn.qkv_a.lora_B"]
    expected = torch.cat([b[:5] @ a[:RANK], b[5:] @ a[RANK:]])
    torch.testing.assert_close(adapter.delta_weight(0, "attn.qkv_a"), expected)
    gate_up = adapter.delta_weight(1, "moe.gate_up")
    down = adapter.delta_weight(1, "moe.down")
    assert gate_up.shape == (3, 12, 10) and down.shape == (3, 10, 6)
    for e in range(3):
        a, b = t["layers.1.moe.gate_up.lora_A"][0], t["layers.1.moe.gate_up.lora_B"][e]
        expected = torch.cat([b[:6] @ a[:RANK], b[6:] @ a[RANK:]])
        torch.testing.assert_close(gate_up[e], expected)
        a, b = t["layers.1.moe.down.lora_A"][e], t["layers.1.moe.down.lora_B"][0]
        torch.testing.assert_close(down[e], b @ a)
