"""Generate's contract around the tokens: sampling knobs, streaming, cancellation and
deadlines freeing resources, error statuses, versions, corrupt downloads, a failing step."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from inference_svc.adapters.s3_fetch import S3FetchConfig, adapter_prefix
from inference_svc.model.tiny import EMBEDDED_ADAPTERS_DIR, EMBEDDED_BASE_DIR
from protos import inference_pb2 as pb
from tests.inference.client import (
    PROMPTS,
    assert_same_generation,
    collect,
    generate,
    request,
    status_of,
)
from tests.inference.conftest import scaled_adapter, upload

boto3 = pytest.importorskip("boto3")  # absent on the GPU machine

# lora_B × this stays finite in bf16 storage (the store refuses inf) and drives the tiny
# model's float32 activations past float32's range.
OVERFLOW_SCALE = 1e36


@pytest.fixture
def replica(start_inference):
    return start_inference()


@pytest.fixture
def stub(replica):
    with grpc.insecure_channel(replica.address) as channel:
        yield replica.stub(channel)


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


# -- sampling and streaming -----------------------------------------------------------------


def test_seeded_sampling_repeats_and_streams_token_by_token(stub) -> None:
    knobs = dict(temperature=1.0, top_p=0.9, top_k=50)
    first = generate(stub, request("shouty", PROMPTS[2], 12, seed=7, **knobs))
    again = generate(stub, request("shouty", PROMPTS[2], 12, seed=7, **knobs))
    other = generate(stub, request("shouty", PROMPTS[2], 12, seed=8, **knobs))
    assert first.token_ids == again.token_ids and first.logprobs == again.logprobs
    assert other.token_ids != first.token_ids
    assert first.messages == 12 and first.finish_reason == pb.FINISH_REASON_LENGTH


def test_stop_strings_and_stop_token_ids(stub) -> None:
    free = generate(stub, request("", PROMPTS[0], 16))
    # Stop at the first newline the model writes: the text ends before it.
    assert "\n" in free.text
    stopped = generate(stub, request("", PROMPTS[0], 16, stop=["\n"]))
    assert stopped.finish_reason == pb.FINISH_REASON_STOP
    assert stopped.text == free.text.split("\n")[0]
    # A stop token id ends generation with that token included.
    stop_id = free.token_ids[3]
    by_id = generate(stub, request("", PROMPTS[0], 16, stop_token_ids=[stop_id]))
    assert by_id.finish_reason == pb.FINISH_REASON_STOP
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]


def test_prompt_token_ids_and_defaults(stub, replica) -> None:
    ids = replica.app.runtime.tokenizer.encode(PROMPTS[1])
    by_ids = generate(stub, pb.GenerateRequest(prompt_token_ids=ids, logprobs=True))
    by_text = generate(stub, pb.GenerateRequest(prompt=PROMPTS[1], logprobs=True))
    assert by_ids.token_ids == by_text.token_ids
    assert by_ids.prompt_logprobs == []  # not asked for
    assert len(by_text.token_ids) <= 16  # the default max_new_tokens


# -- cancellation and deadlines free pages and slots ------------------------------------------


def test_cancel_frees_pages_and_slot_at_once(stub, replica) -> None:
    before = replica.stats()
    call = stub.Generate(request("docs-prose", PROMPTS[0], 400), timeout=120)
    next(call), next(call)
    during = replica.stats()
    assert during.kv_pages_free < before.kv_pages_free
    assert during.slot_refs == 1 and during.running == 1
    call.cancel()
    wait_until(lambda: replica.stats().running == 0)
    after = replica.stats()
    assert after.kv_pages_free == before.kv_pages_free
    assert after.slot_refs == 0
    assert after.slots_used == during.slots_used  # the adapter stays resident, unreferenced


def test_deadline_stops_the_request(stub, replica) -> None:
    before = replica.stats()
    code = status_of(lambda: collect(stub.Generate(request("", PROMPTS[0], 400), timeout=1.0)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: replica.stats().running == 0)
    assert replica.stats().kv_pages_free == before.kv_pages_free


# -- error statuses ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("req", "code"),
    [
        (request("no-such-adapter"), grpc.StatusCode.NOT_FOUND),
        (request("shouty@9"), grpc.StatusCode.NOT_FOUND),
        (request("bad/name"), grpc.StatusCode.INVALID_ARGUMENT),
        (request("", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT),
        (request("", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT),
        (request("", max_new_tokens=-3), grpc.StatusCode.INVALID_ARGUMENT),
        (request("", prompt=""), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(prompt_token_ids=[1, 99999]), grpc.StatusCode.INVALID_ARGUMENT),
        (request("", max_new_tokens=100000), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ],
)
def test_error_statuses(stub, req, code) -> None:
    assert status_of(lambda: generate(stub, req)) == code


def test_adapter_of_another_base_model_is_refused(stub, store) -> None:
    config = (EMBEDDED_BASE_DIR / "config.json").read_text()
    from adapter_store.client import StoreClient

    async def register_other() -> None:
        async with StoreClient(store.address) as client:
            await client.register_base_model("other-base", config)
            await client.upload_dir(
                EMBEDDED_ADAPTERS_DIR / "shouty", name="for-other", base_model="other-base"
            )

    import asyncio

    asyncio.run(register_other())
    code = status_of(lambda: generate(stub, request("for-other")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION


def test_queue_full_and_prompt_too_long(start_inference) -> None:
    replica = start_inference(runtime=dict(max_queue=1, max_num_seqs=1, max_model_len=64))
    with grpc.insecure_channel(replica.address) as channel:
        stub = replica.stub(channel)
        too_long = request("", "x " * 80, 4)
        assert status_of(lambda: generate(stub, too_long)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(generate, stub, request("", PROMPTS[0], 40)) for _ in range(6)]
            codes = [status_of(f.result) if f.exception() else grpc.StatusCode.OK for f in futures]
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes


def test_store_down_serves_known_adapters_and_refuses_others(
    start_inference, redis_server, s3_server, module_bucket
) -> None:
    from tests.store.harness import InProcessStore

    second = InProcessStore(redis_server.url, s3_server.endpoint_url, module_bucket).start()
    replica = start_inference(store_address=second.address)
    with grpc.insecure_channel(replica.address) as channel:
        stub = replica.stub(channel)
        warm = generate(stub, request("shouty", PROMPTS[0], 6))
        second.stop()
        assert generate(stub, request("shouty", PROMPTS[0], 6)).token_ids == warm.token_ids
        assert generate(stub, request("", PROMPTS[0], 4)).finish_reason
        with pytest.raises(grpc.RpcError) as raised:
            generate(stub, request("docs-prose", PROMPTS[0], 4))
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert second.address in raised.value.details()


def test_s3_down_is_unavailable_naming_s3(start_inference, module_bucket) -> None:
    dead = S3FetchConfig(bucket=module_bucket, endpoint_url="http://127.0.0.1:9", max_attempts=1)
    replica = start_inference(s3=dead)
    with grpc.insecure_channel(replica.address) as channel:
        stub = replica.stub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            generate(stub, request("unittest-style", PROMPTS[0], 4))
        assert generate(stub, request("", PROMPTS[0], 4)).token_ids  # the base still serves
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "S3" in raised.value.details()


def test_weights_through_fetch_adapter_when_no_s3(start_inference, stub) -> None:
    replica = start_inference(s3=None)
    with grpc.insecure_channel(replica.address) as channel:
        via_store = generate(replica.stub(channel), request("docs-prose", PROMPTS[3], 6))
    assert_same_generation(via_store, generate(stub, request("docs-prose", PROMPTS[3], 6)))


def test_manifest_naming_other_weights_is_refused_through_fetch_adapter(
    start_inference, store, s3_server, module_bucket
) -> None:
    """Without S3 the replica reads the store's stream: the client checks the bytes against
    the record, and the manifest that comes with them must name the same digest."""
    upload(store, [(EMBEDDED_ADAPTERS_DIR / "shouty", "odd-manifest")])
    key = adapter_prefix("default", "odd-manifest", 1) + "manifest.json"
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    manifest = json.loads(s3.get_object(Bucket=module_bucket, Key=key)["Body"].read())
    s3.put_object(Bucket=module_bucket, Key=key, Body=json.dumps({**manifest, "sha256": "0" * 64}))
    replica = start_inference(s3=None)
    with grpc.insecure_channel(replica.address) as channel:
        stub = replica.stub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            generate(stub, request("odd-manifest", PROMPTS[0], 4))
        listed = stub.ListLoadedAdapters(pb.ListLoadedAdaptersRequest(), timeout=10)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"its manifest names weights of sha256 {'0' * 64}" in raised.value.details()
    assert "odd-manifest" not in {a.name for a in listed.adapters}


def test_corrupt_weights_never_reach_a_slot(stub, replica, store, s3_server, module_bucket):
    upload(store, [(EMBEDDED_ADAPTERS_DIR / "shouty", "to-corrupt")])
    key = adapter_prefix("default", "to-corrupt", 1) + "weights.safetensors"
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    data = bytearray(s3.get_object(Bucket=module_bucket, Key=key)["Body"].read())
    data[-10] ^= 0xFF
    s3.put_object(Bucket=module_bucket, Key=key, Body=bytes(data))
    with pytest.raises(grpc.RpcError) as raised:
        generate(stub, request("to-corrupt", PROMPTS[0], 4))
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "corrupt" in raised.value.details()
    listed = stub.ListLoadedAdapters(pb.ListLoadedAdaptersRequest(), timeout=10)
    assert "to-corrupt" not in {a.name for a in listed.adapters}


# -- versions -----------------------------------------------------------------------------------


def test_name_follows_new_versions_and_pins_keep_theirs(stub, store, tmp_path) -> None:
    v1 = generate(stub, request("docs-prose", PROMPTS[0], 8))
    assert v1.adapter_version == 1
    upload(store, [(scaled_adapter(EMBEDDED_ADAPTERS_DIR / "docs-prose", tmp_path / "v2", 3.0),
                    "docs-prose")])  # fmt: skip
    # The store's event reaches the replica's resolver: `name` now means version 2.
    wait_until(lambda: generate(stub, request("docs-prose", PROMPTS[0], 1)).adapter_version == 2)
    v2 = generate(stub, request("docs-prose", PROMPTS[0], 8))
    pinned = generate(stub, request("docs-prose@1", PROMPTS[0], 8))
    assert pinned.adapter_version == 1 and pinned.token_ids == v1.token_ids
    assert v2.token_ids != v1.token_ids

    # A running request keeps its version while a newer one is published.
    call = stub.Generate(request("docs-prose", PROMPTS[0], 24), timeout=120)
    head = next(call)
    assert head.adapter_version == 2
    upload(store, [(EMBEDDED_ADAPTERS_DIR / "shouty", "docs-prose")])  # version 3
    rest = collect(call)
    running = list(head.token_ids) + rest.token_ids
    assert running == generate(stub, request("docs-prose@2", PROMPTS[0], 24)).token_ids


# -- one failing request does not take the others down -----------------------------------------


def test_a_failing_step_fails_only_its_request(stub, replica) -> None:
    runner = replica.app.runtime.engine.runner
    execute = runner.execute
    poison = 7

    def faulty(input_ids, batch):
        if bool((input_ids == poison).any()):
            raise RuntimeError("injected fault")
        return execute(input_ids, batch)

    healthy = [request("", p, 6) for p in PROMPTS[:3]]
    expected = [generate(stub, r) for r in healthy]
    ids = replica.app.runtime.tokenizer.encode(PROMPTS[0])
    replica.on_engine(lambda: setattr(runner, "execute", faulty))
    try:
        poisoned = pb.GenerateRequest(
            prompt_token_ids=[*ids, poison], sampling={"max_new_tokens": 4}
        )
        barrier = threading.Barrier(4)

        def run(req):
            barrier.wait()
            return generate(stub, req)

        with ThreadPoolExecutor(4) as pool:
            bad = pool.submit(run, poisoned)
            good = [pool.submit(run, r) for r in healthy]
            assert [f.result().token_ids for f in good] == [e.token_ids for e in expected]
            assert status_of(bad.result) == grpc.StatusCode.INTERNAL
    finally:
        replica.on_engine(lambda: setattr(runner, "execute", execute))
    assert generate(stub, request("", PROMPTS[0], 6)).token_ids == expected[0].token_ids
    assert replica.stats().kv_pages_free == replica.stats().kv_pages_total


def test_an_adapter_whose_logits_overflow_ends_only_its_request(stub, replica, store, tmp_path):
    """Finite weights (the store checks that) can still overflow float32 activations: the
    request gets FAILED_PRECONDITION naming the adapter, not NaN logprobs and garbage
    tokens, and the requests batched with it are unaffected."""
    huge = scaled_adapter(EMBEDDED_ADAPTERS_DIR / "shouty", tmp_path / "huge", OVERFLOW_SCALE)
    upload(store, [(huge, "overflowing")])
    healthy = [request("", PROMPTS[0], 6), request("shouty", PROMPTS[1], 6)]
    expected = [generate(stub, r) for r in healthy]
    barrier = threading.Barrier(3)

    def run(req):
        barrier.wait()
        return generate(stub, req)

    with ThreadPoolExecutor(3) as pool:
        bad = pool.submit(run, request("overflowing", PROMPTS[2], 6))
        good = [pool.submit(run, r) for r in healthy]
        assert [f.result().token_ids for f in good] == [e.token_ids for e in expected]
        for got, want in zip(good, expected, strict=True):  # batched: summation order moves
            assert got.result().logprobs == pytest.approx(want.logprobs, abs=1e-4)
        with pytest.raises(grpc.RpcError) as failed:
            bad.result()
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "overflowing@1" in failed.value.details()
    assert "not finite" in failed.value.details()
    assert replica.stats().kv_pages_free == replica.stats().kv_pages_total


def test_preemption_when_kv_pages_run_out_keeps_results(start_inference, stub) -> None:
    small = start_inference(runtime=dict(kv_pages=12, page_size=16, max_num_seqs=8))
    cases = [("", PROMPTS[i % 4]) for i in range(3)] + [("shouty", PROMPTS[i]) for i in range(3)]
    expected = [generate(stub, request(a, p, 40)) for a, p in cases]
    with grpc.insecure_channel(small.address) as channel:
        small_stub = small.stub(channel)
        with ThreadPoolExecutor(len(cases)) as pool:
            got = list(pool.map(lambda c: generate(small_stub, request(*c, 40)), cases))
    for g, e in zip(got, expected, strict=True):
        assert_same_generation(g, e)
    assert small.app.metrics.preemptions._value.get() > 0
    assert small.stats().kv_pages_free == 12
