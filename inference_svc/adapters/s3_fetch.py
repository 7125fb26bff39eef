"""Fetch one canonical adapter version from S3: manifest, then weights by parallel ranged
GETs, sha256-verified before anything parses them.

S3 layout (fixed): `tenants/{tenant}/adapters/{name}/v{version}/weights.safetensors` and
`manifest.json`. The manifest's digests must equal the store's record (when the caller has
it) and the downloaded bytes must hash to them, one of two ways:
- by parts: when the manifest lists a digest per part and the record binds that list
  (`parts_sha256`; or the caller has no record), each ranged GET is one part, hashed on the
  thread that fetched it, so parts are checked on several cores as they arrive;
- whole: otherwise (versions stored before parts were digested), one in-order sha256 of
  the whole file on one core (553 MiB: 451 ms on the H200 host, against 37 ms in parts on
  its 16 cores; on the 2-core CI machine, where the client and SeaweedFS already fill both
  cores, by parts is 5-12 % faster).
Every GET reads straight into its place in one download buffer that the fetcher reuses
across fetches (inference_svc.adapters.download_buffers says why). `fetch` copies the
tensors out before the buffer goes back; `fetch_into` lends views of it to a callback.

Errors, decided here:
- a digest mismatch is retried once (a torn read or a flaky proxy): the part, or the whole
  download; a second mismatch means the stored object itself is bad, which retrying later
  will not fix: FailedPrecondition naming the object and both digests (gRPC's DATA_LOSS
  would fit too, but clients already handle FAILED_PRECONDITION as "this adapter cannot be
  served until someone fixes it");
- a manifest that disagrees with the store's record, or stored bytes that do not parse:
  FailedPrecondition;
- a missing object: NotFound; S3 unreachable, timing out or answering 5xx: Unavailable,
  naming S3 and its endpoint.

boto3 is imported when a fetcher is built, not at module import (the GPU image lacks it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from adapter_store.byte_pieces import BytePieces, HashedPieces
from adapter_store.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from adapter_store.format import CanonicalAdapter, Manifest, deserialize_pieces, sha256_hex
from inference_svc.adapters.download_buffers import DownloadBuffers
from inference_svc.engine.sequence import AdapterBinding

MIB = 1 << 20
T = TypeVar("T")


def adapter_prefix(tenant: str, name: str, version: int) -> str:
    """Key prefix of one adapter version in the store's bucket."""
    return f"tenants/{tenant}/adapters/{name}/v{version}/"


@dataclass(frozen=True)
class S3FetchConfig:
    bucket: str
    endpoint_url: str | None = None  # None: AWS (credentials the usual boto3 way)
    part_size: int = 8 * MIB  # bytes per ranged GET where the manifest has no part digests
    concurrency: int = 8  # ranged GETs in flight, shared by concurrent fetches
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 30.0
    max_attempts: int = 2  # botocore's own retries per request (connection errors, 5xx)
    # Download buffers kept between fetches (inference_svc.adapters.download_buffers).
    idle_buffer_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ValueError("bucket must be set")
        if self.part_size < 1 or self.concurrency < 1 or self.max_attempts < 1:
            raise ValueError(
                f"part_size, concurrency and max_attempts must be >= 1, got {self.part_size}, "
                f"{self.concurrency}, {self.max_attempts}"
            )
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        if self.idle_buffer_bytes < 0:
            raise ValueError(f"idle_buffer_bytes must be >= 0, got {self.idle_buffer_bytes}")


@dataclass(frozen=True)
class FetchedAdapter:
    adapter: CanonicalAdapter
    size_bytes: int  # of weights.safetensors
    parts: int  # ranged GETs per download
    verified_by: str  # "parts" (each part's own digest) or "whole" (the file's digest)
    refetched_parts: int  # parts downloaded again after a digest mismatch (all, if "whole")
    seconds: float


@dataclass(frozen=True)
class _Download:
    """Verified weights in a leased download buffer, and how they were fetched."""

    label: str
    manifest: Manifest
    weights: memoryview  # [bytes] of weights.safetensors
    parts: int
    verified_by: str
    refetched_parts: int
    started: float  # time.perf_counter() at the fetch's start

    def fetched(self, views: bool) -> FetchedAdapter:
        """The parsed adapter: its tensors copied out of the buffer, or (views) viewing it."""
        pieces = BytePieces()
        pieces.append(self.weights)
        buffer = torch.frombuffer(self.weights, dtype=torch.uint8) if views else None
        try:
            adapter = deserialize_pieces(pieces, self.manifest, views_of=buffer)  # verified
        except InvalidArgument as exc:
            raise FailedPrecondition(f"{self.label}: stored weights do not parse: {exc}") from None
        return FetchedAdapter(
            adapter, self.manifest.size_bytes, self.parts, self.verified_by,
            self.refetched_parts, time.perf_counter() - self.started,
        )  # fmt: skip


class _DigestMismatch(Exception):
    def __init__(self, got: str, size: int) -> None:
        super().__init__(got)
        self.got, self.size = got, size


