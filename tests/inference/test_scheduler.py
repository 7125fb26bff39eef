"""Scheduler invariants, driven step by step without a model: fairness across adapters,
adapters streaming in without holding others up, slot limits, preemption, freeing.

The engine's part (running the batch, appending tokens) is played by `complete`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
from concurrent.futures import Future

import pytest
import torch

from adapter_store.errors import NotFound, ResourceExhausted
from adapter_store.format import CanonicalAdapter
from adapter_store.model_shapes import model_lora_shapes
from inference_svc.adapters.host_cache import HostAdapterCache, HostCacheConfig
from inference_svc.adapters.owned_tensors import OwnedTensorsSource
from inference_svc.adapters.residency import AdapterResidency, HostState
from inference_svc.engine.lora_slots import LoraSlotAllocator
from inference_svc.engine.scheduler import (
    PrefetchTicket,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from inference_svc.engine.sequence import (
    AdapterBinding,
    FinishReason,
    GenerationParams,
    Sequence,
    SequenceStatus,
)
from inference_svc.lora.pool import LoraPool, LoraPoolConfig
from inference_svc.metrics import InferenceMetrics
from inference_svc.model.tiny import EMBEDDED_BASE_DIR
from inference_svc.model.tokenizer import ByteTokenizer
from tests.fixtures.random_adapters import random_adapter

HF_CONFIG = json.loads((EMBEDDED_BASE_DIR / "config.json").read_text())


class FakeSource(OwnedTensorsSource):
    """Random adapters by name; `gate(name)` holds that adapter's download until `open`."""

    tier = "s3"

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}
        self.fetched: list[str] = []

    def gate(self, name: str) -> threading.Event:
        return self.gates.setdefault(name, threading.Event())

    def fetch(self, adapter: AdapterBinding) -> CanonicalAdapter:
        if adapter.name in self.gates:
            self.gates[adapter.name].wait(10)
        if adapter.name.startswith("missing"):
            raise NotFound(f"adapter {adapter.label} is gone")
        self.fetched.append(adapter.name)
        return random_adapter(HF_CONFIG, 4, seed=hash(adapter.name) % 1000, modules=["attn.o"])


def binding(name: str, size_bytes: int = 1000) -> AdapterBinding:
    return AdapterBinding("default", name, 1, 4, "0" * 64, size_bytes, "tiny")


def make_scheduler(
    num_slots=2,
    num_pages=64,
    max_num_seqs=8,
    budget=64,
    page_size=4,
    max_loads_in_flight=8,
    breadth_first_admission=True,
):
    metrics = InferenceMetrics()
    pool_config = LoraPoolConfig(8, dtype=torch.float32, device="cpu", max_loras=num_slots)
    pool = LoraPool(model_lora_shapes(HF_CONFIG), num_slots, pool_config)
    fetched = threading.Event()
    source = FakeSource()
    residency = AdapterResidency(
        source, HostAdapterCache(HostCacheConfig(1 << 28)), pool, metrics, fetched.set
    )
    config = SchedulerConfig(
        num_pages=num_pages,
        page_size=page_size,
        max_model_len=256,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_loads_in_flight=max_loads_in_flight,
        breadth_first_admission=breadth_first_admission,
    )
    scheduler = Scheduler(config, LoraSlotAllocator(num_slots), residency, metrics)
    return scheduler, source, fetched


_ids = iter(range(10**6))


def seq(
    adapter: str | None = None, prompt_len: int = 6, max_new: int = 4, adapter_bytes: int = 1000
) -> Sequence:
    tokenizer = ByteTokenizer(eos_token_ids=(1,))
    return Sequence(
        f"r{next(_ids)}",
        [65] * prompt_len,
        GenerationParams(max_new_tokens=max_new),
        tokenizer,
        (),
        None if adapter is None else binding(adapter, adapter_bytes),
    )


