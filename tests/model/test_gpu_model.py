"""GPU-only checks of the model runtime (run with `make gpu-test` on an H100)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from inference_svc.engine.batch import SequenceStep, build_batch
from inference_svc.engine.model_runner import ModelRunner, RunnerConfig
from inference_svc.model.loader import load_model
from tests.fixtures.fp8_checkpoints import FP8_CONFIG, copy_with, fp8_tensors
from tests.model.bf16_parity import KL_BOUND, check_bf16_close_to_transformers, kl_per_token

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
PAGE_SIZE = 16


@pytest.mark.parametrize("spec", ["v3_q_lora", "v3_yarn", "v2_group_limited"])
def test_bf16_prefill_and_decode_close_to_transformers(spec, tiny_checkpoint):
    """KL ≤ 1e-3 per token except at rare routing near-ties (see tests/model/bf16_parity.py)."""
    check_bf16_close_to_transformers(tiny_checkpoint(spec), "cuda")


def test_cuda_graph_replay_equals_eager(tiny_checkpoint):
    ckpt = tiny_checkpoint("v3_q_lora")
    loaded = load_model(ckpt.folder, device="cuda", dtype=torch.bfloat16)
    config = RunnerConfig(num_pages=64, page_size=PAGE_SIZE, max_pages_per_seq=4,
                          cuda_graph_batch_sizes=(1, 2, 4, 8))  # fmt: skip
    eager = ModelRunner(loaded.model, config)
    graphed = ModelRunner(loaded.model, config)
    graphed.capture_decode_graphs()
    g = torch.Generator().manual_seed(0)
    for batch_size in (1, 3, 8):
        lengths = torch.randint(1, 40, (batch_size,), generator=g).tolist()
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
        steps = [SequenceStep(0, n, (4 * b, 4 * b + 1, 4 * b + 2)) for b, n in enumerate(lengths)]
        ids = torch.tensor([t for p in prompts for t in p], device="cuda")
        for runner in (eager, graphed):  # fill both caches with the prompts
            runner.execute(ids, build_batch(steps, PAGE_SIZE, "cuda"))
        decode = [SequenceStep(n, 1, s.pages) for n, s in zip(lengths, steps, strict=True)]
        batch = build_batch(decode, PAGE_SIZE, "cuda")
        next_ids = torch.randint(0, 256, (batch_size,), generator=g).cuda()
        assert graphed._graph_for(batch) is not None
        torch.testing.assert_close(
            graphed.execute(next_ids, batch), eager.execute(next_ids, batch), atol=0, rtol=0
        )


@pytest.mark.parametrize("expert_activations", ["bf16", "e4m3"])
def test_fp8_kept_on_gpu_matches_dequantized(tiny_checkpoint, tmp_path, expert_activations):
    """bf16 expert activations: the dequantized model's outputs (KL_BOUND). e4m3: the
    experts' inputs are rounded to e4m3 per 128-group, so within that rounding (as on the
    CPU, tests/model/test_loader.py)."""
    ckpt = tiny_checkpoint("v3_q_lora")
    quantized, dequantized = fp8_tensors(load_file(str(ckpt.folder / "model.safetensors")))
    fp8 = load_model(copy_with(ckpt.folder, tmp_path / "fp8", quantized, FP8_CONFIG), "cuda",
                     torch.bfloat16, expert_activations=expert_activations)  # fmt: skip
    ref = load_model(copy_with(ckpt.folder, tmp_path / "f", dequantized), "cuda", torch.bfloat16)
    assert fp8.model.layers[1].moe.experts.w13.weight.dtype == torch.float8_e4m3fn
    tokens = list(range(3, 30))
    outs = []
    for loaded in (fp8, ref):
        runner = ModelRunner(loaded.model, RunnerConfig(num_pages=4, page_size=PAGE_SIZE))
        batch = build_batch([SequenceStep(0, len(tokens), (0, 1), True)], PAGE_SIZE, "cuda")
        outs.append(runner.execute(torch.tensor(tokens, device="cuda"), batch).log_softmax(-1))
    if expert_activations == "e4m3":
        assert fp8.model.layers[1].moe.experts.quant.name == "fp8_block_a8"
        diff = (outs[0].float() - outs[1].float()).abs()
        assert 0 < diff.max() < 0.2 and diff.mean() < 0.02, (diff.max(), diff.mean())
        return
    kl = kl_per_token(outs[1].float(), outs[0].float())
    assert kl.max() <= KL_BOUND
