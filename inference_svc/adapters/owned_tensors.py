"""The base of adapter sources whose `fetch` returns tensors of the adapter's own, and the
callback type of `fetch_into`.

No gRPC, S3 or Redis client is imported here: the embedded and local-file sources, which
run on the GPU machine too, derive from it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TypeVar

from adapter_store.format import CanonicalAdapter
from inference_svc.engine.sequence import AdapterBinding

T = TypeVar("T")
# consume(adapter, lent) of `fetch_into`: lent is True when the adapter's tensors view a
# buffer the source reuses after the call (the consumer copies what it keeps), False when
# they are the adapter's own.
Consume = Callable[[CanonicalAdapter, bool], T]


class OwnedTensorsSource(ABC):
    """`fetch_into` (inference_svc.adapters.sources.AdapterSource) as `consume(fetch(...),
    lent=False)`: the adapter's tensors are its own, so `consume` may keep them."""

    @abstractmethod
    def fetch(self, adapter: AdapterBinding) -> CanonicalAdapter: ...

    def fetch_into(self, adapter: AdapterBinding, consume: Consume[T]) -> T:
        return consume(self.fetch(adapter), False)
