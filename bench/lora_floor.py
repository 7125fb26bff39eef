"""The bytes of LoRA weights a decode step must read, beside those of the base model.

A step with adapters reads, per layer, each distinct adapter's A and B of every linear
module once, and for the routed experts each distinct (adapter, expert) key's A and B once:
a key is an adapter's expert picked by at least one of its tokens. With a uniform router
(the base floor's assumption, `bench.model_decode.expected_distinct_experts`) an adapter of
n tokens touches E·(1 − (1 − k/E)^n) experts.

Divided by the base step's bytes, this is the LoRA overhead a step would have if its LoRA
kernels read their weights as efficiently as the base kernels read theirs: the overhead's
floor, below which no kernel work can bring a bandwidth-bound step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from adapter_store.model_shapes import ModuleShape
from bench.model_decode import expected_distinct_experts


def lora_step_bytes(
    shapes: Mapping[str, ModuleShape],
    rank: int,
    element_size: int,
    tokens_per_adapter: Sequence[int],
    top_k: int,
) -> dict[str, float]:
    """Bytes of LoRA weights one decode step reads: "linear" (every non-expert module) and
    "routed" (moe.*, per distinct key expected under a uniform router), for adapters of
    `rank` on every module, adapter i holding tokens_per_adapter[i] of the batch's tokens."""
    adapters = [n for n in tokens_per_adapter if n > 0]
    linear = routed = 0.0
    for shape in shapes.values():
        # One A and B: an adapter's (linear) or an (adapter, expert) key's (moe.*).
        a_and_b = rank * (shape.stack * shape.in_features + shape.out_features) * element_size
        layers = len(shape.layers)
        if shape.num_experts is None:
            linear += layers * len(adapters) * a_and_b
        else:
            keys = sum(expected_distinct_experts(n, shape.num_experts, top_k) for n in adapters)
            routed += layers * keys * a_and_b
    return {"linear": linear, "routed": routed}


def tokens_per_slot(slots: Sequence[int]) -> list[int]:
    """How many of a batch's tokens each adapter slot holds (slot -1: base model, left out)."""
    counts: dict[int, int] = {}
    for slot in slots:
        if slot >= 0:
            counts[slot] = counts.get(slot, 0) + 1
    return list(counts.values())
