"""Both services start with the fixed command lines, answer health and reflection, and stop
cleanly on SIGTERM."""

from __future__ import annotations

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.fixtures.servers import RedisServer, SeaweedS3Server
from tests.fixtures.services import ServiceProcess


def _reflected_services(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
    return {service.name for service in reply.list_services_response.service}


@pytest.fixture
def store_process(tmp_path, redis_server: RedisServer, s3_server: SeaweedS3Server, s3_bucket):
    process = ServiceProcess(
        "adapter_store",
        [
            "--redis-url",
            redis_server.url,
            "--s3-endpoint-url",
            s3_server.endpoint_url,
            "--s3-bucket",
            s3_bucket,
        ],
        tmp_path,
    ).start()
    yield process
    process.stop(kill=True)


@pytest.fixture
def inference_process(tmp_path, store_process: ServiceProcess):
    process = ServiceProcess(
        "inference_svc",
        [
            "--store",
            store_process.address,
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ],
        tmp_path,
    ).start()
    yield process
    process.stop(kill=True)


def test_store_serves_health_and_reflection(store_process: ServiceProcess) -> None:
    services = _reflected_services(store_process.address)
    assert "loraserve.v1.AdapterStore" in services
    assert "grpc.health.v1.Health" in services


def test_inference_serves_health_and_reflection(inference_process: ServiceProcess) -> None:
    services = _reflected_services(inference_process.address)
    assert "loraserve.v1.Inference" in services
    assert "grpc.health.v1.Health" in services


def test_sigterm_stops_both_cleanly(store_process, inference_process) -> None:
    assert inference_process.stop() == 0
    assert store_process.stop() == 0
    assert "stopped" in store_process.log_text()
    assert "stopped" in inference_process.log_text()
