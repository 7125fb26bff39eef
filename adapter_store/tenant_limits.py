"""Per-tenant limits: how many adapter versions a tenant may keep stored, and how many of
its RPCs one server runs at a time.

The stored count is enforced in Redis, atomically with the commit (so replicas sharing one
Redis agree); the concurrency limit is per server process (a replica admits up to
`max_concurrent` of a tenant's calls, N replicas up to N times that).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from adapter_store.errors import ResourceExhausted

UNLIMITED = 0


@dataclass(frozen=True)
class TenantLimits:
    """0 means unlimited."""

    max_adapters: int = UNLIMITED  # adapter versions stored (every version counts)
    max_concurrent: int = UNLIMITED  # RPCs in flight on one server

    def __post_init__(self) -> None:
        if self.max_adapters < 0 or self.max_concurrent < 0:
            raise ValueError("tenant limits must be >= 0 (0: unlimited)")

    def overridden(self, max_adapters: int | None, max_concurrent: int | None) -> TenantLimits:
        """These limits with the fields that are not None replaced."""
        return TenantLimits(
            self.max_adapters if max_adapters is None else max_adapters,
            self.max_concurrent if max_concurrent is None else max_concurrent,
        )


NO_LIMITS = TenantLimits()


class ConcurrencyGate:
    """Counts each tenant's calls in flight and refuses the one over its limit."""

    def __init__(self) -> None:
        self._in_flight: Counter[str] = Counter()

    def in_flight(self, tenant: str) -> int:
        return self._in_flight[tenant]

    @contextmanager
    def admit(
        self, tenant: str, limit: int, setting: str = "its concurrency limit"
    ) -> Iterator[None]:
        """Hold one of `tenant`'s `limit` places for the block; ResourceExhausted if none
        (the message names `setting`, the knob an operator would raise)."""
        if limit != UNLIMITED and self._in_flight[tenant] >= limit:
            raise ResourceExhausted(
                f"tenant {tenant!r} already has {limit} requests in flight on this server "
                f"({setting}); retry when one finishes"
            )
        self._in_flight[tenant] += 1
        try:
            yield
        finally:
            self._in_flight[tenant] -= 1
            if not self._in_flight[tenant]:
                del self._in_flight[tenant]
