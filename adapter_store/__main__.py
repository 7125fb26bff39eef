"""`python -m adapter_store serve|reindex|gc …` (serve and reindex command lines fixed by
DESIGN.md). The environment is read here and nowhere below."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from prometheus_client import start_http_server

from adapter_store.auth import Authenticator, Principal, parse_api_keys
from adapter_store.errors import LoraserveError
from adapter_store.maintenance import (
    DEFAULT_GC_GRACE_S,
    collect_garbage,
    keep_index_ready,
    reindex,
)
from adapter_store.metrics import MetricsInterceptor, StoreMetrics
from adapter_store.rpc.server import configure_logging, serve_forever
from adapter_store.rpc.settings import add_flag
from adapter_store.rpc.tls import add_tls_server_flags, server_credentials
from adapter_store.service import AdapterStoreService, StoreConfig
from adapter_store.servicer import SERVICE_NAME, AdapterStoreServicer
from adapter_store.storage.metadata import MetadataConfig, MetadataStore
from adapter_store.storage.objects import ObjectStore, ObjectStoreConfig
from adapter_store.tenant_limits import TenantLimits
from adapter_store.upload import UploadLimits
from protos import adapter_store_pb2_grpc

log = logging.getLogger("loraserve.adapter_store")
MiB = 1024 * 1024


def _add_storage_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--redis-url", required=True, help="Redis URL, e.g. redis://127.0.0.1:6379/0")
    add_flag(parser, "--s3-endpoint-url", default=None, help="S3 endpoint (empty: AWS default)")
    add_flag(parser, "--s3-bucket", required=True, help="S3 bucket holding adapter weights")
    add_flag(parser, "--log-level", default="INFO", help="logging level")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m adapter_store")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the AdapterStore gRPC server")
    add_flag(serve, "--port", type=int, default=50051, help="gRPC port")
    _add_storage_flags(serve)
    add_flag(serve, "--metrics-port", type=int, default=0, help="Prometheus port (0: off)")
    add_flag(serve, "--api-keys-file", default=None, help="JSON file of hashed API keys")
    add_flag(serve, "--api-keys", default=None, help="the same JSON, inline")
    add_flag(serve, "--max-upload-mb", type=int, default=4096, help="largest upload accepted")
    add_flag(serve, "--max-upload-files", type=int, default=16, help="most files per upload")
    add_flag(serve, "--max-rank", type=int, default=256, help="largest adapter rank accepted")
    add_flag(
        serve,
        "--max-canonical-mb",
        type=int,
        default=8192,
        help="largest canonical adapter assembled (float32, zero padding included)",
    )
    add_flag(
        serve,
        "--tenant-max-adapters",
        type=int,
        default=0,
        help="adapter versions a tenant may store, unless its key says otherwise (0: no limit)",
    )
    add_flag(
        serve,
        "--tenant-max-concurrent",
        type=int,
        default=0,
        help="a tenant's RPCs in flight on this server, unless its key says so (0: no limit)",
    )
    add_tls_server_flags(serve)
    add_flag(
        serve,
        "--index-check-s",
        type=float,
        default=10.0,
        help="how often to check that Redis still holds the index (rebuilt from S3 if not)",
    )
    reindex_cmd = sub.add_parser("reindex", help="rebuild every Redis record from the S3 manifests")
    _add_storage_flags(reindex_cmd)
    gc = sub.add_parser("gc", help="remove uncommitted uploads and finish interrupted deletes")
    _add_storage_flags(gc)
    add_flag(
        gc,
        "--grace-s",
        type=float,
        default=DEFAULT_GC_GRACE_S,
        help="leave uncommitted uploads younger than this alone (they may still be in flight)",
    )
    return parser


def _backends(args: argparse.Namespace) -> tuple[ObjectStore, MetadataStore]:
    objects = ObjectStore(
        ObjectStoreConfig(bucket=args.s3_bucket, endpoint_url=args.s3_endpoint_url)
    )
    return objects, MetadataStore(MetadataConfig(url=args.redis_url))


def _authenticator(args: argparse.Namespace) -> Authenticator:
    limits = TenantLimits(args.tenant_max_adapters, args.tenant_max_concurrent)
    principals: dict[str, Principal] = {}
    if args.api_keys_file:
        path = Path(args.api_keys_file)
        principals |= parse_api_keys(path.read_text(), str(path), limits)
    if args.api_keys:
        principals |= parse_api_keys(args.api_keys, "LORASERVE_API_KEYS / --api-keys", limits)
    return Authenticator(principals, anonymous_limits=limits)


async def _serve(args: argparse.Namespace) -> None:
    credentials = server_credentials(args.tls_cert, args.tls_key)
    objects, metadata = _backends(args)
    auth = _authenticator(args)
    log.info("TLS is %s", "on" if credentials is not None else "off (plain TCP)")
    if auth.enabled:
        log.info("auth is on: every RPC needs 'authorization: Bearer <api key>'")
    else:
        log.warning("auth is off (no API keys configured): every caller is tenant 'default'")
    metrics = StoreMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=metrics.registry)
        log.info("metrics on port %d", args.metrics_port)
    config = StoreConfig(
        max_rank=args.max_rank,
        max_canonical_bytes=args.max_canonical_mb * MiB,
        limits=UploadLimits(
            max_total_bytes=args.max_upload_mb * MiB, max_files=args.max_upload_files
        ),
    )
    servicer = AdapterStoreServicer(AdapterStoreService(objects, metadata, config), auth, metrics)
    watcher = asyncio.create_task(keep_index_ready(objects, metadata, args.index_check_s))

    async def shutdown() -> None:
        watcher.cancel()
        await metadata.close()

    await serve_forever(
        port=args.port,
        service_names=[SERVICE_NAME],
        register=lambda server: adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server(
            servicer, server
        ),
        interceptors=[MetricsInterceptor(metrics)],
        on_shutdown=shutdown,
        credentials=credentials,
    )


async def _maintain(args: argparse.Namespace) -> dict:
    objects, metadata = _backends(args)
    try:
        if args.command == "reindex":
            return asdict(await reindex(objects, metadata))
        return asdict(await collect_garbage(objects, metadata, args.grace_s))
    finally:
        await metadata.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        if args.command == "serve":
            asyncio.run(_serve(args))
            return 0
        print(json.dumps(asyncio.run(_maintain(args)), indent=1))
    except LoraserveError as error:
        log.error("%s failed: %s", args.command, error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
