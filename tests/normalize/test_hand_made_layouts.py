"""Layouts made by hand (dense/shared MLP, per-expert keys, 3D and shared-outer experts),
checked against ΔW = scaling · B @ A from their definition."""

from __future__ import annotations

import math

import pytest
import torch

from adapter_store.normalize import normalize_peft
from tests.fixtures.tiny_models import build_tiny_model, tiny_config
from tests.normalize.hand_made import PREFIX, lora_pair, peft_files
from tests.normalize.peft_adapters import merged_base_model

CONFIG = tiny_config("v3_q_lora").to_dict()  # hidden 64, inter 96, moe_inter 32, E 8, 3 layers
HIDDEN, INTER, MOE_INTER, E = 64, 96, 32, 8
TOL = dict(atol=1e-6, rtol=1e-5)


def _delta(tensors, path: str, scaling: float) -> torch.Tensor:
    return (
        scaling
        * tensors[f"{path}.lora_B.weight"].float()
        @ tensors[f"{path}.lora_A.weight"].float()
    )


def test_dense_and_shared_mlp_half_present_and_key_forms() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        **lora_pair(g, f"{PREFIX}.0.mlp.gate_proj", 4, HIDDEN, INTER),
        **lora_pair(g, f"{PREFIX}.0.mlp.up_proj", 4, HIDDEN, INTER),
        **lora_pair(g, f"{PREFIX}.0.mlp.down_proj", 4, INTER, HIDDEN),
        **lora_pair(g, f"{PREFIX}.1.mlp.shared_experts.up_proj", 4, HIDDEN, MOE_INTER),
        **lora_pair(g, f"{PREFIX}.2.mlp.shared_experts.down_proj", 2, MOE_INTER, HIDDEN),
    }
    # bare "model.layers" keys without ".weight" are accepted too
    bare = {
        k.removeprefix("base_model.model.").removesuffix(".weight"): v for k, v in tensors.items()
    }
    for upload in (tensors, bare):
        adapter = normalize_peft(
            peft_files(upload, rank_pattern={r"layers\.2\..*down_proj": 2}),
            CONFIG,
            base_model="tiny",
            max_rank=8,
        )
        assert adapter.manifest.rank == 4 and adapter.manifest.moe_layout == "none"
        assert adapter.manifest.module_ranks == {
            "layers.0.mlp.gate_up": 4,
            "layers.0.mlp.down": 4,
            "layers.1.mlp.gate_up": 4,
            "layers.2.mlp.down": 2,
        }
        gate_up0 = adapter.delta_weight(0, "mlp.gate_up")
        torch.testing.assert_close(
            gate_up0[:INTER], _delta(tensors, f"{PREFIX}.0.mlp.gate_proj", 2.0), **TOL
        )
        torch.testing.assert_close(
            gate_up0[INTER:], _delta(tensors, f"{PREFIX}.0.mlp.up_proj", 2.0), **TOL
        )
        shared = adapter.delta_weight(1, "mlp.gate_up")
        assert torch.equal(shared[:MOE_INTER], torch.zeros(MOE_INTER, HIDDEN))  # absent gate half
        torch.testing.assert_close(
            shared[MOE_INTER:],
            _delta(tensors, f"{PREFIX}.1.mlp.shared_experts.up_proj", 2.0),
            **TOL,
        )
        torch.testing.assert_close(
            adapter.delta_weight(2, "mlp.down"),
            _delta(tensors, f"{PREFIX}.2.mlp.shared_experts.down_proj", 8 / 2),
            **TOL,
        )
        # padding: the rank-2 module's extra rank columns are exactly zero
        assert torch.equal(
            adapter.tensors["layers.2.mlp.down.lora_B"][:, 2:], torch.zeros(HIDDEN, 2)
        )


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")])
def test_per_expert_keys(names: tuple[str, str, str]) -> None:
    g = torch.Generator().manual_seed(1)
    gate, up, down = names
    tensors = {}
    for e in range(E):
        if e != 5:  # expert 5 has no gate LoRA: zeros for its gate slice
            tensors |= lora_pair(g, f"{PREFIX}.1.mlp.experts.{e}.{gate}", 3, HIDDEN, MOE_INTER)
        tensors |= lora_pair(g, f"{PREFIX}.1.mlp.experts.{e}.{up}", 3, HIDDEN, MOE_INTER)
        if e < 4:  # only some experts adapt down_proj
            tensors |= lora_pair(g, f"{PREFIX}.2.mlp.experts.{e}.{down}", 3, MOE_INTER, HIDDEN)
    adapter = normalize_peft(
        peft_files(tensors, r=3, lora_alpha=6, use_rslora=True), CONFIG, base_model="t", max_rank=8
    )
    assert adapter.manifest.moe_layout == "per_expert"
    assert adapter.tensors["layers.1.moe.gate_up.lora_A"].shape == (E, 6, HIDDEN)
    assert adapter.tensors["layers.2.moe.down.lora_B"].shape == (E, HIDDEN, 3)
    scaling = 6 / math.sqrt(3)
    gate_up_delta = adapter.delta_weight(1, "moe.gate_up")
    down_delta = adapter.delta_weight(2, "moe.down")
    zeros_gate = torch.zeros(MOE_INTER, HIDDEN)
    for e in range(E):
        expected_gate = (
            zeros_gate if e == 5 else _delta(tensors, f"{PREFIX}.1.mlp.experts.{e}.{gate}", scaling)
        )
        torch.testing.assert_close(gate_up_delta[e, :MOE_INTER], expected_gate, **TOL)
        torch.testing.assert_close(
            gate_up_delta[e, MOE_INTER:],
            _delta(tensors, f"{PREFIX}.1.mlp.experts.{e}.{up}", scaling),
            **TOL,
        )
        expected_down = (
            _delta(tensors, f"{PREFIX}.2.mlp.experts.{e}.{down}", scaling)
            if e < 4
            else torch.zeros(HIDDEN, MOE_INTER)
        )
        torch.testing.assert_close(down_delta[e], expected_down, **TOL)
        torch.testing.assert_close(adapter.delta_weight(2, "moe.down", e), expected_down, **TOL)


