"""`python -m inference_svc serve …` (command line fixed by DESIGN.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from adapter_store.rpc.server import configure_logging, serve_forever
from adapter_store.rpc.settings import add_flag
from inference_svc.servicer import SERVICE_NAME, InferenceServicer
from protos import inference_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inference_svc")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the Inference gRPC server")
    add_flag(serve, "--port", type=int, default=50052, help="gRPC port")
    add_flag(serve, "--store", default="127.0.0.1:50051", help="adapter store HOST:PORT")
    add_flag(serve, "--model", default="tiny", help="HF model folder, or 'tiny'")
    add_flag(serve, "--device", default="cpu", choices=["cpu", "cuda"], help="device")
    add_flag(
        serve, "--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype"
    )
    add_flag(serve, "--log-level", default="INFO", help="logging level")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    servicer = InferenceServicer()
    asyncio.run(
        serve_forever(
            port=args.port,
            service_names=[SERVICE_NAME],
            register=lambda server: inference_pb2_grpc.add_InferenceServicer_to_server(
                servicer, server
            ),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
