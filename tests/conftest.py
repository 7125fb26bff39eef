"""Session-wide setup: Triton interpreter without CUDA, real Redis + SeaweedFS servers, tiny
HF models on disk."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.triton_interpret import use_interpreter_without_cuda

# Must run before anything imports triton (see tests/fixtures/triton_interpret.py).
use_interpreter_without_cuda()

from tests.fixtures.launch_record import LOG_ENV, record_launches  # noqa: E402
from tests.fixtures.servers import RedisServer, SeaweedS3Server  # noqa: E402
from tests.fixtures.tiny_models import TINY_SPECS, save_tiny_model  # noqa: E402

# `make test` compiles every launch the run records for sm_90 (tools/sm90_compile.py).
if os.environ.get(LOG_ENV):
    record_launches(Path(os.environ[LOG_ENV]))

# SeaweedFS accepts any credentials when none are configured; boto3 needs some to sign.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "loraserve-test")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "loraserve-test")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3Server]:
    server = SeaweedS3Server(tmp_path_factory.mktemp("seaweed")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """A clean Redis for one test."""
    redis_server.flushall()
    return redis_server.url


@pytest.fixture
def s3_bucket() -> str:
    """A fresh bucket name for one test (the code under test creates it if missing)."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every tiny spec saved once as an HF folder: name -> folder."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: save_tiny_model(name, root / name) for name in TINY_SPECS}
