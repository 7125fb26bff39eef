"""The engine step's host-side layout: `build_batch` against a per-sequence oracle, and how
the engine picks the logits rows it samples."""

from __future__ import annotations

import random

import pytest
import torch

from inference_svc.engine.batch import SequenceStep, build_batch
from inference_svc.engine.engine import LLMEngine, _sampled_rows
from inference_svc.engine.scheduler import ScheduledSeq

PAGE_SIZE = 4


def _oracle(seqs: list[SequenceStep]) -> dict[str, list]:
    """Each field of the batch, built one sequence and one token at a time."""
    positions, slots, logits, starts, table = [], [], [], [0], []
    width = max(len(s.pages) for s in seqs)
    for s in seqs:
        new = range(s.cached_len, s.cached_len + s.query_len)
        positions += new
        slots += [s.pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in new]
        first = starts[-1]
        last = first + s.query_len
        logits += range(first, last) if s.all_logits else [last - 1]
        starts.append(last)
        table.append(list(s.pages) + [0] * (width - len(s.pages)))
    return {
        "positions": positions,
        "slot_mapping": slots,
        "logits_indices": logits,
        "query_start_loc": starts,
        "context_lens": [s.cached_len + s.query_len for s in seqs],
        "page_table": table,
    }


def _random_step(rng: random.Random, decode: bool) -> SequenceStep:
    cached = rng.randint(0, 30)
    query = 1 if decode else rng.randint(2, 12)
    pages = rng.sample(range(500), -(-(cached + query) // PAGE_SIZE) + rng.randint(0, 2))
    return SequenceStep(cached, query, tuple(pages), rng.random() < 0.3)


@pytest.mark.parametrize("seed", range(20))
def test_batch_matches_the_per_sequence_layout(seed: int) -> None:
    rng = random.Random(seed)
    decodes = rng.randint(0, 6)
    prefills = rng.randint(0 if decodes else 1, 3)  # at least one sequence
    seqs = [_random_step(rng, True) for _ in range(decodes)]
    seqs += [_random_step(rng, False) for _ in range(prefills)]
    batch = build_batch(seqs, PAGE_SIZE, "cpu")
    dtypes = {
        "positions": torch.int64,
        "slot_mapping": torch.int64,
        "logits_indices": torch.int64,
        "query_start_loc": torch.int32,
        "context_lens": torch.int32,
        "page_table": torch.int32,
    }
    for name, expected in _oracle(seqs).items():
        field = getattr(batch, name)
        assert field.dtype == dtypes[name] and field.tolist() == expected, name
        # One shared buffer, but every field aligned as a tensor of its own would be.
        assert field.is_contiguous() and field.data_ptr() % 16 == 0, name
    assert batch.num_decode_seqs == decodes


def _scheduled(query_lens: list[int], all_logits: list[bool]) -> list[ScheduledSeq]:
    """Scheduled shares without sequences: `_row_spans` reads only the lengths."""
    return [ScheduledSeq(None, n, wants) for n, wants in zip(query_lens, all_logits, strict=True)]


def test_row_spans_cover_all_logits_sequences_and_last_rows() -> None:
    scheduled = _scheduled([1, 1, 3, 4], [False, True, True, False])
    assert LLMEngine._row_spans(scheduled) == [(0, 1), (1, 2), (2, 5), (5, 6)]


def test_sampled_rows_of_a_whole_run_are_the_run_itself() -> None:
    logits = torch.randn(3, 5)
    assert _sampled_rows([(logits, 0), (logits, 1), (logits, 2)]) is logits


def test_sampled_rows_stack_a_subset_or_several_runs() -> None:
    first, second = torch.randn(3, 5), torch.randn(1, 5)
    assert torch.equal(_sampled_rows([(first, 0), (first, 2)]), first[[0, 2]])
    picked = [(first, 0), (first, 1), (second, 0)]
    assert torch.equal(_sampled_rows(picked), torch.cat([first[:2], second]))
