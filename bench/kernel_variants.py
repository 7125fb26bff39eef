"""Old/new kernel choices of the decode step, switchable so one GPU run compares them.

Each patch swaps one module attribute the model reads at call time for the v1 (pre-
`bkperf`) implementation, which is also the torch reference the tests use, so "v1" is
exactly the code measured in bench/results/model_decode_v1.json (up to the MLA grid
order). Variant "v2" is the code as it is; "v2-x" is v2 with patch x reverted, so the
difference to v2 is what change x bought; "v2+y" is v2 with upgrade y (a kernel not yet
the default), so the difference is what y would buy.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch

import inference_svc.engine.model_runner as model_runner
import inference_svc.layers.linear as linear_layer
import inference_svc.layers.mla as mla_layer
import inference_svc.layers.moe as moe_layer
import inference_svc.layers.norm as norm_layer
import inference_svc.layers.rope as rope_layer
import inference_svc.models.deepseek_v3 as model_module
from kernels import fused_moe as fm
from kernels import moe_routing
from kernels.decode_inputs import set_decode_inputs_ref
from kernels.mla_attention import MLA_DECODE_CONFIGS, mla_decode
from kernels.rms_norm import RoutedPairs, rms_norm_ref
from kernels.rope import rope, rope_cos_sin_ref, rope_ref


def block_m_v1(num_pairs: int, num_experts: int, scheme: str = "float") -> int:
    """v1's grouped-GEMM row tile: 16 at every batch size."""
    return 16


def add_rms_norm_unfused(residual, addends, weight, eps, y_float=None):
    """The MoE combine and the residual adds as their own launches, then the norm (and the
    float copy) (before add_rms_norm). The norm here is the layer's module attribute, so
    "v1" still gets the torch form."""
    parts = [fm.moe_combine(*a) if isinstance(a, RoutedPairs) else a for a in addends]
    total = parts[0]
    for addend in parts[1:]:
        total = total + addend
    h = residual + total
    y = norm_layer.rms_norm(h, weight, eps)
    if y_float is not None:
        y_float.copy_(y)
    return h, y


# The rotation the unfused latent write below launches ("rope" patches in the torch form).
unfused_rope = rope


def write_latent_cache_unfused(kv_a, norm_weight, eps, cos, sin, interleave, rows, slots, q_rope):
    """The norm and both rotations as their own launches, a concatenation and an indexed copy
    (before write_latent_cache). The norm is the layer's module attribute, so "v1" still
    gets the torch form."""
    latent, k_rope = kv_a.split([norm_weight.shape[0], kv_a.shape[-1] - norm_weight.shape[0]], -1)
    rows[slots] = torch.cat(
        [
            norm_layer.rms_norm(latent, norm_weight, eps),
            unfused_rope(k_rope, cos, sin, interleave),
        ],
        -1,
    ).to(rows.dtype)
    return unfused_rope(q_rope, cos, sin, interleave)


