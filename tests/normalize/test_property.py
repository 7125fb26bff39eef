"""Property test: random model dims, module sets, ranks, patterns and expert layouts.

The expected ΔW is built here from the LoRA definition (PEFT's einsum for its fused-expert
layout), independently of the normalizer, and compared with the canonical adapter's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapter_store.format import deserialize, serialize
from adapter_store.normalize import normalize_peft
from tests.normalize.hand_made import peft_files

EXPERT_LAYOUTS = ("none", "per_expert_keys", "peft_fused", "explicit_3d", "shared_outer")


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    nope: int
    rope: int
    v: int
    inter: int
    moe_inter: int
    experts: int
    n_shared: int
    layers: int
    first_dense: int

    def config(self) -> dict:
        return {
            "model_type": "deepseek_v3",
            "vocab_size": 32,
            "hidden_size": self.hidden,
            "num_attention_heads": self.heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.nope,
            "qk_rope_head_dim": self.rope,
            "v_head_dim": self.v,
            "intermediate_size": self.inter,
            "moe_intermediate_size": self.moe_inter,
            "n_routed_experts": self.experts,
            "n_shared_experts": self.n_shared,
            "num_hidden_layers": self.layers,
            "first_k_dense_replace": self.first_dense,
        }

    def linear_paths(self, layer: int) -> dict[str, tuple[str, int, int, int]]:
        """HF path -> (canonical module, row offset in its stacked output, in, out)."""
        q_out = self.heads * (self.nope + self.rope)
        kv_a = self.kv_lora_rank + self.rope
        paths = {}
        if self.q_lora_rank is None:
            paths["self_attn.q_proj"] = ("attn.q", 0, self.hidden, q_out)
            paths["self_attn.kv_a_proj_with_mqa"] = ("attn.qkv_a", 0, self.hidden, kv_a)
        else:
            paths["self_attn.q_a_proj"] = ("attn.qkv_a", 0, self.hidden, self.q_lora_rank)
            paths["self_attn.kv_a_proj_with_mqa"] = (
                "attn.qkv_a",
                self.q_lora_rank,
                self.hidden,
                kv_a,
            )
            paths["self_attn.q_b_proj"] = ("attn.q_b", 0, self.q_lora_rank, q_out)
        paths["self_attn.kv_b_proj"] = (
            "attn.kv_b",
            0,
            self.kv_lora_rank,
            self.heads * (self.nope + self.v),
        )
        paths["self_attn.o_proj"] = ("attn.o", 0, self.heads * self.v, self.hidden)
        moe = layer >= self.first_dense
        inter = self.moe_inter * self.n_shared if moe else self.inter
        if inter:
            mlp = "mlp.shared_experts" if moe else "mlp"
            paths[f"{mlp}.gate_proj"] = ("mlp.gate_up", 0, self.hidden, inter)
            paths[f"{mlp}.up_proj"] = ("mlp.gate_up", inter, self.hidden, inter)
            paths[f"{mlp}.down_proj"] = ("mlp.down", 0, inter, self.hidden)
        return paths


dims_strategy = st.builds(
    Dims,
    hidden=st.integers(4, 20),
    heads=st.integers(1, 3),
    q_lora_rank=st.none() | st.integers(3, 12),
    kv_lora_rank=st.integers(2, 10),
    nope=st.integers(1, 5),
    rope=st.sampled_from([2, 4]),
    v=st.integers(1, 5),
    inter=st.integers(2, 12),
    moe_inter=st.integers(1, 7),
    experts=st.integers(2, 4),
    n_shared=st.integers(0, 2),
    layers=st.integers(1, 3),
    first_dense=st.integers(0, 2),
)


class Expected:
    """Dense ΔW per (layer, module), accumulated from the definition of each LoRA pair."""

    def __init__(self) -> None:
        self.deltas: dict[tuple[int, str], torch.Tensor] = {}
        self.ranks: dict[tuple[int, str], int] = {}

    def add(
        self, layer: int, module: str, shape, rows: slice, delta: torch.Tensor, rank: int
    ) -> None:
        full = self.deltas.setdefault((layer, module), torch.zeros(shape))
        full[..., rows, :] += delta
        self.ranks[(layer, module)] = max(self.ranks.get((layer, module), 0), rank)


class UploadDraw:
    """Draws the PEFT side: global r/alpha/rslora, per-module patterns, keys and tensors."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data
        self.g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
        self.r = data.draw(st.integers(1, 5), label="r")
        self.alpha = data.draw(st.sampled_from([1, 2, 8, 16.5]), label="alpha")
        self.rslora = data.draw(st.booleans(), label="rslora")
        self.prefix = data.draw(st.sampled_from(["base_model.model.model.layers", "model.layers"]))
        self.suffix = data.draw(st.sampled_from([".weight", ""]))
        self.rank_pattern: dict[str, int] = {}
        self.alpha_pattern: dict[str, float] = {}
        self.tensors: dict[str, torch.Tensor] = {}

    def rank_and_scaling(self, key: str) -> tuple[int, float]:
        """Maybe give the PEFT module `key` its own rank/alpha through exact patterns."""
        rank, alpha = self.r, self.alpha
        if self.data.draw(st.booleans()):
            rank = self.rank_pattern[re.escape(key)] = self.data.draw(st.integers(1, 6))
        if self.data.draw(st.booleans()):
            alpha = self.alpha_pattern[re.escape(key)] = self.data.draw(st.sampled_from([3, 5.5]))
        return rank, alpha / (math.sqrt(rank) if self.rslora else rank)

    def put(self, path: str, lora_A: torch.Tensor, lora_B: torch.Tensor) -> None:
        self.tensors[f"{self.prefix}.{path}.lora_A{self.suffix}"] = lora_A
        self.tensors[f"{self.prefix}.{path}.lora_B{self.suffix}"] = lora_B

    def linear(self, path: str, fan_in: int, fan_out: int) -> tuple[int, torch.Tensor]:
        """A plain [r, in]/[out, r] pair at `path` ("L.module"); -> (rank, scaled ΔW)."""
        rank, scaling = self.rank_and_scaling(f"layers.{path}")
        lora_A = torch.randn(rank, fan_in, generator=self.g)
        lora_B = torch.randn(fan_out, rank, generator=self.g)
        self.put(path, lora_A, lora_B)
        return rank, scaling * lora_B @ lora_A

    def files(self) -> dict[str, bytes]:
        return peft_files(
            self.tensors,
            r=self.r,
            lora_alpha=self.alpha,
            use_rslora=self.rslora,
            rank_pattern=self.rank_pattern,
            alpha_pattern=self.alpha_pattern,
        )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dims=dims_strategy, data=st.data())
