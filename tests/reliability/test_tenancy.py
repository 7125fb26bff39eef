"""Tenancy and auth: API keys hashed at rest, tenants isolated (list, get, fetch, delete),
TLS with a self-signed certificate, per-tenant limits answered with RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from adapter_store import cli
from adapter_store.auth import hash_key, parse_api_keys
from adapter_store.client import StoreClient
from adapter_store.records import parse_adapter_key
from protos import adapter_store_pb2 as pb
from tests.fixtures.services import ServiceProcess
from tests.reliability.conftest import (
    BASE_MODEL,
    list_all,
    register,
    store_args,
    stub_of,
    upload_requests,
)
from tests.store.harness import InProcessStore

KEY_A, KEY_B = "sk-alpha-0123456789", "sk-bravo-9876543210"


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """(cert.pem, key.pem) for 127.0.0.1 and localhost, made with the openssl CLI."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def _keys_file(folder: Path) -> Path:
    path = folder / "api_keys.json"
    entries = [
        {"sha256": hash_key(KEY_A), "tenant": "alpha"},
        {"sha256": hash_key(KEY_B), "tenant": "bravo", "base_models": [BASE_MODEL]},
    ]
    path.write_text(json.dumps({"keys": entries}))
    return path


async def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call
    return error.value.code(), error.value.details()


