"""Batch metadata: everything the layers need about one step, built once per step.

A step runs a flattened batch of T tokens from B sequences. Sequence b contributes
query_len[b] new tokens at positions [cached_len[b], cached_len[b] + query_len[b]).
Decode sequences (one new token) come first, so their tokens are rows [0, num_decode_tokens)
and take the absorbed paged-attention path; prefill sequences follow and attend over K/V
expanded from their cached latent rows (`kernels.mla_prefill`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inference_svc.engine.kv_pages import pages_for
from inference_svc.engine.uploads import staging_buffer, to_device
from inference_svc.lora.batch import LoraBatch, build_lora_batch
from kernels.host_math import cdiv

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
    context_rows: [Σ prefill contexts] int64 flat cache row of every context position of
        every prefill sequence, sequence after sequence (decodes have none).
    context_start_loc: [B + 1] int32 cu_seqlens of those rows per sequence (decodes add 0);
        context_start_host its host copy, to slice a group's rows.
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
    context_rows: torch.Tensor | None = None
    context_start_loc: torch.Tensor | None = None
    context_start_host: tuple[int, ...] = ()
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
    lora_slot_routed: Sequence[bool] | None = None,
) -> BatchMetadata:
    """Lay out a step's sequences (decodes first) into one `BatchMetadata`.

    lora_slot_rank: the LoRA pool's per-slot rank tensor; needed when a sequence has a
    `lora_slot`. lora_slot_routed: the pool's per-slot "targets the routed experts"
    (`LoraBatch.routed_experts`; None: every adapter does).

    The token layout is computed with array operations (no Python work per token) and
    reaches the device in one copy: this runs on the host every step while the GPU waits.
    """
    if not seqs:
        raise ValueError("a batch needs at least one sequence")
    num_decodes = 0
    while num_decodes < len(seqs) and seqs[num_decodes].is_decode:
        num_decodes += 1
    if any(s.is_decode for s in seqs[num_decodes:]):
        raise ValueError("decode sequences (query_len 1) must come before prefill sequences")
    query_lens = [s.query_len for s in seqs]
    context_lens = [s.cached_len + s.query_len for s in seqs]
    num_pages = [len(s.pages) for s in seqs]
    _check_pages(num_pages, context_lens, page_size)
    table = _page_table(seqs, num_pages)
    layout = _token_layout(seqs, query_lens, table, page_size)

    groups = prefill_groups(context_lens, num_decodes, PREFILL_GROUP_ROWS)
    lora = None
    if any(s.lora_slot != -1 for s in seqs):
        if lora_slot_rank is None:
            raise ValueError("a sequence uses a LoRA slot but the batch has no LoRA pool")
        lora = build_lora_batch(
            [s.lora_slot for s in seqs], query_lens, num_decodes,
            lora_slot_rank, device, context_lens, groups, lora_slot_routed,
        )  # fmt: skip

    context_rows, context_start = _context_rows(num_decodes, context_lens, table, page_size)
    fields = [*layout, np.array(context_lens, dtype=np.int32), table, context_rows, context_start]
    (
        positions, slot_mapping, logits_indices, query_start_loc, context, page_table,
        context_rows_device, context_start_loc,
    ) = _to_device(fields, device)  # fmt: skip
    return BatchMetadata(
        positions=positions,
        query_start_loc=query_start_loc,
        context_lens=context,
        page_table=page_table,
        slot_mapping=slot_mapping,
        logits_indices=logits_indices,
        num_decode_seqs=num_decodes,
        query_lens=tuple(query_lens),
        context_lens_host=tuple(context_lens),
        page_size=page_size,
        prefill_groups=groups,
        context_rows=context_rows_device,
        context_start_loc=context_start_loc,
        context_start_host=tuple(context_start.tolist()),
        lora=lora,
    )


def _check_pages(num_pages: list[int], context_lens: list[int], page_size: int) -> None:
    """Every sequence's page table covers its context."""
    for b, (pages, total) in enumerate(zip(num_pages, context_lens, strict=True)):
        if pages < pages_for(total, page_size):
            raise ValueError(f"sequence {b}: {pages} pages cannot hold {total} tokens")


