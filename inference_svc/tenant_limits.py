"""Per-tenant limit on concurrent Generate streams at one replica.

The store limits a tenant's stored adapters and concurrent store calls; this is the serving
side: one tenant cannot occupy every running slot of a replica. Counted per replica (N
replicas admit up to N× the limit), like the store's per-process concurrency limit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from adapter_store.errors import ResourceExhausted


class TenantConcurrencyLimit:
    """At most `limit` streams per tenant at once; 0 means no limit. Event-loop only (the
    servicer's coroutines), so no lock."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"tenant concurrency limit must be ≥ 0, got {limit}")
        self.limit = limit
        self._active: Counter[str] = Counter()

    def active(self, tenant: str) -> int:
        return self._active[tenant]

    @contextmanager
    def hold(self, tenant: str) -> Iterator[None]:
        """One place for `tenant` while the block runs; RESOURCE_EXHAUSTED when it has none."""
        if self.limit and self._active[tenant] >= self.limit:
            raise ResourceExhausted(
                f"tenant {tenant!r} already has {self.limit} concurrent requests on this "
                "replica (--tenant-max-concurrent); retry when one finishes"
            )
        self._active[tenant] += 1
        try:
            yield
        finally:
            self._active[tenant] -= 1
            if not self._active[tenant]:
                del self._active[tenant]