def complete(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after running `out`: advance, append a token, finish."""
    for s in out.scheduled:
        s.seq.num_computed += s.query_len
        if s.seq.num_computed == s.seq.num_tokens:
            s.seq.output_token_ids.append(66)
            if len(s.seq.output_token_ids) >= s.seq.params.max_new_tokens:
                scheduler.finish(s.seq, FinishReason.LENGTH)


def settle(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule until adapters requested so far have arrived (downloads are threads)."""
    for _ in range(200):
        out = scheduler.schedule()
        if not any(scheduler.residency.fetching()):
            return out if out.scheduled else scheduler.schedule()
        complete(scheduler, out)
        threading.Event().wait(0.01)
    raise AssertionError("downloads did not finish")


def step_collecting_failures(scheduler: Scheduler, done) -> list:  # type: ignore[no-untyped-def]
    """Step (downloads are threads) until `done(failures so far)`; the (request, error)
    pairs the steps reported."""
    failures: list = []
    for _ in range(100):
        out = scheduler.schedule()
        failures += out.failed
        complete(scheduler, out)
        if done(failures):
            break
        threading.Event().wait(0.01)
    return failures


def drain(scheduler: Scheduler) -> None:
    for _ in range(1000):
        if not scheduler.has_work():
            return
        complete(scheduler, settle(scheduler))
    raise AssertionError("the scheduler never emptied")


def test_round_robin_over_adapters_lets_a_cold_adapter_in() -> None:
    scheduler, _, _ = make_scheduler(num_slots=2, max_num_seqs=3)
    # Both adapters resident first: otherwise the step that admits depends on which of the
    # two background downloads lands first (a race in the test, not in the scheduler).
    for warm in (seq("hot"), seq("cold")):
        scheduler.add(warm)
    drain(scheduler)
    hot = [seq("hot") for _ in range(10)]
    cold, base = seq("cold"), seq(None)
    for s in [*hot, cold, base]:
        scheduler.add(s)
    first = settle(scheduler)
    admitted = {s.seq.request_id for s in first.scheduled}
    assert {cold.request_id, base.request_id} <= admitted
    assert len(admitted) == 3  # one of the hot requests took the third seat


def test_waiting_adapter_does_not_hold_up_others() -> None:
    scheduler, source, _ = make_scheduler()
    gate = source.gate("slow")
    slow, base, other = seq("slow"), seq(None), seq("fast")
    for s in (slow, base, other):
        scheduler.add(s)
    for _ in range(50):
        out = scheduler.schedule()
        complete(scheduler, out)
        if other.status is SequenceStatus.RUNNING or other.is_finished:
            break
        threading.Event().wait(0.01)
    assert base.status is not SequenceStatus.WAITING
    assert other.status is not SequenceStatus.WAITING
    assert slow.status is SequenceStatus.WAITING and "slow" not in source.fetched
    gate.set()
    drain(scheduler)
    assert slow.finish_reason is FinishReason.LENGTH


class InFlight:
    """A slot copy still running on the GPU's side stream until `land()`."""

    def __init__(self) -> None:
        self.landed = False

    def land(self) -> None:
        self.landed = True

    def done(self) -> bool:
        return self.landed


def copies_in_flight(scheduler: Scheduler, monkeypatch) -> list[InFlight]:  # type: ignore[no-untyped-def]
    """Make every slot copy the scheduler starts an `InFlight` (it lands on `land()`); the
    returned list gets them in the order they start."""
    in_flight: list[InFlight] = []
    load_into_slot = scheduler.residency.load_into_slot

    def issued(slot, key):  # type: ignore[no-untyped-def]
        copy = InFlight()
        in_flight.append(copy)
        return dataclasses.replace(load_into_slot(slot, key), load=copy)

    monkeypatch.setattr(scheduler.residency, "load_into_slot", issued)
    return in_flight


def test_slot_copy_in_flight_holds_up_only_its_own_requests(monkeypatch) -> None:
    """An adapter whose host→GPU copy is still running: its requests start in the first
    step after the copy landed, and the others run meanwhile (the engine makes no step
    wait for a copy)."""
    scheduler, _, _ = make_scheduler()
    copy, issued = InFlight(), []
    load_into_slot = scheduler.residency.load_into_slot

    def in_flight(slot, key):  # type: ignore[no-untyped-def]
        issued.append(key)
        return dataclasses.replace(load_into_slot(slot, key), load=copy)

    monkeypatch.setattr(scheduler.residency, "load_into_slot", in_flight)
    waiting, base = seq("copying"), seq(None, max_new=8)
    scheduler.add(waiting)
    scheduler.add(base)
    for _ in range(200):  # until the download landed and the slot copy was issued
        out = scheduler.schedule()
        assert waiting not in [s.seq for s in out.scheduled]
        complete(scheduler, out)
        if issued:
            break
        threading.Event().wait(0.01)
    assert issued == [waiting.adapter_key]
    for _ in range(3):
        out = scheduler.schedule()
        assert waiting not in [s.seq for s in out.scheduled]
        complete(scheduler, out)
    assert base.status is not SequenceStatus.WAITING
    copy.land()
    out = scheduler.schedule()
    assert waiting in [s.seq for s in out.scheduled]
    complete(scheduler, out)
    drain(scheduler)
    assert waiting.finish_reason is FinishReason.LENGTH


def test_more_adapters_than_slots_wait_for_a_free_slot() -> None:
    scheduler, _, _ = make_scheduler(num_slots=2)
    seqs = [seq(f"a{i}", max_new=3) for i in range(5)]
    for s in seqs:
        scheduler.add(s)
    peak = 0
    for _ in range(500):
        if not scheduler.has_work():
            break
        out = settle(scheduler)
        slots = {s.seq.lora_slot for s in out.scheduled}
        assert len(slots) <= 2 and -1 not in slots
        peak = max(peak, len(slots))
        complete(scheduler, out)
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)
    assert peak == 2
    assert scheduler.slots.metrics().referenced == 0
    assert scheduler.slots.metrics().evictions >= 3


