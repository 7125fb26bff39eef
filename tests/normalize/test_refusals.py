"""Every refusal: INVALID_ARGUMENT naming the key (and expected vs found shape where relevant)."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch

from adapter_store.errors import InvalidArgument
from adapter_store.normalize import normalize_peft
from tests.fixtures.tiny_models import tiny_config
from tests.normalize.hand_made import PREFIX, lora_pair, peft_files
from tests.normalize.peft_adapters import make_peft_adapter

CONFIG = tiny_config("v3_q_lora").to_dict()
NO_Q_LORA = tiny_config("v3_no_q_lora").to_dict()
HIDDEN, INTER, MOE_INTER, E = 64, 96, 32, 8


def _o_proj(layer: int = 0, rank: int = 4) -> dict[str, torch.Tensor]:
    return lora_pair(
        torch.Generator().manual_seed(0), f"{PREFIX}.{layer}.self_attn.o_proj", rank, HIDDEN, HIDDEN
    )


def _refused(files: dict[str, bytes], *needles: str, config=CONFIG, max_rank: int = 16) -> str:
    with pytest.raises(InvalidArgument) as info:
        normalize_peft(files, config, base_model="tiny", max_rank=max_rank)
    message = str(info.value)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "Traceback" not in message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def _with(tensors_update: Callable[[dict], None] | None = None, **config) -> dict[str, bytes]:
    tensors = _o_proj()
    if tensors_update:
        tensors_update(tensors)
    return peft_files(tensors, **config)


class _Exploit:
    """Unpickling this touches a marker file; a loader that unpickles would leave it behind."""

    marker: Path

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("name", ["adapter_model.bin", "training_args.bin", "optimizer.pt"])
def test_pickle_files_are_refused_and_never_unpickled(tmp_path: Path, name: str) -> None:
    exploit = _Exploit()
    exploit.marker = tmp_path / "unpickled"
    files = {**_with(), name: pickle.dumps(exploit)}
    _refused(files, name, "pickle")
    assert not exploit.marker.exists()


def test_truncated_and_malformed_safetensors() -> None:
    files = _with()
    weights = files["adapter_model.safetensors"]
    for broken in (weights[: len(weights) - 7], weights[:5], b"\x00" * 64, b"not safetensors"):
        _refused({**files, "adapter_model.safetensors": broken}, "adapter_model.safetensors")


def test_missing_files_and_bad_json() -> None:
    files = _with()
    _refused(
        {"adapter_model.safetensors": files["adapter_model.safetensors"]}, "adapter_config.json"
    )
    _refused({"adapter_config.json": files["adapter_config.json"]}, "adapter_model.safetensors")
    _refused({**files, "adapter_config.json": b"{"}, "adapter_config.json", "JSON")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf(bad: float) -> None:
    def poison(tensors):
        tensors[f"{PREFIX}.0.self_attn.o_proj.lora_B.weight"][3, 1] = bad

    _refused(_with(poison), f"{PREFIX}.0.self_attn.o_proj.lora_B.weight", "NaN or Inf")


def test_integer_tensor() -> None:
    def to_int(tensors):
        key = f"{PREFIX}.0.self_attn.o_proj.lora_A.weight"
        tensors[key] = tensors[key].to(torch.int32)

    _refused(_with(to_int), "o_proj.lora_A.weight", "int32")


@pytest.mark.parametrize(
    ("path", "rank_in_out", "needles"),
    [
        ("0.self_attn.foo_proj", (4, HIDDEN, HIDDEN), ["foo_proj", "no such LoRA-able module"]),
        ("0.mlp.shared_experts.gate_proj", (4, HIDDEN, MOE_INTER), ["shared_experts.gate_proj"]),
        ("1.mlp.gate_proj", (4, HIDDEN, INTER), ["layers.1.mlp.gate_proj"]),
        ("0.mlp.experts.0.gate_proj", (4, HIDDEN, MOE_INTER), ["layers.0.mlp.experts.0.gate_proj"]),
        ("1.mlp.experts.8.w1", (4, HIDDEN, MOE_INTER), ["expert 8", "8 experts"]),
        ("1.mlp.gate", (4, HIDDEN, E), ["router"]),
        ("3.self_attn.o_proj", (4, HIDDEN, HIDDEN), ["layer 3", "3 layers"]),
    ],
)
def test_unknown_modules_and_layers(path: str, rank_in_out, needles: list[str]) -> None:
    rank, fan_in, fan_out = rank_in_out
    tensors = lora_pair(torch.Generator(), f"{PREFIX}.{path}", rank, fan_in, fan_out)
    _refused(peft_files(tensors), *needles)


def test_q_a_proj_on_model_without_q_lora() -> None:
    tensors = lora_pair(torch.Generator(), f"{PREFIX}.0.self_attn.q_a_proj", 4, HIDDEN, 48)
    _refused(peft_files(tensors), "q_a_proj", config=NO_Q_LORA)


def test_router_lora_from_peft_all_linear() -> None:
    peft_model, files = make_peft_adapter(
        "v3_q_lora", r=2, lora_alpha=4, target_modules="all-linear"
    )
    _refused(files, "mlp.gate", "router")


@pytest.mark.parametrize(
    ("key", "shape", "expected"),
    [
        (f"{PREFIX}.0.self_attn.o_proj.lora_A.weight", (4, HIDDEN + 1), "expected shape [4, 64]"),
        (f"{PREFIX}.0.self_attn.o_proj.lora_B.weight", (HIDDEN, 5), "expected shape [64, 4]"),
        (f"{PREFIX}.0.self_attn.o_proj.lora_A.weight", (4, HIDDEN, 1), "expected shape [4, 64]"),
    ],
)
def test_shape_mismatch_names_expected_and_found(key: str, shape, expected: str) -> None:
    def reshape(tensors):
        tensors[key] = torch.zeros(shape)

    message = _refused(_with(reshape), key, expected, f"found {list(shape)}")
    assert "attn.o" in message


def test_rank_differs_from_config() -> None:
    # tensors of rank 4 but the config claims r=8
    _refused(_with(r=8), "o_proj.lora_A.weight", "expected shape [8, 64]", "found [4, 64]")


def test_fused_experts_shape_mismatch() -> None:
    tensors = {
        f"{PREFIX}.1.mlp.experts.lora_A.weight": torch.zeros(E * 4, HIDDEN + 3),
        f"{PREFIX}.1.mlp.experts.lora_B.weight": torch.zeros(2 * MOE_INTER, E * 4),
    }
    _refused(peft_files(tensors), "mlp.experts.lora_A", "gate_up_proj", "down_proj", "[32, 67]")
    tensors = {
        f"{PREFIX}.1.mlp.experts.lora_A.weight": torch.zeros(E * 3, HIDDEN),
        f"{PREFIX}.1.mlp.experts.lora_B.weight": torch.zeros(2 * MOE_INTER, E * 3),
    }
    _refused(peft_files(tensors), "expected shape [32, 64]", "found [24, 64]")


def test_3d_experts_wrong_expert_dim() -> None:
    tensors = {
        f"{PREFIX}.1.mlp.experts.down_proj.lora_A.weight": torch.zeros(E - 1, 4, MOE_INTER),
        f"{PREFIX}.1.mlp.experts.down_proj.lora_B.weight": torch.zeros(E, HIDDEN, 4),
    }
    _refused(peft_files(tensors), "down_proj.lora_A", "[1 or 8, 4, 32]", "found [7, 4, 32]")


def test_missing_partner_and_duplicates() -> None:
    def drop_b(tensors):
        del tensors[f"{PREFIX}.0.self_attn.o_proj.lora_B.weight"]

    _refused(_with(drop_b), "o_proj.lora_A.weight", "lora_B is missing")

    def duplicate(tensors):
        key = f"{PREFIX}.0.self_attn.o_proj.lora_A"
        tensors[key] = tensors[f"{key}.weight"].clone()

    _refused(_with(duplicate), "duplicate")

    g = torch.Generator()
    both = lora_pair(g, f"{PREFIX}.1.mlp.experts.2.up_proj", 4, HIDDEN, MOE_INTER) | {
        f"{PREFIX}.1.mlp.experts.gate_up_proj.lora_A.weight": torch.zeros(E, 4, HIDDEN),
        f"{PREFIX}.1.mlp.experts.gate_up_proj.lora_B.weight": torch.zeros(E, 2 * MOE_INTER, 4),
    }
    _refused(peft_files(both), "both adapt slice")


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"lora_bias": True}, "lora_bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"trainable_token_indices": [5, 6]}, "trainable_token_indices"),
        ({"peft_type": "IA3"}, "IA3"),
        ({"bias": "all"}, "bias"),
        ({"init_lora_weights": "pissa_niter_4"}, "pissa"),
        ({"rank_pattern": {"o_proj(": 2}}, "rank_pattern"),
        ({"alpha_pattern": {"o_proj": -1}}, "alpha_pattern"),
        ({"r": 0}, "r must be"),
    ],
)
def test_unsupported_config(config: dict, needle: str) -> None:
    _refused(_with(**config), "adapter_config.json", needle)


@pytest.mark.parametrize(
    ("key", "needle"),
    [
        (f"{PREFIX}.0.self_attn.o_proj.lora_magnitude_vector", "DoRA"),
        (f"{PREFIX}.0.self_attn.o_proj.lora_B.bias", "lora_bias"),
        ("base_model.model.model.embed_tokens.weight", "added tokens"),
        ("base_model.model.lm_head.weight", "added tokens"),
        ("base_model.model.model.embed_tokens.lora_embedding_A", "embeddings"),
        ("base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta", "tokens"),
        (f"{PREFIX}.0.mlp.modules_to_save.default.down_proj.weight", "modules_to_save"),
        ("something.else", "not a LoRA weight"),
    ],
)
def test_unsupported_keys(key: str, needle: str) -> None:
    def add(tensors):
        tensors[key] = torch.zeros(4, 4)

    _refused(_with(add), key, needle)


def test_added_tokens() -> None:
    vocab = CONFIG["vocab_size"]
    known = {**_with(), "added_tokens.json": json.dumps({"<s>": 0, "<eos>": 1}).encode()}
    normalize_peft(known, CONFIG, base_model="tiny", max_rank=8)  # ids inside the vocab: fine
    new = {**_with(), "added_tokens.json": json.dumps({"<tool>": vocab}).encode()}
    _refused(new, "added_tokens.json", "<tool>")


def test_rank_above_max() -> None:
    _refused(peft_files(_o_proj(rank=8), r=8), "o_proj", "rank 8", "maximum rank 4", max_rank=4)


def test_bad_dtype_request() -> None:
    with pytest.raises(InvalidArgument, match="dtype"):
        normalize_peft(_with(), CONFIG, base_model="tiny", max_rank=8, dtype="int8")
