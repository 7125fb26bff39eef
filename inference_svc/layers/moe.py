"""Dense MLP, the MoE router and routed experts run as explicit fused-MoE stages.

Shape legend: T tokens, k experts per token, P = T·k (token, expert) pairs, E experts,
I moe_intermediate_size.

LoRA: the dense MLP's (and shared experts') `gate_up` / `down` add their deltas inside
`Linear` (a long step's gate_up delta in the activation's launch instead); the routed
experts add theirs per pair, to the gate_up output before the activation and to the down
output before the weighted combine.
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
    expands_gate_up_with_silu,
    finish_gate_up_lora_with_silu,
    moe_lora_in_gemm,
    start_moe_lora,
)
from inference_svc.model.config import RoutingConfig
from kernels import fused_moe as fm
from kernels import moe_routing
from kernels.gemv import gemv, gemv_fits
from kernels.lora_segments import LoraSegments
from kernels.moe_route_align import select_and_align, select_and_align_fits
from kernels.moe_routing import select_experts, select_experts_ref
from kernels.rms_norm import RoutedPairs


class DenseMLP(nn.Module):
    """Semantics: down(silu(gate·x) ⊙ up·x), with `gate_up` one fused matmul."""

    def __init__(self, hidden: int, inter: int, quant: QuantMethod, dtype, device):
        super().__init__()
        self.gate_up = Linear(hidden, [inter, inter], quant, dtype, device)
        self.down = Linear(inter, [hidden], quant, dtype, device)

    def forward(self, x: torch.Tensor, lora: LoraSegments | None = None) -> torch.Tensor:
        if (
            lora is not None
            and self.gate_up.lora is not None
            and expands_gate_up_with_silu(x.shape[0])
        ):
            # A long step: gate_up's LoRA expand rides in the activation's launch.
            gate_up, pending = self.gate_up.forward_leaving_expand(x, lora)  # [T, 2·inter]
            act = finish_gate_up_lora_with_silu(pending, gate_up, self.gate_up.lora)
            return self.down(act, lora)
        gate_up = self.gate_up(x, lora)  # [T, 2·inter]
        return self.down(gate_up, lora, gated=True)


class MoeRouting(NamedTuple):
    """The router's choice for a batch: weights [T, k] float32, ids [T, k] int64, and the
    grouped GEMMs' row tiles: the (token, expert) pairs aligned, or one tile per pair. With
    `selection`, the weights and ids are empty until the first grouped GEMM's launch
    selects from the router's logits and stores them (fm.TokenSelection)."""

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    align: fm.MoEAlignment | fm.PairTiles | None
    selection: fm.TokenSelection | None = None


# One token's experts are chosen inside its first grouped GEMM (fm.TokenSelection over
# fm.PairTiles) when the routed experts run without LoRA: every program of the gate_up
# launch selects for itself, so neither a selection launch nor an alignment sits between
# the router's GEMV and the expert weights' reads. Measured in docs/benchmarks.md
# (twenty-fourth session; bench patch "select_in_gemm" turns it off).
SELECT_IN_GEMM = True
# Steps of up to this many tokens whose routed experts run without LoRA take SiLU·mul in the
# gate_up GEMM's epilogue (fm.grouped_gemm's gated_out): one launch fewer a MoE layer, and
# gate_up's [P, 2I] output neither written nor read. Measured in docs/benchmarks.md
# (twenty-fifth session; bench patch "silu_epilogue" turns it off); longer steps keep the
# activation's own launch (prefill tiles not measured with it).
SILU_IN_GATE_UP_MAX_TOKENS = 256