# name → (module, attribute, v1 value)
PATCHES = {
    "norm": (norm_layer, "rms_norm", rms_norm_ref),  # 8 torch kernels instead of 1
    # 9 torch kernels instead of 1 (the rotations are inside write_latent_cache now, so
    # this reaches them only with "latent_cache" patched too, as in v1).
    "rope": (sys.modules[__name__], "unfused_rope", rope_ref),
    "align": (fm, "moe_align", fm.moe_align_ref),  # ~35 torch kernels instead of 1
    "block_m": (fm, "moe_block_m", block_m_v1),  # 16-row tiles at every batch
    "mla": (
        mla_layer,
        "mla_decode",
        functools.partial(mla_decode, config=MLA_DECODE_CONFIGS[0], variant="v2"),
    ),  # fmt: skip
    # The v2 kernel at every head count (v3 became the default for ≤ 32 heads).
    "mla_v3": (mla_layer, "mla_decode", functools.partial(mla_decode, variant="v2")),
    # 64 × 64 column/K tiles at every decode row tile and scheme (before DECODE_TILES).
    "decode_tiles": (fm, "DECODE_TILES", {}),
    # FP8 experts with the bf16 row tiles at decode (before FP8_HALF_ROWS_MAX_PAIRS).
    "fp8_rows": (fm, "FP8_HALF_ROWS_MAX_PAIRS", 0),
    # The router's selection as torch ops (before the one-launch selection kernel).
    "routing": (moe_layer, "select_experts", moe_routing.select_experts_ref),
    # Routers with expert groups (V3) on the torch ops (before the kernel's group limit).
    "grouped_selection": (moe_routing, "GROUPED_IN_KERNEL", False),
    # MoE combine and residual adds as their own launches (before they rode in the norm's).
    "add_norm": (norm_layer, "add_rms_norm", add_rms_norm_unfused),
    # kv_a_norm, k and q RoPE, concatenation and scatter as five launches (before one).
    "latent_cache": (mla_layer, "write_latent_cache", write_latent_cache_unfused),
    # The router converts its input to float32 itself (before the norm wrote the copy).
    "router_input": (model_module, "ROUTER_INPUT_FROM_NORM", False),
    # Decode batches of up to 4096 pairs aligned by one program (before 512-pair chunks).
    "align_chunks": (fm, "MAX_SINGLE_PROGRAM_PAIRS", 4096),
    # The shared experts after the routed experts on the step's stream (before they ran on
    # their own stream beside them).
    "shared_stream": (model_module, "SHARED_EXPERTS_STREAM_MAX_TOKENS", 0),
    # The shared experts forked before the router runs at every batch (before the router
    # ran first from 2 tokens).
    "route_first": (model_module, "ROUTE_BEFORE_FORK_MIN_TOKENS", 2**31),
    # One token's router logits on cuBLAS (before kernels.gemv took them).
    "router_gemv": (moe_layer, "ROUTER_GEMV", False),
    # MLA's q_a_norm as its own launch before q_b's one-token GEMV (before it rode in it).
    "norm_gemv": (linear_layer, "NORM_IN_GEMV", False),
    # The MLP's silu·mul as its own launch before a one-token down GEMV (before it rode in it).
    "silu_gemv": (linear_layer, "SILU_IN_GEMV", False),
    # One token's W_UK / W_UV absorption as cuBLAS bmm (before the per-head GEMV).
    "absorb_gemv": (mla_layer, "ABSORB_GEMV", False),
    # Selection and alignment as two launches (before one program did both at decode).
    "select_align": (moe_layer, "SELECT_AND_ALIGN_MAX_TOKENS", 0),
    # A single token forks the shared experts before its router runs, as with cuBLAS's
    # router (before the gemv router ran first).
    "gemv_route_first": (model_module, "ROUTE_FIRST_WITH_ROUTER_GEMV", False),
    # One token's selection (and alignment) as a launch of its own before the grouped GEMMs
    # (before the gate_up GEMM selected).
    "select_in_gemm": (moe_layer, "SELECT_IN_GEMM", False),
    # One token's residual add and input norm as their own launch before qkv_a's GEMV
    # (before they rode in it).
    "residual_gemv": (linear_layer, "RESIDUAL_IN_GEMV", False),
    # The routed experts' SiLU·mul as its own launch after the gate_up GEMM (before it rode
    # in the GEMM's epilogue).
    "silu_epilogue": (moe_layer, "SILU_IN_GATE_UP_MAX_TOKENS", 0),
    # The step's RoPE cos/sin tables as six torch launches (before one).
    "cos_sin": (rope_layer, "rope_cos_sin", rope_cos_sin_ref),
    # A replay's inputs copied and padded field by field with torch ops (before one launch).
    "decode_inputs": (model_runner, "set_decode_inputs", set_decode_inputs_ref),
}
# name → (module, attribute, value): kernels newer than v2, not yet the model's default.
UPGRADES: dict[str, tuple] = {
    # FP8 experts scale the weight tile and chain the MMA at decode row tiles too (the
    # model does so from SCALE_TILES_MIN_ROWS rows: prefill tiles).
    "fp8_scale_tiles": (fm, "SCALE_TILES_MIN_ROWS", 16),
}
VARIANTS: dict[str, frozenset[str]] = {
    "v1": frozenset(PATCHES),
    "v2": frozenset(),
    **{f"v2-{name}": frozenset({name}) for name in PATCHES},
    **{f"v2+{name}": frozenset({name}) for name in UPGRADES},
    # The fused selection + alignment launch and the selecting GEMM bypass both patched
    # functions at decode.
    "v2-routing": frozenset({"routing", "select_align", "select_in_gemm"}),
    "v2-align": frozenset({"align", "select_align", "select_in_gemm"}),
    "v2-fusions": frozenset({"add_norm", "latent_cache", "router_input", "residual_gemv"}),
    # The one-token launches of the thirteenth and twenty-fourth sessions, all off
    # (docs/benchmarks.md).
    "v2-one_token": frozenset(
        {
            "router_gemv",
            "norm_gemv",
            "absorb_gemv",
            "silu_gemv",
            "gemv_route_first",
            "select_align",
            "select_in_gemm",
            "residual_gemv",
        }  # fmt: skip
    ),
}


@contextmanager
def kernel_variant(name: str) -> Iterator[None]:
    """Within the block, the model runs variant `name` (capture graphs inside it)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; known: {sorted(VARIANTS)}")
    with ExitStack() as stack:
        for patch in sorted(VARIANTS[name]):
            module, attribute, value = {**PATCHES, **UPGRADES}[patch]
            stack.enter_context(mock.patch.object(module, attribute, value))
        yield
