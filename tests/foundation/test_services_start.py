"""Both services start with the fixed command lines, answer health and reflection, and stop
cleanly on SIGTERM."""

from __future__ import annotations

import socket

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


def _store(workdir, redis_server: RedisServer, s3_server: SeaweedS3Server, bucket: str, port=0):
    storage = ["--redis-url", redis_server.url, "--s3-endpoint-url", s3_server.endpoint_url]
    return ServiceProcess("adapter_store", [*storage, "--s3-bucket", bucket], workdir, port)


@pytest.fixture
def store_process(tmp_path, redis_server: RedisServer, s3_server: SeaweedS3Server, s3_bucket):
    process = _store(tmp_path, redis_server, s3_server, s3_bucket).start()
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


def test_a_drawn_port_taken_before_the_bind_is_drawn_again(
    tmp_path, redis_server: RedisServer, s3_server: SeaweedS3Server, s3_bucket
) -> None:
    process = _store(tmp_path, redis_server, s3_server, s3_bucket)
    taken = process.port
    with socket.socket() as squatter:  # another process takes the port after the draw
        squatter.bind(("0.0.0.0", taken))
        squatter.listen()
        process.start()
        try:
            assert process.port != taken
            assert "loraserve.v1.AdapterStore" in _reflected_services(process.address)
            assert "Address already in use" in process.log_text()
        finally:
            process.stop(kill=True)


def test_a_given_port_is_not_drawn_again(
    tmp_path, redis_server: RedisServer, s3_server: SeaweedS3Server, s3_bucket
) -> None:
    with socket.socket() as squatter:
        squatter.bind(("0.0.0.0", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        process = _store(tmp_path, redis_server, s3_server, s3_bucket, port=taken)
        with pytest.raises(TimeoutError, match="Address already in use"):
            process.start(timeout_s=30)
