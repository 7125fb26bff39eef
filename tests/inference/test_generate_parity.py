"""Generate through the service equals transformers+peft: per adapter and for the base,
alone and 24 at once (batch invariance), and with more distinct adapters than slots."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from inference_svc.model.tiny import EMBEDDED_ADAPTERS_DIR
from tests.inference.client import (
    PROMPTS,
    assert_same_generation,
    generate,
    oracle_generation,
    request,
)
from tests.inference.conftest import EMBEDDED_ADAPTERS, scaled_adapter, upload

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def replica(app_config, store):
    from tests.inference.harness import InProcessInference

    replica = InProcessInference(app_config).start()
    yield replica
    replica.stop()


@pytest.fixture(scope="module")
def stub(replica):
    with grpc.insecure_channel(replica.address) as channel:
        yield replica.stub(channel)


@pytest.mark.parametrize("adapter", ["", *EMBEDDED_ADAPTERS])
def test_matches_transformers_peft(stub, replica, peft_oracle, adapter: str) -> None:
    got = generate(stub, request(adapter, PROMPTS[0], NEW_TOKENS))
    prompt_ids = replica.app.runtime.tokenizer.encode(PROMPTS[0])
    assert got.prompt_tokens == len(prompt_ids)
    assert got.adapter_version == (1 if adapter else 0)
    assert_same_generation(got, oracle_generation(peft_oracle, adapter, prompt_ids, NEW_TOKENS))
    assert got.text == replica.app.runtime.tokenizer.decode(got.token_ids)


def test_adapters_change_the_output(stub) -> None:
    outputs = {a: generate(stub, request(a, PROMPTS[1], 12)).token_ids for a in EMBEDDED_ADAPTERS}
    outputs["base"] = generate(stub, request("", PROMPTS[1], 12)).token_ids
    assert len({tuple(tokens) for tokens in outputs.values()}) == len(outputs)


def test_24_concurrent_requests_equal_each_alone(stub, replica) -> None:
    refs = ["", *EMBEDDED_ADAPTERS, "docs-prose@1"]
    cases = [(refs[i % len(refs)], PROMPTS[i % len(PROMPTS)]) for i in range(24)]
    alone = {case: generate(stub, request(*case, NEW_TOKENS)) for case in set(cases)}
    with ThreadPoolExecutor(24) as pool:
        together = list(pool.map(lambda case: generate(stub, request(*case, NEW_TOKENS)), cases))
    for case, got in zip(cases, together, strict=True):
        assert_same_generation(got, alone[case])
    assert replica.stats().kv_pages_free == replica.stats().kv_pages_total
    assert replica.stats().slot_refs == 0


def test_more_distinct_adapters_than_slots(stub, replica, store, tmp_path_factory) -> None:
    """4 slots, 7 adapters in flight at once: all complete, each as it does alone."""
    root = tmp_path_factory.mktemp("scaled")
    extra = {f"scaled-{i}": 0.5 + 0.25 * i for i in range(4)}
    upload(
        store,
        [
            (scaled_adapter(EMBEDDED_ADAPTERS_DIR / "docs-prose", root / name, f), name)
            for name, f in extra.items()
        ],
    )
    adapters = [*EMBEDDED_ADAPTERS, *extra]
    assert len(adapters) > replica.stats().slots_total
    with ThreadPoolExecutor(len(adapters) * 2) as pool:
        together = list(
            pool.map(
                lambda i: generate(stub, request(adapters[i % 7], PROMPTS[i % 2], NEW_TOKENS)),
                range(14),
            )
        )
    for i, got in enumerate(together):
        assert_same_generation(
            got, generate(stub, request(adapters[i % 7], PROMPTS[i % 2], NEW_TOKENS))
        )
    distinct = {tuple(g.token_ids) for g in together[:7]}
    assert len(distinct) > 1
