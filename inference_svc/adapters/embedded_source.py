"""The shipped PEFT adapters (the embedded demo model's), normalized in memory as the store
would store them: an adapter source for an engine without a store (tests, benchmarks).

Imports no Redis, S3 or gRPC client, so it also runs on the GPU machine.
"""

from __future__ import annotations

from adapter_store.format import CanonicalAdapter
from adapter_store.normalize import normalize_peft
from inference_svc.adapters.owned_tensors import OwnedTensorsSource
from inference_svc.engine.sequence import AdapterBinding
from inference_svc.model.tiny import EMBEDDED_ADAPTERS_DIR

EMBEDDED_ADAPTERS = ("docs-prose", "shouty", "unittest-style")


class EmbeddedAdapterSource(OwnedTensorsSource):
    """`AdapterSource` over the folders in EMBEDDED_ADAPTERS_DIR (a binding's name picks one)."""

    tier = "local"

    def __init__(self, hf_config: dict) -> None:
        self.hf_config = hf_config

    def fetch(self, adapter: AdapterBinding) -> CanonicalAdapter:
        folder = EMBEDDED_ADAPTERS_DIR / adapter.name
        files = {path.name: path.read_bytes() for path in folder.iterdir()}
        return normalize_peft(files, self.hf_config, base_model="tiny", max_rank=16)


def embedded_binding(name: str) -> AdapterBinding:
    """Version 1 of a shipped adapter, as the store would record it (rank 8)."""
    return AdapterBinding("default", name, 1, 8, "-", 0, "tiny")
