"""Read a safetensors file that arrived in pieces (adapter_store.byte_pieces) into tensors,
without joining the pieces first.

Why not `safetensors.torch.load`: it takes one bytes object, and joining a 553 MB
download's pieces into one touches every page of a fresh allocation of that size (0.33-0.39
s on the 2-core machine, 2.6 s the first time in a process) and doubles the peak memory;
copying each tensor out of the pieces took 0.09-0.10 s (/tmp experiment, 8 MiB pieces).

What the file must be (the safetensors format): an 8-byte little-endian header length, a
JSON object of `name: {dtype, shape, data_offsets: [begin, end]}` (plus an optional
`__metadata__` of strings), then the data, whose tensors follow one another from 0 to the
end with no gap and no overlap, each exactly shape × dtype size bytes. Anything else is a
SafetensorsError naming what is wrong, as safetensors itself refuses it.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import torch

from adapter_store.byte_pieces import BytePieces

# The safetensors dtype names of the float types canonical adapters are stored in.
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


class SafetensorsError(ValueError):
    pass


def read_safetensors(
    pieces: BytePieces, views_of: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the file in `pieces`, each a fresh CPU tensor of its own; or, with
    `views_of` (uint8 [file bytes], the same bytes in one tensor), views into it wherever a
    tensor's data is aligned to its dtype (a copy where not)."""
    if sys.byteorder != "little":
        raise SafetensorsError("safetensors data is little-endian; this host is not")
    header, data_start = _header(pieces)
    entries = sorted(
        ((name, _entry(name, info)) for name, info in header.items() if name != "__metadata__"),
        key=lambda item: item[1][2],
    )
    tensors: dict[str, torch.Tensor] = {}
    end_of_previous = 0
    for name, (dtype, shape, begin, end) in entries:
        if begin != end_of_previous:
            raise SafetensorsError(
                f"tensor {name!r} starts at data byte {begin}, not where the previous one "
                f"ends ({end_of_previous}): a gap or an overlap"
            )
        if data_start + end > pieces.size:
            raise SafetensorsError(
                f"tensor {name!r} ends at byte {data_start + end}, outside the "
                f"{pieces.size}-byte file"
            )
        first = data_start + begin
        if views_of is not None and first % dtype.itemsize == 0:
            tensor = views_of[first : data_start + end].view(dtype).view(shape)
        else:
            tensor = torch.empty(shape, dtype=dtype)
            if end > begin:
                raw = tensor.view(-1).view(torch.uint8).numpy()  # [bytes] of the tensor
                pieces.copy_out(first, memoryview(raw))
        tensors[name] = tensor
        end_of_previous = end
    if data_start + end_of_previous != pieces.size:
        raise SafetensorsError(
            f"the tensors' data ends at byte {data_start + end_of_previous} of a "
            f"{pieces.size}-byte file"
        )
    return tensors


def _header(pieces: BytePieces) -> tuple[dict[str, Any], int]:
    """The JSON header and the offset of the data after it."""
    if pieces.size < 8:
        raise SafetensorsError(f"the file is {pieces.size} bytes, shorter than its header length")
    length_bytes = bytearray(8)
    pieces.copy_out(0, memoryview(length_bytes))
    length = int.from_bytes(length_bytes, "little")
    if length > min(MAX_HEADER_BYTES, pieces.size - 8):
        raise SafetensorsError(f"header length {length} does not fit a {pieces.size}-byte file")
    raw = bytearray(length)
    pieces.copy_out(8, memoryview(raw))
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"the header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SafetensorsError("the header is not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError("__metadata__ must map names to strings")
    return header, 8 + length


def _entry(name: str, info: Any) -> tuple[torch.dtype, list[int], int, int]:
    """(dtype, shape, begin, end) of one tensor's header entry, checked."""
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise SafetensorsError(f"tensor {name!r}: entry must hold dtype, shape and data_offsets")
    dtype = DTYPES.get(info["dtype"])
    if dtype is None:
        raise SafetensorsError(f"tensor {name!r}: dtype {info['dtype']!r} not in {tuple(DTYPES)}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(_count(dim) for dim in shape):
        raise SafetensorsError(f"tensor {name!r}: shape {shape!r} is not a list of counts")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_count, offsets)):
        raise SafetensorsError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    size = math.prod(shape) * dtype.itemsize
    if end - begin != size:
        raise SafetensorsError(
            f"tensor {name!r}: data_offsets {offsets} hold {end - begin} bytes, its "
            f"{info['dtype']} shape {shape} needs {size}"
        )
    return dtype, shape, begin, end


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0
