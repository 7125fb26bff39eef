"""Faults while serving, every part a real process on loopback: Redis SIGKILLed (resident
adapters are still served, the residency record comes back with Redis), the S3 server
SIGKILLed (a non-resident adapter gets UNAVAILABLE naming S3, resident ones are served, and
the adapter loads once S3 is back), the replica SIGKILLed (its residency record expires; the
restarted process serves the same tokens). No request is answered with wrong output: every
success is compared with the tokens of the healthy system."""

from __future__ import annotations

import time

import grpc
import pytest
import redis

from inference_svc.adapters.residency_publisher import residency_key
from tests.fixtures.servers import RedisServer, SeaweedS3Server
from tests.reliability.inference_stack import (
    channel_to,
    failure_of,
    generate_as,
    inference_process,
    inference_stub,
    start_store,
    upload_embedded,
)

RESIDENCY_TTL_S = 15.0  # the replica's default (AppConfig.residency_ttl_s)
RECOVERY_S = 60.0


def _wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


def _record(redis_url: str, replica_id: str) -> dict[bytes, bytes]:
    with redis.Redis.from_url(redis_url, socket_timeout=2) as client:
        return client.hgetall(residency_key(replica_id))


@pytest.fixture
def own_backends(tmp_path):
    """Redis and S3 of this test alone (it kills them)."""
    backends = RedisServer(tmp_path / "redis").start(), SeaweedS3Server(tmp_path / "s3").start()
    yield backends
    for server in backends:
        server.stop(kill=True)


def test_faults_while_serving(tmp_path, own_backends, tally) -> None:
    redis_server, s3 = own_backends
    store = start_store(tmp_path, redis_server.url, s3.endpoint_url, "faults")
    upload_embedded(store, {"shouty": "shouty", "cold": "docs-prose"})
    storage = ["--redis-url", redis_server.url, "--s3-endpoint-url", s3.endpoint_url]
    replica_args = [*storage, "--s3-bucket", "faults", "--replica-id", "r1"]
    inference = inference_process(tmp_path, store, *replica_args).start()
    try:
        with channel_to(inference) as channel:
            stub = inference_stub(channel)
            expected = generate_as(stub, "shouty").token_ids
            _wait_until(lambda: b"default/shouty@1" in _record(redis_server.url, "r1"), 15,
                        "residency published")  # fmt: skip
            _redis_down(stub, expected, redis_server, tally)
            _s3_down(stub, expected, s3, tally)
        _replica_killed(inference, expected, redis_server.url, tally)
    finally:
        inference.stop(kill=True)
        store.stop(kill=True)
    assert "Traceback" not in inference.log_text()


def _redis_down(stub, expected, redis_server, tally) -> None:
    redis_server.stop(kill=True)
    tally.add("inference faults injected: Redis SIGKILL while serving")
    # Past the resolver's TTL for `name`, so the store is asked (and cannot answer from Redis).
    time.sleep(6.0)
    for ref in ("shouty", "shouty@1", "shouty"):
        assert generate_as(stub, ref).token_ids == expected
        tally.add("inference requests served with Redis down (resident adapter)")
    redis_server.start()  # empty: the replica republishes its residency by itself
    _wait_until(lambda: b"default/shouty@1" in _record(redis_server.url, "r1"), RECOVERY_S,
                "residency republished after Redis restart")  # fmt: skip
    assert generate_as(stub, "shouty").token_ids == expected
    tally.add("inference faults survived: Redis SIGKILL while serving")


def _s3_down(stub, expected, s3, tally) -> None:
    s3.stop(kill=True)
    tally.add("inference faults injected: S3 SIGKILL while serving")
    code, details = failure_of(lambda: generate_as(stub, "cold", timeout=60))
    assert code == grpc.StatusCode.UNAVAILABLE and "S3" in details, (code, details)
    tally.add("inference requests refused cleanly with S3 down (UNAVAILABLE naming S3)")
    assert generate_as(stub, "shouty").token_ids == expected  # resident: no S3 needed
    tally.add("inference requests served with S3 down (resident adapter)")
    s3.start()

    def cold_loads() -> bool:
        try:
            return len(generate_as(stub, "cold").token_ids) == 6
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
            return False

    _wait_until(cold_loads, RECOVERY_S, "non-resident adapter loads after S3 restart")
    tally.add("inference faults survived: S3 SIGKILL while serving")


def _replica_killed(inference, expected, redis_url, tally) -> None:
    inference.stop(kill=True)
    tally.add("inference faults injected: replica SIGKILL")
    killed = time.monotonic()
    _wait_until(lambda: not _record(redis_url, "r1"), RESIDENCY_TTL_S + 5,
                "the killed replica's residency record expires")  # fmt: skip
    tally.add(f"inference: residency record expired ≤ {RESIDENCY_TTL_S + 5:.0f} s after kill")
    assert time.monotonic() - killed <= RESIDENCY_TTL_S + 5
    inference.start()  # same command line and port
    with channel_to(inference) as channel:
        assert generate_as(inference_stub(channel), "shouty").token_ids == expected
    _wait_until(lambda: b"default/shouty@1" in _record(redis_url, "r1"), 15,
                "the restarted replica publishes its residency")  # fmt: skip
    tally.add("inference faults survived: replica SIGKILL + restart")