def test_keys_hashed_at_rest_isolation_and_tls(
    tmp_path, redis_url, s3_server, s3_bucket, peft_dirs, tiny_config_json, capsys, tally
) -> None:
    keys_file = _keys_file(tmp_path)
    at_rest = keys_file.read_bytes()
    assert KEY_A.encode() not in at_rest and KEY_B.encode() not in at_rest
    assert cli.main(["hash-key", KEY_A]) == 0
    assert capsys.readouterr().out.strip() == hash_key(KEY_A)  # what an operator stores

    cert, key = self_signed_cert(tmp_path)
    args = store_args(redis_url, s3_server.endpoint_url, s3_bucket)
    args += ["--api-keys-file", str(keys_file), "--tls-cert", str(cert), "--tls-key", str(key)]
    store = ServiceProcess("adapter_store", args, tmp_path / "store", tls_ca=cert).start()
    try:
        asyncio.run(_isolation(store.address, cert, peft_dirs, tiny_config_json, tally))
        # Plain TCP against the TLS server gets nowhere.
        with grpc.insecure_channel(store.address) as channel:
            with pytest.raises(grpc.RpcError) as error:
                stub_of(channel).ListAdapters(pb.ListAdaptersRequest(), timeout=5)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        # loractl over TLS, as a person would use it.
        base = ["--store", store.address, "--tls-ca", str(cert), "--json"]
        assert cli.main([*base, "--api-key", KEY_A, "list"]) == 0
        assert [a["name"] for a in json.loads(capsys.readouterr().out)] == ["a-only", "shared"]
        assert cli.main([*base, "list"]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
    finally:
        store.stop()
    log = store.log_text()
    assert KEY_A not in log and KEY_B not in log
    assert "TLS is on" in log and "auth is on" in log


async def _isolation(address, cert, peft_dirs, config_json, tally) -> None:
    async with (
        StoreClient(address, api_key=KEY_A, tls_ca=cert) as alpha,
        StoreClient(address, api_key=KEY_B, tls_ca=cert) as bravo,
        StoreClient(address, tls_ca=cert) as nobody,
        StoreClient(address, api_key="sk-not-a-key", tls_ca=cert) as stranger,
    ):
        await alpha.register_base_model(BASE_MODEL, config_json)
        mine = await alpha.upload_dir(peft_dirs[0], name="a-only", base_model=BASE_MODEL)
        await alpha.upload_dir(peft_dirs[0], name="shared", base_model=BASE_MODEL)
        theirs = await bravo.upload_dir(peft_dirs[1], name="shared", base_model=BASE_MODEL)
        assert theirs.version == 1 and theirs.tenant == "bravo"

        for client in (nobody, stranger):
            code, _ = await _code(client.list_adapters())
            assert code == grpc.StatusCode.UNAUTHENTICATED
            tally.add("auth probes refused (no key / unknown key)")
        assert [a.name for a in await bravo.list_adapters()] == ["shared"]
        for attempt in (
            bravo.get_adapter("a-only"),
            bravo.get_adapter("a-only@1"),
            bravo.fetch_adapter("a-only"),
            bravo.delete_adapter("a-only"),
            bravo.delete_adapter("a-only@1"),
        ):
            code, details = await _code(attempt)
            assert code == grpc.StatusCode.NOT_FOUND, details
            tally.add("cross-tenant probes refused (get/fetch/delete)")
        # bravo's own "shared" is bravo's bytes, alpha's is alpha's: same name, two tenants.
        assert (await bravo.fetch_adapter("shared")).adapter.sha256 == theirs.sha256
        assert (await alpha.fetch_adapter("shared")).adapter.sha256 == mine.sha256
        await bravo.delete_adapter("shared")
        assert (await alpha.get_adapter("shared")).tenant == "alpha"
        fetched = await alpha.fetch_adapter("a-only")
        assert hashlib.sha256(fetched.weights).hexdigest() == mine.sha256


def _limited_store(redis_url, s3_server, s3_bucket, tiny_config_json) -> InProcessStore:
    keys = {
        "keys": [
            {"sha256": hash_key(KEY_A), "tenant": "alpha", "max_adapters": 3},
            {"sha256": hash_key(KEY_B), "tenant": "bravo", "max_concurrent": 1},
        ]
    }
    principals = parse_api_keys(json.dumps(keys), "test")
    store = InProcessStore(redis_url, s3_server.endpoint_url, s3_bucket, principals=principals)
    store.start()
    with grpc.insecure_channel(store.address) as channel:
        register(stub_of(channel), tiny_config_json, metadata=_auth(KEY_A))
    return store


def _auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def test_stored_adapter_limit_is_atomic(
    redis_url, s3_server, s3_bucket, peft_dirs, tiny_config_json, tally
) -> None:
    store = _limited_store(redis_url, s3_server, s3_bucket, tiny_config_json)
    try:
        with grpc.insecure_channel(store.address) as channel:
            stub = stub_of(channel)

            def upload(i: int) -> grpc.StatusCode:
                try:
                    requests = upload_requests(peft_dirs[i % 2], f"x{i}")
                    stub.UploadAdapter(requests, timeout=60, metadata=_auth(KEY_A))
                    return grpc.StatusCode.OK
                except grpc.RpcError as error:
                    assert "limit" in error.details()
                    return error.code()

            with ThreadPoolExecutor(6) as pool:
                codes = list(pool.map(upload, range(6)))
            assert sorted(c.name for c in codes) == ["OK"] * 3 + ["RESOURCE_EXHAUSTED"] * 3
            tally.add("per-tenant limit refusals (stored adapters)", 3)
            listed = list_all(stub, metadata=_auth(KEY_A))
            assert len(listed) == 3
            # Refused uploads leave no objects: S3 holds exactly the committed versions.
            keys = store.run(store.objects.list_objects("tenants/"))
            prefixes = {parse_adapter_key(info.key).prefix for info in keys}
            assert prefixes == {a.storage_prefix for a in listed.values()}
            name = sorted(listed)[0][0]
            stub.DeleteAdapter(pb.DeleteAdapterRequest(ref=name), timeout=20, metadata=_auth(KEY_A))
            assert upload(7) == grpc.StatusCode.OK
            assert upload(8) == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        store.stop()


HELD_UPLOAD_ADMITTED_S = 60.0


def test_concurrent_request_limit(
    redis_url, s3_server, s3_bucket, peft_dirs, tiny_config_json, tally
) -> None:
    store = _limited_store(redis_url, s3_server, s3_bucket, tiny_config_json)
    release = threading.Event()

    def held_upload():
        header, *rest = list(upload_requests(peft_dirs[0], "held"))
        yield header
        release.wait(30)  # bravo's one place stays taken while the stream is open
        yield from rest

    try:
        with grpc.insecure_channel(store.address) as channel:
            stub = stub_of(channel)

            def start_held_upload() -> grpc.Future:
                return stub.UploadAdapter.future(held_upload(), timeout=60, metadata=_auth(KEY_B))

            future = start_held_upload()
            refused = None
            # Until the held upload is admitted: on a loaded 2-core CI machine that took
            # longer than the 5 s a fixed count of tries gave it.
            deadline = time.monotonic() + HELD_UPLOAD_ADMITTED_S
            while refused is None and time.monotonic() < deadline:
                if future.done():
                    # A probe held bravo's one place when the upload arrived, so the upload
                    # was the one refused (seen on CI). Start it again: what is tested is a
                    # probe refused while the upload holds the place.
                    lost = future.exception()
                    assert lost is not None and lost.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "in flight" in lost.details()
                    future = start_held_upload()
                try:
                    stub.ListAdapters(pb.ListAdaptersRequest(), timeout=5, metadata=_auth(KEY_B))
                except grpc.RpcError as error:
                    refused = error
                threading.Event().wait(0.05)
            assert not future.done(), f"the held upload ended early: {future.exception()}"
            assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "in flight" in refused.details()
            tally.add("per-tenant limit refusals (concurrent requests)")
            # Another tenant is not held up.
            stub.ListAdapters(pb.ListAdaptersRequest(), timeout=5, metadata=_auth(KEY_A))
            release.set()
            assert future.result().name == "held"
            # The place is given back when the call ends.
            names = [
                a.name
                for a in stub.ListAdapters(
                    pb.ListAdaptersRequest(), timeout=5, metadata=_auth(KEY_B)
                ).adapters
            ]
            assert names == ["held"]
    finally:
        release.set()
        store.stop()
