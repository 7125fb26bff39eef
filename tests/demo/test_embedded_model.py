"""The shipped demo model (inference_svc/embedded/base) loads in our runtime and gives the
logprobs that transformers gives for it (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from inference_svc.engine.batch import SequenceStep, build_batch
from inference_svc.engine.kv_pages import KVCache, KVCacheConfig
from inference_svc.model.loader import load_model
from inference_svc.model.tiny import EMBEDDED_BASE_DIR

TEXT = 'def read_config(path):\n    """Read the file at *path*."""\n    with open(path) as f:\n'
PAGE_SIZE = 16
LOGPROB_TOL = 1e-4


@torch.no_grad()
def runtime_logprobs(token_ids: list[int]) -> torch.Tensor:
    loaded = load_model(EMBEDDED_BASE_DIR)
    c = loaded.config
    pages = -(-len(token_ids) // PAGE_SIZE)
    cache = KVCache(
        KVCacheConfig(c.num_layers, pages, PAGE_SIZE, c.kv_cache_dim), torch.float32, "cpu"
    )
    step = SequenceStep(0, len(token_ids), tuple(range(pages)), all_logits=True)
    batch = build_batch([step], PAGE_SIZE, "cpu")
    hidden = loaded.model(torch.tensor(token_ids), batch, cache)
    return loaded.model.compute_logits(hidden).float().log_softmax(-1)  # [T, V]


@torch.no_grad()
def transformers_logprobs(token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_BASE_DIR, dtype=torch.float32).eval()
    return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)  # [T, V]


@pytest.fixture(scope="module")
def token_ids() -> list[int]:
    ids = load_model(EMBEDDED_BASE_DIR).tokenizer.encode(TEXT)
    assert 20 < len(ids) < len(TEXT)  # the trained BPE merges bytes
    return ids


def test_shipped_model_matches_transformers(token_ids: list[int]) -> None:
    ours, reference = runtime_logprobs(token_ids), transformers_logprobs(token_ids)
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() <= LOGPROB_TOL
    # A trained model, not a random one: it predicts the Python it was trained on (a mean of
    # about -3.0 here; uniform over the 2048 tokens would be -7.6).
    next_token_logprobs = reference[:-1].gather(1, torch.tensor(token_ids[1:])[:, None])
    assert next_token_logprobs.mean().item() > -4.0
