"""S3-compatible object storage (AWS, MinIO, SeaweedFS) through boto3.

boto3 is blocking, so every call runs in a worker thread (`asyncio.to_thread`) and the event
loop never waits on S3. Objects above `multipart_threshold_bytes` go up as multipart uploads.
Every S3 failure surfaces as `Unavailable` naming S3, never a botocore traceback.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import boto3
import botocore.config
import botocore.exceptions
from boto3.exceptions import S3TransferFailedError, S3UploadFailedError
from boto3.s3.transfer import TransferConfig

from adapter_store.errors import NotFound, Unavailable

T = TypeVar("T")
MiB = 1024 * 1024
_NOT_FOUND_CODES = {"404", "NoSuchKey", "NotFound", "NoSuchBucket"}


@dataclass(frozen=True)
class ObjectStoreConfig:
    bucket: str
    endpoint_url: str | None = None  # None: AWS's default endpoint for the region
    multipart_threshold_bytes: int = 64 * MiB
    multipart_part_bytes: int = 16 * MiB
    # Fail fast: a dead S3 must become UNAVAILABLE in seconds, not after minutes of retries.
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 30.0
    max_attempts: int = 3

    def __post_init__(self) -> None:
        if not 3 <= len(self.bucket) <= 63:
            raise ValueError(f"S3 bucket name {self.bucket!r} must have 3-63 characters")
        if self.multipart_part_bytes < 5 * MiB:
            raise ValueError("S3 multipart parts must be at least 5 MiB")
        if self.multipart_threshold_bytes < self.multipart_part_bytes:
            raise ValueError("multipart threshold must be at least one part")
        if self.max_attempts < 1 or self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("S3 retries and timeouts must be positive")


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    last_modified: datetime


def _is_not_found(error: botocore.exceptions.ClientError) -> bool:
    return str(error.response.get("Error", {}).get("Code")) in _NOT_FOUND_CODES


class ObjectStore:
    """Bytes by key in one bucket; the bucket is created on first write if missing."""

    def __init__(self, config: ObjectStoreConfig) -> None:
        self.config = config
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=config.endpoint_url,
            config=botocore.config.Config(
                connect_timeout=config.connect_timeout_s,
                read_timeout=config.read_timeout_s,
                retries={"max_attempts": config.max_attempts, "mode": "standard"},
                max_pool_connections=32,
                s3={"addressing_style": "path"},
            ),
        )
        self._transfer = TransferConfig(
            multipart_threshold=config.multipart_threshold_bytes,
            multipart_chunksize=config.multipart_part_bytes,
            max_concurrency=4,
        )
        self._bucket_ready = False

    @property
    def where(self) -> str:
        return f"S3 bucket {self.config.bucket!r} at {self.config.endpoint_url or 'AWS'}"

    async def _call(self, what: str, func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return await asyncio.to_thread(func, *args, **kwargs)
        except botocore.exceptions.ClientError as error:
            if _is_not_found(error):
                raise NotFound(f"{what}: not found in {self.where}") from None
            code = error.response.get("Error", {}).get("Code", "?")
            raise Unavailable(f"S3 error during {what} ({self.where}): {code}") from None
        except (
            botocore.exceptions.BotoCoreError,
            S3UploadFailedError,
            S3TransferFailedError,
        ) as error:
            raise Unavailable(f"S3 is unavailable ({self.where}) during {what}: {error}") from None

    async def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist yet (idempotent, safe across replicas)."""
        if self._bucket_ready:
            return
        try:
            await self._call("head bucket", self._client.head_bucket, Bucket=self.config.bucket)
        except NotFound:
            try:
                await self._call(
                    "create bucket", self._client.create_bucket, Bucket=self.config.bucket
                )
            except Unavailable as error:
                if "BucketAlreadyOwnedByYou" not in str(error):
                    raise
        self._bucket_ready = True

    async def put(self, key: str, data: bytes) -> None:
        """Write one object; multipart above the threshold."""
        await self.ensure_bucket()
        await self._call(
            f"put {key}",
            self._client.upload_fileobj,
            io.BytesIO(data),
            self.config.bucket,
            key,
            Config=self._transfer,
        )

    async def get(self, key: str) -> bytes:
        """Read one whole object; NotFound when it does not exist."""

        def read() -> bytes:
            return self._client.get_object(Bucket=self.config.bucket, Key=key)["Body"].read()

        return await self._call(f"get {key}", read)

    async def get_or_none(self, key: str) -> bytes | None:
        try:
            return await self.get(key)
        except NotFound:
            return None

    async def iter_chunks(self, key: str, chunk_bytes: int) -> AsyncIterator[bytes]:
        """Stream one object in `chunk_bytes` pieces without holding it whole in memory."""
        response = await self._call(
            f"get {key}", self._client.get_object, Bucket=self.config.bucket, Key=key
        )
        body = response["Body"]
        try:
            while chunk := await self._call(f"read {key}", body.read, chunk_bytes):
                yield chunk
        finally:
            body.close()

    async def list_objects(self, prefix: str) -> list[ObjectInfo]:
        """Every object under `prefix` (all pages)."""

        def list_all() -> list[ObjectInfo]:
            found: list[ObjectInfo] = []
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.config.bucket, Prefix=prefix
            )
            for page in pages:
                found += [
                    ObjectInfo(item["Key"], item["Size"], item["LastModified"])
                    for item in page.get("Contents", ())
                ]
            return found

        try:
            return await self._call(f"list {prefix}", list_all)
        except NotFound:  # no bucket yet: nothing stored
            return []

    async def delete(self, keys: list[str]) -> None:
        """Delete objects (missing ones are fine); at most 1000 per request, as S3 allows."""
        for start in range(0, len(keys), 1000):
            batch = [{"Key": key} for key in keys[start : start + 1000]]
            await self._call(
                f"delete {len(batch)} objects",
                self._client.delete_objects,
                Bucket=self.config.bucket,
                Delete={"Objects": batch, "Quiet": True},
            )
