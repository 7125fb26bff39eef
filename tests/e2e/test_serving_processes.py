"""The whole path with every part a real process: Redis, SeaweedFS, `python -m adapter_store
serve`, `python -m inference_svc serve --model tiny`; adapters uploaded and generations
streamed with `loractl`; outputs equal transformers+peft."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from inference_svc.model.config import load_config
from inference_svc.model.tiny import EMBEDDED_ADAPTERS_DIR, EMBEDDED_BASE_DIR
from inference_svc.model.tokenizer import load_tokenizer
from protos import inference_pb2 as pb
from protos import inference_pb2_grpc
from tests.fixtures.services import REPO_ROOT, ServiceProcess
from tests.inference.client import (
    PROMPTS,
    assert_same_generation,
    generate,
    load_peft_oracle,
    oracle_generation,
    request,
)

ADAPTERS = ("shouty", "unittest-style")


def loractl(store: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "adapter_store.cli", "--store", store, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def stack(tmp_path, redis_url, s3_server, s3_bucket):
    storage = ["--redis-url", redis_url, "--s3-endpoint-url", s3_server.endpoint_url]
    store = ServiceProcess(
        "adapter_store", [*storage, "--s3-bucket", s3_bucket], tmp_path / "store"
    ).start()
    inference = ServiceProcess(
        "inference_svc",
        ["--store", store.address, "--model", "tiny", "--device", "cpu", "--dtype", "float32",
         *storage, "--s3-bucket", s3_bucket, "--max-loras", "2"],
        tmp_path / "inference",
    ).start()  # fmt: skip
    yield store, inference
    inference.stop()
    store.stop()


def test_upload_then_generate_through_both_services(stack) -> None:
    store, inference = stack
    loractl(store.address, "base-model", "register", "tiny", str(EMBEDDED_BASE_DIR))
    for name in ADAPTERS:
        loractl(store.address, "upload", str(EMBEDDED_ADAPTERS_DIR / name), "--name", name,
                "--base-model", "tiny")  # fmt: skip

    oracle = load_peft_oracle(ADAPTERS)
    prompt_ids = load_tokenizer(EMBEDDED_BASE_DIR, load_config(EMBEDDED_BASE_DIR)).encode(
        PROMPTS[0]
    )
    with grpc.insecure_channel(inference.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for adapter in ("", *ADAPTERS):
            got = generate(stub, request(adapter, PROMPTS[0], 8))
            assert_same_generation(got, oracle_generation(oracle, adapter, prompt_ids, 8))
        listed = stub.ListLoadedAdapters(pb.ListLoadedAdaptersRequest(), timeout=10)
        assert {a.name for a in listed.adapters} == set(ADAPTERS)

    streamed = json.loads(
        loractl(
            store.address,
            "--json",
            "generate",
            "--inference",
            inference.address,
            "--adapter",
            "shouty",
            "--max-new-tokens",
            "8",
            PROMPTS[0],
        )  # fmt: skip
    )
    expected = oracle_generation(oracle, "shouty", prompt_ids, 8)
    assert streamed["token_ids"] == expected.token_ids
    assert streamed["adapter_version"] == 1 and streamed["finish_reason"] in ("length", "eos")
    text = loractl(store.address, "generate", "--inference", inference.address, PROMPTS[0])
    assert text.strip()
    assert "request id=" in inference.log_text()  # one structured line per request
