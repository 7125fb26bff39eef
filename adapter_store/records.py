"""Domain records of the store and where they live in S3.

S3 layout (fixed by the design): one prefix per adapter version,
`tenants/{tenant}/adapters/{name}/v{version}/`, holding

- `weights.safetensors` and `manifest.json` — the canonical adapter (adapter_store.format);
- `record.json` — the `AdapterRecord` (name, tenant, labels, …). It is written only after
  the Redis commit, so it doubles as S3's commit marker: `reindex` restores exactly the
  prefixes that have one;
- `deleted.json` — a tombstone, written before a delete touches Redis, so neither reindex
  nor a crash can bring a deleted version back.

Beside the versions, `tenants/{tenant}/adapters/{name}/last_version.json` remembers the
highest version ever deleted, so a name deleted whole does not reuse its version numbers
after a reindex. Base models live at `base_models/{name}.json`. Names are validated
(adapter_store.names) before they reach a key, so the keys need no escaping.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

from adapter_store.errors import InvalidArgument

WEIGHTS_FILE = "weights.safetensors"
MANIFEST_FILE = "manifest.json"
RECORD_FILE = "record.json"
TOMBSTONE_FILE = "deleted.json"
ADAPTER_FILES = (WEIGHTS_FILE, MANIFEST_FILE, RECORD_FILE, TOMBSTONE_FILE)
TENANTS_ROOT = "tenants/"
BASE_MODELS_ROOT = "base_models/"

LAST_VERSION_FILE = "last_version.json"

_ADAPTER_KEY = re.compile(r"^tenants/([^/]+)/adapters/([^/]+)/v(\d+)/([^/]+)$")
_LAST_VERSION_KEY = re.compile(r"^tenants/([^/]+)/adapters/([^/]+)/last_version\.json$")


def utc_now() -> str:
    """Now as RFC 3339 UTC with millisecond precision."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def adapter_prefix(tenant: str, name: str, version: int) -> str:
    return f"tenants/{tenant}/adapters/{name}/v{version}/"


def last_version_key(tenant: str, name: str) -> str:
    return f"tenants/{tenant}/adapters/{name}/{LAST_VERSION_FILE}"


def parse_last_version_key(key: str) -> tuple[str, str] | None:
    """(tenant, name) of a `last_version.json` key, or None for any other key."""
    match = _LAST_VERSION_KEY.match(key)
    return None if match is None else (match.group(1), match.group(2))


def base_model_key(name: str) -> str:
    return f"{BASE_MODELS_ROOT}{name}.json"


@dataclass(frozen=True)
class AdapterKey:
    """An S3 key of one adapter version's file, parsed."""

    tenant: str
    name: str
    version: int
    filename: str

    @property
    def prefix(self) -> str:
        return adapter_prefix(self.tenant, self.name, self.version)


def parse_adapter_key(key: str) -> AdapterKey | None:
    """The parts of `tenants/{t}/adapters/{n}/v{N}/{file}`, or None for any other key."""
    match = _ADAPTER_KEY.match(key)
    if match is None:
        return None
    tenant, name, version, filename = match.groups()
    return AdapterKey(tenant, name, int(version), filename)


def _from_json(cls: type, data: bytes | str, what: str) -> Any:
    try:
        raw = json.loads(data)
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})
    except (ValueError, TypeError, AttributeError) as error:
        raise InvalidArgument(f"{what} is malformed: {error}") from None


@dataclass(frozen=True)
class AdapterRecord:
    """One immutable adapter version: what Redis indexes and `record.json` persists."""

    tenant: str
    name: str
    version: int
    base_model: str
    rank: int
    sha256: str
    size_bytes: int
    dtype: str
    moe_layout: str
    format_version: int
    created_at: str
    module_ranks: dict[str, int] = field(default_factory=dict)  # "layers.L.module" -> rank
    description: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    # format.parts_digest of the manifest's part digests: binds them to this record, so a
    # reader may verify the weights part by part ("" for versions stored before parts).
    parts_sha256: str = ""

    @property
    def storage_prefix(self) -> str:
        return adapter_prefix(self.tenant, self.name, self.version)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def target_modules(self) -> list[str]:
        """Canonical module names present, e.g. ["attn.qkv_a", "moe.down"]."""
        return sorted({key.split(".", 2)[2] for key in self.module_ranks})

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> AdapterRecord:
        return _from_json(cls, data, "adapter record")


@dataclass(frozen=True)
class BaseModelRecord:
    """A registered base model: its HF config and the canonical modules derived from it."""

    name: str
    config_json: str
    config_sha256: str
    architecture: str
    lora_modules: list[str]
    created_at: str

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(self.config_json)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> BaseModelRecord:
        return _from_json(cls, data, "base model record")
