"""Dense MLP, the MoE router and routed experts run as explicit fused-MoE stages.

Shape legend: T tokens, k experts per token, P = T·k (token, expert) pairs, E experts,
I moe_intermediate_size.

LoRA: the dense MLP's (and shared experts') `gate_up` / `down` add their deltas inside
`Linear`; the routed experts add theirs per pair, to the gate_up output before the
activation and to the down output before the weighted combine.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from inference_svc.layers.linear import Linear
from inference_svc.layers.quant import QuantInfo, QuantMethod
from inference_svc.lora.apply import (
    LoraWeights,
    add_moe_down,
    add_moe_gate_up,
    moe_lora_in_gemm,
    start_moe_lora,
)
from inference_svc.model.config import RoutingConfig
from kernels import fused_moe as fm
from kernels import moe_routing
from kernels.lora_segments import LoraSegments
from kernels.moe_routing import select_experts, select_experts_ref
from kernels.rms_norm import RoutedPairs


class DenseMLP(nn.Module):
    """Semantics: down(silu(gate·x) ⊙ up·x), with `gate_up` one fused matmul."""

    def __init__(self, hidden: int, inter: int, quant: QuantMethod, dtype, device):
        super().__init__()
        self.gate_up = Linear(hidden, [inter, inter], quant, dtype, device)
        self.down = Linear(inter, [hidden], quant, dtype, device)

    def forward(self, x: torch.Tensor, lora: LoraSegments | None = None) -> torch.Tensor:
        gate_up = self.gate_up(x, lora)  # [T, 2·inter]
        act = fm.silu_mul(gate_up) if x.is_cuda else fm.silu_mul_ref(gate_up)
        return self.down(act, lora)


class Router(nn.Module):
    """Picks k experts per token and their weights (float32, like the reference)."""

    def __init__(self, hidden: int, routing: RoutingConfig, device):
        super().__init__()
        self.routing = routing
        e = routing.num_experts
        self.weight = nn.Parameter(
            torch.empty(e, hidden, dtype=torch.float32, device=device), False
        )
        if routing.method == "noaux_tc":  # only V3's aux-loss-free routing has the bias
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(e, dtype=torch.float32, device=device), False
            )

    def forward(
        self, x: torch.Tensor, x_float: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] → topk_weights [T, k] float32, topk_ids [T, k] int64; x_float: x as
        float32 when the caller has it already."""
        r = self.routing
        logits = (x.float() if x_float is None else x_float) @ self.weight.T  # [T, E]
        # One launch on the GPU where it measured faster than the torch ops (routers without
        # expert groups, kernels/moe_routing.py).
        fused = x.is_cuda and moe_routing.kernel_selects(r.method, r.num_experts, r.n_group)
        select = select_experts if fused else select_experts_ref
        bias = self.e_score_correction_bias if r.method == "noaux_tc" else None
        return select(
            logits, r.top_k, r.method, r.n_group, r.topk_group, r.norm_topk_prob,
            r.routed_scaling_factor, bias,
        )  # fmt: skip


class RoutedExperts(nn.Module):
    """E experts stored stacked: w13 [E, 2I, hidden] (gate ⊕ up), w2 [E, hidden, I]."""

    def __init__(
        self, num_experts: int, hidden: int, inter: int, quant: QuantMethod, dtype, device
    ):
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.quant = quant
        quant.check_slices([inter, inter])
        self.w13 = nn.Module()
        self.w2 = nn.Module()
        quant.create_weights(
            self.w13, (num_experts, 2 * inter, hidden), dtype, torch.device(device)
        )
        quant.create_weights(self.w2, (num_experts, hidden, inter), dtype, torch.device(device))

    def load(
        self, which: str, kind: str, tensor: torch.Tensor, expert: int | None, slice_index: int
    ) -> None:
        """Load one checkpoint tensor: `which` is w13 (slice 0 gate, 1 up) or w2.

        expert None: the tensor holds all experts ([E, N, K] fused checkpoint layout).
        """
        module = self.w13 if which == "w13" else self.w2
        row = slice_index * self.inter
        if expert is None:
            for e in range(self.num_experts):
                self.quant.load(module, kind, tensor[e], row, e)
        else:
            self.quant.load(module, kind, tensor, row, expert)

    def quant_info(self) -> tuple[QuantInfo, QuantInfo]:
        return self.quant.quant_info(self.w13), self.quant.quant_info(self.w2)


