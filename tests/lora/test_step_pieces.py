"""CPU, float32: a step run the way a step graph runs it equals the model's forward.

A step graph (inference_svc/engine/step_graphs.py) replays the model's pieces on a padded
copy of the step's inputs (`PaddedStep`), leaving their state in fixed buffers
(`piece_buffers`), with each layer's attention run on the step's own batch between two
pieces. Here the pieces run eagerly that way (no CUDA graph: the GPU test
test_lora_gpu.py::test_step_graphs_equal_eager_steps adds the capture), with adapters
mixed in, prompt chunks on cached context beside one-token rows, and padding rows past
every step, against a runner that runs the plain forward.
"""

from __future__ import annotations

import pytest
import torch

from inference_svc.engine.batch import BatchMetadata
from inference_svc.engine.model_runner import ModelRunner
from inference_svc.engine.step_graphs import PaddedStep, piece_buffers
from inference_svc.lora.batch import LoraScope
from tests.lora.harness import assert_runners_agree, make_runner, peft_case

SPEC = "v3_q_lora"
PADDING = 11  # rows past each step


def _adapted_runner(folder) -> ModelRunner:  # type: ignore[no-untyped-def]
    runner = make_runner(folder, SPEC, num_slots=4, max_rank=16)
    runner.lora_pool.load(1, peft_case(SPEC, rank=4, seed=41)[1]).wait_on()
    _, attention_only = peft_case(SPEC, rank=8, seed=42, target_parameters=None)
    runner.lora_pool.load(3, attention_only).wait_on()
    return runner


def _run_as_pieces(runner: ModelRunner, input_ids: torch.Tensor, batch: BatchMetadata):  # type: ignore[no-untyped-def]
    """The step through its pieces on a padded copy of its inputs, attention between."""
    size = batch.num_tokens + PADDING
    model, kv_cache = runner.model, runner.kv_cache
    step = PaddedStep(size, LoraScope.of(batch.lora), kv_cache, runner.lora_pool, runner.device)
    step.load(input_ids, batch)
    buffers = piece_buffers(model, size)
    state = model.first_piece(step.inputs.input_ids, step.batch, kv_cache, buffers)
    for i, layer in enumerate(model.layers):
        layer.attn.attend(state.queries, batch, kv_cache.layer(i))
        state = model.next_piece(i, state, step.batch, kv_cache, buffers)
    assert state.h.shape[0] == size
    return model.compute_logits(state.h[: batch.num_tokens][batch.logits_indices])


@pytest.mark.parametrize("slots", [[1, 1, -1, 3, 1], [3, -1, 3, 3, -1], [-1] * 5])
def test_padded_pieces_equal_the_forward(tiny_model_dirs, slots) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_model_dirs[SPEC]
    plain, pieced = _adapted_runner(folder), _adapted_runner(folder)
    pieced.execute = lambda ids, batch: _run_as_pieces(pieced, ids, batch)  # type: ignore[method-assign]
    assert_runners_agree(plain, pieced, slots, seed=43, tol=1e-5)
