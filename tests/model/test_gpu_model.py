"""GPU-only checks of the model runtime (run with `make gpu-test` on an H100)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from inference_svc.engine.batch import SequenceStep, build_batch
from inference_svc.engine.model_runner import ModelRunner, RunnerConfig
from inference_svc.layers import linear as linear_layer
from inference_svc.layers import moe as moe_layer
from inference_svc.model.loader import load_model
from kernels import fused_moe as fm
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
    """Graphed decode steps equal eager ones, bit for bit: full graphs, graphs with padding
    rows, and a graph replayed with fewer rows (and page-table columns) than before. The
    logits a replay returns are its own: the next replay of the graph leaves them alone."""
    ckpt = tiny_checkpoint("v3_q_lora")
    loaded = load_model(ckpt.folder, device="cuda", dtype=torch.bfloat16)
    config = RunnerConfig(num_pages=64, page_size=PAGE_SIZE, max_pages_per_seq=4,
                          cuda_graph_batch_sizes=(1, 2, 4, 8))  # fmt: skip
    eager = ModelRunner(loaded.model, config)
    graphed = ModelRunner(loaded.model, config)
    graphed.capture_decode_graphs()
    g = torch.Generator().manual_seed(0)
    for batch_size in (8, 4, 3, 1, 2):
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
        logits = graphed.execute(next_ids, batch)
        expected = eager.execute(next_ids, batch)
        torch.testing.assert_close(logits, expected, atol=0, rtol=0)
        graphed.execute((next_ids + 1) % 256, batch)
        torch.testing.assert_close(logits, expected, atol=0, rtol=0)


def _one_token_decode(loaded) -> torch.Tensor:
    """A 21-token prompt, then 4 one-token decode steps (eager): their logits [4, V]."""
    runner = ModelRunner(loaded.model, RunnerConfig(num_pages=16, page_size=PAGE_SIZE))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (21,), generator=g).cuda()
    runner.execute(prompt, build_batch([SequenceStep(0, 21, (0, 1))], PAGE_SIZE, "cuda"))
    steps = []
    for i, token in enumerate(torch.randint(0, 256, (4,), generator=g).cuda()):
        batch = build_batch([SequenceStep(21 + i, 1, (0, 1))], PAGE_SIZE, "cuda")
        steps.append(runner.execute(token.view(1), batch))
    return torch.stack(steps)


def _recording(monkeypatch, module, name: str, keyword: str) -> list[bool]:
    """Wrap module.name to record, per call, whether `keyword` was passed (not None or
    False)."""
    seen: list[bool] = []
    plain = getattr(module, name)

    def recorded(*args, **kwargs):
        seen.append(kwargs.get(keyword) not in (None, False))
        return plain(*args, **kwargs)

    monkeypatch.setattr(module, name, recorded)
    return seen


@pytest.mark.parametrize("spec", ["v3_q_lora", "v2_greedy"])
def test_one_token_selection_in_the_gemm_equals_its_own_launch(spec, tiny_checkpoint, monkeypatch):
    """One-token decode steps give the same logits, bit for bit, whether the gate_up GEMM
    selects the experts (moe.SELECT_IN_GEMM) or a launch before it does."""
    loaded = load_model(tiny_checkpoint(spec).folder, device="cuda", dtype=torch.bfloat16)
    selecting = _recording(monkeypatch, fm, "grouped_gemm", "selection")
    logits = {}
    for in_gemm in (True, False):
        monkeypatch.setattr(moe_layer, "SELECT_IN_GEMM", in_gemm)
        logits[in_gemm] = _one_token_decode(loaded)
        assert any(selecting) == in_gemm  # the path under test ran (or did not)
        selecting.clear()
    torch.testing.assert_close(logits[True], logits[False], atol=0, rtol=0)


@pytest.mark.parametrize("spec", ["v3_q_lora", "v2_greedy"])
def test_silu_mul_in_the_gate_up_gemm_equals_its_own_launch(spec, tiny_checkpoint, monkeypatch):
    """A prompt step and one-token decode steps give the same logits, bit for bit, whether
    the routed experts' SiLU·mul rides in the gate_up GEMM's epilogue
    (moe.SILU_IN_GATE_UP_MAX_TOKENS) or has its own launch."""
    loaded = load_model(tiny_checkpoint(spec).folder, device="cuda", dtype=torch.bfloat16)
    gating = _recording(monkeypatch, fm, "grouped_gemm", "gated_out")
    logits = {}
    for max_tokens in (256, 0):
        monkeypatch.setattr(moe_layer, "SILU_IN_GATE_UP_MAX_TOKENS", max_tokens)
        logits[max_tokens] = _one_token_decode(loaded)
        assert any(gating) == bool(max_tokens)  # the path under test ran (or did not)
        gating.clear()
    torch.testing.assert_close(logits[256], logits[0], atol=0, rtol=0)


@pytest.mark.parametrize("spec", ["v3_q_lora", "v3_no_q_lora"])
def test_one_token_residual_add_in_the_gemv_matches_its_own_launch(
    spec, tiny_checkpoint, monkeypatch
):
    """One-token decode steps whose input norms (with the residual adds and the MoE
    combine) ride in the attention's first GEMVs (linear.RESIDUAL_IN_GEMV; without q_lora
    two GEMVs read the input) agree with the separate norm launch: the norm's sum of squares
    is reduced in another order, so a value may round to the next bf16 (KL ≤ 1e-5)."""
    loaded = load_model(tiny_checkpoint(spec).folder, device="cuda", dtype=torch.bfloat16)
    adding = _recording(monkeypatch, linear_layer, "gemv", "residual")
    logprobs = {}
    for in_gemv in (True, False):
        monkeypatch.setattr(linear_layer, "RESIDUAL_IN_GEMV", in_gemv)
        logprobs[in_gemv] = _one_token_decode(loaded).float().log_softmax(-1).flatten(0, -2)
        assert any(adding) == in_gemv  # the path under test ran (or did not)
        adding.clear()
    assert kl_per_token(logprobs[False], logprobs[True]).max() <= 1e-5


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
