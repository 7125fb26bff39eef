"""Generate fuzzing against a real inference process: hostile sampling values, prompts over
the limit, invalid token ids, odd adapter refs. Every case ends with a clean status (or a
valid generation) within a time bound, and the replica keeps serving afterwards."""

from __future__ import annotations

import math
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos import inference_pb2 as pb
from tests.inference.client import collect
from tests.reliability.inference_stack import (
    channel_to,
    failure_of,
    generate_as,
    inference_process,
    inference_stub,
    start_store,
    upload_embedded,
)
from tests.reliability.test_fuzz_uploads import rss_mb

VOCAB = 2048  # the embedded tiny model's vocabulary
MAX_MODEL_LEN = 96
TIME_BOUND_S = 20.0
RSS_GROWTH_BOUND_MB = 300
_REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
_FUZZ = settings(
    max_examples=150,
    deadline=None,  # the time bound is asserted per case, with a clearer message
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

INT32 = st.integers(-(2**31), 2**31 - 1)
ODD_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e-45, 1e-30, 1e38, 2.0])
ANY_FLOAT = st.one_of(st.floats(width=32), ODD_FLOATS)
ODD_REFS = st.sampled_from(
    ["shouty@1", "shouty@0", "shouty@-1", "shouty@99", "missing", "a/../b", "a\x00b", "é",
     "ｓｈｏｕｔｙ", "shouty@", "@1", "a" * 300, " shouty", "shouty@1@1", "\u202eyt"]
)  # fmt: skip

# Each case is a valid request with a few fields made hostile, so the hostile value (or a
# mix of them) is what the server must handle. Field -> hostile values.
HOSTILE: dict[str, st.SearchStrategy] = {
    "max_new_tokens": st.one_of(st.integers(-5, -1), INT32, st.just(2**31 - 1)),
    "temperature": ANY_FLOAT,
    "top_p": ANY_FLOAT,
    "top_k": st.one_of(st.integers(-3, -1), INT32),
    "stop": st.lists(st.text(max_size=3), min_size=1, max_size=3),
    "stop_token_ids": st.lists(INT32, min_size=1, max_size=3),
    "seed": st.integers(0, 2**64 - 1),
    "adapter": st.one_of(ODD_REFS, st.text(max_size=20)),
    "prompt": st.one_of(st.text(max_size=40), st.just("word " * (4 * MAX_MODEL_LEN))),
    "prompt_token_ids": st.one_of(
        st.lists(st.one_of(st.integers(0, VOCAB - 1), INT32), min_size=1, max_size=8),
        st.lists(st.sampled_from([-1, VOCAB, 2**31 - 1]), min_size=1, max_size=3),
        st.integers(MAX_MODEL_LEN - 4, 3 * MAX_MODEL_LEN).map(lambda n: [7] * n),
    ),
    "request_id": st.text(max_size=30),
}
_SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids")


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    valid = pb.GenerateRequest(
        adapter=draw(st.sampled_from(["", "shouty"])),
        prompt=draw(st.sampled_from(["Hello", "def f(x):", "a b c d e f"])),
        sampling=pb.SamplingParams(
            max_new_tokens=draw(st.integers(1, 8)),
            temperature=draw(st.floats(0.0, 1.5, width=32)),
            top_p=draw(st.floats(0.0625, 1.0, width=32)),
            top_k=draw(st.integers(0, 40)),
            ignore_eos=draw(st.booleans()),
        ),
        logprobs=draw(st.booleans()),
        prompt_logprobs=draw(st.booleans()),
    )
    for field in draw(st.lists(st.sampled_from(sorted(HOSTILE)), min_size=1, max_size=3)):
        value = draw(HOSTILE[field])
        target = valid.sampling if field in (*_SAMPLING_FIELDS, "seed") else valid
        if isinstance(value, list):
            getattr(target, field)[:] = value
        else:
            setattr(target, field, value)
    return valid


def _edge_cases() -> list[pb.GenerateRequest]:
    """Values at the edges of what sampling can take, each in an otherwise valid request."""
    cases = []
    for field, value in [
        ("temperature", 1e-45), ("temperature", 1e-30), ("temperature", 1e38),
        ("top_p", 1e-45), ("top_k", 2**31 - 1), ("max_new_tokens", 2**31 - 1),
        ("stop_token_ids", [-1, 2**31 - 1, VOCAB]), ("seed", 2**64 - 1),
    ]:  # fmt: skip
        req = pb.GenerateRequest(adapter="shouty", prompt="Hello")
        req.sampling.temperature = 1.0
        if isinstance(value, list):
            getattr(req.sampling, field)[:] = value
        else:
            setattr(req.sampling, field, value)
        cases.append(req)
    return cases


@pytest.fixture
def replica(tmp_path, redis_url, s3_server, s3_bucket):
    store = start_store(tmp_path, redis_url, s3_server.endpoint_url, s3_bucket)
    upload_embedded(store, {"shouty": "shouty"})
    inference = inference_process(
        tmp_path, store, "--redis-url", redis_url, "--max-model-len", str(MAX_MODEL_LEN)
    ).start()
    yield inference
    inference.stop()
    store.stop()


def test_hostile_generate_requests_get_clean_statuses(replica, tally) -> None:
    with channel_to(replica) as channel:
        stub = inference_stub(channel)
        assert len(generate_as(stub, "shouty").token_ids) == 6  # warm: adapter resident
        rss_before = rss_mb(replica.process.pid)

        def one_case(req: pb.GenerateRequest) -> None:
            started = time.monotonic()
            try:
                got = collect(stub.Generate(req, timeout=TIME_BOUND_S + 10))
                assert got.finish_reason != pb.FINISH_REASON_ERROR
                outcome = "OK"
            except grpc.RpcError as error:
                assert error.code() in _REFUSALS, (error.code(), error.details(), req)
                outcome = error.code().name
            elapsed = time.monotonic() - started
            assert elapsed < TIME_BOUND_S, f"took {elapsed:.1f} s: {req}"
            tally.add(f"fuzz Generate cases: {outcome}")

        for req in _edge_cases():
            one_case(req)
        _FUZZ(given(req=generate_requests())(one_case))()
        growth = rss_mb(replica.process.pid) - rss_before
        tally.add("fuzz Generate RSS growth MB", max(int(growth), 0))
        assert growth < RSS_GROWTH_BOUND_MB, f"replica RSS grew {growth:.0f} MB"
        # Still serving, with and without an adapter.
        assert len(generate_as(stub, "shouty").token_ids) == 6
        assert len(generate_as(stub, "").token_ids) == 6
        code, _ = failure_of(lambda: generate_as(stub, "shouty", max_new_tokens=-1))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "Traceback" not in replica.log_text()