def _experts_3d(
    g: torch.Generator, layer: int, rank: int, shared_outer: bool
) -> dict[str, torch.Tensor]:
    first = 1 if shared_outer else E
    path = f"{PREFIX}.{layer}.mlp.experts"
    return {
        f"{path}.gate_up_proj.lora_A.weight": torch.randn(first, rank, HIDDEN, generator=g),
        f"{path}.gate_up_proj.lora_B.weight": torch.randn(E, 2 * MOE_INTER, rank, generator=g),
        f"{path}.down_proj.lora_A.weight": torch.randn(E, rank, MOE_INTER, generator=g),
        f"{path}.down_proj.lora_B.weight": torch.randn(first, HIDDEN, rank, generator=g),
    }


@pytest.mark.parametrize("shared_outer", [True, False])
def test_explicit_3d_experts(shared_outer: bool) -> None:
    g = torch.Generator().manual_seed(2)
    tensors = _experts_3d(g, 1, 4, shared_outer) | _experts_3d(g, 2, 2, shared_outer)
    tensors |= lora_pair(g, f"{PREFIX}.0.self_attn.o_proj", 4, HIDDEN, HIDDEN)
    adapter = normalize_peft(
        peft_files(tensors, rank_pattern={r"layers\.2\.mlp\.experts\..*": 2}),
        CONFIG,
        base_model="t",
        max_rank=4,
    )
    layout = adapter.manifest.moe_layout
    assert layout == ("shared_outer" if shared_outer else "per_expert")
    shared_dim = 1 if shared_outer else E
    assert adapter.tensors["layers.2.moe.gate_up.lora_A"].shape == (shared_dim, 8, HIDDEN)
    assert adapter.tensors["layers.2.moe.down.lora_B"].shape == (shared_dim, HIDDEN, 4)
    assert adapter.manifest.module_ranks["layers.2.moe.down"] == 2
    for layer, rank in ((1, 4), (2, 2)):
        path = f"{PREFIX}.{layer}.mlp.experts"
        scaling = 8 / rank
        for module, param in (("moe.gate_up", "gate_up_proj"), ("moe.down", "down_proj")):
            lora_A = tensors[f"{path}.{param}.lora_A.weight"].expand(E, -1, -1)
            lora_B = tensors[f"{path}.{param}.lora_B.weight"].expand(E, -1, -1)
            torch.testing.assert_close(
                adapter.delta_weight(layer, module), scaling * lora_B @ lora_A, **TOL
            )


