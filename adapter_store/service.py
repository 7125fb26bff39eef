"""The store's operations, independent of gRPC: base models, uploads, versions, fetches.

Commit protocol of an upload (so nothing half-done is ever visible):
  1. normalize and serialize in memory (a bad adapter fails here, nothing is written);
  2. allocate version N (atomic INCR; refused while the index is being rebuilt);
  3. write weights.safetensors + manifest.json under the version's S3 prefix;
  4. one Redis transaction: the record becomes visible and the `published` event is emitted;
  5. write record.json, S3's commit marker (reindex restores exactly these).
A crash before 4 leaves an unreferenced prefix without record.json, which `gc` removes; a
crash between 4 and 5 leaves an indexed version without its marker, which `gc` writes.
Deletes write an S3 tombstone first, then remove the Redis record (with the `deleted`
event), then the objects. Steps 3-5 run shielded, so a client hanging up mid-commit does
not stop them halfway.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from adapter_store.auth import Principal
from adapter_store.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from adapter_store.format import CANONICAL_MODULES, model_lora_shapes, serialize
from adapter_store.maintenance import remove_version
from adapter_store.names import check_labels, check_name, parse_ref
from adapter_store.normalize import normalize_peft
from adapter_store.records import (
    MANIFEST_FILE,
    RECORD_FILE,
    TOMBSTONE_FILE,
    WEIGHTS_FILE,
    AdapterRecord,
    BaseModelRecord,
    base_model_key,
    last_version_key,
    utc_now,
)
from adapter_store.storage.metadata import MetadataStore
from adapter_store.storage.objects import ObjectStore
from adapter_store.upload import UploadLimits, UploadSpec

log = logging.getLogger("loraserve.adapter_store")

T = TypeVar("T")
MiB = 1024 * 1024
DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
# Names fetched from Redis per round trip while listing.
_NAME_BATCH = 100


@dataclass(frozen=True)
class StoreConfig:
    max_rank: int = 256
    limits: UploadLimits = field(default_factory=UploadLimits)
    # Largest canonical adapter assembled (float32, before conversion to the stored dtype).
    max_canonical_bytes: int = 8192 * MiB
    fetch_chunk_bytes: int = 1 * MiB
    max_fetch_chunk_bytes: int = 16 * MiB

    def __post_init__(self) -> None:
        if self.max_rank <= 0 or self.max_canonical_bytes <= 0:
            raise ValueError("max_rank and max_canonical_bytes must be positive")
        if not 0 < self.fetch_chunk_bytes <= self.max_fetch_chunk_bytes:
            raise ValueError("fetch chunk size must be positive and at most the maximum")


@dataclass(frozen=True)
class AdapterQuery:
    """A ListAdapters request in domain terms."""

    page_size: int = 0
    page_token: str = ""
    base_model: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    all_versions: bool = False

    def matches(self, record: AdapterRecord) -> bool:
        if self.base_model and record.base_model != self.base_model:
            return False
        return all(record.labels.get(key) == value for key, value in self.labels.items())


@dataclass(frozen=True)
class AdapterPage:
    adapters: list[AdapterRecord]
    next_page_token: str


@dataclass(frozen=True)
class AdapterDownload:
    """A fetch: the record and manifest up front, the weights as a stream of chunks."""

    record: AdapterRecord
    manifest_json: bytes
    chunks: AsyncIterator[bytes]


_REINDEXING = "the Redis index is being rebuilt from S3 (reindex); retry shortly"


@dataclass(frozen=True)
class _Cursor:
    """Position in a listing: the last (name, version) returned."""

    name: str
    version: int

    def encode(self) -> str:
        raw = json.dumps({"n": self.name, "v": self.version}).encode()
        return base64.urlsafe_b64encode(raw).decode()

    @classmethod
    def decode(cls, token: str) -> _Cursor:
        try:
            raw = json.loads(base64.urlsafe_b64decode(token.encode()))
            return cls(check_name(str(raw["n"]), "page_token"), int(raw["v"]))
        except (ValueError, KeyError, TypeError, binascii.Error, InvalidArgument):
            raise InvalidArgument("page_token is malformed (pass next_page_token back)") from None


def _config_sha256(config: dict) -> str:
    """Hash of the config's content, so whitespace or key order do not count as a change."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


async def _shielded(work: Awaitable[T]) -> T:
    """Run `work` to completion even if the calling RPC is cancelled."""
    return await asyncio.shield(asyncio.ensure_future(work))


