"""Repairs that make S3 and Redis agree again: `reindex` (Redis from S3) and `gc` (S3 of
what Redis and the commit protocol say is garbage). Both are safe to run while stores
serve: reindex only adds and re-adds, gc only removes what no commit can still claim."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from adapter_store.errors import FailedPrecondition, LoraserveError
from adapter_store.format import Manifest
from adapter_store.records import (
    ADAPTER_FILES,
    BASE_MODELS_ROOT,
    MANIFEST_FILE,
    RECORD_FILE,
    TENANTS_ROOT,
    TOMBSTONE_FILE,
    AdapterKey,
    AdapterRecord,
    BaseModelRecord,
    parse_adapter_key,
    parse_last_version_key,
    utc_now,
)
from adapter_store.storage.metadata import MetadataStore
from adapter_store.storage.objects import ObjectInfo, ObjectStore

log = logging.getLogger("loraserve.adapter_store.maintenance")

# Uploads whose commit is in flight have objects but no record yet; gc leaves prefixes
# younger than this alone.
DEFAULT_GC_GRACE_S = 3600.0
_PARALLEL = 16


@dataclass(frozen=True)
class VersionObjects:
    """The S3 objects of one adapter version prefix."""

    key: AdapterKey
    files: dict[str, ObjectInfo]

    @property
    def prefix(self) -> str:
        return self.key.prefix

    @property
    def newest(self) -> datetime:
        return max(info.last_modified for info in self.files.values())


def group_versions(listing: Iterable[ObjectInfo]) -> list[VersionObjects]:
    """The adapter version prefixes of a bucket listing, with the files each holds."""
    grouped: dict[AdapterKey, dict[str, ObjectInfo]] = defaultdict(dict)
    for info in listing:
        key = parse_adapter_key(info.key)
        if key is not None:
            grouped[AdapterKey(key.tenant, key.name, key.version, "")][key.filename] = info
    return [VersionObjects(key, files) for key, files in sorted(grouped.items(), key=_order)]


def _order(item: tuple[AdapterKey, dict]) -> tuple[str, str, int]:
    key = item[0]
    return key.tenant, key.name, key.version


async def remove_version(objects: ObjectStore, prefix: str) -> None:
    """Delete a version's objects; the tombstone goes last so a crash midway is resumed."""
    await objects.delete([prefix + name for name in ADAPTER_FILES if name != TOMBSTONE_FILE])
    await objects.delete([prefix + TOMBSTONE_FILE])


async def _bounded(jobs: Iterable[Callable[[], Awaitable[None]]]) -> None:
    limit = asyncio.Semaphore(_PARALLEL)

    async def run(job: Callable[[], Awaitable[None]]) -> None:
        async with limit:
            await job()

    await asyncio.gather(*(run(job) for job in jobs))


@dataclass
class ReindexReport:
    base_models: int = 0
    adapters: int = 0
    tombstoned: int = 0
    uncommitted: int = 0
    corrupt: list[str] = field(default_factory=list)


async def reindex(objects: ObjectStore, metadata: MetadataStore) -> ReindexReport:
    """Rebuild every Redis record from S3 and mark the index as mirroring S3.

    Committed versions (record.json, no tombstone) are indexed; every version number seen
    raises its name's counter, so no number is handed out twice; tombstoned versions are
    dropped from the index. A record that disagrees with its manifest is reported, not
    indexed.
    """
    report = ReindexReport()
    for info in await objects.list_objects(BASE_MODELS_ROOT):
        await metadata.restore_base_model(BaseModelRecord.from_json(await objects.get(info.key)))
        report.base_models += 1

    async def restore(version: VersionObjects) -> None:
        key = version.key
        await metadata.raise_counter(key.tenant, key.name, key.version)
        if TOMBSTONE_FILE in version.files:
            report.tombstoned += 1
            indexed = await metadata.get_adapter(key.tenant, key.name, key.version)
            if indexed is not None:
                await metadata.delete_adapters([indexed])
            return
        if RECORD_FILE not in version.files:
            report.uncommitted += 1
            return
        try:
            record = AdapterRecord.from_json(await objects.get(version.prefix + RECORD_FILE))
            manifest = Manifest.from_json(await objects.get(version.prefix + MANIFEST_FILE))
            _check_consistent(key, record, manifest)
        except LoraserveError as error:
            log.error("reindex: %s not restored: %s", version.prefix, error)
            report.corrupt.append(version.prefix)
            return
        await metadata.restore_adapter(record)
        report.adapters += 1

    listing = await objects.list_objects(TENANTS_ROOT)
    await _bounded(lambda v=v: restore(v) for v in group_versions(listing))
    for info in listing:
        owner = parse_last_version_key(info.key)
        if owner is not None:
            last = json.loads(await objects.get(info.key))["version"]
            await metadata.raise_counter(*owner, int(last))
    await metadata.mark_index_ready(f"reindexed {utc_now()}")
    log.info("reindex: %s", report)
    return report