# One token's router logits through kernels.gemv (float32 weights read before the PDL wait)
# instead of cuBLAS's GEMV pair (dot_kernel + reduce_1Block, ~11 µs per MoE layer in a
# graphed B=1 step, launched only after the norm had finished). H100, 27-layer V2-Lite
# B=1 step (bench.model_decode, patch "router_gemv" turns it off): 2.848 → 2.704 ms.
ROUTER_GEMV = True


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
        self,
        x: torch.Tensor,
        x_float: torch.Tensor | None = None,
        block_m: int | None = None,
        select_in_gemm: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | MoeRouting:
        """x [T, hidden] → topk_weights [T, k] float32, topk_ids [T, k] int64; x_float: x as
        float32 when the caller has it already. With `block_m`, a MoeRouting whose row tiles
        are the pairs aligned into tiles of block_m when the selection's launch aligned
        them too (SELECT_AND_ALIGN_MAX_TOKENS), one tile per pair with the selection left
        to the first grouped GEMM (`select_in_gemm`, where `selects_in_gemm`), else None.
        (Every routed token passes through here, where hooks see it.)"""
        logits = self.logits(x, x_float)  # [T, E]
        if block_m is not None and select_in_gemm and self.selects_in_gemm(x):
            return self._selection_in_gemm(logits, block_m)
        if block_m is not None and self._aligns_in_selection(x):
            return MoeRouting(*select_and_align(logits, *self.selection_args(), block_m))
        select = select_experts if self.selects_in_kernel(x) else select_experts_ref
        weights, ids = select(logits, *self.selection_args())
        return (weights, ids) if block_m is None else MoeRouting(weights, ids, None)

    def selects_in_gemm(self, x: torch.Tensor) -> bool:
        """Whether one token's selection can ride in its first grouped GEMM (SELECT_IN_GEMM;
        the routers the selection kernel takes)."""
        return SELECT_IN_GEMM and x.shape[0] == 1 and self.selects_in_kernel(x)

    def _selection_in_gemm(self, logits: torch.Tensor, block_m: int) -> MoeRouting:
        """Empty weights and ids [1, k], one row tile per pair, and what the grouped GEMM
        selects from: logits [1, E] float32."""
        r = self.routing
        weights = logits.new_empty((1, r.top_k))
        ids = torch.empty((1, r.top_k), dtype=torch.int64, device=logits.device)
        top_k, method, n_group, topk_group, norm, scaling, bias = self.selection_args()
        constexprs = moe_routing.selection_constexprs(
            logits.shape[1], top_k, method, n_group, topk_group, norm
        )
        selection = fm.TokenSelection(logits, bias, scaling, constexprs, weights)
        return MoeRouting(weights, ids, fm.PairTiles(ids, block_m), selection)

    def _aligns_in_selection(self, x: torch.Tensor) -> bool:
        r = self.routing
        return (
            x.shape[0] <= SELECT_AND_ALIGN_MAX_TOKENS
            and self.selects_in_kernel(x)
            and select_and_align_fits(x.shape[0], r.num_experts, r.top_k, r.n_group)
        )

    def logits(self, x: torch.Tensor, x_float: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] → float32 router logits [T, E]."""
        x32 = x.float() if x_float is None else x_float  # [T, hidden]
        return gemv(x32, self.weight) if self.runs_gemv(x32) else x32 @ self.weight.T

    def selects_in_kernel(self, x: torch.Tensor) -> bool:
        """One launch on the GPU where it measured faster than the torch ops (routers
        without expert groups, and grouped ones in power-of-two groups: moe_routing)."""
        r = self.routing
        return x.is_cuda and moe_routing.kernel_selects(r.method, r.num_experts, r.n_group)

    def selection_args(self) -> tuple:
        """select_experts' arguments after the logits."""
        r = self.routing
        bias = self.e_score_correction_bias if r.method == "noaux_tc" else None
        return (
            r.top_k, r.method, r.n_group, r.topk_group, r.norm_topk_prob,
            r.routed_scaling_factor, bias,
        )  # fmt: skip

    def runs_gemv(self, x32: torch.Tensor) -> bool:
        """Whether the logits of the float32 input x32 [T, hidden] come from kernels.gemv."""
        return ROUTER_GEMV and x32.is_cuda and gemv_fits(x32, self.weight)


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