class S3AdapterFetcher:
    """Downloads adapter versions with parallel ranged GETs on a shared thread pool."""

    def __init__(self, config: S3FetchConfig) -> None:
        import boto3
        from botocore.config import Config

        self.config = config
        # One client for all threads: boto3 clients are thread-safe (resources are not).
        self._s3 = boto3.client(
            "s3",
            endpoint_url=config.endpoint_url,
            config=Config(
                connect_timeout=config.connect_timeout_s,
                read_timeout=config.read_timeout_s,
                retries={"max_attempts": config.max_attempts, "mode": "standard"},
                max_pool_connections=max(10, 2 * config.concurrency),
            ),
        )
        self._parts = ThreadPoolExecutor(config.concurrency, thread_name_prefix="s3-part")
        self.buffers = DownloadBuffers(config.idle_buffer_bytes)

    def close(self) -> None:
        self._parts.shutdown(wait=False, cancel_futures=True)

    def fetch(
        self,
        tenant: str,
        name: str,
        version: int,
        expected_sha256: str | None = None,
        expected_parts_sha256: str = "",
    ) -> FetchedAdapter:
        """Download, verify and deserialize one adapter version (blocking); its tensors are
        its own.

        `expected_sha256` and `expected_parts_sha256` are the store's record of the weights'
        digests (None / "" where the caller has none); the manifest in S3 must agree.
        """
        with self._download(tenant, name, version, expected_sha256, expected_parts_sha256) as got:
            return got.fetched(views=False)

    def fetch_into(self, adapter: AdapterBinding, consume: Callable[[FetchedAdapter], T]) -> T:
        """`fetch` of a resolved adapter (its record's digests), handing the result to
        `consume`, whose tensors view the download buffer: they are valid during the call
        only, so `consume` copies what it keeps (the host cache's `insert(...,
        borrowed=True)` packs them). One copy of the weights fewer than `fetch`, whose parse
        copies every tensor out of the buffer."""
        with self._download(
            adapter.tenant, adapter.name, adapter.version, adapter.sha256, adapter.parts_sha256
        ) as got:
            return consume(got.fetched(views=True))

    @contextmanager
    def _download(
        self,
        tenant: str,
        name: str,
        version: int,
        expected_sha256: str | None,
        expected_parts_sha256: str,
    ) -> Iterator[_Download]:
        """The verified weights in a download buffer (inference_svc.adapters.download_buffers),
        for the block; the buffer goes back to the pool after it."""
        started = time.perf_counter()
        prefix = adapter_prefix(tenant, name, version)
        label = f"adapter {tenant}/{name}@{version}"
        manifest_json = self._get(prefix + "manifest.json", label)
        try:
            manifest = Manifest.from_json(manifest_json)
        except InvalidArgument as exc:
            raise FailedPrecondition(f"{label}: manifest.json in S3 is unreadable: {exc}") from None
        if expected_sha256 is not None and manifest.sha256 != expected_sha256:
            raise FailedPrecondition(
                f"{label}: manifest.json in S3 names weights sha256 {manifest.sha256}, the "
                f"store's record says {expected_sha256}"
            )
        weights_key = prefix + "weights.safetensors"
        with self.buffers.lease(manifest.size_bytes) as weights:
            if _parts_bound(manifest, expected_sha256, expected_parts_sha256, label):
                refetched = self._download_by_parts(weights_key, manifest, label, weights)
                parts, verified_by = len(manifest.part_sha256), "parts"
            else:
                refetched = self._download_whole(weights_key, manifest, label, weights)
                parts = max(1, -(-manifest.size_bytes // self.config.part_size))
                verified_by = "whole"
            yield _Download(label, manifest, weights, parts, verified_by, refetched, started)

    def _download_by_parts(
        self, key: str, manifest: Manifest, label: str, weights: memoryview
    ) -> int:
        """Every part into its place in `weights`; returns the parts fetched twice. Each
        part is hashed against its own digest on the thread that fetched it, and fetched
        once more if it does not match."""
        where = f"s3://{self.config.bucket}/{key}"
        count = len(manifest.part_sha256)

        def get_verified(index: int) -> int:
            start, end = manifest.part_range(index)
            expected = manifest.part_sha256[index]
            for refetches in (0, 1):
                got = self._get_into(key, label, start, weights[start:end])
                digest = sha256_hex(weights[start : start + got])  # releases the GIL
                if digest == expected and got == end - start:
                    return refetches
            raise FailedPrecondition(
                f"{label}: {where} is corrupt: bytes {start}-{end - 1} (part {index + 1} of "
                f"{count}) hashed to sha256 {digest} ({got} bytes) in two downloads, "
                f"the manifest says {expected} ({end - start} bytes); re-upload the adapter"
            )

        return sum(self._run_parts(get_verified, range(count)))

    def _download_whole(self, key: str, manifest: Manifest, label: str, weights: memoryview) -> int:
        """The weights into `weights`, verified by the whole file's digest; returns the parts
        fetched twice: a mismatch downloads everything once more."""
        try:
            self._download_hashed(key, manifest, label, weights)
            return 0
        except _DigestMismatch:
            pass
        try:
            self._download_hashed(key, manifest, label, weights)
            return -(-manifest.size_bytes // self.config.part_size)
        except _DigestMismatch as mismatch:
            raise FailedPrecondition(
                f"{label}: s3://{self.config.bucket}/{key} is corrupt: two "
                f"downloads hashed to sha256 {mismatch.got} ({mismatch.size} bytes), "
                f"the manifest says {manifest.sha256} ({manifest.size_bytes} bytes); "
                "re-upload the adapter"
            ) from None

    def _download_hashed(
        self, key: str, manifest: Manifest, label: str, weights: memoryview
    ) -> None:
        """All parts into `weights`, hashed in order while later ones download; raises
        _DigestMismatch unless they hash right."""
        size, part = manifest.size_bytes, self.config.part_size
        starts = range(0, size, part)

        def get_part(start: int) -> memoryview:
            end = min(start + part, size)
            return weights[start : start + self._get_into(key, label, start, weights[start:end])]

        hashed = HashedPieces()
        for received in self._run_parts(get_part, starts):  # in order, as they complete
            hashed.append(received)
        if hashed.size != size or hashed.hexdigest() != manifest.sha256:
            raise _DigestMismatch(hashed.hexdigest(), hashed.size)

    def _run_parts(self, work: Callable[[int], T], items: Iterable[int]) -> Iterator[T]:
        """`work` of every item on the GET threads, the results in order as they complete.
        However the caller leaves (done, an error, a part refused), no task of these is still
        running afterwards: the ones not started are cancelled and the running ones waited
        for, so none writes into a download buffer after it has gone back to the pool (the
        next fetch may already hold it, and checks its bytes only once)."""
        futures = [self._parts.submit(work, item) for item in items]
        try:
            for future in futures:
                yield future.result()
        finally:
            for future in futures:
                future.cancel()
            wait(futures)

    def _get_into(self, key: str, label: str, start: int, dest: memoryview) -> int:
        """GET bytes start..start+len(dest)-1 of `key` into `dest`; the bytes received (fewer
        where the object is shorter; a server that ignores the range fills dest from the
        object's start, which hashes wrong)."""
        byte_range = f"bytes={start}-{start + len(dest) - 1}"
        body = self._request(key, label, byte_range)
        if body is None:
            return 0
        received = 0
        with self._errors(key, label):
            try:
                while received < len(dest):
                    count = body.readinto(dest[received:])
                    if not count:
                        break
                    received += count
            finally:
                body.close()
        return received

    def _get(self, key: str, label: str) -> bytes:
        body = self._request(key, label)
        with self._errors(key, label):
            return body.read()

    def _request(self, key: str, label: str, byte_range: str | None = None) -> Any:
        """The streaming body of a GET (None: the range lies past the object's end, which is
        shorter than its manifest says: a digest mismatch)."""
        from botocore.exceptions import ClientError

        args: dict[str, Any] = {"Bucket": self.config.bucket, "Key": key}
        if byte_range is not None:
            args["Range"] = byte_range
        with self._errors(key, label):
            try:
                return self._s3.get_object(**args)["Body"]
            except ClientError as exc:
                if byte_range is not None and _error_code(exc) == "InvalidRange":
                    return None
                raise

    @contextmanager
    def _errors(self, key: str, label: str) -> Iterator[None]:
        """botocore's errors of a GET of `key` as the service's: NotFound, Unavailable."""
        from botocore.exceptions import BotoCoreError, ClientError

        where = f"s3://{self.config.bucket}/{key}"
        try:
            yield
        except ClientError as exc:
            code = _error_code(exc)
            if code in ("NoSuchKey", "404", "NoSuchBucket"):
                raise NotFound(f"{label}: {where} does not exist") from None
            message = exc.response.get("Error", {}).get("Message", "")
            raise Unavailable(
                f"S3 at {self._endpoint} refused GET {where}: {code} {message}"
            ) from None
        except BotoCoreError as exc:
            raise Unavailable(
                f"S3 at {self._endpoint} is unavailable for GET {where}: "
                f"{type(exc).__name__}: {exc}"
            ) from None

    @property
    def _endpoint(self) -> str:
        return self.config.endpoint_url or "AWS"


def _error_code(exc: Any) -> str:
    """The S3 error code of a botocore ClientError."""
    return str(exc.response.get("Error", {}).get("Code", ""))


def _parts_bound(
    manifest: Manifest, expected_sha256: str | None, expected_parts_sha256: str, label: str
) -> bool:
    """Whether the manifest's part digests may verify the weights: the record binds them, or
    the caller has no record (then the manifest is all there is, either way)."""
    if not manifest.part_sha256:
        return False
    if expected_parts_sha256:
        if manifest.parts_sha256 != expected_parts_sha256:
            raise FailedPrecondition(
                f"{label}: manifest.json in S3 lists part digests that hash to "
                f"{manifest.parts_sha256}, the store's record says {expected_parts_sha256}"
            )
        return True
    return expected_sha256 is None
