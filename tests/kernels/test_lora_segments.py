"""Invariants of the segment builder, apart from any kernel numerics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.lora_segments import (
    LoraSegmentsConfig,
    allocate_lora_segments,
    build_lora_segments,
)


def _live(segs):  # type: ignore[no-untyped-def]
    n = segs.num_live_segments
    return segs.seg_indptr[: n + 1].tolist(), segs.seg_slot[:n].tolist()


def test_consecutive_equal_slots_form_one_segment() -> None:
    segs = build_lora_segments([2, 2, 0, -1, -1, 2], [4, 0, 8])
    assert _live(segs) == ([0, 2, 3, 5, 6], [2, 0, -1, 2])
    assert segs.token_slot.tolist() == [2, 2, 0, -1, -1, 2]
    assert segs.num_segments.tolist() == [4]
    assert segs.slot_rank.tolist() == [4, 0, 8]


def test_host_mean_adapter_run_is_token_weighted() -> None:
    """Runs ignore the max_seg_len cut and the base model's tokens (what the MoE-LoRA
    placement reads: rows per (expert, adapter run))."""
    segs = build_lora_segments([2] * 40 + [0, -1, -1, 2, 1, 1], [4, 8, 8])
    assert segs.num_live_segments == 7  # 40 tokens of slot 2 cut at 16
    assert segs.run_tokens == (40**2 + 1 + 1 + 2**2) / 44
    reused = build_lora_segments([-1, -1, -1], [4, 8, 8], out=segs)
    assert reused.run_tokens == 0.0
    assert build_lora_segments([], [8]).run_tokens == 0.0


def test_empty_batch_has_no_segments() -> None:
    segs = build_lora_segments([], [8, 8])
    assert segs.num_tokens == 0 and segs.num_live_segments == 0
    assert segs.seg_indptr.tolist() == [0, 0]
    assert segs.seg_slot.tolist() == [-1]
    assert segs.token_slot.tolist() == [-1]


def test_all_base_is_one_no_work_segment() -> None:
    segs = build_lora_segments([-1] * 5, [8])
    assert _live(segs) == ([0, 5], [-1])


def test_all_one_slot_is_split_at_max_seg_len() -> None:
    segs = build_lora_segments([1] * 40, [8, 8], max_seg_len=16)
    assert _live(segs) == ([0, 16, 32, 40], [1, 1, 1])


def test_one_token_per_segment() -> None:
    slots = [0, 1, 2, 3, 2, 1, 0]
    segs = build_lora_segments(slots, [1, 2, 3, 4])
    assert _live(segs) == (list(range(8)), slots)


def test_reuse_pads_past_the_live_batch() -> None:
    segs = allocate_lora_segments(LoraSegmentsConfig(max_tokens=8, num_slots=3), "cpu")
    packed = segs.packed.data_ptr()
    build_lora_segments([0, 1, 1, 2, 2, 2, 0, 0], [1, 2, 3], out=segs)
    build_lora_segments([2, 2, 1], torch.tensor([5, 6, 7], dtype=torch.int32), out=segs)
    assert segs.packed.data_ptr() == packed, "a captured graph must keep seeing the same buffer"
    assert segs.seg_indptr.tolist() == [0, 2, 3, 3, 3, 3, 3, 3, 3]
    assert segs.seg_slot.tolist() == [2, 1, -1, -1, -1, -1, -1, -1]
    assert segs.token_slot.tolist() == [2, 2, 1, -1, -1, -1, -1, -1]
    assert segs.slot_rank.tolist() == [5, 6, 7]
    assert (segs.num_tokens, segs.num_live_segments, segs.num_segments.item()) == (3, 2, 2)


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 16, 17, 63, 130, 1023])
def test_every_field_starts_16_byte_aligned(num_tokens: int) -> None:
    """Kernels get the fields as pointers, which Triton specialises by 16-byte alignment:
    an offset that moves with the token count would compile new variants mid-serving."""
    for segs in (
        build_lora_segments([0] * num_tokens, [4]),
        allocate_lora_segments(LoraSegmentsConfig(max_tokens=num_tokens, num_slots=2), "cpu"),
    ):
        for field in (segs.seg_indptr, segs.seg_slot, segs.token_slot, segs.num_segments):
            offset = field.data_ptr() - segs.packed.data_ptr()
            assert field.data_ptr() % 16 == 0, (num_tokens, offset)


@pytest.mark.parametrize("seed", range(5))
def test_random_batches_partition_the_tokens(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_tokens = int(torch.randint(1, 80, (1,), generator=gen))
    slots = torch.randint(-1, 4, (num_tokens,), generator=gen).tolist()
    segs = build_lora_segments(slots, [3, 0, 16, 9], max_seg_len=16)
    indptr, seg_slot = _live(segs)
    assert indptr[0] == 0 and indptr[-1] == num_tokens
    for start, end, slot in zip(indptr, indptr[1:], seg_slot, strict=False):
        assert 0 < end - start <= 16
        assert slots[start:end] == [slot] * (end - start)
    for i in range(len(seg_slot) - 1):
        # Runs are maximal: a run only continues into the next segment at the length cap.
        if seg_slot[i] == seg_slot[i + 1]:
            assert indptr[i + 1] - indptr[i] == 16


def test_rejects_bad_input() -> None:
    segs = allocate_lora_segments(LoraSegmentsConfig(max_tokens=2, num_slots=2), "cpu")
    with pytest.raises(ValueError, match="tokens"):
        build_lora_segments([0, 0, 0], [1, 1], out=segs)
    with pytest.raises(ValueError, match="slots"):
        build_lora_segments([0], [1, 1, 1], out=segs)
    with pytest.raises(ValueError, match="token slots"):
        build_lora_segments([2], [1, 1], out=segs)
    with pytest.raises(ValueError, match="max_seg_len"):
        LoraSegmentsConfig(max_tokens=4, num_slots=1, max_seg_len=24)


def _torch_reference(slots: list[int], capacity: int, max_seg_len: int) -> list[list[int]]:
    """The builder's fields (seg_indptr, seg_slot, token_slot, num_segments) as the torch
    implementation it replaced computed them."""
    token_slots = torch.tensor(slots, dtype=torch.int32)
    starts = torch.zeros(0, dtype=torch.int64)
    if slots:
        changed = torch.ones(len(slots), dtype=torch.bool)
        changed[1:] = token_slots[1:] != token_slots[:-1]
        run_starts = torch.nonzero(changed).flatten()
        run_of_token = torch.cumsum(changed.to(torch.int64), 0) - 1
        pos_in_run = torch.arange(len(slots)) - run_starts[run_of_token]
        starts = torch.nonzero(pos_in_run % max_seg_len == 0).flatten()
    seg_indptr = torch.full((capacity + 1,), len(slots), dtype=torch.int32)
    seg_indptr[: starts.numel()] = starts
    seg_slot = torch.full((capacity,), -1, dtype=torch.int32)
    seg_slot[: starts.numel()] = token_slots[starts]
    token_slot = torch.full((capacity,), -1, dtype=torch.int32)
    token_slot[: len(slots)] = token_slots
    return [seg_indptr.tolist(), seg_slot.tolist(), token_slot.tolist(), [starts.numel()]]


def _random_slots(gen: torch.Generator, num_tokens: int, num_slots: int) -> list[int]:
    """Runs of random slots (-1 included), some longer than a segment."""
    slots: list[int] = []
    while len(slots) < num_tokens:
        slot = int(torch.randint(-1, num_slots, (1,), generator=gen))
        slots += [slot] * int(torch.randint(1, 40, (1,), generator=gen))
    return slots[:num_tokens]


@pytest.mark.parametrize("seed", range(20))
def test_numpy_builder_equals_the_torch_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    max_seg_len = (16, 32)[seed % 2]
    capacity = 96
    num_tokens = (0, 1, 7, 64, capacity)[seed % 5]
    slots = _random_slots(gen, num_tokens, 4)
    if seed % 7 == 3:
        slots = [-1] * num_tokens
    ranks = torch.tensor([3, 0, 16, 9], dtype=torch.int32)
    config = LoraSegmentsConfig(max_tokens=capacity, num_slots=4, max_seg_len=max_seg_len)
    padded = allocate_lora_segments(config, "cpu")
    build_lora_segments(_random_slots(gen, capacity, 4), ranks, out=padded)  # stale contents
    exact = build_lora_segments(slots, ranks, max_seg_len=max_seg_len)
    for segs, cap in ((build_lora_segments(slots, ranks, out=padded), capacity), (exact, None)):
        want = _torch_reference(slots, cap or max(num_tokens, 1), max_seg_len)
        fields = (segs.seg_indptr, segs.seg_slot, segs.token_slot, segs.num_segments)
        assert [f.tolist() for f in fields] == want
        assert all(f.dtype == torch.int32 and f.device.type == "cpu" for f in fields)
        assert segs.slot_rank.tolist() == ranks.tolist() and segs.slot_rank.dtype == torch.int32
        assert (segs.num_tokens, segs.num_live_segments) == (num_tokens, want[3][0])
        assert type(segs.num_tokens) is int and type(segs.num_live_segments) is int


def test_token_slots_may_be_a_tensor_or_an_array() -> None:
    want = build_lora_segments([2, 2, 0, -1], [4, 0, 8])
    for given in (torch.tensor([2, 2, 0, -1]), np.array([2, 2, 0, -1], dtype=np.int32)):
        got = build_lora_segments(given, [4, 0, 8])
        assert torch.equal(got.packed, want.packed) and got.num_live_segments == 3


def test_pair_tokens_are_made_once_per_step_and_top_k():
    """The routed pairs' tokens (p = t·k + j → t) for every MoE layer of a step: one tensor
    per (tokens, top_k), shared by the per-module views of the segments."""
    segs = build_lora_segments([0, 0, -1, 1, 1], [4, 8])
    tokens = segs.pair_tokens(3)
    assert tokens.dtype == torch.int32
    assert tokens.tolist() == [t for t in range(5) for _ in range(3)]
    assert segs.pair_tokens(3) is tokens
    assert segs.with_slot_rank(torch.tensor([4, 0], dtype=torch.int32)).pair_tokens(3) is tokens
    assert segs.pair_tokens(2).tolist() == [t for t in range(5) for _ in range(2)]