def test_random_adapters_match_definition(dims: Dims, data: st.DataObject) -> None:
    upload = UploadDraw(data)
    expected = Expected()
    for layer in range(dims.layers):
        for path, (module, offset, fan_in, fan_out) in dims.linear_paths(layer).items():
            if data.draw(st.booleans()):
                rank, delta = upload.linear(f"{layer}.{path}", fan_in, fan_out)
                total = _stacked_out(dims, layer, module)
                rows = slice(offset, offset + fan_out)
                expected.add(layer, module, (total, fan_in), rows, delta, rank)
        if layer >= dims.first_dense:
            layout = data.draw(st.sampled_from(EXPERT_LAYOUTS), label=f"experts {layer}")
            _draw_experts(dims, layer, layout, upload, expected)

    if not upload.tensors:
        return
    adapter = normalize_peft(upload.files(), dims.config(), base_model="p", max_rank=6)
    adapter = deserialize(*serialize(adapter))
    manifest = adapter.manifest
    assert manifest.rank == max(expected.ranks.values())
    assert {(layer, m) for layer, m in manifest.modules} == set(expected.deltas)
    for (layer, module), delta in expected.deltas.items():
        assert manifest.module_ranks[f"layers.{layer}.{module}"] == expected.ranks[(layer, module)]
        torch.testing.assert_close(
            adapter.delta_weight(layer, module),
            delta,
            atol=1e-4,
            rtol=1e-4,
            msg=f"{layer} {module}",
        )


def _stacked_out(dims: Dims, layer: int, module: str) -> int:
    return sum(out for m, _, _, out in dims.linear_paths(layer).values() if m == module)


def _draw_experts(
    dims: Dims, layer: int, layout: str, upload: UploadDraw, expected: Expected
) -> None:
    E, H, I = dims.experts, dims.hidden, dims.moe_inter  # noqa: N806
    gate_up_shape, down_shape = (E, 2 * I, H), (E, H, I)
    draw = upload.data.draw
    if layout == "per_expert_keys":
        names = draw(st.sampled_from([("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")]))
        for e in range(E):
            for name, module, rows, fan_in, fan_out, shape in (
                (names[0], "moe.gate_up", slice(0, I), H, I, gate_up_shape),
                (names[1], "moe.gate_up", slice(I, 2 * I), H, I, gate_up_shape),
                (names[2], "moe.down", slice(0, H), I, H, down_shape),
            ):
                if draw(st.booleans()):
                    rank, delta = upload.linear(f"{layer}.mlp.experts.{e}.{name}", fan_in, fan_out)
                    expert_delta = torch.zeros(shape)
                    expert_delta[e, rows] = delta
                    expected.add(layer, module, shape, slice(None), expert_delta, rank)
        return
    if layout == "none":
        return
    # Params in the order PEFT nests its wrappers: gate_up_proj innermost ("base_layer").
    params = [
        ("gate_up_proj", "moe.gate_up", H, 2 * I, gate_up_shape),
        ("down_proj", "moe.down", I, H, down_shape),
    ]
    chosen = [p for p in params if draw(st.booleans())]
    for depth, (param, module, fan_in, fan_out, shape) in enumerate(chosen):
        rank, scaling = upload.rank_and_scaling(f"layers.{layer}.mlp.experts.{param}")
        g = upload.g
        if layout == "peft_fused":
            lora_A = torch.randn(E * rank, fan_in, generator=g)
            lora_B = torch.randn(fan_out, E * rank, generator=g)
            nesting = ".base_layer" * (len(chosen) - 1 - depth)
            upload.put(f"{layer}.mlp.experts{nesting}", lora_A, lora_B)
            delta = torch.einsum(
                "ore,eri->eoi", lora_B.view(fan_out, rank, E), lora_A.view(E, rank, fan_in)
            )
        else:
            shared_a = layout == "shared_outer" and param == "gate_up_proj"
            shared_b = layout == "shared_outer" and param == "down_proj"
            lora_A = torch.randn(1 if shared_a else E, rank, fan_in, generator=g)
            lora_B = torch.randn(1 if shared_b else E, fan_out, rank, generator=g)
            upload.put(f"{layer}.mlp.experts.{param}", lora_A, lora_B)
            delta = lora_B @ lora_A
        expected.add(layer, module, shape, slice(None), scaling * delta.expand(shape), rank)