class AdapterStoreService:
    def __init__(self, objects: ObjectStore, metadata: MetadataStore, config: StoreConfig) -> None:
        self.objects = objects
        self.metadata = metadata
        self.config = config

    # --- base models -----------------------------------------------------------------

    async def register_base_model(
        self, principal: Principal, name: str, config_json: str
    ) -> BaseModelRecord:
        """Register `name`; idempotent for the same config, AlreadyExists for another."""
        check_name(name, "base model name")
        principal.check_base_model(name)
        try:
            config = json.loads(config_json)
        except ValueError as error:
            raise InvalidArgument(f"config_json is not valid JSON: {error}") from None
        except RecursionError:
            raise InvalidArgument("config_json is nested too deeply to be an HF config") from None
        if not isinstance(config, dict):
            raise InvalidArgument("config_json must be a JSON object (an HF config.json)")
        shapes = model_lora_shapes(config)
        modules = {shape.module for shape in shapes.values()}
        record = BaseModelRecord(
            name=name,
            config_json=config_json,
            config_sha256=_config_sha256(config),
            architecture=str((config.get("architectures") or [""])[0]),
            lora_modules=[module for module in CANONICAL_MODULES if module in modules],
            created_at=utc_now(),
        )
        existing = await self.metadata.get_base_model(name)
        if existing is not None:
            return _same_base_model(existing, record)
        stored = await self.objects.get_or_none(base_model_key(name))
        if stored is not None:
            # Known to S3 but not to Redis (Redis was emptied): keep the original record.
            record = _same_base_model(BaseModelRecord.from_json(stored), record)
        else:
            await self.objects.put(base_model_key(name), record.to_json())
        # Redis decides which of two racing registrations wins; the winner makes sure S3
        # holds its record.
        if not await self.metadata.add_base_model(record):
            winner = await self.metadata.get_base_model(name)
            assert winner is not None  # HSETNX refused: the field exists
            return _same_base_model(winner, record)
        if BaseModelRecord.from_json(await self.objects.get(base_model_key(name))) != record:
            await self.objects.put(base_model_key(name), record.to_json())
        log.info("registered base model %s (%s)", name, record.architecture)
        return record

    async def get_base_model(self, principal: Principal, name: str) -> BaseModelRecord:
        check_name(name, "base model name")
        principal.check_base_model(name)
        record = await self.metadata.get_base_model(name)
        if record is None:
            # S3 is the truth: Redis may have been emptied since the registration.
            stored = await self.objects.get_or_none(base_model_key(name))
            if stored is None:
                raise NotFound(f"base model {name!r} is not registered")
            record = BaseModelRecord.from_json(stored)
            await self.metadata.add_base_model(record)
        return record

    async def list_base_models(self, principal: Principal) -> list[BaseModelRecord]:
        return [r for r in await self.metadata.list_base_models() if principal.may_use(r.name)]

    # --- adapters --------------------------------------------------------------------

    async def upload(
        self, principal: Principal, spec: UploadSpec, files: dict[str, bytes]
    ) -> AdapterRecord:
        """Validate, normalize and commit one new version of `spec.name`."""
        base = await self.get_base_model(principal, spec.base_model)
        # Checked again atomically at the commit; this early check spares the work.
        await self._check_room(principal)
        canonical = await asyncio.to_thread(
            normalize_peft,
            files,
            base.config,
            base_model=base.name,
            max_rank=self.config.max_rank,
            dtype=spec.dtype or None,
            max_canonical_bytes=self.config.max_canonical_bytes,
        )
        weights, manifest_json = await asyncio.to_thread(serialize, canonical)
        version = await self.metadata.allocate_version(principal.tenant, spec.name)
        if version is None:
            # Refused, whatever the index says by now: a reindex finishing between the two
            # Redis calls let a record of version None through (seen in the Redis-kill test).
            raise Unavailable(_REINDEXING)
        manifest = canonical.manifest
        record = AdapterRecord(
            tenant=principal.tenant,
            name=spec.name,
            version=version,
            base_model=base.name,
            rank=manifest.rank,
            sha256=manifest.sha256,
            parts_sha256=manifest.parts_sha256,
            size_bytes=manifest.size_bytes,
            dtype=manifest.dtype,
            moe_layout=manifest.moe_layout,
            format_version=manifest.format_version,
            created_at=utc_now(),
            module_ranks=dict(manifest.module_ranks),
            description=spec.description,
            labels=dict(spec.labels),
        )
        await _shielded(self._commit(record, weights, manifest_json, principal.limits.max_adapters))
        log.info("published %s/%s (%d bytes)", record.tenant, record.ref, record.size_bytes)
        return record

    async def _check_room(self, principal: Principal) -> None:
        limit = principal.limits.max_adapters
        if limit and await self.metadata.stored_count(principal.tenant) >= limit:
            raise _too_many_adapters(principal.tenant, limit)

    async def _commit(
        self, record: AdapterRecord, weights: bytes, manifest_json: bytes, max_stored: int
    ) -> None:
        prefix = record.storage_prefix
        await asyncio.gather(
            self.objects.put(prefix + WEIGHTS_FILE, weights),
            self.objects.put(prefix + MANIFEST_FILE, manifest_json),
        )
        if not await self.metadata.commit_adapter(record, max_stored):
            # Lost a race for the tenant's last place: nothing was indexed, drop the objects
            # (gc would remove them too).
            await remove_version(self.objects, prefix)
            raise _too_many_adapters(record.tenant, max_stored)
        try:
            await self.objects.put(prefix + RECORD_FILE, record.to_json())
        except Unavailable as error:
            # Visible already; `gc` writes the missing marker later.
            log.warning("%s: commit marker not written (gc will): %s", prefix, error)

    async def get_adapter(self, principal: Principal, ref: str) -> AdapterRecord:
        """The record of `name` (latest) or `name@N`."""
        parsed = parse_ref(ref)
        record = await self.metadata.get_adapter(principal.tenant, parsed.name, parsed.version)
        if record is None:
            await self._require_index()
            raise NotFound(f"adapter {str(parsed)!r} not found")
        return record

    async def _require_index(self) -> None:
        """Before answering "not found": is the index complete, or is Redis being rebuilt?"""
        if not await self.metadata.index_ready():
            raise Unavailable(_REINDEXING)

    async def list_adapters(self, principal: Principal, query: AdapterQuery) -> AdapterPage:
        if query.page_size < 0:
            raise InvalidArgument("page_size must not be negative")
        if query.base_model:
            check_name(query.base_model, "base_model filter")
        check_labels(query.labels, "label filter")
        page_size = min(query.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        after = _Cursor.decode(query.page_token) if query.page_token else None
        found: list[AdapterRecord] = []
        # One more than a page tells whether a next page exists.
        async for record in self._matching(principal.tenant, query, after):
            found.append(record)
            if len(found) > page_size:
                break
        if not found:
            await self._require_index()
        if len(found) <= page_size:
            return AdapterPage(found, "")
        last = found[page_size - 1]
        return AdapterPage(found[:page_size], _Cursor(last.name, last.version).encode())

    async def _matching(
        self, tenant: str, query: AdapterQuery, after: _Cursor | None
    ) -> AsyncIterator[AdapterRecord]:
        """Records of `tenant` in (name, version) order after the cursor, filtered."""
        if after is not None and query.all_versions:
            for record in await self.metadata.adapter_versions(tenant, after.name):
                if record.version > after.version and query.matches(record):
                    yield record
        name_after = None if after is None else after.name
        while names := await self.metadata.adapter_names(tenant, name_after, _NAME_BATCH):
            for name in names:
                versions = await self.metadata.adapter_versions(tenant, name)
                for record in versions if query.all_versions else versions[-1:]:
                    if query.matches(record):
                        yield record
            name_after = names[-1]

    async def delete_adapter(self, principal: Principal, ref: str) -> list[int]:
        """Delete `name@N`, or every version of `name`; returns the versions deleted."""
        parsed = parse_ref(ref)
        if parsed.version is None:
            records = await self.metadata.adapter_versions(principal.tenant, parsed.name)
        else:
            record = await self.get_adapter(principal, ref)
            records = [record]
        if not records:
            await self._require_index()
            raise NotFound(f"adapter {str(parsed)!r} not found")
        return await _shielded(self._delete(records))

    async def _delete(self, records: list[AdapterRecord]) -> list[int]:
        tombstone = json.dumps({"deleted_at": utc_now()}).encode()
        tenant, name = records[0].tenant, records[0].name
        last = max(record.version for record in records)
        stored = await self.objects.get_or_none(last_version_key(tenant, name))
        if stored is None or json.loads(stored)["version"] < last:
            await self.objects.put(
                last_version_key(tenant, name), json.dumps({"version": last}).encode()
            )
        await asyncio.gather(
            *(self.objects.put(r.storage_prefix + TOMBSTONE_FILE, tombstone) for r in records)
        )
        deleted = await self.metadata.delete_adapters(records)
        for record in records:
            try:
                await remove_version(self.objects, record.storage_prefix)
            except Unavailable as error:
                log.warning("%s: objects left for gc: %s", record.storage_prefix, error)
        log.info("deleted %s/%s versions %s", tenant, name, deleted)
        return deleted

    async def download(
        self, principal: Principal, ref: str, chunk_bytes: int = 0
    ) -> AdapterDownload:
        """The record, manifest.json, and a stream of the canonical weights."""
        if chunk_bytes < 0 or chunk_bytes > self.config.max_fetch_chunk_bytes:
            raise InvalidArgument(
                f"chunk_size must be 0..{self.config.max_fetch_chunk_bytes}, got {chunk_bytes}"
            )
        record = await self.get_adapter(principal, ref)
        manifest_json = await self.objects.get(record.storage_prefix + MANIFEST_FILE)
        chunks = self.objects.iter_chunks(
            record.storage_prefix + WEIGHTS_FILE, chunk_bytes or self.config.fetch_chunk_bytes
        )
        return AdapterDownload(record, manifest_json, chunks)


def _too_many_adapters(tenant: str, limit: int) -> ResourceExhausted:
    return ResourceExhausted(
        f"tenant {tenant!r} already stores {limit} adapter versions (its limit); "
        "delete old versions to upload new ones"
    )


def _same_base_model(existing: BaseModelRecord, requested: BaseModelRecord) -> BaseModelRecord:
    if existing.config_sha256 != requested.config_sha256:
        raise AlreadyExists(
            f"base model {existing.name!r} is already registered with a different config "
            f"(sha256 {existing.config_sha256[:12]}…); register it under another name"
        )
    return existing
