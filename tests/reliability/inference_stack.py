"""A store and an inference replica as real processes (their fixed command lines), the
embedded demo adapters uploaded, and small gRPC helpers for the inference-side tests."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from adapter_store.client import StoreClient
from adapter_store.rpc.tls import sync_channel
from inference_svc.model.tiny import EMBEDDED_ADAPTERS_DIR, EMBEDDED_BASE_DIR
from protos import inference_pb2_grpc
from tests.fixtures.services import ServiceProcess
from tests.inference.client import Generation, collect, request
from tests.reliability.conftest import store_args

TINY = "tiny"
EMBEDDED = ("docs-prose", "shouty", "unittest-style")


def bearer(key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) if key else ()


def start_store(
    folder: Path, redis_url: str, s3_url: str, bucket: str, *extra: str, tls_ca: Path | None = None
) -> ServiceProcess:
    args = store_args(redis_url, s3_url, bucket, *extra)
    return ServiceProcess("adapter_store", args, folder / "store", tls_ca=tls_ca).start()


def inference_process(
    folder: Path, store: ServiceProcess, *extra: str, tls_ca: Path | None = None
) -> ServiceProcess:
    """The replica's process (not started): tiny model on CPU, weights through `extra`'s
    S3 flags or else the store's FetchAdapter."""
    args = ["--store", store.address, "--model", TINY, "--device", "cpu", *extra]
    return ServiceProcess("inference_svc", args, folder / "inference", tls_ca=tls_ca)


async def _upload(
    address: str, names: dict[str, str], api_key: str | None, tls_ca: Path | None
) -> None:
    async with StoreClient(address, api_key=api_key, tls_ca=tls_ca) as client:
        await client.register_base_model(TINY, (EMBEDDED_BASE_DIR / "config.json").read_text())
        for name, embedded in names.items():
            await client.upload_dir(EMBEDDED_ADAPTERS_DIR / embedded, name=name, base_model=TINY)


def upload_embedded(
    store: ServiceProcess,
    names: dict[str, str],
    api_key: str | None = None,
    tls_ca: Path | None = None,
) -> None:
    """Upload embedded adapters under new names: {store name: embedded adapter}."""
    asyncio.run(_upload(store.address, names, api_key, tls_ca))


def inference_stub(
    channel: grpc.Channel,
) -> inference_pb2_grpc.InferenceStub:
    return inference_pb2_grpc.InferenceStub(channel)


def channel_to(process: ServiceProcess) -> grpc.Channel:
    return sync_channel(process.address, process.tls_ca)


def generate_as(
    stub: inference_pb2_grpc.InferenceStub,
    adapter: str,
    api_key: str | None = None,
    max_new_tokens: int = 6,
    timeout: float = 60.0,
) -> Generation:
    req = request(adapter, max_new_tokens=max_new_tokens, prompt_logprobs=False)
    return collect(stub.Generate(req, timeout=timeout, metadata=bearer(api_key)))


def failure_of(call) -> tuple[grpc.StatusCode, str]:
    """(status, details) of a call that must fail."""
    try:
        call()
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    raise AssertionError("the call succeeded")
