"""Reliability fixtures: real store processes on loopback, a ledger of what the store
acknowledged (checked against what it lists and serves), and a tally of faults and fuzz
cases that the session prints (and writes to $LORASERVE_RELIABILITY_REPORT when set)."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from protos import adapter_store_pb2 as pb
from protos import adapter_store_pb2_grpc
from tests.fixtures.services import ServiceProcess
from tests.store.conftest import (  # noqa: F401 - fixtures shared with the store tests
    BASE_MODEL,
    fetch_all,
    peft_dirs,
    registered,
    s3_bucket,
    store,
    stub,
    tiny_config_json,
    upload_requests,
)

_TALLY = pytest.StashKey["Tally"]()
REPORT_ENV = "LORASERVE_RELIABILITY_REPORT"


@dataclass
class Tally:
    """Named counters: faults injected/survived, fuzz cases by outcome, …"""

    counts: Counter = field(default_factory=Counter)

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] += n


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_TALLY] = Tally()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    tally = config.stash.get(_TALLY, None)
    if tally is None or not tally.counts:
        return
    terminalreporter.section("reliability tally")
    for key in sorted(tally.counts):
        terminalreporter.write_line(f"{key:60s} {tally.counts[key]}")
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).write_text(json.dumps(dict(sorted(tally.counts.items())), indent=1))


@pytest.fixture
def tally(request: pytest.FixtureRequest) -> Tally:
    return request.config.stash[_TALLY]


def store_args(redis_url: str, s3_url: str, bucket: str, *extra: str) -> list[str]:
    return [
        "--redis-url",
        redis_url,
        "--s3-endpoint-url",
        s3_url,
        "--s3-bucket",
        bucket,
        "--index-check-s",
        "0.5",
        *extra,
    ]


@pytest.fixture
def store_process(tmp_path: Path) -> Iterator[list[ServiceProcess]]:
    """Store processes a test starts (append them); all killed at the end."""
    started: list[ServiceProcess] = []
    yield started
    for process in started:
        process.stop(kill=True)


def stub_of(channel: grpc.Channel) -> adapter_store_pb2_grpc.AdapterStoreStub:
    return adapter_store_pb2_grpc.AdapterStoreStub(channel)


def register(client, config_json: str, metadata=()) -> None:
    client.RegisterBaseModel(
        pb.RegisterBaseModelRequest(name=BASE_MODEL, config_json=config_json),
        timeout=30,
        metadata=metadata,
    )


def list_all(client, metadata=()) -> dict[tuple[str, int], pb.Adapter]:
    """Every listed version, following the pages: (name, version) -> adapter."""
    found: dict[tuple[str, int], pb.Adapter] = {}
    token = ""
    while True:
        reply = client.ListAdapters(
            pb.ListAdaptersRequest(all_versions=True, page_token=token, page_size=100),
            timeout=20,
            metadata=metadata,
        )
        for adapter in reply.adapters:
            found[(adapter.name, adapter.version)] = adapter
        token = reply.next_page_token
        if not token:
            return found


@dataclass
class Failure:
    what: str
    code: grpc.StatusCode
    details: str


@dataclass
class Ledger:
    """What the store acknowledged, and every failure it answered with."""

    acknowledged: dict[tuple[str, int], str] = field(default_factory=dict)  # -> sha256
    failures: list[Failure] = field(default_factory=list)

    def ack(self, adapter: pb.Adapter) -> None:
        key = (adapter.name, adapter.version)
        assert key not in self.acknowledged, f"version {key} acknowledged twice"
        self.acknowledged[key] = adapter.sha256

    def fail(self, what: str, error: grpc.RpcError) -> None:
        self.failures.append(Failure(what, error.code(), error.details() or ""))

    def assert_failures_clear(self, dependencies: tuple[str, ...]) -> None:
        """Every failure is UNAVAILABLE naming one of `dependencies` (or the store itself
        being unreachable, which gRPC reports as UNAVAILABLE with a connection message)."""
        for failure in self.failures:
            assert failure.code == grpc.StatusCode.UNAVAILABLE, failure
            assert any(name in failure.details for name in dependencies), failure

    def verify(self, client, *, exact: bool) -> int:
        """Everything acknowledged is listed, gettable and fetches with its sha256; every
        listed version is whole. `exact`: nothing unacknowledged is listed. Returns the
        number of listed versions the store committed but whose reply was lost."""
        listed = list_all(client)
        for key, sha in self.acknowledged.items():
            assert key in listed, f"acknowledged {key} is not listed"
            assert listed[key].sha256 == sha, f"{key}: sha256 changed"
        extras = set(listed) - set(self.acknowledged)
        assert not (exact and extras), f"listed but never acknowledged: {sorted(extras)}"
        for (name, version), adapter in listed.items():
            ref = f"{name}@{version}"
            assert client.GetAdapter(pb.GetAdapterRequest(ref=ref), timeout=20) == adapter
            _, manifest_json, weights = fetch_all(client, ref)
            assert hashlib.sha256(weights).hexdigest() == adapter.sha256, ref
            assert len(weights) == adapter.size_bytes, ref
            assert json.loads(manifest_json)["sha256"] == adapter.sha256, ref
        return len(extras)
