"""A safetensors file read straight from its pieces equals safetensors' own reading of the
joined file, however it was cut; a malformed one is refused with what is wrong."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load, save

from adapter_store.byte_pieces import HashedPieces
from adapter_store.safetensors_pieces import SafetensorsError, read_safetensors


def _cut(blob: bytes, rng: random.Random, max_piece: int) -> HashedPieces:
    pieces, start = HashedPieces(), 0
    while start < len(blob):
        end = min(len(blob), start + rng.randint(1, max_piece))
        pieces.append(blob[start:end])
        start = end
    return pieces


def _file(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize("max_piece", [1, 7, 4096, 1 << 30])
def test_every_tensor_equals_safetensors_reading(max_piece: int) -> None:
    rng = random.Random(max_piece)
    gen = torch.Generator().manual_seed(max_piece)
    tensors = {
        "a": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "b": torch.randn(64, 2, 33, generator=gen),
        "c": torch.randn(7, generator=gen).to(torch.float16),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
    }
    blob = save(tensors, metadata={"format_version": "1"})
    read = read_safetensors(_cut(blob, rng, max_piece))
    expected = load(blob)
    assert read.keys() == expected.keys()
    for name, tensor in expected.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape
        assert torch.equal(read[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8))


def _pieces(blob: bytes) -> HashedPieces:
    pieces = HashedPieces()
    pieces.append(blob)
    return pieces


F32_8 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def _one(**changes: object) -> bytes:
    """A file of one 8-byte tensor whose entry has `changes`."""
    return _file({"t": {**F32_8, **changes}}, bytes(8))


@pytest.mark.parametrize(
    ("blob", "says"),
    [
        (b"\x01\x00", "shorter than its header length"),
        ((10**9).to_bytes(8, "little") + b"{}", "does not fit"),
        (b"\x03\x00\x00\x00\x00\x00\x00\x00{x}", "not JSON"),
        (_file([1, 2], b""), "not a JSON object"),  # type: ignore[arg-type]
        (_file({"__metadata__": {"k": 1}}, b""), "__metadata__"),
        (_one(dtype="I64", shape=[1]), "dtype"),
        (_one(shape=[3]), "needs 12"),
        (_one(shape=[-2]), "shape"),
        (_one(data_offsets=[8]), "begin, end"),
        (_file({"t": {"dtype": "F32", "shape": [2]}}, bytes(8)), "must hold"),
        (_file({"t": F32_8}, bytes(7)), "outside"),  # the data is cut short
        (_file({"t": F32_8}, bytes(9)), "ends at byte"),  # trailing bytes
        (
            _file({"t": F32_8, "u": {**F32_8, "data_offsets": [12, 20]}}, bytes(20)),
            "gap or an overlap",
        ),
        (
            _file({"t": F32_8, "u": {**F32_8, "data_offsets": [4, 12]}}, bytes(12)),
            "gap or an overlap",
        ),
    ],
)
def test_malformed_files_are_refused_naming_the_fault(blob: bytes, says: str) -> None:
    with pytest.raises(SafetensorsError, match=says):
        read_safetensors(_pieces(blob))


def test_copy_out_of_range_is_refused() -> None:
    pieces = _pieces(b"abc")
    with pytest.raises(ValueError, match="outside"):
        pieces.copy_out(2, memoryview(bytearray(2)))


def test_views_of_one_buffer_share_its_memory_where_aligned() -> None:
    """With `views_of`, aligned tensors are views into that tensor (no copy); a tensor
    whose data is not aligned to its dtype is copied out; the values are the same."""
    half = torch.tensor([1.5], dtype=torch.float16)  # 2 bytes: the float32 after it is at 2
    floats = torch.tensor([3.25, -1.0])
    header = {
        "h": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]},
        "f": {"dtype": "F32", "shape": [2], "data_offsets": [2, 10]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # the data starts 8-byte aligned, as safetensors pads
    blob = len(raw).to_bytes(8, "little") + raw + half.view(torch.uint8).numpy().tobytes()
    blob += floats.view(torch.uint8).numpy().tobytes()
    buffer = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    read = read_safetensors(_pieces(blob), views_of=buffer)
    assert torch.equal(read["h"], half) and torch.equal(read["f"], floats)
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    assert start <= read["h"].data_ptr() < end  # a view
    assert not start <= read["f"].data_ptr() < end  # misaligned: copied
    buffer[-1] = 0  # the view follows the buffer; the copy does not
    assert torch.equal(read["f"], floats)
