"""Read an uploaded PEFT folder (filename -> bytes) without ever unpickling anything."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from adapter_store.errors import InvalidArgument
from adapter_store.finite import all_finite

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADDED_TOKENS_FILE = "added_tokens.json"
# torch.save / pickle outputs: loading them would run arbitrary code.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PeftUpload:
    config: dict[str, Any]  # adapter_config.json as uploaded
    tensors: dict[str, torch.Tensor]  # adapter_model.safetensors, keys as PEFT wrote them


def read_upload(files: Mapping[str, bytes], vocab_size: int | None) -> PeftUpload:
    """Pick the config and weights out of the uploaded files and check them at the byte level.

    Refuses pickle files, missing or malformed config/safetensors, non-float or non-finite
    tensors, and added tokens beyond the base vocabulary.
    """
    by_name: dict[str, bytes] = {}
    for path, data in files.items():
        name = PurePosixPath(path).name
        if name.lower().endswith(PICKLE_SUFFIXES):
            raise InvalidArgument(
                f"{path}: pickle checkpoints are never loaded; save the adapter with "
                "safe_serialization=True (adapter_model.safetensors)"
            )
        if name in by_name:
            raise InvalidArgument(f"{name} uploaded twice")
        by_name[name] = data
    for required in (CONFIG_FILE, WEIGHTS_FILE):
        if required not in by_name:
            raise InvalidArgument(f"{required} is missing from the upload (got {sorted(by_name)})")
    if ADDED_TOKENS_FILE in by_name:
        _refuse_added_tokens(
            _json_object(ADDED_TOKENS_FILE, by_name[ADDED_TOKENS_FILE]), vocab_size
        )
    config = _json_object(CONFIG_FILE, by_name[CONFIG_FILE])
    return PeftUpload(config=config, tensors=_load_tensors(by_name[WEIGHTS_FILE]))


def _json_object(name: str, data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"{name} is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidArgument(f"{name} is nested too deeply to be a PEFT file") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{name} must hold a JSON object, found {type(value).__name__}")
    return value


def _refuse_added_tokens(added: dict[str, Any], vocab_size: int | None) -> None:
    # Tokenizers often list special tokens the base vocabulary already has; only ids past
    # the base vocabulary need new embedding rows, which a LoRA adapter cannot carry.
    new = sorted(
        token
        for token, index in added.items()
        if not isinstance(index, int) or vocab_size is None or index >= vocab_size
    )
    if new:
        raise InvalidArgument(
            f"{ADDED_TOKENS_FILE}: added tokens {new[:5]} are not in the base model's "
            f"vocabulary (size {vocab_size}); adapters with new tokens are not supported"
        )


def _load_tensors(data: bytes) -> dict[str, torch.Tensor]:
    try:
        tensors = load_safetensors(data)
    except Exception as exc:  # safetensors raises its own (Rust-side) error types
        raise InvalidArgument(f"{WEIGHTS_FILE} is truncated or malformed: {exc}") from None
    if not tensors:
        raise InvalidArgument(f"{WEIGHTS_FILE} holds no tensors")
    for key, tensor in tensors.items():
        if tensor.dtype not in FLOAT_DTYPES:
            raise InvalidArgument(
                f"{key}: dtype {str(tensor.dtype).removeprefix('torch.')} is not supported "
                "(float32, float16 or bfloat16)"
            )
        if not all_finite(tensor):
            raise InvalidArgument(f"{key}: contains NaN or Inf")
    return tensors
