"""The fixtures start real servers that answer, and can be restarted."""

from __future__ import annotations

import socket

import boto3
import redis

from tests.fixtures.servers import RedisServer, SeaweedS3Server
from tools import stack
from tools.stack import SEAWEED_LISTENERS


def test_redis_answers_and_restarts(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.set("k", "v")
    assert client.get("k") == b"v"
    redis_server.stop()
    redis_server.start()
    assert redis.Redis.from_url(redis_server.url).ping()


def test_s3_round_trip_with_ranged_get(s3_server: SeaweedS3Server, s3_bucket: str) -> None:
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    s3.create_bucket(Bucket=s3_bucket)
    s3.put_object(Bucket=s3_bucket, Key="a/b", Body=b"hello world")
    ranged = s3.get_object(Bucket=s3_bucket, Key="a/b", Range="bytes=6-10")["Body"].read()
    assert ranged == b"world"
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert keys == ["a/b"]


def test_tiny_models_saved_as_hf_folders(tiny_model_dirs) -> None:
    for folder in tiny_model_dirs.values():
        assert (folder / "config.json").exists()
        assert (folder / "model.safetensors").exists()


def test_s3_server_whose_drawn_port_is_taken_starts_on_fresh_ports(tmp_path, monkeypatch) -> None:
    """Another process binds one of weed's drawn gRPC ports before weed does (what failed a CI
    run): the gateway dies at start, and the server starts again on fresh ports."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        draws: list[list[int]] = []

        def first_draw_loses_s3_grpc(count: int, exclude=()) -> list[int]:
            ports = draw_ports(count, exclude)
            if not draws:
                ports[SEAWEED_LISTENERS.index("s3.grpc")] = taken
            draws.append(ports)
            return ports

        draw_ports = stack.distinct_free_ports
        monkeypatch.setattr(stack, "distinct_free_ports", first_draw_loses_s3_grpc)
        server = SeaweedS3Server(tmp_path / "s3").start()
        try:
            assert len(draws) == 2
            assert server.ports["s3.grpc"] != taken
            assert len({server.s3_port, *server.ports.values()}) == 1 + len(SEAWEED_LISTENERS)
            s3 = boto3.client("s3", endpoint_url=server.endpoint_url)
            s3.create_bucket(Bucket="fresh-ports")
            assert s3.list_buckets()["Buckets"][0]["Name"] == "fresh-ports"
        finally:
            server.stop(kill=True)


def test_xdist_workers_draw_ports_from_disjoint_slices(monkeypatch) -> None:
    """Two pytest-xdist workers starting servers at once never draw the same port."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    drawn = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        low, high = stack._draw_range()
        ports = stack.distinct_free_ports(20)
        assert all(low <= port < high for port in ports)
        drawn[worker] = range(low, high)
    assert drawn["gw0"].stop <= drawn["gw1"].start
    assert drawn["gw0"].start >= stack.PORT_FLOOR
