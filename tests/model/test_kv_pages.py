"""Page allocator invariants and batch-metadata layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_svc.engine.batch import SequenceStep, build_batch
from inference_svc.engine.kv_pages import KVCache, KVCacheConfig, PageAllocator, pages_for


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_allocator_never_double_allocates_and_conserves_pages(ops):
    allocator = PageAllocator(16)
    owned: list[list[int]] = []
    for allocate, n in ops:
        if allocate:
            if allocator.can_allocate(n):
                owned.append(allocator.allocate(n))
            else:
                with pytest.raises(MemoryError):
                    allocator.allocate(n)
        elif owned:
            allocator.free(owned.pop(n % len(owned)))
        held = [p for pages in owned for p in pages]
        assert len(held) == len(set(held)), "a page has two owners"
        assert all(0 <= p < 16 for p in held)
        assert allocator.num_free + len(held) == 16


def test_allocator_rejects_double_free_and_foreign_pages():
    allocator = PageAllocator(4)
    pages = allocator.allocate(2)
    allocator.free(pages)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free(pages)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free([3, 3])
    assert allocator.num_free == 4


def test_pages_for_and_cache_geometry():
    assert [pages_for(n, 4) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]
    cache = KVCache(KVCacheConfig(3, 10, 4, 24), torch.float32, "cpu")
    assert cache.layer(2).shape == (11, 4, 24) and cache.scratch_page == 10
    assert cache.config.bytes(torch.float32) == cache.pools.numel() * 4


def test_batch_layout_decodes_first():
    seqs = [
        SequenceStep(cached_len=5, query_len=1, pages=(7, 2)),
        SequenceStep(cached_len=0, query_len=3, pages=(4,), all_logits=True),
        SequenceStep(cached_len=4, query_len=2, pages=(1, 9)),
    ]
    b = build_batch(seqs, page_size=4, device="cpu")
    assert b.positions.tolist() == [5, 0, 1, 2, 4, 5]
    assert b.query_start_loc.tolist() == [0, 1, 4, 6]
    assert b.context_lens.tolist() == [6, 3, 6]
    assert b.slot_mapping.tolist() == [2 * 4 + 1, 16, 17, 18, 9 * 4 + 0, 9 * 4 + 1]
    assert b.logits_indices.tolist() == [0, 1, 2, 3, 5]
    assert b.page_table.tolist() == [[7, 2], [4, 0], [1, 9]]
    assert b.num_decode_seqs == 1 and b.num_tokens == 6
    # The prefill sequences' whole contexts (cached prefix included), decodes skipped.
    assert b.context_rows.tolist() == [16, 17, 18, 4, 5, 6, 7, 36, 37]
    assert b.context_start_loc.tolist() == [0, 0, 3, 9]
    assert b.context_start_host == (0, 0, 3, 9)


def test_batch_rejects_bad_layouts():
    with pytest.raises(ValueError, match="must come before"):
        build_batch([SequenceStep(0, 2, (0,)), SequenceStep(3, 1, (1,))], 4, "cpu")
    with pytest.raises(ValueError, match="cannot hold"):
        build_batch([SequenceStep(4, 1, (0,))], 4, "cpu")
