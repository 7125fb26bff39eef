"""Hypothesis strategies for hostile PEFT uploads: a valid adapter's files, mutated.

Each strategy draws `{filename: bytes}`. The mutations aim at what a parser can get wrong:
safetensors headers (huge, negative, overlapping or swapped offsets; wrong or unknown
dtypes; giant, negative or empty shapes; lying header lengths; deep JSON), adapter configs
(hostile values for every field that changes the math, deep or huge JSON, catastrophic
regexes), raw byte flips and truncation, random bytes, and odd file sets (pickles, missing
files, extra files).
"""

from __future__ import annotations

import json
import struct
from typing import Any

from hypothesis import strategies as st

Files = dict[str, bytes]
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_HUGE = [2**31, 2**32 + 7, 2**53, 2**62, 2**64 - 1]
_DTYPES = ["F32", "F16", "BF16", "F64", "I64", "I8", "U8", "BOOL", "F8_E4M3", "Q99", "", "f32"]


def split_safetensors(data: bytes) -> tuple[dict[str, Any], bytes]:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def join_safetensors(header: Any, body: bytes, length_delta: int = 0) -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", max(len(raw) + length_delta, 0) % 2**64) + raw + body


def deep_json(depth: int, kind: str) -> bytes:
    return (
        (b"[" * depth + b"]" * depth)
        if kind == "list"
        else (b'{"a":' * depth + b"1" + b"}" * depth)
    )


@st.composite
def header_mutation(draw: st.DrawFn, files: Files) -> Files:
    header, body = split_safetensors(files[WEIGHTS])
    names = sorted(k for k in header if k != "__metadata__")
    name = draw(st.sampled_from(names))
    entry = dict(header[name])
    kind = draw(
        st.sampled_from(
            ["offsets", "overlap", "dtype", "shape", "length", "deep", "metadata", "drop_body"]
        )
    )
    length_delta = 0
    if kind == "offsets":
        start, end = entry["data_offsets"]
        entry["data_offsets"] = draw(
            st.sampled_from(
                [[-8, end], [start, -1], [end, start], [start, _HUGE[3]], [_HUGE[4], _HUGE[4]]]
            )
            | st.lists(st.integers(-(2**64), 2**64), min_size=0, max_size=3)
        )
    elif kind == "overlap":
        other = header[draw(st.sampled_from(names))]
        entry["data_offsets"] = list(other["data_offsets"])
    elif kind == "dtype":
        entry["dtype"] = draw(st.sampled_from(_DTYPES) | st.integers() | st.none())
    elif kind == "shape":
        entry["shape"] = draw(
            st.lists(
                st.sampled_from(_HUGE) | st.integers(-3, 3) | st.integers(0, 10**6),
                min_size=0,
                max_size=6,
            )
        )
    elif kind == "length":
        length_delta = draw(st.integers(-64, 64) | st.sampled_from([-(2**40), 2**40, 2**63]))
    elif kind == "deep":
        depth = draw(st.integers(100, 200_000))
        return {**files, WEIGHTS: join_safetensors(deep_json(depth, "list"), body)}
    elif kind == "metadata":
        header["__metadata__"] = draw(
            st.dictionaries(st.text(max_size=8), st.text(max_size=8) | st.integers(), max_size=4)
            | st.integers()
            | st.lists(st.integers(), max_size=3)
        )
    else:
        body = body[: draw(st.integers(0, max(len(body) - 1, 0)))]
    header[name] = entry
    return {**files, WEIGHTS: join_safetensors(header, body, length_delta)}


_CONFIG_FIELDS = [
    "r",
    "lora_alpha",
    "rank_pattern",
    "alpha_pattern",
    "target_modules",
    "use_rslora",
    "peft_type",
    "bias",
    "use_dora",
    "init_lora_weights",
    "modules_to_save",
    "target_parameters",
]
_HOSTILE_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.lists(st.integers() | st.text(max_size=5), max_size=4),
    st.dictionaries(
        st.sampled_from(["o_proj", ".*", "(.*.*.*.*.*)*z", "(a|a?)+$", "[", "q_a_proj"]),
        st.integers(-2, 2**40) | st.floats(allow_nan=True) | st.text(max_size=3),
        max_size=3,
    ),
)


@st.composite
def config_mutation(draw: st.DrawFn, files: Files) -> Files:
    kind = draw(st.sampled_from(["field", "field", "deep", "huge", "not_object", "bad_utf8"]))
    if kind == "deep":
        depth = draw(st.integers(1_000, 200_000))
        return {**files, CONFIG: deep_json(depth, draw(st.sampled_from(["list", "object"])))}
    if kind == "huge":
        keys = draw(st.integers(10_000, 60_000))
        config = json.loads(files[CONFIG]) | {f"k{i}": i for i in range(keys)}
        return {**files, CONFIG: json.dumps(config).encode()}
    if kind == "not_object":
        return {**files, CONFIG: json.dumps(draw(_HOSTILE_VALUES)).encode()}
    if kind == "bad_utf8":
        return {**files, CONFIG: b'{"r": 4, "lora_alpha": \xff\xfe}'}
    config = json.loads(files[CONFIG])
    for key in draw(st.lists(st.sampled_from(_CONFIG_FIELDS), min_size=1, max_size=3)):
        config[key] = draw(_HOSTILE_VALUES)
    return {**files, CONFIG: json.dumps(config).encode()}


@st.composite
def byte_mutation(draw: st.DrawFn, files: Files) -> Files:
    target = draw(st.sampled_from([CONFIG, WEIGHTS]))
    data = bytearray(files[target])
    if draw(st.booleans()):
        return {**files, target: bytes(data[: draw(st.integers(0, len(data)))])}
    for _ in range(draw(st.integers(1, 8))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return {**files, target: bytes(data)}


@st.composite
def file_set_mutation(draw: st.DrawFn, files: Files) -> Files:
    kind = draw(st.sampled_from(["random_weights", "missing", "pickle", "extra", "empty"]))
    if kind == "random_weights":
        return {**files, WEIGHTS: draw(st.binary(max_size=4096))}
    if kind == "missing":
        return {k: v for k, v in files.items() if k != draw(st.sampled_from(sorted(files)))}
    if kind == "pickle":
        name = draw(st.sampled_from(["adapter_model.bin", "model.pt", "x.pkl", "a.ckpt"]))
        return {**files, name: b"\x80\x04cos\nsystem\n(S'true'\ntR."}
    if kind == "extra":
        return {**files, "added_tokens.json": draw(st.binary(max_size=64))}
    return {**files, WEIGHTS: b""}


def hostile_uploads(files: Files) -> st.SearchStrategy[Files]:
    """Any of the mutations of a valid adapter's `files`."""
    return st.one_of(
        header_mutation(files),
        config_mutation(files),
        byte_mutation(files),
        file_set_mutation(files),
    )
