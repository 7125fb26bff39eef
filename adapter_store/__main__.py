"""`python -m adapter_store serve|reindex …` (command lines fixed by DESIGN.md)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from adapter_store.rpc.server import configure_logging, serve_forever
from adapter_store.rpc.settings import add_flag
from adapter_store.servicer import SERVICE_NAME, AdapterStoreServicer
from protos import adapter_store_pb2_grpc

log = logging.getLogger("loraserve.adapter_store")


def _add_storage_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--redis-url", required=True, help="Redis URL, e.g. redis://127.0.0.1:6379/0")
    add_flag(parser, "--s3-endpoint-url", default=None, help="S3 endpoint (empty: AWS default)")
    add_flag(parser, "--s3-bucket", required=True, help="S3 bucket holding adapter weights")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m adapter_store")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the AdapterStore gRPC server")
    add_flag(serve, "--port", type=int, default=50051, help="gRPC port")
    _add_storage_flags(serve)
    add_flag(serve, "--log-level", default="INFO", help="logging level")
    reindex = sub.add_parser("reindex", help="rebuild every Redis record from the S3 manifests")
    _add_storage_flags(reindex)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(getattr(args, "log_level", "INFO"))
    if args.command == "serve":
        servicer = AdapterStoreServicer()
        asyncio.run(
            serve_forever(
                port=args.port,
                service_names=[SERVICE_NAME],
                register=lambda server: adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server(
                    servicer, server
                ),
            )
        )
        return 0
    log.error("reindex is not implemented yet")
    return 2


if __name__ == "__main__":
    sys.exit(main())
