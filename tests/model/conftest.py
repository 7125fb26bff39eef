"""Tiny HF checkpoints saved once per session, with the transformers model as oracle."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.fixtures.tiny_models import build_tiny_model, save_tiny_model


class TinyCheckpoint:
    def __init__(self, name: str, folder: Path):
        self.name, self.folder = name, folder
        self.hf = build_tiny_model(name)

    @torch.no_grad()
    def hf_logprobs(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab] log-probabilities of a full-sequence transformers forward."""
        logits = self.hf(torch.tensor([ids])).logits[0].float()
        return logits.log_softmax(dim=-1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    cache: dict[str, TinyCheckpoint] = {}

    def get(name: str) -> TinyCheckpoint:
        if name not in cache:
            folder = save_tiny_model(name, tmp_path_factory.mktemp(name))
            cache[name] = TinyCheckpoint(name, folder)
        return cache[name]

    return get
