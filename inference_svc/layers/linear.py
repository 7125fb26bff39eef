"""Linear layers whose weight may fuse several checkpoint projections along the output dim.

`attn.qkv_a` = q_a_proj ⊕ kv_a_proj_with_mqa and `mlp.gate_up` = gate_proj ⊕ up_proj are one
matmul each, exactly like the canonical LoRA modules, so a LoRA delta maps 1:1 onto one call.
`lora` holds the module's LoRA pool buffers once a pool is attached.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_svc.layers.norm import RMSNorm
from inference_svc.layers.quant import QuantMethod
from inference_svc.lora import apply as lora_apply
from inference_svc.lora.apply import (
    LoraWeights,
    PendingLinearLora,
    finish_linear_lora,
    one_token_linear_lora,
    product_with_lora,
    shrinks_in_product,
    start_linear_lora,
)
from kernels import fused_moe as fm
from kernels.fp8 import fp8_block_linear, fp8_block_linear_ref
from kernels.gemv import ResidualAdd, gemv, gemv_fits
from kernels.lora_segments import LoraSegments

# A norm handed to `Linear.forward` rides in the one-token kernel (kernels.gemv) instead of
# its own launch before it: MLA's q_a_norm before q_b. H100, 27-layer V2-Lite B=1 step
# (bench.model_decode, patch "norm_gemv" turns it off): 2.736 → 2.704 ms.
NORM_IN_GEMV = True
# Likewise the MLP's silu(gate)·up before its down projection: one launch fewer in the
# shared experts' branch and the dense layer, no gain resolved at B=1 (patch "silu_gemv":
# 2.901 → 2.775 / 2.836 ms in one call, 2.699 → 2.704 / 2.722 in another).
SILU_IN_GEMV = True
# And a decoder's residual add before that norm (`Linear.forward`'s `residual`): the layer's
# input norm, with the previous layer's MoE combine, rides in qkv_a's one-token kernel (one
# launch fewer per layer). Measured in docs/benchmarks.md (twenty-fourth session; bench
# patch "residual_gemv" turns it off).
RESIDUAL_IN_GEMV = True


class Linear(nn.Module):
    """Semantics: y[T, N] = x[T, K] @ Wᵀ, W = slice_0 ⊕ slice_1 ⊕ ... along N."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        quant: QuantMethod,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.quant = quant
        if not quant.dense_linear:
            raise ValueError(f"quant method {quant.name} is for routed experts only, not Linear")
        quant.check_slices(self.output_sizes)
        quant.create_weights(self, (self.out_features, in_features), dtype, torch.device(device))
        self.lora: LoraWeights | None = None
        self.slice_offsets = [sum(self.output_sizes[:i]) for i in range(len(output_sizes) + 1)]

    def load(self, kind: str, tensor: torch.Tensor, slice_index: int = 0) -> None:
        """Load checkpoint `tensor` as slice `slice_index` of the fused weight."""
        self.quant.load(self, kind, tensor, sum(self.output_sizes[:slice_index]), None)

    def takes_residual(self, x: torch.Tensor, lora: LoraSegments | None) -> bool:
        """Whether `forward` takes a `residual` add for x [T, in] in this step: its one-token
        kernel, with no LoRA on this module (RESIDUAL_IN_GEMV)."""
        has_lora = lora is not None and self.lora is not None
        return RESIDUAL_IN_GEMV and NORM_IN_GEMV and not has_lora and self._one_token(x, False)

    def _one_token(self, x: torch.Tensor, gated: bool) -> bool:
        info = self.quant.quant_info(self)
        return info.scale is None and x.is_cuda and gemv_fits(x, info.weight, gated)

    def forward(
        self,
        x: torch.Tensor,
        lora: LoraSegments | None = None,
        norm: RMSNorm | None = None,
        gated: bool = False,
        residual: ResidualAdd | None = None,
    ) -> torch.Tensor:
        """x [T, in] → [T, out]; plus each token's LoRA delta when `lora` describes x.
        `norm`: x is normed by it first; `gated`: x [T, 2·in] is gate ⊕ up and the input is
        silu(gate)·up. Both ride in the one-token kernel where that runs. `residual` (with
        `norm`, where `takes_residual`): x is the residual stream, the input is norm(h) for
        h = x + Σ residual.addends, and the kernel stores h into residual.h."""
        info = self.quant.quant_info(self)
        has_lora = lora is not None and self.lora is not None
        if residual is not None and (norm is None or not self.takes_residual(x, lora)):
            raise ValueError("a residual add rides only in the one-token kernel, with its norm")
        # One token: the weight-streaming kernel (kernels.gemv), with LoRA its shrink launched
        # just before it and its expand in its epilogue (lora_apply.ONE_TOKEN_LORA_IN_GEMV).
        one_token = self._one_token(x, gated)
        if one_token and (not has_lora or lora_apply.ONE_TOKEN_LORA_IN_GEMV):
            if norm is not None and not NORM_IN_GEMV:
                x, norm = norm(x), None
            if gated and not SILU_IN_GEMV:
                x, gated = fm.silu_mul(x), False
            norm_args = () if norm is None else (norm.weight, norm.eps)
            gemv_lora = None
            if has_lora:
                gemv_lora = one_token_linear_lora(
                    x, self.lora, lora, self.slice_offsets, *norm_args, gated=gated
                )
            return gemv(x, info.weight, *norm_args, gated=gated, lora=gemv_lora, residual=residual)
        x = self._input(x, norm, gated)
        if not has_lora:
            return self._matmul(x)
        if shrinks_in_product(self.lora, x.shape[0]):  # one product with the pool's carrier
            y, pending = product_with_lora(x, self.lora, lora)  # y: a row-strided view
        else:  # issued first: the shrink runs beside the base matmul (start_linear_lora)
            pending = start_linear_lora(x, self.lora, lora, len(self.output_sizes))
            y = self._matmul(x)
        finish_linear_lora(pending, y, self.lora, self.slice_offsets)
        return y

    def runs_one_token_lora(self, x: torch.Tensor) -> bool:
        """Whether `forward` of x [T, in] takes the one-token kernel with this module's LoRA
        in it (no separate expand to leave to a caller)."""
        return lora_apply.ONE_TOKEN_LORA_IN_GEMV and self._one_token(x, False)

    def forward_leaving_expand(
        self, x: torch.Tensor, lora: LoraSegments, norm: RMSNorm | None = None
    ) -> tuple[torch.Tensor, PendingLinearLora]:
        """`forward` where it does not run the one-token LoRA kernel (`runs_one_token_lora`
        is False) and this module has LoRA: the product [T, out] with its LoRA shrink issued,
        and the pending shrink whose expand the caller launches (MLA: q_b's expand with kv_b's
        query correction, lora_apply.finish_q_b_lora_with_kv_b_q). Those launches read y per
        token, so the shrink never rides in the product here (`shrinks_in_product`)."""
        if self.lora is None or self.runs_one_token_lora(x):
            raise ValueError("forward_leaving_expand needs LoRA and a multi-token product")
        x = self._input(x, norm, False)
        pending = start_linear_lora(x, self.lora, lora, len(self.output_sizes))
        return self._matmul(x), pending

    def has_plain_weight(self) -> bool:
        """Whether the weight is a plain matrix (no quantization scale): one the LoRA pool
        can carry (`keep_weight_in`)."""
        return self.quant.quant_info(self).scale is None

    def keep_weight_in(self, carrier: torch.Tensor) -> None:
        """Read the weight from carrier[:out] from now on (`LoraPool.carry_base_weights`
        copied it there): the old storage is freed."""
        if not self.has_plain_weight():
            raise ValueError(f"a {self.quant.name} weight has a scale; the pool carries bf16 ones")
        self.weight.data = carrier[: self.out_features]

    def _input(self, x: torch.Tensor, norm: RMSNorm | None, gated: bool) -> torch.Tensor:
        if norm is not None:
            x = norm(x)
        if gated:
            x = fm.silu_mul(x) if x.is_cuda else fm.silu_mul_ref(x)
        return x

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The multi-token product: cuBLAS, or the FP8 block-scaled GEMM."""
        info = self.quant.quant_info(self)
        if info.scale is None:
            return F.linear(x, info.weight)
        gemm = fp8_block_linear if x.is_cuda else fp8_block_linear_ref
        return gemm(x, info.weight, info.scale, info.block)
