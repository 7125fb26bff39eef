"""`python -m inference_svc serve …` (command line fixed by DESIGN.md). The environment is
read here (flags and their `LORASERVE_*` variables) and nowhere below."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys

from prometheus_client import start_http_server

from adapter_store.rpc.server import configure_logging, serve_forever
from adapter_store.rpc.settings import add_flag
from adapter_store.rpc.tls import add_tls_server_flags, server_credentials
from inference_svc.adapters.s3_fetch import S3FetchConfig
from inference_svc.app import AppConfig, InferenceApp
from inference_svc.model.loader import EXPERT_ACTIVATIONS
from inference_svc.model.tiny import TINY_MODEL_NAME, model_folder
from inference_svc.runtime import DEFAULT_STEP_GRAPH_MAX_TOKENS, RuntimeConfig
from inference_svc.servicer import SERVICE_NAME
from protos import inference_pb2_grpc

log = logging.getLogger("loraserve.inference")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inference_svc")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the Inference gRPC server")
    add_flag(serve, "--port", type=int, default=50052, help="gRPC port")
    add_flag(serve, "--store", default="127.0.0.1:50051", help="adapter store HOST:PORT")
    add_flag(
        serve,
        "--store-tls-ca",
        default=None,
        help="PEM CA (or self-signed cert) of a TLS store (empty: plain TCP to the store)",
    )
    add_tls_server_flags(serve)
    add_flag(serve, "--model", default=TINY_MODEL_NAME, help="HF model folder, or 'tiny'")
    add_flag(serve, "--device", default="cpu", choices=["cpu", "cuda"], help="device")
    add_flag(
        serve, "--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype"
    )
    add_flag(
        serve,
        "--base-model",
        default=None,
        help="the store's name of this base model (default: 'tiny' for --model tiny, else the "
        "model folder's name); adapters of other base models are refused",
    )
    add_flag(serve, "--redis-url", default=None, help="Redis for store events and residency")
    add_flag(serve, "--s3-endpoint-url", default=None, help="S3 endpoint (empty: AWS default)")
    add_flag(
        serve,
        "--s3-bucket",
        default=None,
        help="bucket of adapter weights (empty: fetch through the store's FetchAdapter)",
    )
    add_flag(serve, "--max-loras", type=int, default=8, help="GPU LoRA slots")
    add_flag(serve, "--max-lora-rank", type=int, default=16, help="largest adapter rank served")
    add_flag(serve, "--lora-memory-gb", type=float, default=None, help="GPU memory for LoRA slots")
    add_flag(
        serve,
        "--lora-memory-fraction",
        type=float,
        default=None,
        help="or the LoRA slots' memory as a fraction of the GPU's free memory at start-up",
    )
    add_flag(serve, "--host-cache-gb", type=float, default=2.0, help="host adapter cache size")
    add_flag(serve, "--kv-pages", type=int, default=0, help="KV cache pages (0: automatic)")
    add_flag(serve, "--page-size", type=int, default=16, help="tokens per KV page")
    add_flag(
        serve, "--max-model-len", type=int, default=0, help="prompt + output limit (0: model's)"
    )
    add_flag(serve, "--max-num-seqs", type=int, default=32, help="requests running at once")
    add_flag(serve, "--max-batch-tokens", type=int, default=512, help="token budget per step")
    add_flag(serve, "--max-queue", type=int, default=256, help="waiting requests before refusing")
    add_flag(
        serve,
        "--step-graph-max-tokens",
        type=int,
        default=DEFAULT_STEP_GRAPH_MAX_TOKENS,
        help="largest step with prompt tokens replayed as CUDA step graphs (0: eager)",
    )
    add_flag(
        serve,
        "--overlap-steps",
        type=bool,
        default=True,
        help="launch each step before reading the previous one back (throughput; a new "
        "request joins one step later: --no-overlap-steps for the lowest time to first token)",
    )
    add_flag(
        serve,
        "--breadth-first-admission",
        type=bool,
        default=True,
        help="while the adapters outnumber the GPU slots, admit one request per ready adapter "
        "a step while another waiting adapter's slot copy is in flight or can start (a wider "
        "wave of requests; a step's token budget may go partly unused)",
    )
    add_flag(
        serve,
        "--expert-activations",
        default="bf16",
        choices=list(EXPERT_ACTIVATIONS),
        help="routed experts' GEMM inputs on an FP8 checkpoint: bf16 (exact) or e4m3 per "
        "128-group (DeepSeek-V3's FP8 scheme, faster prefill)",
    )
    add_flag(
        serve,
        "--tenant-max-concurrent",
        type=int,
        default=0,
        help="Generate streams one tenant may run at once on this replica (0: no limit)",
    )
    add_flag(serve, "--metrics-port", type=int, default=0, help="Prometheus port (0: off)")
    add_flag(serve, "--replica-id", default=None, help="residency record id (default host-port)")
    add_flag(
        serve,
        "--advertise-address",
        default=None,
        help="HOST:PORT routers use to reach this replica (default hostname:port)",
    )
    add_flag(serve, "--log-level", default="INFO", help="logging level")
    return parser


def app_config(args: argparse.Namespace) -> AppConfig:
    host = socket.gethostname()
    base_model = args.base_model or (
        TINY_MODEL_NAME if args.model == TINY_MODEL_NAME else model_folder(args.model).name
    )
    return AppConfig(
        runtime=RuntimeConfig(
            model=args.model,
            base_model_name=base_model,
            device=args.device,
            dtype=args.dtype,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            lora_memory_gb=args.lora_memory_gb,
            lora_memory_fraction=args.lora_memory_fraction,
            host_cache_gb=args.host_cache_gb,
            kv_pages=args.kv_pages,
            page_size=args.page_size,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_batch_tokens=args.max_batch_tokens,
            max_queue=args.max_queue,
            step_graph_max_tokens=args.step_graph_max_tokens,
            overlap_steps=args.overlap_steps,
            breadth_first_admission=args.breadth_first_admission,
            expert_activations=args.expert_activations,
        ),
        store_address=args.store,
        store_tls_ca=args.store_tls_ca or None,
        tenant_max_concurrent=args.tenant_max_concurrent,
        replica_id=args.replica_id or f"{host}-{args.port}",
        advertise_address=args.advertise_address or f"{host}:{args.port}",
        redis_url=args.redis_url or None,
        s3=(
            S3FetchConfig(bucket=args.s3_bucket, endpoint_url=args.s3_endpoint_url or None)
            if args.s3_bucket
            else None
        ),
    )


async def _serve(args: argparse.Namespace) -> None:
    credentials = server_credentials(args.tls_cert or None, args.tls_key or None)
    log.info("TLS is %s", "on" if credentials is not None else "off (plain TCP)")
    app = InferenceApp(app_config(args))
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=app.metrics.registry)
        log.info("metrics on port %d", args.metrics_port)
    await app.start()
    await serve_forever(
        port=args.port,
        service_names=[SERVICE_NAME],
        register=lambda server: inference_pb2_grpc.add_InferenceServicer_to_server(
            app.servicer, server
        ),
        on_shutdown=app.stop,
        credentials=credentials,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
