"""Versions are immutable and numbered atomically; listing pages and filters; deletes; events."""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis

from adapter_store.records import RECORD_FILE, TOMBSTONE_FILE, WEIGHTS_FILE
from adapter_store.storage.metadata import EVENTS_CHANNEL, EVENTS_STREAM
from protos import adapter_store_pb2 as pb
from protos import adapter_store_pb2_grpc
from tests.store.conftest import fetch_all, upload_requests


def _upload(stub, folder, name, **header) -> pb.Adapter:
    return stub.UploadAdapter(upload_requests(folder, name, **header), timeout=60)


def test_pinned_version_is_unchanged_after_a_new_one(stub, registered, peft_dirs) -> None:
    first = _upload(stub, peft_dirs[0], "chat")
    second = _upload(stub, peft_dirs[1], "chat")
    assert (first.version, second.version) == (1, 2)
    assert first.sha256 != second.sha256
    assert stub.GetAdapter(pb.GetAdapterRequest(ref="chat"), timeout=10) == second
    assert stub.GetAdapter(pb.GetAdapterRequest(ref="chat@1"), timeout=10) == first
    _, _, weights = fetch_all(stub, "chat@1")
    assert hashlib.sha256(weights).hexdigest() == first.sha256


def test_concurrent_uploads_of_one_name_get_distinct_versions(store, registered, peft_dirs) -> None:
    def upload_one(i: int) -> int:
        with grpc.insecure_channel(store.address) as channel:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
            return _upload(stub, peft_dirs[i % 2], "busy").version

    with ThreadPoolExecutor(8) as pool:
        versions = sorted(pool.map(upload_one, range(8)))
    assert versions == list(range(1, 9))
    with grpc.insecure_channel(store.address) as channel:
        stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
        listed = stub.ListAdapters(pb.ListAdaptersRequest(all_versions=True), timeout=10)
    assert sorted(a.version for a in listed.adapters) == versions


def _list_all(stub, **request) -> list[pb.Adapter]:
    found, token = [], ""
    while True:
        page = stub.ListAdapters(pb.ListAdaptersRequest(page_token=token, **request), timeout=10)
        assert len(page.adapters) <= request.get("page_size", 50)
        found += page.adapters
        token = page.next_page_token
        if not token:
            return found


def test_list_pages_and_filters(stub, registered, peft_dirs, tiny_config_json) -> None:
    stub.RegisterBaseModel(
        pb.RegisterBaseModelRequest(name="other-base", config_json=tiny_config_json), timeout=10
    )
    for i in range(5):
        _upload(stub, peft_dirs[0], f"a{i}", labels={"parity": str(i % 2)})
    _upload(stub, peft_dirs[1], "a1", labels={"parity": "1", "new": "yes"})
    _upload(stub, peft_dirs[0], "b0", base_model="other-base")

    latest = _list_all(stub, page_size=2)
    assert [(a.name, a.version) for a in latest] == [
        ("a0", 1),
        ("a1", 2),
        ("a2", 1),
        ("a3", 1),
        ("a4", 1),
        ("b0", 1),
    ]
    every = _list_all(stub, page_size=3, all_versions=True)
    assert [(a.name, a.version) for a in every][:3] == [("a0", 1), ("a1", 1), ("a1", 2)]
    assert len(every) == 7
    odd = _list_all(stub, page_size=1, label={"parity": "1"})
    assert [a.name for a in odd] == ["a1", "a3"]
    assert [a.name for a in _list_all(stub, base_model="other-base")] == ["b0"]
    assert [a.name for a in _list_all(stub, label={"new": "yes"}, all_versions=True)] == ["a1"]

    with pytest.raises(grpc.RpcError) as error:
        stub.ListAdapters(pb.ListAdaptersRequest(page_token="garbage!"), timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_delete_one_version_then_all(store, stub, registered, peft_dirs) -> None:
    for folder in (peft_dirs[0], peft_dirs[1], peft_dirs[0]):
        _upload(stub, folder, "gone")
    deleted = stub.DeleteAdapter(pb.DeleteAdapterRequest(ref="gone@3"), timeout=10)
    assert list(deleted.versions) == [3]
    assert stub.GetAdapter(pb.GetAdapterRequest(ref="gone"), timeout=10).version == 2
    with pytest.raises(grpc.RpcError) as error:
        stub.GetAdapter(pb.GetAdapterRequest(ref="gone@3"), timeout=10)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND

    assert list(stub.DeleteAdapter(pb.DeleteAdapterRequest(ref="gone"), timeout=10).versions) == [
        1,
        2,
    ]
    assert _list_all(stub, all_versions=True) == []
    keys = [info.key for info in store.run(store.objects.list_objects("tenants/"))]
    # Only the high-water mark that keeps version numbers from being reused stays.
    assert keys == ["tenants/default/adapters/gone/last_version.json"]
    # Numbers are never reused: the next upload is version 4.
    assert _upload(stub, peft_dirs[0], "gone").version == 4
    with pytest.raises(grpc.RpcError) as error:
        stub.DeleteAdapter(pb.DeleteAdapterRequest(ref="never"), timeout=10)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_events_are_published_and_streamed(redis_url, stub, registered, peft_dirs) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    pubsub = client.pubsub()
    pubsub.subscribe(EVENTS_CHANNEL)
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"
    heard: list[dict] = []
    listening = threading.Event()

    def listen() -> None:
        listening.set()
        while len(heard) < 2:
            message = pubsub.get_message(timeout=10)
            if message is None:
                return
            heard.append(json.loads(message["data"]))

    listener = threading.Thread(target=listen)
    listener.start()
    listening.wait()
    adapter = _upload(stub, peft_dirs[0], "loud")
    stub.DeleteAdapter(pb.DeleteAdapterRequest(ref="loud@1"), timeout=10)
    listener.join(15)
    expected = {"tenant": "default", "name": "loud", "version": 1, "sha256": adapter.sha256}
    assert heard == [{"type": "published", **expected}, {"type": "deleted", **expected}]
    streamed = [json.loads(fields["event"]) for _, fields in client.xrange(EVENTS_STREAM)]
    assert streamed == heard


def test_storage_layout_in_s3(store, stub, registered, peft_dirs) -> None:
    adapter = _upload(stub, peft_dirs[0], "laid-out", labels={"k": "v"})
    files = {
        info.key.removeprefix(adapter.storage_prefix)
        for info in store.run(store.objects.list_objects(adapter.storage_prefix))
    }
    assert files == {WEIGHTS_FILE, "manifest.json", RECORD_FILE}
    assert TOMBSTONE_FILE not in files
    record = json.loads(store.run(store.objects.get(adapter.storage_prefix + RECORD_FILE)))
    assert (record["name"], record["version"], record["labels"]) == ("laid-out", 1, {"k": "v"})
