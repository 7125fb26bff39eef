"""Batch metadata: everything the layers need about one step, built once per step.

A step runs a flattened batch of T tokens from B sequences. Sequence b contributes
query_len[b] new tokens at positions [cached_len[b], cached_len[b] + query_len[b]).
Decode sequences (one new token) come first, so their tokens are rows [0, num_decode_tokens)
and take the absorbed paged-attention path; prefill sequences follow and take the naive path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_svc.engine.kv_pages import pages_for
from inference_svc.lora.batch import LoraBatch, build_lora_batch

# Prefill expands K/V from the cached latent rows of several sequences in one matmul (and
# one LoRA call) while their contexts together stay under this many rows: peak memory is
# that of one sequence of this context, the per-sequence launches (and the host work that
# made an eager prefill step host-bound: H100, 16 prompts × 8 layers) are shared.
PREFILL_GROUP_ROWS = 8192


@dataclass(frozen=True)
class SequenceStep:
    """One sequence's share of a step, as the scheduler sees it."""

    cached_len: int  # tokens already in the KV cache
    query_len: int  # new tokens run this step
    pages: tuple[int, ...]  # page table covering cached_len + query_len tokens
    all_logits: bool = False  # logits for every new token (prompt logprobs), else the last
    lora_slot: int = -1  # LoRA pool slot of the sequence's adapter, -1 = base model

    def __post_init__(self) -> None:
        if self.cached_len < 0 or self.query_len <= 0:
            raise ValueError(f"bad lengths cached={self.cached_len} query={self.query_len}")

    @property
    def is_decode(self) -> bool:
        return self.query_len == 1


@dataclass(frozen=True)
class BatchMetadata:
    """Positions, sequence layout, page tables and KV write slots of one step (device tensors).

    positions: [T] int64 absolute position of each token.
    query_start_loc: [B + 1] int32 cu_seqlens of the new tokens.
    context_lens: [B] int32 tokens in the cache after this step's writes (what attention sees).
    page_table: [B, max_pages] int32 (unused entries 0).
    slot_mapping: [T] int64 flat cache row (page · page_size + offset) each token writes.
    logits_indices: [L] int64 rows of the hidden states that need logits.
    num_decode_seqs: sequences [0, num_decode_seqs) are decodes (one token each).
    query_lens / context_lens_host: host copies for the prefill path's per-sequence loop.
    prefill_groups: [first, end) sequence ranges of the prefill sequences whose cached
        contexts are expanded together (see PREFILL_GROUP_ROWS).
    lora: which LoRA slot each token uses; None when no sequence uses an adapter.
    """

    positions: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    page_table: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    num_decode_seqs: int
    query_lens: tuple[int, ...]
    context_lens_host: tuple[int, ...]
    page_size: int
    prefill_groups: tuple[tuple[int, int], ...] = ()
    lora: LoraBatch | None = None

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_seqs


def build_batch(
    seqs: list[SequenceStep],
    page_size: int,
    device: torch.device | str,
    lora_slot_rank: torch.Tensor | None = None,
) -> BatchMetadata:
    """Lay out a step's sequences (decodes first) into one `BatchMetadata`.

    lora_slot_rank: the LoRA pool's per-slot rank tensor; needed when a sequence has a
    `lora_slot`.
    """
    if not seqs:
        raise ValueError("a batch needs at least one sequence")
    num_decodes = 0
    while num_decodes < len(seqs) and seqs[num_decodes].is_decode:
        num_decodes += 1
    if any(s.is_decode for s in seqs[num_decodes:]):
        raise ValueError("decode sequences (query_len 1) must come before prefill sequences")
    positions, slots, logits_rows, starts = [], [], [], [0]
    max_pages = max(len(s.pages) for s in seqs)
    table = torch.zeros((len(seqs), max_pages), dtype=torch.int32)
    for b, s in enumerate(seqs):
        total = s.cached_len + s.query_len
        if len(s.pages) < pages_for(total, page_size):
            raise ValueError(f"sequence {b}: {len(s.pages)} pages cannot hold {total} tokens")
        table[b, : len(s.pages)] = torch.tensor(s.pages, dtype=torch.int32)
        new_positions = range(s.cached_len, total)
        positions.extend(new_positions)
        slots.extend(s.pages[p // page_size] * page_size + p % page_size for p in new_positions)
        first = starts[-1]
        logits_rows.extend(
            range(first, first + s.query_len) if s.all_logits else [first + s.query_len - 1]
        )
        starts.append(first + s.query_len)

    context_lens = [s.cached_len + s.query_len for s in seqs]
    groups = prefill_groups(context_lens, num_decodes, PREFILL_GROUP_ROWS)
    lora = None
    if any(s.lora_slot != -1 for s in seqs):
        if lora_slot_rank is None:
            raise ValueError("a sequence uses a LoRA slot but the batch has no LoRA pool")
        lora = build_lora_batch(
            [s.lora_slot for s in seqs], [s.query_len for s in seqs], num_decodes,
            lora_slot_rank, device, context_lens, groups,
        )  # fmt: skip

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device)

    return BatchMetadata(
        positions=tensor(positions, torch.int64),
        query_start_loc=tensor(starts, torch.int32),
        context_lens=tensor(context_lens, torch.int32),
        page_table=table.to(device),
        slot_mapping=tensor(slots, torch.int64),
        logits_indices=tensor(logits_rows, torch.int64),
        num_decode_seqs=num_decodes,
        query_lens=tuple(s.query_len for s in seqs),
        context_lens_host=tuple(context_lens),
        page_size=page_size,
        prefill_groups=groups,
        lora=lora,
    )


def prefill_groups(
    context_lens: list[int], first: int, max_rows: int
) -> tuple[tuple[int, int], ...]:
    """Consecutive runs [b0, b1) of sequences first.. whose contexts sum to at most
    `max_rows` (a longer context forms a group of its own)."""
    groups: list[tuple[int, int]] = []
    start, rows = first, 0
    for b in range(first, len(context_lens)):
        if b > start and rows + context_lens[b] > max_rows:
            groups.append((start, b))
            start, rows = b, 0
        rows += context_lens[b]
    if start < len(context_lens):
        groups.append((start, len(context_lens)))
    return tuple(groups)
