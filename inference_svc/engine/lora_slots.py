"""Which adapter lives in which GPU LoRA slot: a plain-Python allocator the scheduler owns.

Like nano-vllm's block manager, this holds no device memory; `inference_svc.lora.pool`
holds the buffers and this decides the slot indices. A slot is in one of three states:

    free ──acquire(new key)──▶ loading ──mark_loaded──▶ ready
      ▲                           │ mark_load_failed          │ LRU eviction / unload
      └───────────────────────────┴───────────────────────────┘

Every running request that uses an adapter holds a `SlotHandle` (a reference). A slot with
references, a pinned slot and a slot whose load is in flight are never evicted; among the
others the least recently used one is evicted when a new adapter needs a slot, except that
adapters the caller names as wanted by waiting requests go only after all others (and, for a
look-ahead copy, not at all). Exactly one
`acquire` of a key that is not resident returns `needs_load=True`: that caller starts the
copy and later calls `mark_loaded` (or `mark_load_failed`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Hashable
from dataclasses import dataclass

from adapter_store.errors import ResourceExhausted

AdapterKey = Hashable  # e.g. (tenant, name, version)


@dataclass(frozen=True)
class SlotHandle:
    """One request's reference to an adapter's slot; give it back with `release`."""

    handle_id: int
    slot: int
    adapter_key: AdapterKey
    # Which assignment of the slot this refers to: a failed load frees the slot while
    # handles to it are still out, and their release must not touch a later tenant.
    assignment: int
    # True for the one acquire that assigned the slot: that caller must load the weights.
    needs_load: bool
    # The adapter this acquire evicted from the slot (the caller updates residency), or None.
    evicted: AdapterKey | None


@dataclass(frozen=True)
class SlotMetrics:
    """Counters since start (loads, evictions, hits, misses) and the current occupancy."""

    max_loras: int
    occupied: int  # slots holding an adapter (loading or ready)
    referenced: int  # slots with at least one running request
    pinned: int
    loads: int
    evictions: int
    hits: int
    misses: int

    @property
    def occupancy(self) -> float:
        return self.occupied / self.max_loras


@dataclass
class _Slot:
    key: AdapterKey
    assignment: int
    refs: int = 0
    pinned: bool = False
    loaded: bool = False

    @property
    def evictable(self) -> bool:
        return self.refs == 0 and not self.pinned and self.loaded


class LoraSlotAllocator:
    """`max_loras` slots; ref-counted per request, LRU among unreferenced unpinned slots."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self._free: list[int] = list(range(max_loras - 1, -1, -1))  # pop() gives slot 0 first
        self._slots: dict[int, _Slot] = {}
        # Resident keys, least recently used first.
        self._lru: OrderedDict[AdapterKey, int] = OrderedDict()
        self._handles: set[int] = set()
        self._ids = itertools.count()
        self._loads = self._evictions = self._hits = self._misses = 0

    # -- queries --------------------------------------------------------------------------

    def slot_of(self, key: AdapterKey) -> int | None:
        """The slot holding `key` (loading or ready), or None."""
        return self._lru.get(key)

    def is_ready(self, key: AdapterKey) -> bool:
        """Whether `key`'s weights are in its slot (requests using it may run)."""
        slot = self._lru.get(key)
        return slot is not None and self._slots[slot].loaded

    def refs(self, key: AdapterKey) -> int:
        slot = self._lru.get(key)
        return 0 if slot is None else self._slots[slot].refs

    def is_pinned(self, key: AdapterKey) -> bool:
        slot = self._lru.get(key)
        return slot is not None and self._slots[slot].pinned

    def can_allocate(
        self, key: AdapterKey, wanted: Collection[AdapterKey] = (), evict_wanted: bool = True
    ) -> bool:
        """Whether `acquire(key, wanted, evict_wanted)` would succeed now."""
        return (
            key in self._lru or bool(self._free) or self._victim(wanted, evict_wanted) is not None
        )

    def resident(self) -> list[tuple[AdapterKey, int]]:
        """(key, slot) of every resident adapter, least recently used first."""
        return list(self._lru.items())

    def metrics(self) -> SlotMetrics:
        slots = self._slots.values()
        return SlotMetrics(
            max_loras=self.max_loras,
            occupied=len(self._slots),
            referenced=sum(slot.refs > 0 for slot in slots),
            pinned=sum(slot.pinned for slot in slots),
            loads=self._loads,
            evictions=self._evictions,
            hits=self._hits,
            misses=self._misses,
        )

    # -- request references ---------------------------------------------------------------

    def acquire(
        self, key: AdapterKey, wanted: Collection[AdapterKey] = (), evict_wanted: bool = True
    ) -> SlotHandle:
        """Take a reference to `key`'s slot, assigning (and maybe evicting) one if needed.

        wanted: adapters that waiting requests need; the least recently used evictable
        adapter outside it goes first, one inside it only when no other is left and
        `evict_wanted` allows. Raises ResourceExhausted when no slot can be had; check
        `can_allocate` first to keep the request waiting instead.
        """
        slot = self._lru.get(key)
        evicted = None
        needs_load = slot is None
        if slot is None:
            slot, evicted = self._take_slot(wanted, evict_wanted)
            self._misses += 1
            self._slots[slot] = _Slot(key, next(self._ids))
            self._loads += 1
        else:
            self._hits += 1
        self._lru[key] = slot
        self._lru.move_to_end(key)
        state = self._slots[slot]
        state.refs += 1
        handle = SlotHandle(next(self._ids), slot, key, state.assignment, needs_load, evicted)
        self._handles.add(handle.handle_id)
        return handle

    def release(self, handle: SlotHandle) -> None:
        """Drop a request's reference; the adapter stays resident until evicted."""
        if handle.handle_id not in self._handles:
            raise ValueError(f"slot handle {handle.handle_id} was already released")
        self._handles.remove(handle.handle_id)
        state = self._slots.get(handle.slot)
        if state is None or state.assignment != handle.assignment:
            return  # its load failed and the slot was freed (and maybe reassigned) since
        state.refs -= 1
        self._lru.move_to_end(handle.adapter_key)

    # -- loading --------------------------------------------------------------------------

    def mark_loaded(self, key: AdapterKey) -> None:
        """The copy into `key`'s slot has completed: requests using it may run."""
        self._slots[self._require(key)].loaded = True

    def mark_load_failed(self, key: AdapterKey) -> int:
        """The copy failed: free the slot now; its holders' handles stay valid to release."""
        slot = self._require(key)
        if self._slots[slot].loaded:
            raise ValueError(f"adapter {key!r} is already loaded in slot {slot}")
        self._drop(key)
        return slot

    # -- pinning and explicit unload ------------------------------------------------------

    def pin(self, key: AdapterKey) -> None:
        """Keep `key` resident (never evicted) until `unpin`; it must be resident."""
        self._slots[self._require(key)].pinned = True

    def unpin(self, key: AdapterKey) -> None:
        self._slots[self._require(key)].pinned = False

    def unload(self, key: AdapterKey) -> int | None:
        """Free `key`'s slot now (UnloadAdapter); returns the slot to zero, None if absent.

        Raises ResourceExhausted when running requests still use it or its load is in flight.
        """
        slot = self._lru.get(key)
        if slot is None:
            return None
        state = self._slots[slot]
        if state.refs or not state.loaded:
            raise ResourceExhausted(
                f"adapter {key!r} is in use by {state.refs} running request(s)"
                if state.refs
                else f"adapter {key!r} is still being loaded into slot {slot}"
            )
        self._drop(key)
        return slot

    # -- internals ------------------------------------------------------------------------

    def _require(self, key: AdapterKey) -> int:
        slot = self._lru.get(key)
        if slot is None:
            raise KeyError(f"adapter {key!r} has no LoRA slot")
        return slot

    def _victim(self, wanted: Collection[AdapterKey], evict_wanted: bool) -> AdapterKey | None:
        """The least recently used evictable key outside `wanted`, else (`evict_wanted`) the
        least recently used evictable one, else None."""
        evictable = [key for key, slot in self._lru.items() if self._slots[slot].evictable]
        unwanted = next((key for key in evictable if key not in wanted), None)
        if unwanted is not None or not evict_wanted:
            return unwanted
        return evictable[0] if evictable else None

    def _take_slot(
        self, wanted: Collection[AdapterKey], evict_wanted: bool
    ) -> tuple[int, AdapterKey | None]:
        if self._free:
            return self._free.pop(), None
        victim = self._victim(wanted, evict_wanted)
        if victim is None:
            raise ResourceExhausted(
                f"all {self.max_loras} LoRA slots are in use by running, pinned or loading "
                "adapters" + ("" if evict_wanted else " or wanted by waiting requests")
            )
        slot = self._lru.pop(victim)
        del self._slots[slot]
        self._evictions += 1
        return slot, victim

    def _drop(self, key: AdapterKey) -> None:
        slot = self._lru.pop(key)
        del self._slots[slot]
        self._free.append(slot)
