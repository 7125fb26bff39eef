"""Safety of the data path: nothing is ever unpickled, downloads are checked against their
sha256 before use, and only validated names reach S3 or Redis keys."""

from __future__ import annotations

import ast
import asyncio
import io
import re
from pathlib import Path

import grpc
import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapter_store.client import StoreClient
from adapter_store.errors import DataLoss, FailedPrecondition
from adapter_store.format import Manifest
from adapter_store.names import check_name
from adapter_store.records import MANIFEST_FILE, WEIGHTS_FILE
from inference_svc.adapters.s3_fetch import S3AdapterFetcher, S3FetchConfig
from protos import adapter_store_pb2 as pb
from tests.fixtures.services import REPO_ROOT
from tests.reliability.conftest import upload_requests

PRODUCT_PACKAGES = ("adapter_store", "inference_svc", "kernels", "protos")
_UNPICKLERS = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}


def _unpickling_calls(path: Path) -> list[str]:
    """`torch.load`, `pickle.load(s)`, `numpy.load(..., allow_pickle=True)`, imports of
    pickle-family modules: anything in `path` that could run a pickle."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(REPO_ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            found += [f"{where} imports {m}" for m in modules if m.split(".")[0] in _UNPICKLERS]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if node.func.attr in {"load", "loads"} and owner in {"torch", *_UNPICKLERS}:
                found.append(f"{where} calls {owner}.{node.func.attr}")
            if any(k.arg in {"allow_pickle", "weights_only"} for k in node.keywords):
                found.append(f"{where} passes allow_pickle/weights_only")
    return found


def test_no_product_code_can_unpickle() -> None:
    files = [p for pkg in PRODUCT_PACKAGES for p in (REPO_ROOT / pkg).rglob("*.py")]
    assert len(files) > 30
    offenders = [hit for path in files for hit in _unpickling_calls(path)]
    assert offenders == []


class _Payload:
    """Unpickling this writes a marker file: proof that a pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


def test_malicious_pickle_upload_is_refused_and_never_runs(
    stub, registered, peft_dirs, tmp_path
) -> None:
    marker = tmp_path / "marker"
    import pickle  # noqa: PLC0415 - only this test makes pickles

    raw_pickle = pickle.dumps(_Payload(marker))
    torch_zip = io.BytesIO()
    torch.save({"x": _Payload(marker)}, torch_zip)
    config = (peft_dirs[0] / "adapter_config.json").read_bytes()
    for name, data in (
        ("adapter_model.bin", raw_pickle),
        ("adapter_model.safetensors", raw_pickle),
        ("adapter_model.safetensors", torch_zip.getvalue()),
        ("adapter_model.pt", torch_zip.getvalue()),
    ):
        folder = tmp_path / f"evil-{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        (folder / "adapter_config.json").write_bytes(config)
        (folder / name).write_bytes(data)
        with pytest.raises(grpc.RpcError) as error:
            stub.UploadAdapter(upload_requests(folder, "evil"), timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert not marker.exists()
    listed = stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10).adapters
    assert list(listed) == []


def test_downloads_are_verified_before_use(store, stub, registered, peft_dirs, s3_server) -> None:
    adapter = stub.UploadAdapter(upload_requests(peft_dirs[0], "victim"), timeout=60)
    manifest = Manifest.from_json(
        store.run(store.objects.get(adapter.storage_prefix + MANIFEST_FILE))
    )
    assert manifest.part_sha256 and adapter.parts_sha256 == manifest.parts_sha256
    key = adapter.storage_prefix + WEIGHTS_FILE
    weights = bytearray(store.run(store.objects.get(key)))
    weights[-1] ^= 0xFF  # same size, one bit-flipped byte: only the digest can tell
    store.run(store.objects.put(key, bytes(weights)))

    async def through_store_client() -> None:
        async with StoreClient(store.address) as client:
            await client.fetch_adapter("victim")

    with pytest.raises(DataLoss, match="sha256"):
        asyncio.run(through_store_client())
    fetcher = S3AdapterFetcher(
        S3FetchConfig(bucket=store.objects.config.bucket, endpoint_url=s3_server.endpoint_url)
    )
    try:
        with pytest.raises(FailedPrecondition, match=r"corrupt: bytes \d+-\d+ \(part"):
            fetcher.fetch("default", "victim", 1, adapter.sha256, adapter.parts_sha256)
        with pytest.raises(FailedPrecondition, match="corrupt: two downloads"):
            fetcher.fetch("default", "victim", 1, expected_sha256=adapter.sha256)
    finally:
        fetcher.close()


