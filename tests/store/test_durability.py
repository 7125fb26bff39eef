"""Nothing half-done is ever visible, Redis is a rebuildable cache of S3, and the store
survives its dependencies (and itself) going away."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time

import grpc
import pytest

from adapter_store.errors import Unavailable
from adapter_store.records import MANIFEST_FILE, RECORD_FILE, WEIGHTS_FILE, adapter_prefix
from protos import adapter_store_pb2 as pb
from protos import adapter_store_pb2_grpc
from tests.fixtures.servers import RedisServer
from tests.fixtures.services import REPO_ROOT, ServiceProcess
from tests.store.conftest import BASE_MODEL, fetch_all, upload_requests
from tests.store.harness import InProcessStore


def _store_command(command: str, redis_url: str, s3_url: str, bucket: str, *extra: str):
    """Run `python -m adapter_store <command>`; returns (exit code, parsed JSON report)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "adapter_store",
            command,
            "--redis-url",
            redis_url,
            "--s3-endpoint-url",
            s3_url,
            "--s3-bucket",
            bucket,
            *extra,
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(done.stdout) if done.returncode == 0 else done.stderr
    return done.returncode, report


def _listed(stub) -> list[tuple[str, int, str]]:
    reply = stub.ListAdapters(pb.ListAdaptersRequest(all_versions=True), timeout=10)
    return [(a.name, a.version, a.sha256) for a in reply.adapters]


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code(), error.value.details()


@pytest.fixture
def manual_store(redis_url, s3_server, s3_bucket):
    """A store that does not rebuild its index by itself (so `reindex` is what we test)."""
    store = InProcessStore(redis_url, s3_server.endpoint_url, s3_bucket, index_check_s=3600)
    yield store.start()
    store.stop()


def test_flushed_redis_is_restored_by_reindex(
    manual_store, redis_server, s3_server, s3_bucket, peft_dirs, tiny_config_json
) -> None:
    with grpc.insecure_channel(manual_store.address) as channel:
        stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
        stub.RegisterBaseModel(
            pb.RegisterBaseModelRequest(name=BASE_MODEL, config_json=tiny_config_json)
        )
        for name, folder in (("a", 0), ("a", 1), ("b", 0), ("c", 1)):
            stub.UploadAdapter(
                upload_requests(peft_dirs[folder], name, labels={"n": name}), timeout=60
            )
        stub.DeleteAdapter(pb.DeleteAdapterRequest(ref="c"), timeout=10)
        before = _listed(stub)
        records = {
            (n, v): stub.GetAdapter(pb.GetAdapterRequest(ref=f"{n}@{v}")) for n, v, _ in before
        }

        redis_server.flushall()
        for call in (
            lambda: stub.UploadAdapter(upload_requests(peft_dirs[0], "a"), timeout=60),
            lambda: stub.GetAdapter(pb.GetAdapterRequest(ref="a"), timeout=10),
            lambda: _listed(stub),
        ):
            code, details = _code(call)
            assert code == grpc.StatusCode.UNAVAILABLE and "reindex" in details
        code, report = _store_command("gc", redis_server.url, s3_server.endpoint_url, s3_bucket)
        assert code != 0 and "run `python -m adapter_store reindex`" in report

        code, report = _store_command(
            "reindex", redis_server.url, s3_server.endpoint_url, s3_bucket
        )
        assert code == 0, report
        assert (report["adapters"], report["base_models"], report["corrupt"]) == (3, 1, [])
        assert _listed(stub) == before
        for (name, version), record in records.items():
            assert stub.GetAdapter(pb.GetAdapterRequest(ref=f"{name}@{version}")) == record
        _, _, weights = fetch_all(stub, "a@2")
        assert hashlib.sha256(weights).hexdigest() == records[("a", 2)].sha256
        # Counters come back too: no version number is handed out twice, even deleted ones.
        assert stub.UploadAdapter(upload_requests(peft_dirs[0], "a"), timeout=60).version == 3
        assert stub.UploadAdapter(upload_requests(peft_dirs[0], "c"), timeout=60).version == 2
        assert stub.GetBaseModel(pb.GetBaseModelRequest(name=BASE_MODEL)).name == BASE_MODEL