def _page_table(seqs: list[SequenceStep], num_pages: list[int]) -> np.ndarray:
    """int32 [B, max_pages] page table, unused entries 0, filled from one flat array (one
    conversion for the whole step, not one per sequence)."""
    flat = np.fromiter(
        itertools.chain.from_iterable(s.pages for s in seqs), dtype=np.int32, count=sum(num_pages)
    )
    table = np.zeros((len(seqs), max(num_pages)), dtype=np.int32)
    # Row-major boolean assignment fills each row's first len(pages) entries in order.
    table[np.arange(table.shape[1]) < np.array(num_pages)[:, None]] = flat
    return table


def _token_layout(
    seqs: list[SequenceStep], query_lens: list[int], table: np.ndarray, page_size: int
) -> tuple[np.ndarray, ...]:
    """positions [T] int64, slot_mapping [T] int64, logits_indices [L] int64 and
    query_start_loc [B + 1] int32 of the step's tokens."""
    query = np.array(query_lens, dtype=np.int64)
    starts = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(query, out=starts[1:])
    cached = np.array([s.cached_len for s in seqs], dtype=np.int64)
    seq_of_token = np.repeat(np.arange(len(seqs)), query)  # [T]
    # Token t of sequence b (flat row starts[b] + t) sits at position cached[b] + t.
    positions = np.arange(starts[-1]) + np.repeat(cached - starts[:-1], query)
    pages = table[seq_of_token, positions // page_size].astype(np.int64)
    slot_mapping = pages * page_size + positions % page_size
    # Every token of an all_logits sequence needs logits, else only its last one.
    wants_logits = np.repeat(np.array([s.all_logits for s in seqs]), query)
    wants_logits[starts[1:] - 1] = True
    logits_indices = np.flatnonzero(wants_logits)
    return positions, slot_mapping, logits_indices, starts.astype(np.int32)


def _context_rows(
    num_decodes: int, context_lens: list[int], table: np.ndarray, page_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Flat cache rows [Σ prefill contexts] int64 of the prefill sequences' contexts in
    position order, and their int32 cu_seqlens [B + 1] per sequence (decodes: empty)."""
    if num_decodes == len(context_lens):  # every decode step: no context to gather
        return np.zeros(0, dtype=np.int64), np.zeros(num_decodes + 1, dtype=np.int32)
    lengths = np.array(context_lens, dtype=np.int64)
    lengths[:num_decodes] = 0
    starts = np.zeros(len(context_lens) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    seq_of_row = np.repeat(np.arange(len(context_lens)), lengths)
    positions = np.arange(starts[-1]) - np.repeat(starts[:-1], lengths)
    pages = table[seq_of_row, positions // page_size].astype(np.int64)
    return pages * page_size + positions % page_size, starts.astype(np.int32)


# Each field starts on a 16-byte boundary of the shared buffer, as a tensor of its own
# would: Triton specialises kernels on whether a pointer argument is 16-byte aligned.
_FIELD_ALIGN = 16
_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


def _to_device(arrays: list[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """The arrays on `device` (same dtypes and shapes) as views of one buffer, so the step
    pays one host-to-device copy instead of one per field (asynchronous: `to_device`)."""
    offsets, size = [], 0
    for array in arrays:
        offsets.append(size)
        size += cdiv(array.nbytes, _FIELD_ALIGN) * _FIELD_ALIGN
    staging = staging_buffer(size, torch.uint8, device)
    host = staging.numpy()
    for array, offset in zip(arrays, offsets, strict=True):
        host[offset : offset + array.nbytes] = array.reshape(-1).view(np.uint8)
    buffer = to_device(staging, device)
    return [
        buffer[offset : offset + array.nbytes].view(_TORCH_DTYPES[array.dtype]).view(array.shape)
        for array, offset in zip(arrays, offsets, strict=True)
    ]


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
