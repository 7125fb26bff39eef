"""Bounded load on loopback: 64 concurrent streaming clients over 50 adapters (the embedded
adapters uploaded under 50 names) against one CPU replica of the tiny model, for a fixed
duration. No errors; afterwards nothing is left running or queued, no KV page is in use,
no adapter holds a request reference (Prometheus metrics and ListLoadedAdapters), and the
replica's RSS grew by a bounded amount."""

from __future__ import annotations

import random
import threading
import time
import urllib.request
from collections import Counter

import grpc
import pytest

from protos import inference_pb2 as pb
from tests.fixtures.servers import free_port
from tests.inference.client import collect, request
from tests.reliability.inference_stack import (
    EMBEDDED,
    channel_to,
    inference_process,
    inference_stub,
    start_store,
    upload_embedded,
)
from tests.reliability.test_fuzz_uploads import rss_mb

CLIENTS = 64
ADAPTERS = 50
MAX_NEW_TOKENS = 8
RSS_GROWTH_BOUND_MB = 200
IDLE_GAUGES = ("loraserve_running_requests", "loraserve_queue_depth", "loraserve_kv_pages_used")


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


class Client(threading.Thread):
    """Streams Generate calls over random adapters until the deadline."""

    def __init__(self, channel: grpc.Channel, seed: int, deadline: float, names: list[str]):
        super().__init__(daemon=True)
        self.stub = inference_stub(channel)
        self.rng, self.deadline, self.names = random.Random(seed), deadline, names
        self.outcomes: Counter = Counter()
        self.errors: list[str] = []

    def run(self) -> None:
        while time.monotonic() < self.deadline:
            req = request(self.rng.choice(self.names), max_new_tokens=MAX_NEW_TOKENS,
                          prompt_logprobs=False)  # fmt: skip
            try:
                got = collect(self.stub.Generate(req, timeout=120))
                ok = len(got.token_ids) == MAX_NEW_TOKENS and got.messages > 1
                self.outcomes["streamed OK" if ok else "wrong shape"] += 1
            except grpc.RpcError as error:
                self.errors.append(f"{error.code().name}: {error.details()}")


def _run_load(tmp_path, redis_url, s3_server, s3_bucket, duration_s: float, tally) -> None:
    store = start_store(tmp_path, redis_url, s3_server.endpoint_url, s3_bucket)
    names = [f"load-{i:02d}" for i in range(ADAPTERS)]
    upload_embedded(store, {name: EMBEDDED[i % len(EMBEDDED)] for i, name in enumerate(names)})
    metrics_port = free_port()
    storage = ["--redis-url", redis_url, "--s3-endpoint-url", s3_server.endpoint_url]
    inference = inference_process(
        tmp_path, store, *storage, "--s3-bucket", s3_bucket, "--max-loras", "8",
        "--max-num-seqs", "32", "--metrics-port", str(metrics_port),
    ).start()  # fmt: skip
    try:
        with channel_to(inference) as channel:
            stub = inference_stub(channel)
            collect(stub.Generate(request(names[0], max_new_tokens=2), timeout=60))  # warm up
            rss_before = rss_mb(inference.process.pid)
            deadline = time.monotonic() + duration_s
            clients = [Client(channel, seed, deadline, names) for seed in range(CLIENTS)]
            for client in clients:
                client.start()
            for client in clients:
                client.join(duration_s + 180)
            assert not any(client.is_alive() for client in clients), "a client never stopped"
            errors = [e for client in clients for e in client.errors]
            outcomes = sum((client.outcomes for client in clients), Counter())
            assert not errors, f"{len(errors)} errors, first: {errors[:3]}"
            assert outcomes["wrong shape"] == 0 and outcomes["streamed OK"] > CLIENTS
            growth = rss_mb(inference.process.pid) - rss_before
            assert growth < RSS_GROWTH_BOUND_MB, f"replica RSS grew {growth:.0f} MB"
            metrics = _metrics(metrics_port)
            for gauge in IDLE_GAUGES:
                assert metrics[gauge] == 0, (gauge, metrics[gauge])
            loaded = stub.ListLoadedAdapters(pb.ListLoadedAdaptersRequest(), timeout=10)
            assert all(a.active_requests == 0 for a in loaded.adapters)
        label = f"load {duration_s:.0f} s"
        tally.add(f"{label}: streamed generations OK", outcomes["streamed OK"])
        tally.add(f"{label}: errors", len(errors))
        tally.add(f"{label}: replica RSS growth MB", max(int(growth), 0))
        tally.add(f"{label}: slot loads", int(metrics["loraserve_lora_slot_misses_total"]))
        tally.add(f"{label}: slot evictions", int(metrics["loraserve_lora_slot_evictions_total"]))
    finally:
        inference.stop()
        store.stop()


def test_load_ci(tmp_path, redis_url, s3_server, s3_bucket, tally) -> None:
    _run_load(tmp_path, redis_url, s3_server, s3_bucket, 30.0, tally)


@pytest.mark.slow
def test_load_long(tmp_path, redis_url, s3_server, s3_bucket, tally) -> None:
    _run_load(tmp_path, redis_url, s3_server, s3_bucket, 120.0, tally)