def test_reindex_refuses_a_version_whose_part_digests_left_its_record(
    manual_store, redis_server, s3_server, s3_bucket, peft_dirs, tiny_config_json
) -> None:
    """A manifest whose part digests no longer hash to the record's parts_sha256 (rewritten
    in S3) is reported corrupt by reindex and not indexed: a replica would refuse it."""
    with grpc.insecure_channel(manual_store.address) as channel:
        stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
        stub.RegisterBaseModel(
            pb.RegisterBaseModelRequest(name=BASE_MODEL, config_json=tiny_config_json)
        )
        kept = stub.UploadAdapter(upload_requests(peft_dirs[0], "kept"), timeout=60)
        tampered = stub.UploadAdapter(upload_requests(peft_dirs[1], "tampered"), timeout=60)
        assert kept.parts_sha256 and tampered.parts_sha256
        key = tampered.storage_prefix + MANIFEST_FILE
        manifest = json.loads(manual_store.run(manual_store.objects.get(key)))
        manifest["part_sha256"][0] = "0" * 64  # still a well-formed manifest
        manual_store.run(manual_store.objects.put(key, json.dumps(manifest).encode()))

        redis_server.flushall()
        code, report = _store_command(
            "reindex", redis_server.url, s3_server.endpoint_url, s3_bucket
        )
        assert code == 0, report
        assert (report["adapters"], report["corrupt"]) == (1, [tampered.storage_prefix])
        assert [name for name, _, _ in _listed(stub)] == ["kept"]


def test_crash_before_redis_commit_leaves_only_garbage_that_gc_removes(
    store, stub, registered, peft_dirs, redis_url, s3_server, s3_bucket, monkeypatch
) -> None:
    kept = stub.UploadAdapter(upload_requests(peft_dirs[0], "kept"), timeout=60)

    async def redis_dies(record, max_stored: int = 0) -> bool:
        raise Unavailable("Redis is unavailable: simulated crash before the commit")

    monkeypatch.setattr(store.metadata, "commit_adapter", redis_dies)
    code, _ = _code(lambda: stub.UploadAdapter(upload_requests(peft_dirs[1], "lost"), timeout=60))
    assert code == grpc.StatusCode.UNAVAILABLE
    monkeypatch.undo()
    assert [name for name, _, _ in _listed(stub)] == ["kept"]
    orphan = adapter_prefix("default", "lost", 1)
    left = {i.key for i in store.run(store.objects.list_objects(orphan))}
    assert left == {orphan + WEIGHTS_FILE, orphan + MANIFEST_FILE}

    # Young garbage may be an upload in flight: left alone under the grace period.
    code, report = _store_command("gc", redis_url, s3_server.endpoint_url, s3_bucket)
    assert code == 0 and report["pending"] == [orphan] and report["removed"] == []
    code, report = _store_command(
        "gc", redis_url, s3_server.endpoint_url, s3_bucket, "--grace-s", "0"
    )
    assert code == 0 and report["removed"] == [orphan]
    assert store.run(store.objects.list_objects(orphan)) == []
    assert stub.GetAdapter(pb.GetAdapterRequest(ref="kept")) == kept
    _, _, weights = fetch_all(stub, "kept")
    assert hashlib.sha256(weights).hexdigest() == kept.sha256


def test_missing_commit_marker_is_written_by_gc(
    store, stub, registered, peft_dirs, redis_url, s3_server, s3_bucket, monkeypatch
) -> None:
    real_put = store.objects.put

    async def marker_lost(key: str, data: bytes) -> None:
        if key.endswith(RECORD_FILE):
            raise Unavailable("S3 is unavailable: simulated crash after the Redis commit")
        await real_put(key, data)

    monkeypatch.setattr(store.objects, "put", marker_lost)
    adapter = stub.UploadAdapter(upload_requests(peft_dirs[0], "marked"), timeout=60)
    monkeypatch.undo()
    assert stub.GetAdapter(pb.GetAdapterRequest(ref="marked@1")) == adapter
    code, report = _store_command(
        "gc", redis_url, s3_server.endpoint_url, s3_bucket, "--grace-s", "0"
    )
    assert code == 0 and report["repaired"] == [adapter.storage_prefix], report
    record = json.loads(store.run(store.objects.get(adapter.storage_prefix + RECORD_FILE)))
    assert record["sha256"] == adapter.sha256