def test_shared_outer_mixed_with_per_expert_is_broadcast() -> None:
    g = torch.Generator().manual_seed(3)
    tensors = _experts_3d(g, 1, 4, True) | _experts_3d(g, 2, 4, False)
    adapter = normalize_peft(peft_files(tensors), CONFIG, base_model="t", max_rank=4)
    assert adapter.manifest.moe_layout == "per_expert"
    assert adapter.tensors["layers.1.moe.gate_up.lora_A"].shape == (E, 8, HIDDEN)
    lora_A = tensors[f"{PREFIX}.1.mlp.experts.gate_up_proj.lora_A.weight"]
    lora_B = tensors[f"{PREFIX}.1.mlp.experts.gate_up_proj.lora_B.weight"]
    torch.testing.assert_close(adapter.delta_weight(1, "moe.gate_up"), 2.0 * lora_B @ lora_A, **TOL)


def test_model_logits_dense_and_shared_mlp_adapter() -> None:
    """Model level, for the layout PEFT will not build: the base model running the hand-made
    LoRA by its definition (forward hooks adding s·B·A·x) == base + canonical ΔW merged."""
    g = torch.Generator().manual_seed(4)
    paths = {
        "0.mlp.gate_proj": (HIDDEN, INTER),
        "0.mlp.down_proj": (INTER, HIDDEN),
        "1.mlp.shared_experts.up_proj": (HIDDEN, MOE_INTER),
        "2.mlp.shared_experts.gate_proj": (HIDDEN, MOE_INTER),
        "2.mlp.shared_experts.down_proj": (MOE_INTER, HIDDEN),
    }
    tensors = {}
    for path, (fan_in, fan_out) in paths.items():
        pair = lora_pair(g, f"{PREFIX}.{path}", 4, fan_in, fan_out)
        tensors |= {key: value * 0.3 for key, value in pair.items()}
    adapter = normalize_peft(peft_files(tensors), CONFIG, base_model="t", max_rank=4)

    oracle = build_tiny_model("v3_q_lora")
    for path in paths:
        layer, module_path = path.split(".", 1)
        lora_A = tensors[f"{PREFIX}.{path}.lora_A.weight"]
        lora_B = tensors[f"{PREFIX}.{path}.lora_B.weight"]

        def add_lora(module, inputs, output, lora_A=lora_A, lora_B=lora_B):
            return output + 2.0 * (inputs[0] @ lora_A.T) @ lora_B.T

        oracle.model.layers[int(layer)].get_submodule(module_path).register_forward_hook(add_lora)
    merged = merged_base_model("v3_q_lora", adapter)
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 9), generator=g)
    with torch.no_grad():
        expected = oracle(input_ids=tokens).logits
        found = merged(input_ids=tokens).logits
        base = build_tiny_model("v3_q_lora")(input_ids=tokens).logits
    assert (expected - base).abs().max() > 0.1, "the adapter should change the logits"
    torch.testing.assert_close(found, expected, atol=2e-5, rtol=1e-4)
