"""One pinned host buffer allocated at start-up, handed out in blocks to host-cache entries.

Pinning memory on the serving path stalls serving: `cudaHostAlloc` page-locks every page
of the request while the driver holds locks the engine thread's launches and copies also
need (the H100 cold probes logged 0.5-0.8 s one-token steps while a fetch worker pinned a
582 MB adapter), and torch's pinned allocator rounds each request up to a power of two
(582 MB took 1 GiB). The arena pins its bytes once, before serving, and sub-allocates:
first fit over a free list kept in address order, neighbours merged on free.

Thread-safe: fetch workers allocate while the scheduler's evictions free.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

# Block offsets and sizes are multiples of this: any dtype's view is aligned, and copies
# from an aligned pinned source take the DMA engine's fast path.
ARENA_ALIGN = 512


@dataclass(frozen=True)
class ArenaBlock:
    offset: int  # bytes from the arena's start
    size: int  # bytes, a multiple of ARENA_ALIGN


class PinnedArena:
    """`capacity_bytes` of (pinned, when `pin`) host memory, allocated in blocks."""

    def __init__(self, capacity_bytes: int, pin: bool) -> None:
        if capacity_bytes < ARENA_ALIGN:
            raise ValueError(f"arena capacity must be >= {ARENA_ALIGN} bytes, got {capacity_bytes}")
        capacity = capacity_bytes // ARENA_ALIGN * ARENA_ALIGN
        self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)  # [bytes]
        self._free: list[ArenaBlock] = [ArenaBlock(0, capacity)]  # by offset, never adjacent
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.buffer.numel()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(block.size for block in self._free)

    @property
    def largest_free_bytes(self) -> int:
        with self._lock:
            return max((block.size for block in self._free), default=0)

    def allocate(self, nbytes: int) -> ArenaBlock | None:
        """The lowest free block of at least `nbytes` (rounded up to ARENA_ALIGN), or None
        when no free range is that long."""
        if nbytes <= 0:
            raise ValueError(f"allocation must be > 0 bytes, got {nbytes}")
        size = -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN
        with self._lock:
            for index, free in enumerate(self._free):
                if free.size < size:
                    continue
                if free.size == size:
                    del self._free[index]
                else:
                    self._free[index] = ArenaBlock(free.offset + size, free.size - size)
                return ArenaBlock(free.offset, size)
        return None

    def free(self, block: ArenaBlock) -> None:
        """Return `block` (from `allocate`, not yet freed), merged with free neighbours."""
        with self._lock:
            index = 0
            while index < len(self._free) and self._free[index].offset < block.offset:
                index += 1
            before = self._free[index - 1] if index > 0 else None
            after = self._free[index] if index < len(self._free) else None
            end = block.offset + block.size
            if (before is not None and before.offset + before.size > block.offset) or (
                after is not None and end > after.offset
            ):
                raise ValueError(f"{block} overlaps free memory: freed twice or not allocated")
            if block.offset < 0 or end > self.capacity_bytes:
                raise ValueError(f"{block} lies outside the arena of {self.capacity_bytes} bytes")
            merged = block
            if after is not None and end == after.offset:
                merged = ArenaBlock(merged.offset, merged.size + after.size)
                del self._free[index]
            if before is not None and before.offset + before.size == merged.offset:
                merged = ArenaBlock(before.offset, before.size + merged.size)
                index -= 1
                del self._free[index]
            self._free.insert(index, merged)

    def view(self, block: ArenaBlock, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first `numel` elements of `dtype` in `block`, as a 1-D tensor on the arena."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > block.size:
            raise ValueError(f"{numel} × {dtype} ({nbytes} bytes) do not fit {block}")
        return self.buffer[block.offset : block.offset + nbytes].view(dtype)
