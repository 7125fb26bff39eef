"""Shared inputs of the LoRA kernel tests: slot assignments by adapter popularity, slot pools
with mixed true ranks, and the dtype → tolerance table."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.lora_segments import build_lora_segments

# Kernel (in this dtype) vs reference (float32 on the same values): (atol, rtol).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (6e-2, 6e-2),
}

POPULARITIES = ("distinct", "zipf", "skewed", "identical", "all_base")


def popular_slots(
    popularity: str, num_tokens: int, num_slots: int, gen: torch.Generator
) -> list[int]:
    """Slot per token, grouped so equal slots are contiguous (as the scheduler orders them);
    all but 'identical'/'all_base' also mix in base-model tokens (-1)."""
    if popularity == "all_base":
        return [-1] * num_tokens
    if popularity == "identical":
        return [num_slots - 1] * num_tokens
    if popularity == "distinct":
        choice = torch.randperm(num_tokens, generator=gen) % num_slots
    elif popularity == "zipf":
        weights = 1.0 / torch.arange(1, num_slots + 1, dtype=torch.float64)
        choice = torch.multinomial(weights, num_tokens, replacement=True, generator=gen)
    elif popularity == "skewed":
        choice = torch.where(
            torch.rand(num_tokens, generator=gen) < 0.8,
            0,
            torch.randint(0, num_slots, (num_tokens,), generator=gen),
        )
    else:
        raise ValueError(popularity)
    base = torch.rand(num_tokens, generator=gen) < 0.2
    slots = torch.where(base, -1, choice)
    return sorted(slots.tolist())


def mixed_ranks(num_slots: int, pool_rank: int, gen: torch.Generator) -> list[int]:
    """True ranks 1..pool_rank; slot 0 is below the max rank and slot 1 at it, so a
    rank < max slot always sits next to a max-rank one; the last slot may be empty (0)."""
    ranks = torch.randint(1, pool_rank + 1, (num_slots,), generator=gen).tolist()
    ranks[0] = max(1, pool_rank // 2 - 1)
    if num_slots > 1:
        ranks[1] = pool_rank
    return ranks


def rank_mask(ranks: list[int], pool_rank: int, num_slices: int = 1) -> Tensor:
    """[slots, S*R] bool: stacked rank index i*R + r is live in the slot."""
    live = torch.arange(pool_rank)[None, :] < torch.tensor(ranks)[:, None]  # [slots, R]
    return live.repeat(1, num_slices)


def pool_A(
    ranks: list[int], num_slices: int, pool_rank: int, in_dim: int, poison: float = 0.0
) -> Tensor:
    """A buffer [slots, S*R, in]; rows past a slot's rank hold `poison` (0 in a real pool;
    NaN proves a kernel never reads them)."""
    a = torch.randn(len(ranks), num_slices * pool_rank, in_dim) / in_dim**0.5
    return torch.where(rank_mask(ranks, pool_rank, num_slices)[:, :, None], a, poison)


def pool_B(ranks: list[int], out_dim: int, pool_rank: int, poison: float = 0.0) -> Tensor:
    """B buffer [slots, out, R]; columns past a slot's rank hold `poison`."""
    b = torch.randn(len(ranks), out_dim, pool_rank) / pool_rank**0.5
    return torch.where(rank_mask(ranks, pool_rank)[:, None, :], b, poison)


def assert_close(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def sgmv_case(  # type: ignore[no-untyped-def]
    popularity, num_tokens, in_dim, slice_offsets, pool_rank, dtype, seed, poison=0.0,
    max_seg_len=16,
):  # fmt: skip
    """(segments of at most `max_seg_len` tokens, x [T, in], A, B, base out [T, out]) of a
    5-slot pool with mixed ranks."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    num_slots, num_slices = 5, len(slice_offsets) - 1
    ranks = mixed_ranks(num_slots, pool_rank, gen)
    slots = popular_slots(popularity, num_tokens, num_slots, gen)
    segs = build_lora_segments(slots, ranks, max_seg_len=max_seg_len)
    x = torch.randn(num_tokens, in_dim).to(dtype)
    A = pool_A(ranks, num_slices, pool_rank, in_dim, poison).to(dtype)
    B = pool_B(ranks, slice_offsets[-1], pool_rank, poison).to(dtype)
    base_out = torch.randn(num_tokens, slice_offsets[-1]).to(dtype)
    return segs, x, A, B, base_out
