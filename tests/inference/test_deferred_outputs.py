"""Outputs leave one step late: a step's tokens are detokenized and emitted after the next
step's model run is launched (while the GPU computes it), except for sequences with stop
strings, whose text decides whether they end. The engine alone on the tiny model (CPU)."""

from __future__ import annotations

import pytest

from inference_svc.engine.sequence import FinishReason, GenerationParams, Sequence
from tests.inference.test_engine_local import make_runtime


@pytest.fixture(scope="module")
def runtime():  # type: ignore[no-untyped-def]
    return make_runtime("cpu", "float32")


def submit(runtime, request_id: str, events: list, **params) -> Sequence:  # type: ignore[no-untyped-def]
    tokenizer = runtime.tokenizer
    seq = Sequence(
        request_id,
        tokenizer.encode("The quick brown fox"),
        GenerationParams(ignore_eos=True, **params),
        tokenizer,
        (),
        None,
        sink=lambda out: events.append(("output", out.request_id, out)),
    )
    runtime.engine.add_request(seq)
    return seq


def record_launches(runtime, events: list, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    execute = runtime.engine.runner.execute

    def recording(input_ids, batch):  # type: ignore[no-untyped-def]
        events.append(("launch", batch.num_tokens, None))
        return execute(input_ids, batch)

    monkeypatch.setattr(runtime.engine.runner, "execute", recording)


def test_outputs_leave_after_the_next_launch_and_all_arrive(runtime, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    events: list = []
    record_launches(runtime, events, monkeypatch)
    seq = submit(runtime, "plain", events, max_new_tokens=4)
    engine = runtime.engine
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    kinds = [kind for kind, *_ in events]
    # launch(prefill) launch(decode) out#1 launch out#2 launch out#3, then the last output
    # from a step that ran nothing: every output but the last follows a later launch.
    assert kinds == ["launch", "launch", "output", "launch", "output", "launch", "output", "output"]
    assert steps == 5
    outputs = [out for kind, _, out in events if kind == "output"]
    assert [out.token_ids[0] for out in outputs] == seq.output_token_ids
    assert [out.finish_reason for out in outputs] == [None, None, None, FinishReason.LENGTH]
    assert "".join(out.text for out in outputs) == runtime.tokenizer.decode(seq.output_token_ids)
    # The sequence ended (pages and slot freed) with its last token, before its output left.
    assert seq.finish_reason is FinishReason.LENGTH and not seq.pages


def test_stop_string_sequences_emit_in_their_own_step(runtime, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    events: list = []
    record_launches(runtime, events, monkeypatch)
    submit(runtime, "stops", events, max_new_tokens=3, stop=("never appears \u2603",))
    engine = runtime.engine
    while engine.has_work():
        engine.step()
    kinds = [kind for kind, *_ in events]
    assert kinds == ["launch", "output", "launch", "output", "launch", "output"]


def test_cancel_sends_the_tokens_already_made_first(runtime) -> None:  # type: ignore[no-untyped-def]
    events: list = []
    seq = submit(runtime, "cancelled", events, max_new_tokens=8)
    engine = runtime.engine
    engine.step()  # prefill: its token's output waits
    assert engine.has_work() and not [e for e in events if e[0] == "output"]
    assert engine.abort("cancelled")
    outputs = [out for kind, _, out in events if kind == "output"]
    assert [out.finish_reason for out in outputs] == [None, FinishReason.CANCELLED]
    assert outputs[0].token_ids == seq.output_token_ids[:1]
    assert not engine.has_work()


def test_a_failing_output_fails_only_its_request(runtime) -> None:  # type: ignore[no-untyped-def]
    """Detokenizing runs in the flush: when it raises for one request, that request ends
    with an error (pages freed) and the other goes on to its last token."""
    events: list = []
    broken = submit(runtime, "broken", events, max_new_tokens=4)
    healthy = submit(runtime, "healthy", events, max_new_tokens=4)

    def fail(tokens):  # type: ignore[no-untyped-def]
        raise RuntimeError("detokenizer broke")

    broken.detokenizer.add = fail  # type: ignore[method-assign]
    engine = runtime.engine
    while engine.has_work():
        engine.step()
    by_request: dict[str, list] = {}
    for _, request_id, out in events:
        by_request.setdefault(request_id, []).append(out)
    assert [out.finish_reason for out in by_request["broken"]] == [FinishReason.ERROR]
    # Its output failed before it ended: it fails as a step failure, once.
    assert "inside the model step" in str(by_request["broken"][0].error)
    assert broken.finish_reason is FinishReason.ERROR and not broken.pages
    assert [out.finish_reason for out in by_request["healthy"]][-1] is FinishReason.LENGTH
    assert len(healthy.output_token_ids) == 4