class MoeRouting(NamedTuple):
    """The router's choice for a batch: weights [T, k] float32, ids [T, k] int64, and the
    (token, expert) pairs aligned into the grouped GEMMs' row tiles."""

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    align: fm.MoEAlignment


class MoE(nn.Module):
    """Routed experts: route → align → gate_up → SiLU·mul → down → combine."""

    def __init__(
        self, hidden: int, inter: int, routing: RoutingConfig, quant: QuantMethod, dtype, device
    ):
        super().__init__()
        self.gate = Router(hidden, routing, device)
        self.experts = RoutedExperts(routing.num_experts, hidden, inter, quant, dtype, device)
        # The routed experts' LoRA pool buffers (moe.gate_up, moe.down) once attached.
        self.lora_gate_up: LoraWeights | None = None
        self.lora_down: LoraWeights | None = None

    def route(self, x: torch.Tensor, x_float: torch.Tensor | None = None) -> MoeRouting:
        """x [T, hidden] → each token's experts and weights, and the pairs aligned for the
        grouped GEMMs. x_float: x as float32 for the router, when the caller made it."""
        topk_weights, topk_ids = self.gate(x, x_float)  # [T, k]
        w13 = self.experts.quant_info()[0]
        scheme = fm.weight_scheme(w13.scheme, w13.scale)
        num_experts = self.experts.num_experts
        block_m = fm.moe_block_m(topk_ids.numel(), num_experts, scheme)
        align = (fm.moe_align if x.is_cuda else fm.moe_align_ref)(topk_ids, num_experts, block_m)
        return MoeRouting(topk_weights, topk_ids, align)

    def forward(
        self,
        x: torch.Tensor,
        lora: LoraSegments | None = None,
        combine: bool = True,
        x_float: torch.Tensor | None = None,
        routing: MoeRouting | None = None,
    ) -> torch.Tensor | RoutedPairs:
        """x [T, hidden] → [T, hidden]; with `combine` False the per-pair outputs and their
        weights instead, for a caller that folds the weighted combine into its next launch.
        x_float: x as float32 for the router, when the caller made it; routing: `route`'s
        result for x, when the caller routed already."""
        if routing is None:
            routing = self.route(x, x_float)
        topk_weights, topk_ids, align = routing
        w13, w2 = self.experts.quant_info()
        triton_path = x.is_cuda
        num_experts = self.experts.num_experts
        scheme = fm.weight_scheme(w13.scheme, w13.scale)
        gemm = fm.grouped_gemm if triton_path else fm.grouped_gemm_ref
        top_k = topk_ids.shape[1]
        with_lora = (
            lora is not None and self.lora_gate_up is not None and self.lora_down is not None
        )
        in_gemm = with_lora and moe_lora_in_gemm(
            lora, top_k, num_experts, quantized=w13.scale is not None
        )
        fused = None
        if with_lora:
            pair_token = lora.pair_tokens(top_k)  # [P]
            pair_expert = topk_ids.reshape(-1)  # [P] int64, read as it is: no conversion launch
            pairs = (pair_token, pair_expert, lora, align.sorted_pair_ids)
            if in_gemm:
                fused = start_moe_lora(x, self.lora_gate_up, *pairs, per_pair=False)
        gate_up = gemm(
            x, w13.weight, align, top_k, w13.scale, w13.block, w13.scheme, lora=fused
        )  # [P, 2I]
        if with_lora and not in_gemm:
            add_moe_gate_up(x, gate_up, self.lora_gate_up, *pairs)
        if triton_path and scheme == "block_a8" and not with_lora:
            # e4m3 activations straight from the activation's launch (the LoRA paths read
            # the bf16 activation, so they keep the two launches).
            act = fm.silu_mul_quant_fp8(gate_up, w2.block[1])  # [P, I] e4m3 + scales
        else:
            act = (fm.silu_mul if triton_path else fm.silu_mul_ref)(gate_up)  # [P, I]
        if in_gemm:
            fused = start_moe_lora(act, self.lora_down, *pairs, per_pair=True)
        pair_out = gemm(
            act, w2.weight, align, 1, w2.scale, w2.block, w2.scheme, lora=fused
        )  # [P, hidden]
        if with_lora and not in_gemm:
            add_moe_down(act, pair_out, self.lora_down, *pairs)
        if not combine:
            return RoutedPairs(pair_out, topk_weights)
        return (fm.moe_combine if triton_path else fm.moe_combine_ref)(pair_out, topk_weights)