def test_adapters_beyond_the_slots_with_copies_in_flight_all_run(monkeypatch) -> None:
    """More waiting adapters than slots, each slot copy landing one step after it was
    issued (as on the GPU): a slot whose copy is in flight is not taken by the next waiting
    adapter, so every adapter runs. (Before: each step loaded all five into the two slots,
    evicting the copies in flight, and no request ever started: 5457 loads in 60 s on the
    H100's N=1000 offline scenario.)"""
    scheduler, _, _ = make_scheduler(num_slots=2)
    in_flight = copies_in_flight(scheduler, monkeypatch)
    seqs = [seq(f"b{i}", max_new=3) for i in range(5)]
    for s in seqs:
        scheduler.add(s)
    for _ in range(300):
        if not scheduler.has_work():
            break
        out = scheduler.schedule()
        complete(scheduler, out)
        for copy in in_flight:
            copy.land()  # the GPU finishes the copies issued during this step
        if any(scheduler.residency.fetching()):
            threading.Event().wait(0.01)
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)
    metrics = scheduler.slots.metrics()
    assert metrics.loads <= 2 * len(seqs), metrics  # each adapter loaded about once
    assert metrics.referenced == 0  # the copies' references were given back


def test_slot_copies_in_flight_are_capped(monkeypatch) -> None:
    """Six adapters waiting, free slots for all, at most 3 copies in flight: the first three
    start, the next ones only as those land, and every request runs (on the H100, 64 copies
    started at once filled the launch queue and held the engine thread 424 ms)."""
    scheduler, _, _ = make_scheduler(num_slots=8, max_loads_in_flight=3)
    in_flight = copies_in_flight(scheduler, monkeypatch)
    seqs = [seq(f"c{i}", max_new=2) for i in range(6)]
    for s in seqs:
        scheduler.add(s)
    for _ in range(200):  # every download lands; only the first copies start
        assert not scheduler.schedule().scheduled
        if not any(scheduler.residency.fetching()) and len(in_flight) == 3:
            break
        threading.Event().wait(0.01)
    assert not any(scheduler.residency.fetching())
    assert len(in_flight) == 3
    in_flight[0].land()
    out = scheduler.schedule()
    assert len(out.scheduled) == 1  # the landed adapter's request
    assert len(in_flight) == 4  # and one more copy in its place
    complete(scheduler, out)
    for _ in range(100):
        if not scheduler.has_work():
            break
        for copy in in_flight:
            copy.land()
        complete(scheduler, scheduler.schedule())
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)
    assert len(in_flight) == 6


def test_unload_refused_while_the_slot_copy_is_in_flight(monkeypatch) -> None:
    scheduler, _, _ = make_scheduler()
    copy = InFlight()
    load_into_slot = scheduler.residency.load_into_slot
    monkeypatch.setattr(
        scheduler.residency,
        "load_into_slot",
        lambda slot, key: dataclasses.replace(load_into_slot(slot, key), load=copy),
    )
    waiting = seq("landing")
    scheduler.add(waiting)
    for _ in range(200):  # until the download landed and the slot copy was issued
        complete(scheduler, scheduler.schedule())
        if scheduler.slots.slot_of(waiting.adapter_key) is not None:
            break
        threading.Event().wait(0.01)
    with pytest.raises(ResourceExhausted, match="still being loaded"):
        scheduler.unload(waiting.adapter_key)
    copy.land()
    assert scheduler.unload(waiting.adapter_key)  # landed, nobody running on it yet
    assert scheduler.slots.metrics().referenced == 0


