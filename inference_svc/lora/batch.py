"""LoRA part of a step's batch metadata: which pool slot each token and sequence uses.

Built once per step by `inference_svc.engine.batch.build_batch` (from `SequenceStep.lora_slot`)
and read by every LoRA-carrying layer. The step's tokens are laid out decodes first, so the
absorbed decode path (rows [0, D)) gets segments of its own: a segment of the whole step may
run across the decode/prefill boundary when both sides use the same slot.

The scheduler should order sequences so that those of one adapter are adjacent (within the
decodes and within the prefills): the segment builder never reorders tokens, so an
interleaved batch stays exact but makes more, shorter segments.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kernels.lora_segments import (
    NO_SLOT,
    LoraSegments,
    LoraSegmentsConfig,
    allocate_lora_segments,
    build_lora_segments,
)


@dataclass(frozen=True)
class LoraBatch:
    """Slots of one step's tokens, for the LoRA kernels.

    tokens: segments of all T tokens of the step.
    decode_tokens: segments of the D decode tokens (rows [0, D)); `tokens` itself when the
        step holds decodes only, None when no decode token uses an adapter.
    token_slots: host copy of the slot of each token (-1 = base model), which a CUDA-graph
        replay rebuilds its own fixed-size segments from.
    seq_slots: host slot of each sequence.
    context_rows: per prefill group (`BatchMetadata.prefill_groups`), segments of the
        group's cached context rows laid end to end, each row with its sequence's slot:
        prefill expands K/V (kv_b) from whole contexts, which `tokens` does not describe.
        None for a group in which no sequence uses an adapter.
    routed_experts: whether an adapter of the step targets the routed experts. When none
        does, their LoRA deltas are all zero and the MoE layers run the no-LoRA path (its
        one-token folds, no pair kernels); a CUDA graph of that path serves such steps.
    """

    tokens: LoraSegments
    decode_tokens: LoraSegments | None
    token_slots: tuple[int, ...]
    seq_slots: tuple[int, ...]
    context_rows: tuple[LoraSegments | None, ...] = ()
    routed_experts: bool = True


class LoraScope(enum.Enum):
    """The LoRA a step runs: none, every module's, or every module's but the routed
    experts' (ModelRunner captures a decode graph per scope)."""

    NONE = "none"
    ALL = "all"
    NOT_ROUTED = "not_routed"

    @classmethod
    def of(cls, lora: LoraBatch | None) -> LoraScope:
        if lora is None:
            return cls.NONE
        return cls.ALL if lora.routed_experts else cls.NOT_ROUTED

    @classmethod
    def captured(cls, holds_routed_experts: bool | None) -> tuple[LoraScope, ...]:
        """The scopes a runner captures graphs of: NONE without a LoRA pool (None), ALL
        too with one, and NOT_ROUTED where the pool holds routed-expert weights."""
        if holds_routed_experts is None:
            return (cls.NONE,)
        return (cls.NONE, cls.ALL, cls.NOT_ROUTED) if holds_routed_experts else (cls.NONE, cls.ALL)

    @classmethod
    def serving(cls, lora: LoraBatch | None, captured: Collection[LoraScope]) -> LoraScope:
        """The captured scope whose graphs run a step of `lora`: its own, or ALL for
        NOT_ROUTED where that is not captured (a pool without routed experts has one LoRA
        graph a size)."""
        scope = cls.of(lora)
        return cls.ALL if scope not in captured else scope


def build_lora_batch(
    seq_slots: Sequence[int],
    query_lens: Sequence[int],
    num_decode_seqs: int,
    slot_rank: Tensor,
    device: torch.device | str,
    context_lens: Sequence[int] = (),
    prefill_groups: Sequence[tuple[int, int]] = (),
    slot_routed: Sequence[bool] | None = None,
) -> LoraBatch | None:
    """The LoRA metadata of a step, or None when no sequence uses an adapter (then no layer
    does any LoRA work).

    Args:
        seq_slots: pool slot per sequence, -1 for the base model.
        query_lens: new tokens per sequence this step (decodes first, one token each).
        num_decode_seqs: sequences [0, num_decode_seqs) are decodes.
        slot_rank: the pool's int32 [num_slots] device tensor of loaded ranks (copied on
            the device, no host sync).
        context_lens: cached tokens per sequence after this step (prefill K/V rows).
        prefill_groups: [first, end) sequence ranges whose contexts are expanded together.
        slot_routed: per slot, whether its adapter targets the routed experts (the pool's
            host mirror); None: assume every adapter does.
    """
    if len(seq_slots) != len(query_lens):
        raise ValueError(f"{len(seq_slots)} slots for {len(query_lens)} sequences")
    if all(slot == NO_SLOT for slot in seq_slots):
        return None
    token_slots = _token_slots(seq_slots, query_lens)
    tokens = build_lora_segments(token_slots, slot_rank, device=device)
    decode_tokens: LoraSegments | None = None
    if num_decode_seqs == len(seq_slots):
        decode_tokens = tokens
    elif any(slot != NO_SLOT for slot in seq_slots[:num_decode_seqs]):
        decode_slots = token_slots[:num_decode_seqs]  # one token per decode sequence
        decode_tokens = build_lora_segments(decode_slots, slot_rank, device=device)
    context_rows = tuple(
        _context_segments(seq_slots[b0:b1], context_lens[b0:b1], slot_rank, device)
        for b0, b1 in prefill_groups
    )
    routed = slot_routed is None or any(
        slot_routed[slot] for slot in set(seq_slots) if slot != NO_SLOT
    )
    return LoraBatch(tokens, decode_tokens, token_slots, tuple(seq_slots), context_rows, routed)


def _token_slots(seq_slots: Sequence[int], query_lens: Sequence[int]) -> tuple[int, ...]:
    """Each sequence's slot once per new token. A decode step (one token per sequence, the
    common case) is the sequences' slots as they are: no Python work per token."""
    if all(n == 1 for n in query_lens):
        return tuple(seq_slots)
    return tuple(itertools.chain.from_iterable(map(itertools.repeat, seq_slots, query_lens)))


def _context_segments(
    slots: Sequence[int], context_lens: Sequence[int], slot_rank: Tensor, device: torch.device | str
) -> LoraSegments | None:
    """Segments of the sequences' context rows end to end (None when no adapter is used)."""
    if all(slot == NO_SLOT for slot in slots):
        return None
    rows = np.repeat(np.array(slots, dtype=np.int32), context_lens)  # [Σ ctx]
    return build_lora_segments(rows, slot_rank, device=device)


def capture_lora_batch(
    size: int, slot_rank: Tensor | None, scope: LoraScope, device: torch.device | str
) -> LoraBatch | None:
    """The LoRA batch a CUDA graph of `size` tokens is captured with: fixed-size segment
    buffers, all tokens on no adapter, which each replay rewrites in place
    (`build_lora_segments(..., out=batch.tokens)`); None in scope NONE or without a LoRA
    pool (slot_rank None)."""
    if slot_rank is None or scope is LoraScope.NONE:
        return None
    segs = allocate_lora_segments(
        LoraSegmentsConfig(max_tokens=size, num_slots=slot_rank.shape[0]), device
    )
    no_slots = (NO_SLOT,) * size
    build_lora_segments(no_slots, slot_rank, out=segs)
    # Warm up with the grid the capture uses (the capacity; the padding segments are
    # empty), so that Triton compiles every variant before capturing, not during it.
    segs.num_live_segments = segs.max_segments
    return LoraBatch(segs, segs, no_slots, no_slots, routed_experts=scope is LoraScope.ALL)
