"""Checkpoint loading: layouts, sharding, MTP skipping, FP8 dequantization, errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference_svc.engine.batch import SequenceStep, build_batch
from inference_svc.engine.kv_pages import KVCache, KVCacheConfig
from inference_svc.model.config import load_config
from inference_svc.model.loader import build_model, iter_checkpoint, load_model, load_weights
from inference_svc.model.weight_map import UnexpectedWeightError
from tests.fixtures.fp8_checkpoints import FP8_CONFIG, copy_with, fp8_tensors

PROMPT = [3, 141, 59, 26, 5, 35, 89, 79, 32, 38, 4, 62]


def logits_of(model) -> torch.Tensor:
    c = model.config
    cache = KVCache(KVCacheConfig(c.num_layers, 8, 4, c.kv_cache_dim), model.dtype, "cpu")
    batch = build_batch([SequenceStep(0, len(PROMPT), (0, 1, 2), all_logits=True)], 4, "cpu")
    return model.compute_logits(model(torch.tensor(PROMPT), batch, cache))


def test_sharded_fused_experts_and_mtp_layer(tiny_checkpoint, tmp_path):
    """Sharded index, transformers-5 fused expert tensors and an MTP layer load the same."""
    ckpt = tiny_checkpoint("v3_q_lora")
    tensors = load_file(str(ckpt.folder / "model.safetensors"))
    config = load_config(ckpt.folder)
    fused = {}
    for name, t in tensors.items():
        if ".mlp.experts." not in name:
            fused[name] = t
    for layer in range(config.first_k_dense_replace, config.num_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        experts = range(config.routing.num_experts)
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [
                torch.cat(
                    [
                        tensors[f"{prefix}.{e}.gate_proj.weight"],
                        tensors[f"{prefix}.{e}.up_proj.weight"],
                    ]
                )
                for e in experts
            ]
        )
        fused[f"{prefix}.down_proj"] = torch.stack(
            [tensors[f"{prefix}.{e}.down_proj.weight"] for e in experts]
        )
    mtp = f"model.layers.{config.num_layers}"
    fused[f"{mtp}.eh_proj.weight"] = torch.zeros(4, 4)
    fused[f"{mtp}.self_attn.q_a_proj.weight"] = torch.zeros(4, 4)
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(ckpt.folder / "config.json", folder)
    names = sorted(fused)
    weight_map = {}
    for i in range(3):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        part = {n: fused[n].contiguous() for n in names[i::3]}
        save_file(part, str(folder / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    seen = []
    loaded = load_model(folder, progress=lambda i, n, name: seen.append((i, n)))
    assert seen == [(1, 3), (2, 3), (3, 3)]
    reference = load_model(ckpt.folder)
    torch.testing.assert_close(logits_of(loaded.model), logits_of(reference.model), atol=0, rtol=0)


def test_fp8_checkpoint_dequantizes_on_load(tiny_checkpoint, tmp_path):
    """An fp8 checkpoint loads (CPU: dequantized) to exactly its dequantized float weights."""
    ckpt = tiny_checkpoint("v3_q_lora")
    quantized, dequantized = fp8_tensors(load_file(str(ckpt.folder / "model.safetensors")))
    fp8_folder = copy_with(ckpt.folder, tmp_path / "fp8", quantized, FP8_CONFIG)
    float_folder = copy_with(ckpt.folder, tmp_path / "float", dequantized)
    fp8_model = load_model(fp8_folder).model
    assert fp8_model.layers[0].attn.qkv_a.weight.dtype == torch.float32
    expected = logits_of(load_model(float_folder).model)
    torch.testing.assert_close(logits_of(fp8_model), expected, atol=0, rtol=0)

    # Kept in fp8 (what CUDA does), through the reference block-scaled GEMM.
    kept = build_model(load_config(fp8_folder), "cpu", torch.float32, quant_method="fp8_block")
    load_weights(kept, iter_checkpoint(fp8_folder))
    assert kept.layers[1].moe.experts.w13.weight.dtype == torch.float8_e4m3fn
    assert kept.layers[0].attn.kv_b.weight.dtype == torch.float32  # absorbed decode needs it
    torch.testing.assert_close(logits_of(kept), expected, atol=1e-4, rtol=1e-4)


def test_fp8_experts_with_e4m3_activations(tiny_checkpoint, tmp_path):
    """expert_activations="e4m3": the routed experts (only) take fp8_block_a8, load the same
    e4m3 weights, and the logits stay a rounding of the activations away from fp8_block's."""
    ckpt = tiny_checkpoint("v3_q_lora")
    quantized, _ = fp8_tensors(load_file(str(ckpt.folder / "model.safetensors")))
    fp8_folder = copy_with(ckpt.folder, tmp_path / "fp8", quantized, FP8_CONFIG)
    config = load_config(fp8_folder)
    exact = build_model(config, "cpu", torch.float32, quant_method="fp8_block")
    a8 = build_model(
        config, "cpu", torch.float32, quant_method="fp8_block", expert_activations="e4m3"
    )
    for model in (exact, a8):
        load_weights(model, iter_checkpoint(fp8_folder))
    moe = a8.layers[1].moe
    assert moe.experts.quant.name == "fp8_block_a8"
    assert a8.layers[1].attn.o.quant.name == "fp8_block"  # dense layers keep bf16 inputs
    assert a8.layers[1].mlp.gate_up.quant.name == "fp8_block"  # shared experts too
    assert torch.equal(
        moe.experts.w13.weight.view(torch.uint8),
        exact.layers[1].moe.experts.w13.weight.view(torch.uint8),
    )
    got, want = logits_of(a8).log_softmax(-1), logits_of(exact).log_softmax(-1)
    # e4m3 keeps 3 mantissa bits (≤ 2⁻⁴ relative per activation) in two MoE layers; a wrong
    # scale, group or layout would move log-probabilities by whole units.
    diff = (got - want).abs()
    assert 0 < diff.max() < 0.2 and diff.mean() < 0.02, (diff.max(), diff.mean())
    with pytest.raises(ValueError, match="need an FP8 checkpoint"):
        build_model(load_config(ckpt.folder), "cpu", torch.float32, expert_activations="e4m3")
    with pytest.raises(ValueError, match="expert activations must be one of"):
        build_model(
            config, "cpu", torch.float32, quant_method="fp8_block", expert_activations="fp8"
        )