def running_request(scheduler: Scheduler, adapter: str | None = None) -> Sequence:
    """A request admitted and decoding, long enough to outlast the test's steps."""
    running = seq(adapter, max_new=200)
    scheduler.add(running)
    settle(scheduler)
    assert running.status is SequenceStatus.RUNNING
    return running


def test_waiting_adapters_are_loaded_while_the_batch_is_full() -> None:
    """The one seat is taken (its adapter holds one of the two slots): the nearest waiting
    adapter is fetched and copied into the free slot meanwhile and starts in the first step
    with room. The next one is fetched but gets no slot: the look-ahead does not evict an
    adapter a waiting request needs (or the two would evict each other step after step).
    The third lies past the horizon (as many adapters as slots) and is not fetched."""
    scheduler, source, _ = make_scheduler(num_slots=2, max_num_seqs=1)
    running = running_request(scheduler, "held")
    nearest, later, last = seq("nearest"), seq("later"), seq("last")
    for s in (nearest, later, last):
        scheduler.add(s)
    for _ in range(100):
        complete(scheduler, scheduler.schedule())
        if scheduler.slots.is_ready(nearest.adapter_key) and "later" in source.fetched:
            break
        threading.Event().wait(0.01)
    for _ in range(5):
        complete(scheduler, scheduler.schedule())
    assert running.status is SequenceStatus.RUNNING
    assert all(s.status is SequenceStatus.WAITING for s in (nearest, later, last))
    assert scheduler.slots.is_ready(nearest.adapter_key)
    assert scheduler.slots.slot_of(later.adapter_key) is None
    assert sorted(source.fetched) == ["held", "later", "nearest"]
    assert (scheduler.slots.metrics().loads, scheduler.slots.metrics().evictions) == (2, 0)
    scheduler.finish(running, FinishReason.CANCELLED)
    out = scheduler.schedule()
    assert [s.seq for s in out.scheduled] == [nearest]
    complete(scheduler, out)
    drain(scheduler)
    assert all(s.finish_reason is FinishReason.LENGTH for s in (nearest, later, last))


def test_a_queued_request_whose_adapter_is_gone_fails_before_its_seat_frees() -> None:
    """The look-ahead's download finds the adapter missing while the batch is still full:
    the queued request gets its NotFound then, not after waiting for a seat."""
    scheduler, _, _ = make_scheduler(max_num_seqs=1)
    running = running_request(scheduler)
    gone = seq("missing-2")
    scheduler.add(gone)
    failures = step_collecting_failures(scheduler, lambda failed: bool(failed))
    assert [(s.request_id, type(e)) for s, e in failures] == [(gone.request_id, NotFound)]
    assert running.status is SequenceStatus.RUNNING
    assert gone.finish_reason is FinishReason.ERROR


def test_a_look_ahead_fetch_takes_only_free_host_cache_room() -> None:
    """A waiting adapter larger than the host cache's free room is not fetched ahead (that
    would evict entries nearer requests may need); it is fetched once its request can
    start."""
    scheduler, source, _ = make_scheduler(max_num_seqs=1)
    capacity = scheduler.residency.host_cache.config.capacity_bytes
    running = running_request(scheduler)
    large = seq("large", adapter_bytes=capacity + 1)
    scheduler.add(large)
    for _ in range(20):
        complete(scheduler, scheduler.schedule())
        threading.Event().wait(0.005)
    assert large.status is SequenceStatus.WAITING
    assert not scheduler.residency.fetching() and "large" not in source.fetched
    scheduler.finish(running, FinishReason.CANCELLED)
    drain(scheduler)
    assert large.finish_reason is FinishReason.LENGTH and source.fetched == ["large"]


def test_preemption_frees_the_youngest_and_recomputes_it() -> None:
    # 4 pages of 4 tokens: two 6-token prompts fit, their decodes soon do not.
    scheduler, _, _ = make_scheduler(num_pages=4, page_size=4)
    old, young = seq(None, prompt_len=6, max_new=8), seq(None, prompt_len=6, max_new=8)
    scheduler.add(old)
    complete(scheduler, scheduler.schedule())
    scheduler.add(young)
    preempted_seen = False
    for _ in range(100):
        if not scheduler.has_work():
            break
        out = scheduler.schedule()
        if young.status is SequenceStatus.WAITING and young.preemptions:
            preempted_seen = True
            assert young.pages == [] and young.num_computed == 0
            assert young.output_token_ids  # kept for the recompute
        complete(scheduler, out)
    assert preempted_seen and old.preemptions == 0
    assert old.finish_reason is young.finish_reason is FinishReason.LENGTH
    assert scheduler.pages.num_free == 4