def test_redis_down_is_unavailable_then_recovers(
    tmp_path, s3_server, s3_bucket, peft_dirs, tiny_config_json
) -> None:
    redis_server = RedisServer(tmp_path / "redis").start()
    store = InProcessStore(redis_server.url, s3_server.endpoint_url, s3_bucket).start()
    try:
        with grpc.insecure_channel(store.address) as channel:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
            stub.RegisterBaseModel(
                pb.RegisterBaseModelRequest(name=BASE_MODEL, config_json=tiny_config_json)
            )
            adapter = stub.UploadAdapter(upload_requests(peft_dirs[0], "tough"), timeout=60)
            redis_server.stop(kill=True)
            for call in (
                lambda: stub.GetAdapter(pb.GetAdapterRequest(ref="tough"), timeout=20),
                lambda: stub.UploadAdapter(upload_requests(peft_dirs[0], "tough"), timeout=20),
                lambda: stub.ListAdapters(pb.ListAdaptersRequest(), timeout=20),
            ):
                code, details = _code(call)
                assert code == grpc.StatusCode.UNAVAILABLE and "Redis" in details, details

            # It comes back empty (no persistence here): the store rebuilds its index from S3.
            redis_server.start()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if stub.GetAdapter(pb.GetAdapterRequest(ref="tough"), timeout=5) == adapter:
                        break
                except grpc.RpcError:
                    time.sleep(0.2)
            else:
                pytest.fail("the store did not recover after Redis came back")
            # A record can be readable before the rebuild has finished (it marks the index
            # ready last); until then uploads answer UNAVAILABLE "retry shortly", as a
            # client would, so retry those within the same bound.
            while True:
                try:
                    upload = stub.UploadAdapter(upload_requests(peft_dirs[1], "tough"), timeout=60)
                    break
                except grpc.RpcError as error:
                    rebuilding = error.code() == grpc.StatusCode.UNAVAILABLE and (
                        "being rebuilt" in (error.details() or "")
                    )
                    if not rebuilding or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert upload.version == 2
    finally:
        store.stop()
        redis_server.stop()


def test_store_killed_mid_upload_leaves_nothing_visible(
    tmp_path, redis_url, s3_server, s3_bucket, peft_dirs, tiny_config_json
) -> None:
    args = [
        "--redis-url",
        redis_url,
        "--s3-endpoint-url",
        s3_server.endpoint_url,
        "--s3-bucket",
        s3_bucket,
    ]
    process = ServiceProcess("adapter_store", args, tmp_path).start()
    streaming = threading.Event()
    outcome: list[grpc.StatusCode] = []

    def slow_upload(stub) -> None:
        def requests():
            yield from upload_requests(peft_dirs[0], "half", chunk=1024)
            streaming.set()  # every file sent but the stream is not closed: keep it open
            time.sleep(30)

        try:
            stub.UploadAdapter(requests(), timeout=60)
            outcome.append(grpc.StatusCode.OK)
        except grpc.RpcError as error:
            outcome.append(error.code())

    try:
        with grpc.insecure_channel(process.address) as channel:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
            stub.RegisterBaseModel(
                pb.RegisterBaseModelRequest(name=BASE_MODEL, config_json=tiny_config_json)
            )
            uploader = threading.Thread(target=slow_upload, args=(stub,), daemon=True)
            uploader.start()
            assert streaming.wait(30)
            process.stop(kill=True)
            uploader.join(30)
        assert outcome == [grpc.StatusCode.UNAVAILABLE]

        process = ServiceProcess("adapter_store", args, tmp_path, port=process.port).start()
        with grpc.insecure_channel(process.address) as channel:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
            assert _listed(stub) == []
            code, report = _store_command(
                "gc", redis_url, s3_server.endpoint_url, s3_bucket, "--grace-s", "0"
            )
            assert code == 0 and report["removed"] == [] and report["unindexed"] == []
            adapter = stub.UploadAdapter(upload_requests(peft_dirs[0], "half"), timeout=60)
            assert adapter.version == 1
            _, _, weights = fetch_all(stub, "half@1")
            assert hashlib.sha256(weights).hexdigest() == adapter.sha256
    finally:
        process.stop(kill=True)


def test_upload_refused_when_its_version_was_refused_even_if_reindex_then_finished(
    manual_store, redis_server, peft_dirs, tiny_config_json, monkeypatch
) -> None:
    """The Redis-kill reliability run published `n4@None`: the version was refused while
    the index was rebuilt, and the reindex finished before the upload asked again. The
    interleaving is injected here: allocate_version (real Redis, index not ready) returns
    None, then the index is marked ready."""
    metadata = manual_store.metadata
    allocate = metadata.allocate_version

    async def refused_then_ready(tenant: str, name: str) -> int | None:
        version = await allocate(tenant, name)
        await metadata.mark_index_ready("reindex finished meanwhile (test)")
        return version

    with grpc.insecure_channel(manual_store.address) as channel:
        stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
        stub.RegisterBaseModel(
            pb.RegisterBaseModelRequest(name=BASE_MODEL, config_json=tiny_config_json)
        )
        redis_server.flushall()  # the index no longer mirrors S3: versions are refused
        monkeypatch.setattr(metadata, "allocate_version", refused_then_ready)
        code, details = _code(
            lambda: stub.UploadAdapter(upload_requests(peft_dirs[0], "a"), timeout=60)
        )
        assert code == grpc.StatusCode.UNAVAILABLE and "reindex" in details, details
        monkeypatch.undo()
        assert _listed(stub) == []  # nothing half-stored, nothing of version None