def _check_consistent(key: AdapterKey, record: AdapterRecord, manifest: Manifest) -> None:
    where = (record.tenant, record.name, record.version)
    if where != (key.tenant, key.name, key.version):
        raise FailedPrecondition(f"record.json names {where}, its prefix says otherwise")
    if (manifest.sha256, manifest.size_bytes, manifest.parts_sha256) != (
        record.sha256,
        record.size_bytes,
        record.parts_sha256,
    ):
        raise FailedPrecondition("record.json and manifest.json disagree on the weights")


@dataclass
class GcReport:
    removed: list[str] = field(default_factory=list)  # prefixes deleted
    repaired: list[str] = field(default_factory=list)  # commit markers written
    pending: list[str] = field(default_factory=list)  # uncommitted, younger than the grace
    unindexed: list[str] = field(default_factory=list)  # committed in S3, not in Redis


async def collect_garbage(
    objects: ObjectStore, metadata: MetadataStore, grace_s: float = DEFAULT_GC_GRACE_S
) -> GcReport:
    """Finish interrupted deletes, remove uploads that never committed, write missing
    commit markers. Refuses to run while the index is not known to mirror S3, since an
    emptied Redis would make every version look unreferenced."""
    if not await metadata.index_ready():
        raise FailedPrecondition(
            "the Redis index is not marked as mirroring S3 (was Redis emptied?): "
            "run `python -m adapter_store reindex` before gc"
        )
    report = GcReport()
    now = datetime.now(UTC)

    async def examine(version: VersionObjects) -> None:
        key = version.key
        indexed = await metadata.get_adapter(key.tenant, key.name, key.version)
        if TOMBSTONE_FILE in version.files:
            if indexed is not None:
                await metadata.delete_adapters([indexed])
            await remove_version(objects, version.prefix)
            report.removed.append(version.prefix)
        elif RECORD_FILE in version.files:
            if indexed is None:
                report.unindexed.append(version.prefix)
        elif indexed is not None:
            await objects.put(version.prefix + RECORD_FILE, indexed.to_json())
            report.repaired.append(version.prefix)
        elif (now - version.newest).total_seconds() >= grace_s:
            await remove_version(objects, version.prefix)
            report.removed.append(version.prefix)
        else:
            report.pending.append(version.prefix)

    listing = await objects.list_objects(TENANTS_ROOT)
    await _bounded(lambda v=v: examine(v) for v in group_versions(listing))
    log.info("gc: %s", report)
    return report


async def keep_index_ready(
    objects: ObjectStore, metadata: MetadataStore, interval_s: float
) -> None:
    """Forever: whenever Redis lost the index (flushed, restarted empty), rebuild it.

    Until then uploads are refused (UNAVAILABLE) so no version number is handed out twice;
    a dependency that is down is retried on the next tick.
    """
    while True:
        try:
            if not await metadata.index_ready():
                log.warning("Redis index missing (new or emptied Redis): rebuilding from S3")
                await reindex(objects, metadata)
        except LoraserveError as error:
            log.warning("index check failed, retrying in %.0f s: %s", interval_s, error)
        await asyncio.sleep(interval_s)