def complete_overlapped(scheduler: Scheduler, out: SchedulerOutput, launched: list) -> list:
    """What the overlapping engine does after launching `out`: advance the scheduled
    sequences, read back the previous launch (`launched`: append its tokens, finish by
    length), then the sequences `out` sampled hold a pending token. Returns those."""
    sampled = []
    for s in out.scheduled:
        s.seq.num_computed += s.query_len
        if s.seq.num_computed == s.seq.num_tokens:
            sampled.append(s.seq)
    for s in launched:
        s.pending_token = None
        if not s.is_finished:
            s.output_token_ids.append(66)
            if len(s.output_token_ids) >= s.params.max_new_tokens:
                scheduler.finish(s, FinishReason.LENGTH)
    for s in sampled:
        if not s.is_finished:
            s.pending_token = (torch.zeros(len(sampled), dtype=torch.int64), 0)
    return sampled


def test_a_pending_token_is_a_decode_unless_it_ends_the_sequence_by_length() -> None:
    scheduler, _, _ = make_scheduler(page_size=4)
    one, three = seq(None, prompt_len=4, max_new=1), seq(None, prompt_len=4, max_new=3)
    for s in (one, three):
        scheduler.add(s)
    launched = complete_overlapped(scheduler, scheduler.schedule(), [])
    assert one.pending_token is not None and three.pending_token is not None
    out = scheduler.schedule()
    # `one`'s pending token is its last: not run again; `three` decodes it (a 5th token
    # needs a second page).
    assert [(s.seq, s.query_len) for s in out.scheduled] == [(three, 1)]
    assert len(three.pages) == 2 and three.num_tokens == 5 and three.num_host_tokens == 4
    complete_overlapped(scheduler, out, launched)
    assert one.finish_reason is FinishReason.LENGTH and one.pages == []
    assert three.output_token_ids == [66] and three.pending_token is not None


def test_preempted_sequences_restart_only_once_their_pending_token_is_read() -> None:
    scheduler, _, _ = make_scheduler(num_pages=4, page_size=4)
    old, young = seq(None, prompt_len=6, max_new=8), seq(None, prompt_len=6, max_new=8)
    scheduler.add(old)
    launched = complete_overlapped(scheduler, scheduler.schedule(), [])
    scheduler.add(young)
    restarts, preempted_with_token = 0, False
    for _ in range(100):
        if not scheduler.has_work() and not launched:
            break
        out = scheduler.schedule()
        if young.status is SequenceStatus.WAITING and young.pending_token is not None:
            preempted_with_token = True
            assert young not in [s.seq for s in out.scheduled]
        for s in out.scheduled:
            if s.seq.pending_token is not None:  # only ever a decode of the pending token
                assert s.query_len == 1 and s.seq.num_computed == s.seq.num_host_tokens
            if s.seq is young and young.preemptions and s.seq.num_computed == 0:
                restarts += 1
                assert s.query_len == young.num_host_tokens  # prompt and every output token
        launched = complete_overlapped(scheduler, out, launched)
    assert preempted_with_token and restarts == young.preemptions and old.preemptions == 0
    assert old.finish_reason is young.finish_reason is FinishReason.LENGTH
    assert len(young.output_token_ids) == 8 and scheduler.pages.num_free == 4


