"""Per-part digests of weights.safetensors: what serialize writes, what a manifest may
claim, and the digest that binds the list to the store's record."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from adapter_store.errors import InvalidArgument
from adapter_store.format import Manifest, parts_digest, serialize
from tests.fixtures.random_adapters import random_adapter
from tests.fixtures.tiny_models import tiny_config

PART = 8192


@pytest.fixture(scope="module")
def serialized() -> tuple[bytes, dict]:
    adapter = random_adapter(tiny_config("v3_q_lora").to_dict(), 4, seed=3)
    weights, manifest_json = serialize(adapter, part_bytes=PART)
    return weights, json.loads(manifest_json)


def test_each_part_digest_is_the_sha256_of_its_bytes(serialized) -> None:
    weights, raw = serialized
    assert raw["part_bytes"] == PART and len(weights) % PART != 0  # a short last part
    expected = [
        hashlib.sha256(weights[start : start + PART]).hexdigest()
        for start in range(0, len(weights), PART)
    ]
    assert raw["part_sha256"] == expected and len(expected) > 3
    assert raw["sha256"] == hashlib.sha256(weights).hexdigest()
    manifest = Manifest.from_json(json.dumps(raw).encode())
    assert manifest.part_range(len(expected) - 1) == (PART * (len(expected) - 1), len(weights))


def test_the_binding_digest_covers_every_part_and_the_part_size(serialized) -> None:
    _weights, raw = serialized
    manifest = Manifest.from_json(json.dumps(raw).encode())
    assert len(manifest.parts_sha256) == 64
    for index in (0, len(raw["part_sha256"]) - 1):
        changed = list(raw["part_sha256"])
        changed[index] = "0" * 64
        assert parts_digest(PART, changed) != manifest.parts_sha256
    assert parts_digest(PART * 2, raw["part_sha256"]) != manifest.parts_sha256
    assert parts_digest(PART, []) == ""


def test_a_manifest_without_parts_still_reads(serialized) -> None:
    _weights, raw = serialized
    legacy = {k: v for k, v in raw.items() if k not in ("part_bytes", "part_sha256")}
    manifest = Manifest.from_json(json.dumps(legacy).encode())
    assert manifest.part_sha256 == [] and manifest.parts_sha256 == ""


@pytest.mark.parametrize(
    "change, message",
    [
        ({"part_bytes": 100}, "part_bytes 100 is below 4096"),
        ({"part_bytes": PART * 2}, r"part_sha256 has \d+ digests, \d+ bytes in parts of 16384"),
        ({"part_sha256": ["ab" * 32]}, "part_sha256 has 1 digests"),
        ({"size_bytes": 1}, "part_sha256 has"),
    ],
)
def test_inconsistent_parts_are_refused(serialized, change: dict, message: str) -> None:
    _weights, raw = serialized
    with pytest.raises(InvalidArgument, match=message):
        Manifest.from_json(json.dumps({**raw, **change}).encode())


def test_a_part_digest_that_is_not_hex_is_refused(serialized) -> None:
    _weights, raw = serialized
    digests = list(raw["part_sha256"])
    for bad in ("Z" * 64, digests[1] + "\n", digests[1][:63]):
        digests[1] = bad
        with pytest.raises(InvalidArgument, match=r"part_sha256\[1\] is not 64 hex digits"):
            Manifest.from_json(json.dumps({**raw, "part_sha256": digests}).encode())


def test_serialize_is_unchanged_by_the_part_size() -> None:
    adapter = random_adapter(tiny_config("v3_q_lora").to_dict(), 4, seed=5)
    small, _ = serialize(adapter, part_bytes=4096)
    tensors = {name: tensor.clone() for name, tensor in adapter.tensors.items()}
    default, manifest_json = serialize(adapter)
    assert small == default
    assert json.loads(manifest_json)["part_sha256"] == [hashlib.sha256(default).hexdigest()]
    assert all(torch.equal(adapter.tensors[n], t) for n, t in tensors.items())
