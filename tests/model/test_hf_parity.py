"""Our forward over a flattened batch equals transformers' logits (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from inference_svc.engine.batch import SequenceStep, build_batch
from inference_svc.engine.kv_pages import pages_for
from inference_svc.engine.model_runner import ModelRunner, RunnerConfig
from inference_svc.model.loader import load_model
from tests.fixtures.tiny_models import TINY_SPECS

TOL = 1e-4
PAGE_SIZE = 4


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("spec", sorted(TINY_SPECS))
def test_prefill_logprobs_match_transformers(spec, tiny_checkpoint):
    """Three prompts of uneven lengths in one flattened step, all-token logits."""
    ckpt = tiny_checkpoint(spec)
    loaded = load_model(ckpt.folder)
    runner = ModelRunner(loaded.model, RunnerConfig(num_pages=64, page_size=PAGE_SIZE))
    prompts = random_prompts([13, 5, 22], loaded.config.vocab_size, seed=len(spec))
    steps, next_page = [], 0
    for p in prompts:
        n = pages_for(len(p), PAGE_SIZE)
        steps.append(SequenceStep(0, len(p), tuple(range(next_page, next_page + n)), True))
        next_page += n
    batch = build_batch(steps, PAGE_SIZE, "cpu")
    ids = torch.tensor([t for p in prompts for t in p])
    ours = runner.execute(ids, batch).log_softmax(dim=-1)
    row = 0
    for p in prompts:
        ref = ckpt.hf_logprobs(p)
        diff = (ours[row : row + len(p)] - ref).abs().max().item()
        assert diff <= TOL, f"{spec}: max |Δlogprob| {diff:.2e}"
        # The comparison means something only if the distribution is far from uniform.
        assert ref.max(dim=-1).values.mean() > -4.5  # uniform: ln(1/256) = -5.5
        row += len(p)
