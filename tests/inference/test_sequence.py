"""Sequence bookkeeping that the engine step relies on."""

from __future__ import annotations

from inference_svc.engine.sequence import GenerationParams, Sequence
from inference_svc.model.tokenizer import ByteTokenizer


def test_token_ids_are_slices_of_prompt_then_output() -> None:
    seq = Sequence("r", [10, 11, 12], GenerationParams(), ByteTokenizer(eos_token_ids=()), ())
    seq.output_token_ids += [20, 21, 22, 23]
    tokens = seq.prompt_token_ids + seq.output_token_ids
    for start in range(len(tokens) + 2):
        for end in range(len(tokens) + 2):
            assert seq.token_ids(start, end) == tokens[start:end], (start, end)
