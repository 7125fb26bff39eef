"""The benchmarks' FP8 variant: routed experts swapped for block-quantized copies of the same
weights, the MoE then computing with exactly those (dequantized) weights, LoRA included."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from bench import serve_offline
from bench.fp8_experts import SMOKE_FP8_BLOCK, quantize_routed_experts
from bench.lora_decode_overhead import v2_lite_config
from bench.model_decode import random_model
from inference_svc.model.config import parse_config
from kernels.fp8 import FP8_DTYPE, block_dequant_ref


def _tiny_model():
    torch.manual_seed(0)
    return random_model(parse_config(v2_lite_config(3, smoke=True)), "cpu", torch.float32)


def test_swapped_experts_hold_the_same_weights_up_to_e4m3_rounding() -> None:
    model = _tiny_model()
    before = copy.deepcopy(model)
    assert quantize_routed_experts(model, SMOKE_FP8_BLOCK) == 2  # layers 1 and 2 are MoE
    for old, new in zip(before.layers, model.layers, strict=True):
        if old.moe is None:
            assert new.moe is None
            continue
        for which in ("w13", "w2"):
            source, swapped = getattr(old.moe.experts, which), getattr(new.moe.experts, which)
            assert swapped.weight.dtype == FP8_DTYPE
            restored = block_dequant_ref(swapped.weight, swapped.weight_scale_inv, SMOKE_FP8_BLOCK)
            # e4m3 keeps 3 mantissa bits: relative rounding ≤ 2^-4, plus subnormals near 0.
            error = (restored - source.weight).abs()
            assert (error <= source.weight.abs() / 16 + 1e-3).all()
            assert error.max() > 0  # it was quantized, not copied


def test_fp8_moe_computes_with_the_dequantized_weights() -> None:
    model = _tiny_model()
    quantize_routed_experts(model, SMOKE_FP8_BLOCK)
    moe = model.layers[1].moe
    reference = copy.deepcopy(_tiny_model().layers[1].moe)
    reference.gate.load_state_dict(moe.gate.state_dict())
    for which in ("w13", "w2"):
        swapped = getattr(moe.experts, which)
        restored = block_dequant_ref(swapped.weight, swapped.weight_scale_inv, SMOKE_FP8_BLOCK)
        getattr(reference.experts, which).weight.copy_(restored)
    x = torch.randn(7, model.config.hidden_size)
    torch.testing.assert_close(moe(x), reference(x), rtol=1e-5, atol=1e-6)


def test_fp8_a8_experts_round_the_activations_of_the_same_weights() -> None:
    """fp8_a8 holds fp8's weights; its expert GEMMs round their inputs to e4m3 per group
    ("block_a8"), so its MoE output is near fp8's and not equal to it."""
    fp8, a8 = _tiny_model(), _tiny_model()
    quantize_routed_experts(fp8, SMOKE_FP8_BLOCK, "fp8")
    quantize_routed_experts(a8, SMOKE_FP8_BLOCK, "fp8_a8")
    w13, w2 = a8.layers[1].moe.experts.quant_info()
    assert w13.scheme == w2.scheme == "block_a8"
    assert torch.equal(
        w13.weight.view(torch.uint8), fp8.layers[1].moe.experts.w13.weight.view(torch.uint8)
    )
    x = torch.randn(7, a8.config.hidden_size)
    exact, rounded = fp8.layers[1].moe(x), a8.layers[1].moe(x)
    assert (rounded - exact).abs().max() <= 0.06 * exact.abs().max()
    assert not torch.equal(rounded, exact)


def test_serve_offline_smoke_with_fp8_experts_and_adapters_off_the_experts(tmp_path: Path) -> None:
    out = tmp_path / "serve_offline_fp8.json"
    scenarios = ["--scenarios", "no LoRA", "N=8 zipf"]
    serve_offline.main(
        ["--out", str(out), "--smoke", "--experts", "fp8", "--adapter-modules", "no-routed"]
        + scenarios
    )
    results = json.loads(out.read_text())
    assert results["meta"]["experts"] == "fp8"
    assert "but the routed experts" in results["meta"]["adapter_modules"]
    assert "FP8" in results["meta"]["model"]
    for row in results["rows"]:
        assert row["valid"], row
        assert row["output_tokens"] == row["requests"] * results["meta"]["output_len"]
