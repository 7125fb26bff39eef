"""Linear layers whose weight may fuse several checkpoint projections along the output dim.

`attn.qkv_a` = q_a_proj ⊕ kv_a_proj_with_mqa and `mlp.gate_up` = gate_proj ⊕ up_proj are one
matmul each, exactly like the canonical LoRA modules, so a LoRA delta maps 1:1 onto one call.
`lora` holds the module's LoRA pool buffers once a pool is attached.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_svc.layers.quant import QuantMethod
from inference_svc.lora.apply import LoraWeights, finish_linear_lora, start_linear_lora
from kernels.fp8 import fp8_block_linear, fp8_block_linear_ref
from kernels.gemv import gemv, gemv_fits
from kernels.lora_segments import LoraSegments


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

    def forward(self, x: torch.Tensor, lora: LoraSegments | None = None) -> torch.Tensor:
        """x [T, in] → [T, out]; plus each token's LoRA delta when `lora` describes x."""
        pending = None
        if lora is not None and self.lora is not None:
            # Issued first: the shrink runs beside the base matmul (see start_linear_lora).
            pending = start_linear_lora(x, self.lora, lora, len(self.output_sizes))
        info = self.quant.quant_info(self)
        if info.scale is None:
            # One token without LoRA: the weight-streaming kernel. With LoRA the shrink runs
            # on the side stream beside cuBLAS, and measured slower beside gemv (B=1 with
            # one adapter, 8 layers: 1311 → 1367 µs, lora_decode_overhead_v24_h100.json).
            one_token = pending is None and x.is_cuda and gemv_fits(x, info.weight)
            y = gemv(x, info.weight) if one_token else F.linear(x, info.weight)
        else:
            gemm = fp8_block_linear if x.is_cuda else fp8_block_linear_ref
            y = gemm(x, info.weight, info.scale, info.block)
        if pending is not None:
            finish_linear_lora(pending, y, self.lora, self.slice_offsets)
        return y
