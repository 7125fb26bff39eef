"""Size-bounded LRU of deserialized canonical adapters in (pinned) host memory.

The middle tier of S3 → host → GPU slot. Tensors are converted to the slot pool's dtype on
insert (a dtype-converting host→device copy is converted on the CPU first and is no longer
asynchronous) and pinned when CUDA is available (only pinned memory copies asynchronously).
Built with the pool's `SlotPacking` (`pool.packing`), the cache packs each adapter once, at
insert, into one contiguous buffer in the pool's order: loads then take the pool's fast
path (a few large copies instead of one per layer × module × slice; see
`inference_svc.lora.packing`). Packed entries live in blocks of one arena pinned when the
cache is built (`inference_svc.adapters.pinned_arena`): no pinning on the serving path.

An entry being copied to the GPU is *in use* (`acquire` … `release`) and is never evicted
or dropped, so a side-stream copy never reads freed or reused memory. Thread-safe: S3
fetches insert from worker threads while the scheduler reads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, replace

import torch

from adapter_store.errors import ResourceExhausted
from adapter_store.format import CanonicalAdapter
from inference_svc.adapters.pinned_arena import ArenaBlock, PinnedArena
from inference_svc.lora.packing import PackedAdapter, SlotPacking

HostKey = Hashable  # (tenant, name, version)


@dataclass(frozen=True)
class HostCacheConfig:
    capacity_bytes: int
    dtype: torch.dtype | None = None  # the slot pool's dtype; None keeps the stored dtype
    pin_memory: bool | None = None  # None: pin exactly when CUDA is available
    # Bytes of the arena that packed entries are copied into (allocated, and pinned, when
    # the cache is built); None: capacity_bytes. 0: no arena, each entry allocates its own
    # buffer. Smaller than capacity_bytes where most entries are packed already (they are
    # stored as they are: the serving benchmark's aliased weight sets).
    arena_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {self.capacity_bytes}")
        if self.arena_bytes is not None and self.arena_bytes < 0:
            raise ValueError(f"arena_bytes must be >= 0, got {self.arena_bytes}")
        if self.pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA")

    @property
    def pins(self) -> bool:
        return torch.cuda.is_available() if self.pin_memory is None else self.pin_memory


@dataclass(frozen=True)
class HostCacheEntry:
    key: HostKey
    size_bytes: int
    in_use: int  # copies to the GPU in flight


@dataclass(frozen=True)
class HostCacheMetrics:
    hits: int
    misses: int
    inserts: int
    evictions: int
    entries: int
    bytes_used: int
    capacity_bytes: int


@dataclass
class _Entry:
    adapter: CanonicalAdapter
    size_bytes: int
    in_use: int = 0
    drop_when_released: bool = False
    block: ArenaBlock | None = None  # the arena block the entry was packed into


class HostAdapterCache:
    """LRU by bytes; entries in use are never evicted."""

    def __init__(self, config: HostCacheConfig, packing: SlotPacking | None = None) -> None:
        if packing is not None and config.dtype not in (None, packing.dtype):
            raise ValueError(
                f"host cache dtype {config.dtype} differs from the pool packing's {packing.dtype}"
            )
        self.config = config
        self.packing = packing
        arena_bytes = config.capacity_bytes if config.arena_bytes is None else config.arena_bytes
        self.arena = (
            PinnedArena(arena_bytes, config.pins) if packing is not None and arena_bytes else None
        )
        self._entries: OrderedDict[HostKey, _Entry] = OrderedDict()  # LRU first
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._inserts = self._evictions = 0

    def __contains__(self, key: HostKey) -> bool:
        with self._lock:
            return key in self._entries

    def acquire(self, key: HostKey) -> CanonicalAdapter | None:
        """The cached adapter, marked in use until `release(key)`; None on a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.drop_when_released:
                self._misses += 1
                return None
            self._hits += 1
            entry.in_use += 1
            self._entries.move_to_end(key)
            return entry.adapter

    def insert(
        self, key: HostKey, adapter: CanonicalAdapter, *, borrowed: bool = False
    ) -> CanonicalAdapter:
        """Store a freshly fetched adapter (converted, packed when the cache has a packing,
        pinned) and return the stored one, marked in use until `release(key)`. Evicts least
        recently used entries that are not in use; raises ResourceExhausted when that cannot
        make room. `borrowed`: the adapter's tensors are only lent for the call (they view a
        download buffer that is reused), so what the cache keeps never shares their memory."""
        stored, block = self._to_host(key, adapter, borrowed)
        size = adapter_bytes(stored)
        with self._lock:
            existing = self._entries.get(key)
            if existing is not None:
                # Another fetch of the same (immutable) version won the race, or the entry
                # was discarded while in use: keep the one already here.
                self._free_block(block)
                existing.in_use += 1
                existing.drop_when_released = False
                self._entries.move_to_end(key)
                return existing.adapter
            try:
                self._make_room(key, size)
            except ResourceExhausted:
                self._free_block(block)
                raise
            self._entries[key] = _Entry(stored, size, in_use=1, block=block)
            self._bytes += size
            self._inserts += 1
            return stored

    def release(self, key: HostKey) -> None:
        """The copy to the GPU that `acquire`/`insert` was for has completed."""
        with self._lock:
            entry = self._entries[key]
            if entry.in_use == 0:
                raise ValueError(f"host cache entry {key!r} is not in use")
            entry.in_use -= 1
            if entry.in_use == 0 and entry.drop_when_released:
                self._remove(key)

    def discard(self, key: HostKey) -> bool:
        """Drop an entry (UnloadAdapter, a deleted version); one in use goes when released.
        Returns whether it was cached."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            if entry.in_use:
                entry.drop_when_released = True
            else:
                self._remove(key)
            return True

    def entries(self) -> list[HostCacheEntry]:
        """Every cached adapter, least recently used first."""
        with self._lock:
            return [
                HostCacheEntry(key, entry.size_bytes, entry.in_use)
                for key, entry in self._entries.items()
                if not entry.drop_when_released
            ]

    def metrics(self) -> HostCacheMetrics:
        with self._lock:
            return HostCacheMetrics(
                hits=self._hits,
                misses=self._misses,
                inserts=self._inserts,
                evictions=self._evictions,
                entries=len(self._entries),
                bytes_used=self._bytes,
                capacity_bytes=self.config.capacity_bytes,
            )

    def _make_room(self, key: HostKey, size: int) -> None:
        capacity = self.config.capacity_bytes
        if size > capacity:
            raise ResourceExhausted(
                f"adapter {key!r} needs {size} bytes of host cache, more than its capacity "
                f"of {capacity} bytes"
            )
        while self._bytes + size > capacity:
            if not self._evict_lru(in_arena=False):
                in_use = sum(e.size_bytes for e in self._entries.values())
                raise ResourceExhausted(
                    f"host adapter cache full: adapter {key!r} needs {size} bytes, "
                    f"{in_use} of {capacity} bytes are being copied to the GPU"
                )

    def _evict_lru(self, in_arena: bool) -> bool:
        """Evict the least recently used entry not in use (only one holding an arena block
        when `in_arena`); False when there is none."""
        victim = next(
            (
                k
                for k, e in self._entries.items()
                if e.in_use == 0 and (e.block is not None or not in_arena)
            ),
            None,
        )
        if victim is None:
            return False
        self._remove(victim)
        self._evictions += 1
        return True

    def _remove(self, key: HostKey) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.size_bytes
        self._free_block(entry.block)

    def _free_block(self, block: ArenaBlock | None) -> None:
        if block is not None and self.arena is not None:
            self.arena.free(block)

    def _reserve_block(self, key: HostKey, nbytes: int) -> ArenaBlock:
        """An arena block of `nbytes`, evicting least recently used arena entries that are
        not in use until a free range is long enough; ResourceExhausted when none is."""
        assert self.arena is not None
        with self._lock:
            while (block := self.arena.allocate(nbytes)) is None:
                if not self._evict_lru(in_arena=True):
                    raise ResourceExhausted(
                        f"pinned host arena full: adapter {key!r} needs {nbytes} bytes, the "
                        f"longest free range of the {self.arena.capacity_bytes}-byte arena is "
                        f"{self.arena.largest_free_bytes} bytes and the rest is held by "
                        f"adapters being copied to the GPU"
                    )
            return block

    def _already_packed(self, adapter: CanonicalAdapter) -> bool:
        return (
            isinstance(adapter, PackedAdapter)
            and adapter.packing is self.packing
            and (not self.config.pins or adapter.flat.is_pinned())
        )

    def _to_host(
        self, key: HostKey, adapter: CanonicalAdapter, borrowed: bool
    ) -> tuple[CanonicalAdapter, ArenaBlock | None]:
        """The adapter as the cache stores it, and the arena block it was packed into."""
        if self.packing is not None:
            if self._already_packed(adapter) and not borrowed:
                return adapter, None  # this pool's layout already (a shared weight set)
            if self.arena is None:
                return self.packing.pack(adapter, pin=self.config.pins), None
            numel = self.packing.packed_numel(adapter)
            dtype = self.packing.dtype
            block = self._reserve_block(key, numel * dtype.itemsize)
            try:
                return self.packing.pack(adapter, out=self.arena.view(block, dtype, numel)), block
            except BaseException:
                with self._lock:
                    self._free_block(block)
                raise
        dtype, pin = self.config.dtype, self.config.pins
        tensors = {}
        for name, lent in adapter.tensors.items():
            tensor = lent.to(dtype or lent.dtype).contiguous()
            if pin:
                tensor = tensor.pin_memory()
            if (
                borrowed
                and tensor.untyped_storage().data_ptr() == lent.untyped_storage().data_ptr()
            ):
                tensor = tensor.clone()
            tensors[name] = tensor
        manifest = adapter.manifest
        if dtype is not None:
            # The manifest describes the tensors it travels with; sha256 stays that of the
            # stored file (it names the version).
            manifest = replace(manifest, dtype=str(dtype).removeprefix("torch."))
        return CanonicalAdapter(manifest, tensors), None


def adapter_bytes(adapter: CanonicalAdapter) -> int:
    """Host bytes an adapter holds: its packed buffer, or the sum of its tensors."""
    if isinstance(adapter, PackedAdapter):
        return adapter.flat.numel() * adapter.flat.element_size()
    return sum(tensor.numel() * tensor.element_size() for tensor in adapter.tensors.values())