def test_running_sequences_take_a_page_only_when_they_cross_into_it() -> None:
    scheduler, _, _ = make_scheduler(page_size=4)
    short, long = seq(None, prompt_len=3, max_new=12), seq(None, prompt_len=9, max_new=12)
    for s in (short, long):
        scheduler.add(s)
    for _ in range(11):
        out = scheduler.schedule()
        for s in out.scheduled:
            assert len(s.seq.pages) == -(-(s.seq.num_computed + s.query_len) // 4)
        assert scheduler.pages.num_free == 64 - len(short.pages) - len(long.pages)
        complete(scheduler, out)


def test_failed_download_fails_its_waiters_only() -> None:
    scheduler, _, _ = make_scheduler()
    lost = [seq("missing-1"), seq("missing-1")]
    fine = seq("present")
    for s in [*lost, fine]:
        scheduler.add(s)
    failures = step_collecting_failures(
        scheduler, lambda failed: fine.is_finished and len(failed) == 2
    )
    assert {s.request_id for s, _ in failures} == {s.request_id for s in lost}
    assert all(isinstance(e, NotFound) for _, e in failures)
    assert fine.finish_reason is FinishReason.LENGTH


def test_finish_and_abort_free_pages_and_slot_references() -> None:
    scheduler, _, _ = make_scheduler()
    running, waiting = seq("x", max_new=50), seq("x", prompt_len=200)
    scheduler.add(running)
    settle(scheduler)
    scheduler.add(waiting)
    assert scheduler.slots.refs(binding("x").key) == 1 and running.pages
    scheduler.finish(running, FinishReason.CANCELLED)
    scheduler.finish(waiting, FinishReason.CANCELLED)
    assert scheduler.pages.num_free == 64 and scheduler.slots.refs(binding("x").key) == 0
    assert not scheduler.has_work()


def test_admission_control() -> None:
    scheduler, _, _ = make_scheduler(num_pages=8, page_size=4)
    with pytest.raises(ResourceExhausted, match="max model length"):
        scheduler.add(seq(None, prompt_len=250, max_new=10))
    with pytest.raises(ResourceExhausted, match="KV cache"):
        scheduler.add(seq(None, prompt_len=30, max_new=10))
    for _ in range(scheduler.config.max_waiting):
        scheduler.add(seq(None))
    with pytest.raises(ResourceExhausted, match="queue is full"):
        scheduler.add(seq(None))


def test_a_step_lays_out_decodes_then_prefills_each_grouped_by_adapter() -> None:
    scheduler, _, _ = make_scheduler(num_slots=2, max_num_seqs=12, budget=256)
    for warm in (seq("a"), seq("b")):
        scheduler.add(warm)
    drain(scheduler)
    # Admitted interleaved: a, b, base, a, b, base; then three more prompts arrive.
    early = [seq(name, max_new=8) for _ in range(2) for name in ("a", "b", None)]
    for s in early:
        scheduler.add(s)
    complete(scheduler, settle(scheduler))  # their prompts ran: they decode from now on
    for name in ("b", None, "a"):
        scheduler.add(seq(name))
    out = scheduler.schedule()
    kinds_and_slots = [(s.query_len != 1, s.seq.lora_slot) for s in out.scheduled]
    assert len(out.scheduled) == 9
    assert kinds_and_slots == sorted(kinds_and_slots)  # decodes first, then by slot
    decodes = [s.seq for s in out.scheduled if s.query_len == 1]
    assert len(decodes) == 6
    # Inside one adapter the admission order stays (the sort is stable).
    for slot in {s.lora_slot for s in decodes}:
        same = [s for s in decodes if s.lora_slot == slot]
        assert same == [s for s in early if s.lora_slot == slot]


# -- breadth-first admission --------------------------------------------------------------


def step_until(scheduler: Scheduler, done) -> None:  # type: ignore[no-untyped-def]
    """Step (downloads are threads) until `done()`."""
    for _ in range(200):
        complete(scheduler, scheduler.schedule())
        if done():
            return
        threading.Event().wait(0.01)
    raise AssertionError("the condition never held")


def in_slot(scheduler: Scheduler, name: str) -> None:
    """`name` loaded into a slot and idle there (its request ran and finished)."""
    scheduler.add(seq(name))
    drain(scheduler)
    assert scheduler.slots.is_ready(binding(name).key)


def queued(scheduler: Scheduler, name: str | None, count: int) -> list[Sequence]:
    """`count` requests of `name`, long enough to outlast the test's steps."""
    seqs = [seq(name, max_new=50) for _ in range(count)]
    for s in seqs:
        scheduler.add(s)
    return seqs


def host_cached(scheduler: Scheduler, name: str) -> bool:
    return scheduler.residency.host_state(binding(name).key) is HostState.READY


@contextlib.contextmanager
def outnumbering_slots(scheduler: Scheduler, source: FakeSource, count: int):  # type: ignore[no-untyped-def]
    """`count` more adapters, each with a request waiting on a download that does not finish
    inside the block: they hold nothing back themselves, but make the waiting adapters
    outnumber the slots, which the breadth-first rule needs before it holds anything."""
    gates = [source.gate(f"slow{i}") for i in range(count)]
    try:
        for i in range(count):
            queued(scheduler, f"slow{i}", 1)
        yield
    finally:
        for gate in gates:
            gate.set()


def a_requests_step(
    scheduler: Scheduler, source: FakeSource, count: int = 4, slow: int = 1
) -> tuple[list[Sequence], SchedulerOutput]:
    """`count` requests of `a` queued while `slow` adapters still downloading make the
    waiting adapters outnumber the slots (`outnumbering_slots`), and the step that follows."""
    with outnumbering_slots(scheduler, source, slow):
        a_seqs = queued(scheduler, "a", count)
        return a_seqs, scheduler.schedule()


def a_idle_and_b_copying(
    scheduler: Scheduler,
    monkeypatch,  # type: ignore[no-untyped-def]
    running: str | None = None,
) -> list[InFlight]:
    """`a` idle in its slot and three requests of `b` waiting for b's slot copy, in flight
    (the returned list holds it); `running`: an adapter with a request running meanwhile."""
    in_slot(scheduler, "a")
    if running is not None:
        running_request(scheduler, running)
    in_flight = copies_in_flight(scheduler, monkeypatch)
    queued(scheduler, "b", 3)
    step_until(scheduler, lambda: bool(in_flight))
    return in_flight


@pytest.mark.parametrize("breadth,admitted", [(False, 4), (True, 1)])
def test_breadth_first_admission_holds_repeats_while_a_slot_copy_is_in_flight(
    monkeypatch,  # type: ignore[no-untyped-def]
    breadth: bool,
    admitted: int,
) -> None:
    """`a` is in its slot, `b`'s slot copy is in flight. Breadth-first, the step admits one
    request of `a` (the first pass) and leaves the other seats for `b`'s requests; without
    it, `a`'s repeats fill the step."""
    scheduler, source, _ = make_scheduler(breadth_first_admission=breadth)
    a_idle_and_b_copying(scheduler, monkeypatch)
    a_seqs, out = a_requests_step(scheduler, source)
    assert [s.seq for s in out.scheduled] == a_seqs[:admitted]


def test_breadth_first_admission_holds_nothing_back_while_the_adapters_fit_in_the_slots(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    """`a` and `b` (copy in flight) are all the adapters and there are two slots: both get a
    slot whatever this step admits, so `a`'s repeats fill the step as without the rule."""
    scheduler, _, _ = make_scheduler(breadth_first_admission=True)
    a_idle_and_b_copying(scheduler, monkeypatch)
    a_seqs = queued(scheduler, "a", 4)
    out = scheduler.schedule()
    assert [s.seq for s in out.scheduled] == a_seqs


def test_breadth_first_admission_counts_the_running_requests_adapters(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    """Three slots: `x` runs in one, `a` is idle in one, `b`'s copy takes the third, and
    `slow0` still downloads. The waiting adapters alone (a, b, slow0) would fit; with x's
    they do not, so a's repeats are held back for b."""
    scheduler, source, _ = make_scheduler(num_slots=3, breadth_first_admission=True)
    a_idle_and_b_copying(scheduler, monkeypatch, running="x")
    a_seqs, out = a_requests_step(scheduler, source)
    assert [s.seq for s in out.scheduled if s.query_len > 1] == a_seqs[:1]


def test_breadth_first_admission_does_not_count_slots_pinned_by_other_adapters(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    """Three slots, one pinned by `p` (a LoadAdapter call, no request): a, b and slow0 have
    two slots between them, so a's repeats are held back for b."""
    scheduler, source, _ = make_scheduler(num_slots=3, breadth_first_admission=True)
    pinned: Future = Future()
    scheduler.prefetch(PrefetchTicket(binding("p"), pin=True, future=pinned))
    step_until(scheduler, pinned.done)
    assert scheduler.slots.is_pinned(binding("p").key)
    a_idle_and_b_copying(scheduler, monkeypatch)
    a_seqs, out = a_requests_step(scheduler, source)
    assert [s.seq for s in out.scheduled] == a_seqs[:1]


def test_breadth_first_admission_goes_round_robin_once_the_copy_has_landed(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    scheduler, source, _ = make_scheduler(breadth_first_admission=True)
    in_flight = a_idle_and_b_copying(scheduler, monkeypatch)
    with outnumbering_slots(scheduler, source, 1):
        queued(scheduler, "a", 4)
        complete(scheduler, scheduler.schedule())
        assert [s.adapter.name for s in scheduler.running] == ["a"]
        in_flight[0].land()
        out = scheduler.schedule()
    assert len(out.scheduled) == 7  # a's decode and six prompts
    assert [s.adapter.name for s in scheduler.running] == ["a", "b", "a", "b", "a", "b", "a"]


@pytest.mark.parametrize("breadth,admitted", [(False, 3), (True, 1)])
def test_breadth_first_admission_holds_repeats_for_a_host_cached_adapter_with_a_free_slot(
    monkeypatch,  # type: ignore[no-untyped-def]
    breadth: bool,
    admitted: int,
) -> None:
    """`c` is in the host cache and a slot is free for it; its copy waits only for the
    in-flight cap (taken by a LoadAdapter's copy of `d`). It could start any step, so a
    breadth-first step admits one request of `a` only."""
    scheduler, source, _ = make_scheduler(
        num_slots=4, max_loads_in_flight=1, breadth_first_admission=breadth
    )
    in_slot(scheduler, "a")
    in_flight = copies_in_flight(scheduler, monkeypatch)
    scheduler.prefetch(PrefetchTicket(binding("d"), pin=False, future=Future()))
    step_until(scheduler, lambda: bool(in_flight))
    queued(scheduler, "c", 2)
    step_until(scheduler, lambda: host_cached(scheduler, "c"))
    assert len(in_flight) == 1 and scheduler.slots.slot_of(binding("c").key) is None
    a_seqs, out = a_requests_step(scheduler, source, count=3, slow=3)
    assert [s.seq for s in out.scheduled] == a_seqs[:admitted]


def test_breadth_first_admission_ignores_a_host_cached_adapter_with_no_slot_to_take() -> None:
    """The one slot is held by `a`'s running request: `c` (host cached) cannot be copied
    until it frees, so it does not hold `a`'s requests back."""
    scheduler, _, _ = make_scheduler(num_slots=1, breadth_first_admission=True)
    running_request(scheduler, "a")
    queued(scheduler, "c", 2)
    step_until(scheduler, lambda: host_cached(scheduler, "c"))
    a_seqs = queued(scheduler, "a", 3)
    out = scheduler.schedule()
    assert [s.seq for s in out.scheduled if s.query_len > 1] == a_seqs


def test_breadth_first_admission_ignores_an_adapter_still_being_fetched() -> None:
    """A download can take ~0.5 s: an adapter not in the host cache yet holds nobody back."""
    scheduler, source, _ = make_scheduler(num_slots=1, breadth_first_admission=True)
    in_slot(scheduler, "a")
    gate = source.gate("slow")
    try:
        queued(scheduler, "slow", 2)
        complete(scheduler, scheduler.schedule())
        assert scheduler.residency.host_state(binding("slow").key) is HostState.FETCHING
        a_seqs = queued(scheduler, "a", 4)
        out = scheduler.schedule()
        assert [s.seq for s in out.scheduled] == a_seqs
    finally:
        gate.set()


def test_breadth_first_admission_holds_back_no_base_model_request(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    """While `a`'s repeats are held back for `b` (copy in flight), base-model requests,
    which need no slot, keep being admitted pass after pass."""
    scheduler, source, _ = make_scheduler(breadth_first_admission=True)
    a_idle_and_b_copying(scheduler, monkeypatch)
    with outnumbering_slots(scheduler, source, 1):
        queued(scheduler, None, 3)
        queued(scheduler, "a", 3)
        out = scheduler.schedule()
    names = [None if s.seq.adapter is None else s.seq.adapter.name for s in out.scheduled]
    assert sorted(names, key=str) == [None, None, None, "a"]


def test_breadth_first_admission_leaves_base_model_requests_alone() -> None:
    """With the one slot taken by `a` and a second adapter waiting (so the rule is armed),
    base-model requests are neither held back nor hold anything back."""
    scheduler, source, _ = make_scheduler(num_slots=1, breadth_first_admission=True)
    in_slot(scheduler, "a")
    with outnumbering_slots(scheduler, source, 1):
        queued(scheduler, None, 3)
        queued(scheduler, "a", 3)
        out = scheduler.schedule()
    assert len(out.scheduled) == 6
    names = [None if s.adapter is None else s.adapter.name for s in scheduler.running]
    assert names == [None, "a", None, "a", None, "a"]
