"""The async client (used by the inference service) and `loractl` against a real store."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys

import grpc
import pytest

from adapter_store.auth import hash_key
from adapter_store.client import StoreClient
from adapter_store.errors import DataLoss
from adapter_store.records import WEIGHTS_FILE
from tests.fixtures.services import REPO_ROOT
from tests.store.conftest import BASE_MODEL


def test_client_round_trip_and_sha_check(store, peft_dirs, tiny_config_json) -> None:
    async def scenario() -> None:
        async with StoreClient(store.address) as client:
            base = await client.register_base_model(BASE_MODEL, tiny_config_json)
            assert [m.name for m in await client.list_base_models()] == [base.name]
            seen: list[tuple[int, int]] = []
            adapter = await client.upload_dir(
                peft_dirs[0],
                name="via-client",
                base_model=BASE_MODEL,
                labels={"k": "v"},
                chunk_bytes=4096,
                progress=lambda sent, total: seen.append((sent, total)),
            )
            total = sum(p.stat().st_size for p in peft_dirs[0].iterdir())
            assert seen[-1] == (total, total) and len(seen) > 2
            assert await client.get_adapter("via-client@1") == adapter
            assert await client.list_adapters(labels={"k": "v"}, page_size=1) == [adapter]
            fetched = await client.fetch_adapter("via-client", chunk_size=1000)
            assert hashlib.sha256(fetched.weights).hexdigest() == adapter.sha256
            assert json.loads(fetched.manifest_json)["sha256"] == adapter.sha256

            # Bytes changed behind the store's back are caught by the reader.
            key = adapter.storage_prefix + WEIGHTS_FILE
            store.run(store.objects.put(key, fetched.weights[:-1] + b"\x00"))
            with pytest.raises(DataLoss, match="sha256"):
                await client.fetch_adapter("via-client@1")
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await client.get_adapter("missing")
            assert error.value.code() == grpc.StatusCode.NOT_FOUND
            assert await client.delete_adapter("via-client") == [1]

    asyncio.run(scenario())


def _loractl(address: str, *args: str):
    return subprocess.run(
        [sys.executable, "-m", "adapter_store.cli", *args],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "LORASERVE_STORE": address},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_loractl(store, peft_dirs, tiny_config_json, tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(tiny_config_json)
    done = _loractl(store.address, "base-model", "register", BASE_MODEL, str(config))
    assert done.returncode == 0, done.stderr
    header = done.stdout.splitlines()[0].split()
    assert header == ["name", "architecture", "lora_modules", "created_at"]
    assert BASE_MODEL in done.stdout

    done = _loractl(
        store.address,
        *("upload", str(peft_dirs[0]), "--name", "cli", "--base-model", BASE_MODEL),
        *("--label", "team=x"),
    )
    assert done.returncode == 0, done.stderr
    assert "100.0%" in done.stderr  # the progress bar
    done = _loractl(
        store.address,
        *("--json", "upload", str(peft_dirs[1]), "--name", "cli", "--base-model", BASE_MODEL),
    )
    (second,) = json.loads(done.stdout)
    assert second["version"] == "2"  # int64 is a string in proto JSON

    listed = json.loads(_loractl(store.address, "--json", "list", "--all-versions").stdout)
    assert [(a["name"], a["version"]) for a in listed] == [("cli", "1"), ("cli", "2")]
    table = _loractl(store.address, "list", "--all-versions", "--label", "team=x").stdout
    table = table.splitlines()
    assert table[0].split()[:2] == ["name", "version"] and table[1].split()[:2] == ["cli", "1"]
    assert "cli" in _loractl(store.address, "get", "cli@2").stdout

    out = tmp_path / "fetched"
    assert _loractl(store.address, "fetch", "cli@2", "--out", str(out)).returncode == 0
    weights = (out / "weights.safetensors").read_bytes()
    assert hashlib.sha256(weights).hexdigest() == second["sha256"]

    done = _loractl(store.address, "--json", "delete", "cli")
    assert json.loads(done.stdout) == {"deleted": [1, 2]}
    done = _loractl(store.address, "get", "cli")
    assert done.returncode == 1 and done.stderr.startswith("loractl: NOT_FOUND")
    assert _loractl(store.address, "hash-key", "k1").stdout.strip() == hash_key("k1")
