"""Steps overlap: step n+1 is launched before step n's tokens are read back, and step n's
outputs are made (detokenized, emitted) after that launch, while the GPU computes it. A
sampled token waits on the device as its sequence's pending token; a sequence that its
pending token ends by length is not run again, and one that it ends otherwise (EOS, stop
id, stop string) drops the token of the step already launched for it. The engine alone on
the tiny model (CPU).
"""

from __future__ import annotations

import time

import pytest
import torch

from inference_svc.adapters.embedded_source import embedded_binding
from inference_svc.engine.sampling import SamplingParams
from inference_svc.engine.sequence import FinishReason, GenerationParams, Sequence
from tests.inference.test_engine_local import CASES, make_runtime


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


def run_to_end(runtime) -> int:  # type: ignore[no-untyped-def]
    steps = 0
    while runtime.engine.has_work():
        runtime.engine.step()
        steps += 1
    return steps


def greedy_tokens(runtime, count: int) -> list[int]:  # type: ignore[no-untyped-def]
    seq = submit(runtime, "probe", [], max_new_tokens=count)
    run_to_end(runtime)
    return seq.output_token_ids


def test_stop_string_sequences_are_launched_before_their_text_is_known(
    runtime, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    events: list = []
    record_launches(runtime, events, monkeypatch)
    submit(runtime, "stops", events, max_new_tokens=3, stop=("never appears \u2603",))
    run_to_end(runtime)
    kinds = [kind for kind, *_ in events]
    assert kinds == ["launch", "launch", "output", "launch", "output", "output"]


@pytest.mark.parametrize("ending", ["stop_token_ids", "stop"])
def test_an_ending_read_back_late_drops_the_launched_token(runtime, monkeypatch, ending) -> None:  # type: ignore[no-untyped-def]
    """Token 2 ends the sequence (a stop id, or a stop string in its text); step 3 was
    launched before token 2 was read back: its token is dropped, the pages freed."""
    expected = greedy_tokens(runtime, 4)
    events: list = []
    record_launches(runtime, events, monkeypatch)
    if ending == "stop":
        # The text of token 2 alone, found in the text only once token 2 is there.
        stop = runtime.tokenizer.decode(expected[1:2])
        params = {"stop": (stop,)}
        if not stop.strip() or stop in runtime.tokenizer.decode(expected[:1]):
            pytest.skip("token 2 has no text of its own in this tiny model")
    else:
        params = {"stop_token_ids": (expected[1],)}
        if expected[0] == expected[1]:
            pytest.skip("tokens 1 and 2 are equal in this tiny model")
    seq = submit(runtime, "ends", events, max_new_tokens=8, **params)
    run_to_end(runtime)
    launches = [e for e in events if e[0] == "launch"]
    outputs = [out for kind, _, out in events if kind == "output"]
    assert len(launches) == 3  # prefill, token 1's decode, token 2's decode (dropped)
    assert seq.output_token_ids == expected[:2]
    assert [out.finish_reason for out in outputs] == [None, FinishReason.STOP]
    assert [t for out in outputs for t in out.token_ids] == expected[:2]
    assert seq.pages == [] and seq.pending_token is None
    assert runtime.engine.scheduler.pages.num_free == runtime.engine.scheduler.config.num_pages


def test_a_last_pending_token_is_read_without_another_launch(runtime, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    events: list = []
    record_launches(runtime, events, monkeypatch)
    seq = submit(runtime, "one", events, max_new_tokens=1)
    steps = run_to_end(runtime)
    # Step 2 runs nothing: it reads token 1 back, which ends the sequence by length.
    assert [kind for kind, *_ in events] == ["launch", "output"] and steps == 2
    assert seq.finish_reason is FinishReason.LENGTH and len(seq.output_token_ids) == 1


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


def test_overlapped_steps_give_the_tokens_of_steps_read_back_at_once() -> None:
    """Base and adapter requests, greedy and seeded sampling, ending by length or stop id:
    the same tokens and logprobs with and without the overlap."""
    results = []
    for overlap in (True, False):
        runtime = make_runtime("cpu", "float32")
        runtime.engine.overlap_steps = overlap
        tokenizer = runtime.tokenizer
        seqs = []
        for i, (adapter, prompt) in enumerate(CASES * 2):
            sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=i) if i % 2 else None
            params = GenerationParams(
                max_new_tokens=3 + i,
                ignore_eos=True,
                logprobs=True,
                # Ids the tiny model makes 2nd in two of these requests (greedy, seeded).
                stop_token_ids=(281, 325) if i % 3 == 0 else (),
                sampling=sampling or SamplingParams(),
            )
            logprobs: list[float] = []
            seq = Sequence(
                f"r{i}", tokenizer.encode(prompt), params, tokenizer, (), None,
                sink=lambda out, got=logprobs: got.extend(out.logprobs),
            )  # fmt: skip
            seq.adapter = embedded_binding(adapter) if adapter else None
            runtime.engine.add_request(seq)
            seqs.append((seq, logprobs))
        deadline = time.monotonic() + 120
        while runtime.engine.has_work():
            if runtime.engine.step() == 0:
                time.sleep(0.005)  # adapters streaming in
            assert time.monotonic() < deadline
        results.append([(s.output_token_ids, got, s.finish_reason) for s, got in seqs])
    overlapped, at_once = results
    # A row dropped after a late ending changes the next step's batch, so float32 logprobs
    # may differ in the last bits (the CPU matmuls are not batch invariant); tokens may not.
    assert [(t, r) for t, _, r in overlapped] == [(t, r) for t, _, r in at_once]
    for (tokens, got, _), (_, expected, _) in zip(overlapped, at_once, strict=True):
        assert len(got) == len(tokens)
        assert torch.allclose(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=0)
    assert {reason for *_, reason in overlapped} == {FinishReason.LENGTH, FinishReason.STOP}
