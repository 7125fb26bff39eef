"""Batch metadata that tells the LoRA kernels which pool slot each token uses.

A batch of T tokens is cut into *segments*: runs of consecutive tokens with the same slot,
each at most `max_seg_len` tokens long (one kernel tile). The builder does not reorder
tokens: the scheduler orders the batch so that tokens of one adapter are contiguous (then a
decode batch of N adapters gives about N segments); an unordered batch is still exact, it
only makes more, shorter segments. Tokens with slot -1 use no adapter and do no LoRA work.

All tensors live in fixed-size device buffers so that a decode step can be captured in a
CUDA graph and replayed with another batch: the builder rewrites them in place with one
non-blocking host→device copy (no sync). Entries past the live counts are padded so that
they describe empty segments / slot -1 tokens, which every kernel skips.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.host_math import cdiv

NO_SLOT = -1


@dataclass(frozen=True)
class LoraSegmentsConfig:
    """Capacity of the segment buffers (one instance per captured batch size)."""

    max_tokens: int
    num_slots: int
    # Tokens per kernel tile; a power of two >= 16 because tl.dot needs M >= 16.
    max_seg_len: int = 16

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.max_seg_len < 16 or self.max_seg_len & (self.max_seg_len - 1):
            raise ValueError(f"max_seg_len must be a power of two >= 16, got {self.max_seg_len}")

    @property
    def max_segments(self) -> int:
        # Every segment holds at least one token.
        return self.max_tokens


@dataclass
class LoraSegments:
    """Per-step LoRA batch description read by the SGMV, MLA-LoRA and MoE-LoRA kernels."""

    seg_indptr: Tensor  # int32 [max_segments + 1], token offsets; padded with num_tokens
    seg_slot: Tensor  # int32 [max_segments], slot of each segment, -1 = no adapter
    slot_rank: Tensor  # int32 [num_slots], true rank of each slot's adapter, 0 = empty
    token_slot: Tensor  # int32 [max_tokens], slot per token, -1 = none (also padding)
    num_segments: Tensor  # int32 [1], live segment count on the device
    num_tokens: int  # host copy: live tokens
    num_live_segments: int  # host copy: live segments
    # Host: the mean length of the adapter runs (consecutive equal slots ≥ 0) a token sits
    # in, token-weighted (Σ len² / Σ len; 0 without adapter tokens): a long step's 16
    # prompts of 512 tokens beside 100 one-token decodes give ~500, not ~70.
    run_tokens: float
    max_seg_len: int
    # Backing storage of the four per-step fields above, so the builder makes one copy.
    packed: Tensor = field(repr=False)
    # `pair_tokens` results by (tokens, top_k): made by the first MoE layer of a step.
    _pair_tokens: dict[tuple[int, int], Tensor] = field(default_factory=dict, repr=False)

    @property
    def max_tokens(self) -> int:
        return self.token_slot.shape[0]

    @property
    def max_segments(self) -> int:
        return self.seg_slot.shape[0]

    def require_tokens(self, num_tokens: int) -> None:
        """Launchers call this: the activations must hold exactly the described tokens."""
        if num_tokens != self.num_tokens:
            raise ValueError(f"tensor has {num_tokens} tokens, segments describe {self.num_tokens}")

    def with_slot_rank(self, slot_rank: Tensor) -> LoraSegments:
        """The same segments read with other per-slot ranks (e.g. one module's: 0 where a
        slot's adapter does not target it, so its kernels skip those tokens' work)."""
        if slot_rank.shape != self.slot_rank.shape or slot_rank.device != self.slot_rank.device:
            raise ValueError(
                f"slot_rank {tuple(slot_rank.shape)} on {slot_rank.device} does not match the "
                f"segments' {tuple(self.slot_rank.shape)} on {self.slot_rank.device}"
            )
        # A field-for-field copy without copy.copy's reduce protocol: this runs for every
        # LoRA module of every layer, each step.
        view = object.__new__(LoraSegments)
        view.__dict__.update(self.__dict__)
        view.slot_rank = slot_rank
        return view

    def pair_tokens(self, top_k: int) -> Tensor:
        """int32 [num_tokens · top_k]: the token t of each routed pair p = t·k + j. Every
        MoE layer of the step needs the same one, so it is made once (two launches fewer
        per layer); a captured graph keeps the one made at its warm-up."""
        key = (self.num_tokens, top_k)
        tokens = self._pair_tokens.get(key)
        if tokens is None:
            pairs = torch.arange(
                self.num_tokens * top_k, device=self.token_slot.device, dtype=torch.int32
            )
            tokens = self._pair_tokens[key] = pairs // top_k
        return tokens

    def rows_per_key(self, num_pairs: int, num_experts: int) -> float:
        """Mean routed rows per (adapter, expert) key a token sits in, for `num_pairs`
        (token, expert) pairs of these tokens over `num_experts` experts: its adapter run ×
        top_k / experts (host counts only)."""
        return self.run_tokens * num_pairs / max(self.num_tokens, 1) / num_experts

    def capturing(self) -> bool:
        """Whether a CUDA graph is being captured: the host counts then describe the capture
        batch, not the batches its replays will see."""
        return self.seg_slot.is_cuda and torch.cuda.is_current_stream_capturing()  # type: ignore[no-untyped-call]

    def grid_segments(self) -> int:
        """Segment programs a launcher starts: the live count, or the capacity while a CUDA
        graph is captured so that replays with more segments are covered (the padding
        segments are empty and exit at once)."""
        return self.max_segments if self.capturing() else max(self.num_live_segments, 1)


@triton.jit
def load_segment(seg, seg_indptr_ptr, seg_slot_ptr, slot_rank_ptr):
    """(slot, rank, first token, end token) of segment `seg` inside a kernel; rank is 0 when
    the segment has no work (slot -1, empty padding segment or empty slot)."""
    slot = tl.load(seg_slot_ptr + seg)
    t_start = tl.load(seg_indptr_ptr + seg)
    t_end = tl.load(seg_indptr_ptr + seg + 1)
    rank = tl.load(slot_rank_ptr + tl.maximum(slot, 0))
    rank = tl.where((slot >= 0) & (t_end > t_start), rank, 0)
    return slot, rank, t_start, t_end


# Rank columns a kernel rounds its rank-contiguous loads up to (B rows [.., n, R]): 8 bf16 are
# one 16-byte vector, and a DRAM sector (32 bytes) holds 16, so rounding reads no more sectors.
RANK_VECTOR = 8


def rank_alignment(pool_rank: int) -> int:
    """The RANK_ALIGN a launcher passes (`rank_load_bound`): RANK_VECTOR where the pool rank
    is a multiple of it, else 1 (rounding up could run past a row's last column)."""
    return RANK_VECTOR if pool_rank % RANK_VECTOR == 0 else 1


@triton.jit
def rank_load_bound(rank, RANK_ALIGN: tl.constexpr):
    """Bound of the rank columns to load along a rank-contiguous row: `rank` rounded up to
    RANK_ALIGN. A bound the compiler knows to be a multiple of 8 lets the loads be 16-byte
    vectors; the slot's own rank (any value) makes them 2-byte scalar loads (LDG.E.U16 in
    SASS), 8x the load instructions. The caller zeroes the columns from `rank` on
    (`tl.where`), so what lies there (zeros in the pool) never reaches a result."""
    if RANK_ALIGN > 1:
        return tl.multiple_of((rank + RANK_ALIGN - 1) // RANK_ALIGN * RANK_ALIGN, RANK_ALIGN)
    return rank


def live_rank_columns(slot_rank: Tensor, slot: Tensor, pool_rank: int) -> Tensor:
    """[*slot.shape, R] bool for the torch references: rank column r is used by the adapter
    in `slot` (r < its true rank); all false for slot -1."""
    rank = torch.where(slot >= 0, slot_rank[slot.clamp(min=0).long()], 0)
    return torch.arange(pool_rank, device=slot.device) < rank.unsqueeze(-1)


def allocate_lora_segments(config: LoraSegmentsConfig, device: torch.device | str) -> LoraSegments:
    """Empty-batch buffers of `config`'s capacity, to be refilled by `build_lora_segments`."""
    packed = torch.empty(_packed_len(config), dtype=torch.int32, device=device)
    slot_rank = torch.zeros(config.num_slots, dtype=torch.int32, device=device)
    return build_lora_segments([], slot_rank, out=_views(packed, config, slot_rank))


def build_lora_segments(
    token_slots: Sequence[int] | Tensor | np.ndarray,
    slot_rank: Sequence[int] | Tensor,
    *,
    out: LoraSegments | None = None,
    max_seg_len: int = 16,
    device: torch.device | str = "cpu",
) -> LoraSegments:
    """Cut a batch into segments of consecutive equal slots, at most `max_seg_len` long.

    Semantics: segment s covers tokens [seg_indptr[s], seg_indptr[s+1]), all with slot
    seg_slot[s]; token_slot[t] = token_slots[t]; rows past the live counts are empty / -1.

    The segments are computed with numpy on the host (this runs every engine step, where a
    dozen small torch ops cost more than the arithmetic) and reach the device in one copy.

    Args:
        token_slots: host ints [T], slot per token (-1 = base model).
        slot_rank: [num_slots] true rank per slot, host ints or a tensor; a tensor on the
            output device is copied device-to-device (no sync).
        out: preallocated buffers (see `allocate_lora_segments`), rewritten in place so a
            captured CUDA graph sees the new batch; its capacity bounds T. Without `out`,
            buffers of exactly this batch's size are allocated on `device`.
    """
    slots = torch.as_tensor(token_slots, dtype=torch.int32, device="cpu").reshape(-1).numpy()
    num_slots = slot_rank.shape[0] if isinstance(slot_rank, Tensor) else len(slot_rank)
    if out is None:
        config = LoraSegmentsConfig(max(slots.size, 1), num_slots, max_seg_len)
        # Left uninitialised: the build below writes every entry of both.
        packed = torch.empty(_packed_len(config), dtype=torch.int32, device=device)
        out = _views(packed, config, torch.empty(num_slots, dtype=torch.int32, device=device))
    config = LoraSegmentsConfig(out.max_tokens, out.slot_rank.shape[0], out.max_seg_len)
    if slots.size > config.max_tokens:
        raise ValueError(f"batch has {slots.size} tokens, buffers hold {config.max_tokens}")
    if num_slots != config.num_slots:
        raise ValueError(f"slot_rank has {num_slots} slots, buffers hold {config.num_slots}")
    if slots.size and (slots.min() < NO_SLOT or slots.max() >= config.num_slots):
        raise ValueError(f"token slots must lie in [-1, {config.num_slots}), got {slots.tolist()}")

    run_starts = _run_starts(slots)
    seg_starts = _segment_starts(slots.size, run_starts, config.max_seg_len)
    # Staged in pinned memory on CUDA so that the copy is asynchronous (no host sync while
    # a captured graph's buffers are refilled).
    host = torch.empty(_packed_len(config), dtype=torch.int32, pin_memory=out.packed.is_cuda)
    _fill_packed(host.numpy(), config, slots, seg_starts)
    out.packed.copy_(host, non_blocking=True)

    if isinstance(slot_rank, Tensor):
        out.slot_rank.copy_(slot_rank, non_blocking=True)
    else:
        out.slot_rank.copy_(torch.tensor(list(slot_rank), dtype=torch.int32), non_blocking=True)
    out.num_tokens = slots.size
    out.num_live_segments = seg_starts.size
    out.run_tokens = _adapter_run_tokens(slots, run_starts)
    return out


def _run_starts(slots: np.ndarray) -> np.ndarray:
    """int64 [runs]: the first token of each run of consecutive equal slots, ascending."""
    return np.flatnonzero(np.diff(slots, prepend=NO_SLOT - 1))


def _adapter_run_tokens(slots: np.ndarray, run_starts: np.ndarray) -> float:
    """Token-weighted mean length of the runs of equal slots ≥ 0 (0.0 when none)."""
    lengths = np.diff(run_starts, append=slots.size)[slots[run_starts] >= 0].astype(np.float64)
    return float((lengths**2).sum() / lengths.sum()) if lengths.size else 0.0


def _segment_starts(num_tokens: int, run_starts: np.ndarray, max_seg_len: int) -> np.ndarray:
    """First token of each segment: each run's first token, then every max_seg_len-th.

    Args: run_starts int [runs] (`_run_starts`). Returns int64 [num_segments], ascending.
    """
    run_start = np.repeat(run_starts, np.diff(run_starts, append=num_tokens))  # [T]
    return np.flatnonzero((np.arange(num_tokens) - run_start) % max_seg_len == 0)


def _fill_packed(
    packed: np.ndarray, config: LoraSegmentsConfig, slots: np.ndarray, seg_starts: np.ndarray
) -> None:
    """Write the per-step fields of `slots`' segments into a host packed buffer, padded
    past the live counts with empty segments and slot -1."""
    packed.fill(0)  # the padding between fields too: equal batches give equal buffers
    seg_indptr, seg_slot, token_slot, num_segments = _split(packed, config)
    live = seg_starts.size
    seg_indptr[:live] = seg_starts
    seg_indptr[live:] = slots.size
    seg_slot[:live] = slots[seg_starts]
    seg_slot[live:] = NO_SLOT
    token_slot[: slots.size] = slots
    token_slot[slots.size :] = NO_SLOT
    num_segments[0] = live


# One packed int32 buffer holds every per-step field so the builder needs a single copy:
# seg_indptr, seg_slot, token_slot and num_segments, in that order. Each field starts on a
# 16-byte boundary: kernels take the fields as pointers, which Triton specialises by 16-byte
# alignment, and offsets that moved with the step's token count made serving compile
# variants the warm-up had not met (H100, N=1000 zipf after the other scenarios: two
# `_sgmv_expand_kernel` compiles whose only difference was seg_slot's alignment).
FIELD_ALIGN = 4  # int32 entries: 16 bytes


def _field_lens(config: LoraSegmentsConfig) -> list[int]:
    return [config.max_segments + 1, config.max_segments, config.max_tokens, 1]


def _field_slices(config: LoraSegmentsConfig) -> list[slice]:
    """Each field's entries in the packed buffer, every one starting at a multiple of
    FIELD_ALIGN."""
    slices, offset = [], 0
    for length in _field_lens(config):
        slices.append(slice(offset, offset + length))
        offset += cdiv(length, FIELD_ALIGN) * FIELD_ALIGN
    return slices


def _packed_len(config: LoraSegmentsConfig) -> int:
    return _field_slices(config)[-1].stop


def _split(packed: np.ndarray, config: LoraSegmentsConfig) -> list[np.ndarray]:
    """The fields of a host packed buffer as numpy views (what `_views` is to tensors)."""
    return [packed[field] for field in _field_slices(config)]


def _views(packed: Tensor, config: LoraSegmentsConfig, slot_rank: Tensor) -> LoraSegments:
    seg_indptr, seg_slot, token_slot, num_segments = (
        packed[field] for field in _field_slices(config)
    )
    return LoraSegments(
        seg_indptr=seg_indptr,
        seg_slot=seg_slot,
        slot_rank=slot_rank,
        token_slot=token_slot,
        num_segments=num_segments,
        num_tokens=0,
        num_live_segments=0,
        run_tokens=0.0,
        max_seg_len=config.max_seg_len,
        packed=packed,
    )