def test_fp8_scale_in_another_shard_and_orphans(tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint("v3_no_q_lora")
    quantized, _ = fp8_tensors(load_file(str(ckpt.folder / "model.safetensors")))
    config = load_config(
        copy_with(ckpt.folder, tmp_path / "cfg", {"x": torch.zeros(1)}, FP8_CONFIG)
    )
    scales_first = sorted(quantized, key=lambda n: not n.endswith("_scale_inv"))
    model = build_model(config, "cpu", torch.float32)
    load_weights(model, ((n, quantized[n]) for n in scales_first))  # every scale before its weight

    orphan = dict(quantized)
    del orphan["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    with pytest.raises(ValueError, match="without their weight/weight_scale_inv pair"):
        load_weights(build_model(config, "cpu", torch.float32), orphan.items())


def test_missing_and_unexpected_weights_are_errors(tiny_checkpoint):
    ckpt = tiny_checkpoint("v3_q_lora")
    tensors = load_file(str(ckpt.folder / "model.safetensors"))
    config = load_config(ckpt.folder)
    partial = {n: t for n, t in tensors.items() if "layers.2.mlp.experts.3." not in n}
    with pytest.raises(
        ValueError, match="lacks weights for 2 parameters.*layers.2.moe.experts.w13"
    ):
        load_weights(build_model(config, "cpu", torch.float32), partial.items())
    extra = {**tensors, "model.layers.0.self_attn.mystery.weight": torch.zeros(2)}
    with pytest.raises(UnexpectedWeightError, match="mystery"):
        load_weights(build_model(config, "cpu", torch.float32), extra.items())
    wrong = {**tensors, "model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 63)}
    with pytest.raises(ValueError, match="does not fit"):
        load_weights(build_model(config, "cpu", torch.float32), wrong.items())
