"""The benchmarks' FP8 variant: routed experts block-quantized to e4m3, the rest in bf16.

Issue 9 asks for the serving figures "with FP8 block-quantized experts". A whole-model FP8
checkpoint cannot be built for V2-Lite's shape: its dense MLP's intermediate size (10944)
is not a multiple of the 128-row scale block, so the fused gate ⊕ up slices would share
scale blocks (`Fp8BlockMethod.check_slices` refuses that). The routed experts (1408 =
11 × 128) are what a decode step at batch ≥ 64 mostly reads, and are what this variant
quantizes: each MoE layer's `RoutedExperts` is swapped for an `fp8_block` one holding the
same random weights up to e4m3 rounding, so the base MoE runs the FP8 grouped GEMM and the
routed-expert LoRA runs beside it through the quant-method interface, as it would on a
real FP8 checkpoint.
"""

from __future__ import annotations

import torch

from inference_svc.layers.moe import RoutedExperts
from inference_svc.layers.quant import Fp8BlockA8Method, Fp8BlockMethod
from inference_svc.models.deepseek_v3 import DeepseekV3Model
from kernels.fp8 import block_quant_ref

# fp8_a8: the same weights, with the expert GEMMs quantizing their activations to e4m3 per
# 128-group (`fp8_block_a8`, DeepSeek-V3's own scheme: e4m3 × e4m3 MMAs).
EXPERT_WEIGHTS = ("bf16", "fp8", "fp8_a8")
FP8_BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size
SMOKE_FP8_BLOCK = (32, 32)  # divides the smoke shapes' expert sizes (64 × 128)


def fp8_block(smoke: bool) -> tuple[int, int]:
    """The scale block for the benchmarks' model (smoke: the tiny CPU shapes)."""
    return SMOKE_FP8_BLOCK if smoke else FP8_BLOCK


@torch.no_grad()
def quantize_routed_experts(
    model: DeepseekV3Model, block: tuple[int, int], experts: str = "fp8"
) -> int:
    """Swap every MoE layer's experts for FP8 block-quantized copies (`experts`: "fp8" or
    "fp8_a8", see EXPERT_WEIGHTS); returns the layers."""
    method = {"fp8": Fp8BlockMethod, "fp8_a8": Fp8BlockA8Method}[experts](*block)
    swapped = 0
    for layer in model.layers:
        if layer.moe is None:
            continue
        old = layer.moe.experts
        w13 = old.w13.weight  # [E, 2I, hidden]
        hidden = w13.shape[-1]
        new = RoutedExperts(old.num_experts, hidden, old.inter, method, w13.dtype, w13.device)
        for which in ("w13", "w2"):
            source, target = getattr(old, which), getattr(new, which)
            for expert in range(old.num_experts):
                weight, scale = block_quant_ref(source.weight[expert], block)
                target.weight[expert].copy_(weight)
                target.weight_scale_inv[expert].copy_(scale)
        layer.moe.experts = new
        swapped += 1
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the bf16 experts' memory goes back for the KV and LoRA pools
    return swapped