_HOSTILE_NAMES = st.one_of(
    st.sampled_from(
        ["..", "../x", "a/../b", "a/b", "/abs", "a\0b", "\0", "é", "Ａ", "a:b", "a b", "%2e%2e",
         "a\\b", ".hidden", "-x", "x" * 129, "ok-name", "v1.2_x", "a@1", "@", "a@", "a@0",
         "a@-1", "a@99999999999999999999", "\u202eevil", "a\nb"]
    ),
    st.text(max_size=40),
    st.text(alphabet="abz09._-/:@\\\0 ", max_size=20),
)  # fmt: skip
_KEY = re.compile(
    r"^(base_models/[A-Za-z0-9][A-Za-z0-9._-]*\.json"
    r"|tenants/[A-Za-z0-9][A-Za-z0-9._-]*/adapters/[A-Za-z0-9][A-Za-z0-9._-]*/"
    r"(last_version\.json|v[1-9][0-9]*/(weights\.safetensors|manifest\.json|record\.json)))$"
)
_REDIS_KEY = re.compile(
    r"^loraserve:(index_ready|base_models|tenants|events|events:stream"
    r"|t:[A-Za-z0-9][A-Za-z0-9._-]*:(names|stored|a:[A-Za-z0-9][A-Za-z0-9._-]*:(versions|counter)))$"
)


def _valid(name: str) -> bool:
    try:
        check_name(name, "name")
        return True
    except Exception:  # noqa: BLE001 - InvalidArgument is the only one raised
        return False


def test_hostile_names_never_reach_a_key(
    store, stub, registered, peft_dirs, redis_url, tally
) -> None:
    @settings(
        max_examples=150,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(name=_HOSTILE_NAMES, where=st.sampled_from(["upload", "ref", "base", "label"]))
    def one_case(name: str, where: str) -> None:
        valid = _valid(name.partition("@")[0]) if where == "ref" else _valid(name)
        try:
            if where == "upload":
                stub.UploadAdapter(upload_requests(peft_dirs[0], name), timeout=30)
            elif where == "base":
                stub.UploadAdapter(upload_requests(peft_dirs[0], "n", base_model=name), timeout=30)
            elif where == "label":
                requests = upload_requests(peft_dirs[0], "n", labels={name: "v"})
                stub.UploadAdapter(requests, timeout=30)
            else:
                for call in (stub.GetAdapter, stub.DeleteAdapter):
                    call(
                        pb.GetAdapterRequest(ref=name)
                        if call == stub.GetAdapter
                        else pb.DeleteAdapterRequest(ref=name),
                        timeout=10,
                    )
            outcome = "OK"
        except grpc.RpcError as error:
            outcome = error.code().name
            assert error.code() in {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
            if error.code() == grpc.StatusCode.NOT_FOUND:
                assert valid, f"{name!r} ({where}) reached a lookup"
        tally.add(f"name fuzz cases: {outcome}")

    one_case()
    keys = [info.key for info in store.run(store.objects.list_objects(""))]
    assert keys and all(_KEY.match(key) for key in keys), [k for k in keys if not _KEY.match(k)]
    redis_keys = list(redis.Redis.from_url(redis_url, decode_responses=True).scan_iter())
    assert all(_REDIS_KEY.match(key) for key in redis_keys), redis_keys
    tally.add("name fuzz: S3 keys checked well-formed", len(keys))