# Steps of up to this many tokens select their experts and align the pairs in one launch
# (kernels.moe_route_align) instead of two. H100, 27-layer V2-Lite-shaped step, graphs
# (bench.model_decode, patch "select_align" against the default): B = 1 2.772 → 2.731 /
# 2.729 ms and 2.742 → 2.704 / 2.722 in two calls, but B = 8 7.807 → 7.885 / 7.890 (not
# examined), so one token only.
SELECT_AND_ALIGN_MAX_TOKENS = 1


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

    def route(
        self,
        x: torch.Tensor,
        x_float: torch.Tensor | None = None,
        lora: LoraSegments | None = None,
    ) -> MoeRouting:
        """x [T, hidden] → each token's experts and weights, and the grouped GEMMs' row
        tiles. x_float: x as float32 for the router, when the caller made it; lora: the
        step's, with which the experts' LoRA needs the pairs aligned."""
        w13 = self.experts.quant_info()[0]
        scheme = fm.weight_scheme(w13.scheme, w13.scale)
        num_experts = self.experts.num_experts
        block_m = fm.moe_block_m(x.shape[0] * self.gate.routing.top_k, num_experts, scheme)
        routing = self.gate(x, x_float, block_m, select_in_gemm=not self._has_lora(lora))
        if routing.align is None:
            aligner = fm.moe_align if x.is_cuda else fm.moe_align_ref
            routing = routing._replace(align=aligner(routing.topk_ids, num_experts, block_m))
        return routing

    def _has_lora(self, lora: LoraSegments | None) -> bool:
        """Whether the step adds the routed experts' LoRA (a pool attached, a LoRA step)."""
        return lora is not None and self.lora_gate_up is not None and self.lora_down is not None

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
            routing = self.route(x, x_float, lora)
        topk_weights, topk_ids, align, selection = routing
        w13, w2 = self.experts.quant_info()
        triton_path = x.is_cuda
        num_experts = self.experts.num_experts
        scheme = fm.weight_scheme(w13.scheme, w13.scale)
        gemm = fm.grouped_gemm if triton_path else fm.grouped_gemm_ref
        top_k = topk_ids.shape[1]
        with_lora = self._has_lora(lora)
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
        act_in_gemm = (
            not with_lora and scheme != "block_a8" and x.shape[0] <= SILU_IN_GATE_UP_MAX_TOKENS
        )
        # The selection only the Triton path makes (Router.selects_in_gemm).
        selects = {} if selection is None else {"selection": selection}
        gate_up = gemm(
            x, w13.weight, align, top_k, w13.scale, w13.block, w13.scheme, lora=fused,
            gated_out=act_in_gemm, **selects,
        )  # [P, 2I] ([P, I] with act_in_gemm)  # fmt: skip
        if with_lora and not in_gemm:
            add_moe_gate_up(x, gate_up, self.lora_gate_up, *pairs)
        if act_in_gemm:
            act = gate_up  # [P, I]
        elif triton_path and scheme == "block_a8" and not with_lora:
            # e4m3 activations straight from the activation's launch (the LoRA paths read
            # the bf16 activation, so they keep the two launches).
            act = fm.silu_mul_quant_fp8(gate_up, w2.block[1])  # [P, I] e4m3 + scales
        else:
            act = (fm.silu_mul if triton_path else fm.silu_mul_ref)(gate_up)  # [P, I]
        if in_gemm:
            fused = start_moe_lora(act, self.lora_down, *pairs, per_pair=True)
        pair_out = gemm(
            act, w2.weight, align, 1, w2.scale, w2.block, w2.scheme, lora=fused, role="down"
        )  # [P, hidden]
        if with_lora and not in_gemm:
            add_moe_down(act, pair_out, self.lora_down, *pairs)
        if not combine:
            return RoutedPairs(pair_out, topk_weights)
        return (fm.moe_combine if triton_path else fm.moe_combine_ref)(pair_out, topk_weights)
