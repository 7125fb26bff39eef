"""The engine step: schedule → launch → read the previous step back, on one thread.

`LLMEngine` is single-threaded and has no clock of its own: `EngineLoop`
(`inference_svc.engine.engine_loop`) drives it from a dedicated thread, and CPU tests can
drive `step()` directly. Outputs leave through each sequence's sink.

A step that raises is retried one sequence at a time, so a request whose step fails is
finished with an error and the others go on (re-running a sequence rewrites the same KV
rows, so the retry is exact).

Steps overlap: step n+1 is scheduled, laid out and launched before step n's tokens are
read back, so the host's work runs while the GPU computes step n (on a GPU the read-back
is what waits for it). Each sampled token stays on the device as its sequence's
`pending_token` until then; step n+1 feeds it to the model straight from the device. A
sequence whose pending token ends it by length is not scheduled again; one that it ends
by EOS, a stop id or a stop string was already launched in step n+1, and that row's token
is dropped when step n+1 is read back (its KV rows land in pages that only later steps,
on the same stream, can reuse). Reading step n back applies each token (endings first),
then detokenizes and emits the outputs, still while the GPU computes step n+1.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import torch
from torch import Tensor

from adapter_store.errors import FailedPrecondition, LoraserveError
from inference_svc.adapters.residency_publisher import ResidencyEntry
from inference_svc.engine.batch import SequenceStep, build_batch
from inference_svc.engine.model_runner import ModelRunner
from inference_svc.engine.sampling import (
    SampledOnHost,
    SampleOutput,
    make_generator,
    sample,
)
from inference_svc.engine.scheduler import (
    PrefetchTicket,
    ScheduledSeq,
    Scheduler,
    SchedulerOutput,
)
from inference_svc.engine.sequence import (
    AdapterKey,
    FinishReason,
    Sequence,
    SequenceOutput,
)
from inference_svc.engine.uploads import to_device
from inference_svc.metrics import BASE_LABEL, InferenceMetrics

log = logging.getLogger("loraserve.engine")


class RequestFailed(LoraserveError):
    """A request's own step raised: it is finished, the server goes on (gRPC INTERNAL)."""


def non_finite_logits(seq: Sequence) -> LoraserveError:
    """The error that ends a request whose logits came out NaN or infinite. Every sampled
    token's logprob (from the unmodified logits) is read back anyway, and it is finite
    exactly when its logits row is: the check costs the step nothing. With an adapter, the
    adapter is the likely cause (finite weights can still overflow the compute dtype), and
    FAILED_PRECONDITION says "this adapter cannot be served as it is"."""
    where = f"request {seq.request_id}: the logits of output token {len(seq.output_token_ids)}"
    if seq.adapter is None:
        return RequestFailed(f"{where} of the base model are not finite (NaN or inf)")
    return FailedPrecondition(
        f"{where} with adapter {seq.adapter.label} are not finite (NaN or inf): its weights "
        "overflow the serving dtype; the request is ended"
    )


@dataclass(frozen=True)
class LoadedAdapterInfo:
    """One adapter version this replica holds (ListLoadedAdapters)."""

    tenant: str
    name: str
    version: int
    tier: str  # "gpu" | "host" | "loading"
    slot: int  # -1 when not in a GPU slot
    rank: int
    pinned: bool
    last_used: str  # RFC 3339 UTC, "" when never used
    size_bytes: int
    active_requests: int


@dataclass(frozen=True)
class LaunchedStep:
    """A launched step whose sampled tokens are not read back yet: `drawn` row i is the
    next token of `seqs[i]`."""

    seqs: list[Sequence]
    drawn: SampleOutput
    on_host: SampledOnHost  # the copy of `drawn` to the host, queued right after sampling


@dataclass(frozen=True, slots=True)
class AcceptedToken:
    """A sampled token applied to its sequence, its output not made yet."""

    seq: Sequence
    token: int
    logprob: float
    reason: FinishReason | None  # the ending it caused
    first: bool  # the request's first token: its latency is the TTFT, else the ITL
    latency_s: float


@dataclass(frozen=True)
class EngineStats:
    waiting: int
    running: int
    kv_pages_free: int
    kv_pages_total: int
    slots_total: int
    slots_used: int
    slot_refs: int


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        metrics: InferenceMetrics,
        overlap_steps: bool = True,
    ):
        self.runner = runner
        self.overlap_steps = overlap_steps
        self.scheduler = scheduler
        self.metrics = metrics
        self.device = runner.device
        self.page_size = scheduler.config.page_size
        metrics.kv_pages_total.set(scheduler.config.num_pages)
        metrics.slots_total.set(scheduler.slots.max_loras)
        # Accepted tokens whose outputs are not made yet, in the order they were sampled.
        self._pending_outputs: list[AcceptedToken] = []
        self._launched: LaunchedStep | None = None  # the step not read back yet

    # -- requests -------------------------------------------------------------------------

    def add_request(self, seq: Sequence) -> None:
        """Queue `seq`; raises ResourceExhausted when admission control refuses it."""
        seq.generator = make_generator(seq.params.sampling.seed, self.device)
        self.scheduler.add(seq)
        self.metrics.queue_depth.set(self.scheduler.num_waiting)

    def abort(self, request_id: str) -> bool:
        """Client cancelled or its deadline passed: free its pages and slot now."""
        seq = self.scheduler.get(request_id)
        if seq is None:
            return False
        # The tokens it was already given leave before the cancel: read the launched step
        # back (a sync, only on a cancel) and emit what waits.
        self._read_back()
        self._flush_outputs()
        if seq.is_finished:  # its last token was among them
            return True
        self._finish(seq, FinishReason.CANCELLED)
        self._emit(seq, SequenceOutput(request_id, [], "", [], None, FinishReason.CANCELLED))
        return True

    def prefetch(self, ticket: PrefetchTicket) -> None:
        self.scheduler.prefetch(ticket)

    def has_work(self) -> bool:
        return (
            self.scheduler.has_work() or bool(self._pending_outputs) or self._launched is not None
        )

    def fail_all(self, error: LoraserveError) -> None:
        """Last resort after a scheduler bug: end every request with `error`."""
        for seq in list(self.scheduler.running) + self.scheduler.waiting():
            self._fail(seq, error)

    # -- the step -------------------------------------------------------------------------

    def step(self) -> int:
        """One scheduling round; returns the number of tokens run (0: nothing to run)."""
        out = self._schedule()
        if not out.scheduled and self._launched is not None:
            # Nothing to run until the launched step is read back (its sequences all end
            # by length, or a preempted one waits for its token): read it, schedule again.
            self._read_back()
            out = self._schedule()
        if not out.scheduled:
            self._read_back()
            self._flush_outputs()
            self._update_gauges()
            return 0
        num_tokens = out.num_tokens  # a sum over the scheduled sequences: computed once
        # Observed before the outputs leave, so a client that reads the metrics once its
        # stream ends finds its last step counted.
        self.metrics.batch_tokens.observe(num_tokens)
        self.metrics.batch_seqs.observe(len(out.scheduled))
        adapters = {s.seq.adapter_key for s in out.scheduled} - {None}
        self.metrics.batch_adapters.observe(len(adapters))
        launched = self._launch(out.scheduled)
        self._read_back()  # the previous step, while the GPU runs this one
        self._set_pending(launched)
        if not self.overlap_steps:
            self._read_back()  # this step too: the host waits for it
        self._flush_outputs()
        self._update_gauges()
        return num_tokens

    def _schedule(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        for seq, error in out.failed:
            self._emit_error(seq, error)
        return out

    def _run(self, scheduled: list[ScheduledSeq]) -> list[tuple[list[ScheduledSeq], Tensor]]:
        """The logits of each model run: one run of the whole step, or after a failure one
        per sequence (a sequence whose own run fails is left out)."""
        try:
            return [(scheduled, self._execute(scheduled))]
        except Exception as exc:
            if len(scheduled) == 1:
                self._fail_step(scheduled[0].seq, exc)
                return []
            log.warning(
                "a step of %d sequences raised %s; running them one by one",
                len(scheduled),
                type(exc).__name__,
            )
        runs = []
        for one in scheduled:
            try:
                runs.append(([one], self._execute([one])))
            except Exception as exc:
                self._fail_step(one.seq, exc)
        return runs

    def _execute(self, scheduled: list[ScheduledSeq]) -> Tensor:
        steps = [self._sequence_step(s) for s in scheduled]
        runner = self.runner
        batch = build_batch(
            steps, self.page_size, self.device, runner.lora_slot_rank, runner.lora_slot_routed
        )
        return runner.execute(self._input_ids(scheduled), batch)  # [L, V]

    def _input_ids(self, scheduled: list[ScheduledSeq]) -> Tensor:
        """int64 [T] token ids of the step: known ones from the host, pending ones gathered
        on the device from the launched step's samples (one copy up, no sync)."""
        input_ids: list[int] = []
        pending_rows: list[int] = []  # rows of input_ids that take a pending token
        source_rows: list[int] = []  # its row in the launched step's samples
        sampled: Tensor | None = None
        for s in scheduled:
            seq = s.seq
            start, end = seq.num_computed, seq.num_computed + s.query_len
            known_end = min(end, seq.num_host_tokens)
            input_ids += seq.token_ids(start, known_end)
            if end > known_end:  # the one pending token, the last
                if seq.pending_token is None or end != known_end + 1:
                    raise RuntimeError(f"{seq.request_id}: tokens to {end}, {known_end} known")
                tokens, row = seq.pending_token
                if sampled is not None and tokens is not sampled:
                    raise RuntimeError("pending tokens from two launched steps")
                sampled = tokens
                pending_rows.append(len(input_ids))
                source_rows.append(row)
                input_ids.append(0)
        num_tokens, num_pending = len(input_ids), len(pending_rows)
        packed = to_device(torch.tensor(input_ids + pending_rows + source_rows), self.device)
        ids = packed[:num_tokens]
        if sampled is not None:
            rows = packed[num_tokens : num_tokens + num_pending]
            ids.index_copy_(0, rows, sampled.index_select(0, packed[num_tokens + num_pending :]))
        return ids

    @staticmethod
    def _sequence_step(s: ScheduledSeq) -> SequenceStep:
        seq = s.seq
        return SequenceStep(
            seq.num_computed, s.query_len, tuple(seq.pages), s.all_logits, seq.lora_slot
        )

    @staticmethod
    def _row_spans(scheduled: list[ScheduledSeq]) -> list[tuple[int, int]]:
        """[first, end) logits rows of each scheduled sequence in its run's logits: its new
        tokens (prompt logprobs) or its last one."""
        spans, row = [], 0
        for s in scheduled:
            end = row + (s.query_len if s.all_logits else 1)
            spans.append((row, end))
            row = end
        return spans

    def _launch(self, scheduled: list[ScheduledSeq]) -> LaunchedStep | None:
        """Run the model on `scheduled` and draw the next token of every sequence that
        reaches its last token, on the device (None: no sequence samples)."""
        seqs: list[Sequence] = []
        picked: list[tuple[Tensor, int]] = []  # (run logits, row) that samples seqs[i]
        for run, logits in self._run(scheduled):
            for s, (first, end) in zip(run, self._row_spans(run), strict=True):
                seq = s.seq
                if s.all_logits:
                    self._score_prompt(seq, logits[first:end])
                seq.num_computed += s.query_len
                if s.query_len > 1:
                    self.metrics.prefill_tokens.inc(s.query_len)
                # A sequence can end after its step was launched (its previous output
                # failed in the flush): it gets no further token.
                if seq.num_computed == seq.num_tokens and not seq.is_finished:
                    seqs.append(seq)
                    picked.append((logits, end - 1))
        if not seqs:
            return None
        logits = _sampled_rows(picked)  # [B, V]
        drawn = sample(logits, [s.params.sampling for s in seqs], [s.generator for s in seqs])
        return LaunchedStep(seqs, drawn, drawn.start_host_copy())

    def _set_pending(self, launched: LaunchedStep | None) -> None:
        """Make `launched` the step to read back next; its tokens become pending."""
        self._launched = launched
        if launched is None:
            return
        for row, seq in enumerate(launched.seqs):
            if not seq.is_finished:
                seq.pending_token = (launched.drawn.token_ids, row)

    def _read_back(self) -> None:
        """Read the launched step's tokens to the host (waiting for its GPU work) and apply
        them; sequences that ended meanwhile drop theirs."""
        launched, self._launched = self._launched, None
        if launched is None:
            return
        token_ids, logprobs = launched.on_host.to_lists()
        for seq in launched.seqs:
            seq.pending_token = None
        live = [i for i, seq in enumerate(launched.seqs) if not seq.is_finished]
        self._count_generated([launched.seqs[i] for i in live])
        for i in live:
            seq, token, logprob = launched.seqs[i], token_ids[i], logprobs[i]
            if not math.isfinite(logprob):
                self._fail(seq, non_finite_logits(seq))
                continue
            try:
                if seq.params.stop:
                    self._append_token(seq, token, logprob)
                else:
                    self._pending_outputs.append(self._accept_token(seq, token, logprob))
            except Exception as exc:
                self._fail_step(seq, exc)

    def _count_generated(self, seqs: list[Sequence]) -> None:
        """Count one generated token of each of `seqs`: one increment per adapter label,
        not one labelled-child lookup and increment per token."""
        self.metrics.generated_tokens.inc(len(seqs))
        for label, count in collections.Counter(map(_adapter_label, seqs)).items():
            self.metrics.adapter_tokens.labels(label).inc(count)

    def _score_prompt(self, seq: Sequence, rows: Tensor) -> None:
        """Row j of a chunk starting at position p predicts the token at p + j + 1."""
        start = seq.num_computed
        first = len(seq.prompt_logprobs) + 1  # next prompt position to score
        last = min(start + rows.shape[0], len(seq.prompt_token_ids) - 1)
        if last < first:
            return
        picked = rows[first - start - 1 : last - start].float()  # [n, V]
        targets = torch.tensor(seq.prompt_token_ids[first : last + 1], device=rows.device)
        logprobs = torch.log_softmax(picked, dim=-1).gather(1, targets[:, None]).squeeze(1)
        seq.prompt_logprobs.extend(logprobs.tolist())

    def _accept_token(
        self, seq: Sequence, token: int, logprob: float, stopped: bool = False
    ) -> AcceptedToken:
        """What a new token changes for scheduling: its id appended and the endings that
        need no text (or `stopped`: a stop string in the text), the sequence finished at
        once on one. Its latency is measured now and observed with its output."""
        now = time.monotonic()
        first = seq.first_token_s is None
        latency = now - (seq.arrival_s if first else (seq.last_token_s or now))
        if first:
            seq.first_token_s = now
        seq.last_token_s = now
        seq.output_token_ids.append(token)
        reason = None
        if stopped or token in seq.params.stop_token_ids:
            reason = FinishReason.STOP
        elif token in seq.eos_token_ids:
            reason = FinishReason.EOS
        elif (
            len(seq.output_token_ids) >= seq.params.max_new_tokens
            or seq.num_tokens >= self.scheduler.config.max_model_len
        ):
            reason = FinishReason.LENGTH
        if reason is not None:
            self._finish(seq, reason)
        return AcceptedToken(seq, token, logprob, reason, first, latency)

    def _observe_latency(self, accepted: AcceptedToken) -> None:
        histogram = self.metrics.ttft if accepted.first else self.metrics.itl
        histogram.observe(accepted.latency_s)

    def _append_token(self, seq: Sequence, token: int, logprob: float) -> None:
        """A sequence with stop strings: its text decides whether it ends, so the text is
        made, and the output emitted, now."""
        delta = seq.detokenizer.add([token])
        accepted = self._accept_token(seq, token, logprob, delta.stopped)
        self._observe_latency(accepted)
        text = delta.text
        if accepted.reason is not None and not delta.stopped:
            text += seq.detokenizer.finish()
        self._emit(seq, self._token_output(accepted, text))

    def _flush_outputs(self) -> None:
        """Detokenize and emit the accepted tokens whose outputs wait (see the module
        docstring), in order, observing their latencies first."""
        pending, self._pending_outputs = self._pending_outputs, []
        for accepted in pending:
            seq = accepted.seq
            try:
                self._observe_latency(accepted)
                text = seq.detokenizer.add([accepted.token]).text
                if accepted.reason is not None:
                    text += seq.detokenizer.finish()
                self._emit(seq, self._token_output(accepted, text))
            except Exception as exc:
                if seq.is_finished:
                    log.error("output of request %s failed", seq.request_id, exc_info=exc)
                    self._emit_error(
                        seq,
                        RequestFailed(
                            f"request {seq.request_id} failed "
                            f"making its output ({type(exc).__name__})"
                        ),
                    )
                else:
                    self._fail_step(seq, exc)

    def _token_output(self, accepted: AcceptedToken, text: str) -> SequenceOutput:
        seq = accepted.seq
        return SequenceOutput(
            seq.request_id,
            [accepted.token],
            text,
            [accepted.logprob] if seq.params.logprobs else [],
            self._take_prompt_logprobs(seq),
            accepted.reason,
        )

    def _take_prompt_logprobs(self, seq: Sequence) -> list[float] | None:
        if not seq.params.prompt_logprobs or seq.prompt_logprobs_sent:
            return None
        seq.prompt_logprobs_sent = True
        return list(seq.prompt_logprobs)

    # -- endings --------------------------------------------------------------------------

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.finish(seq, reason)
        self.metrics.requests.labels(_adapter_label(seq), reason.value).inc()
        # Before the final output leaves: a client that reads the metrics after its stream
        # ends sees its pages freed, and an abort while idle has no later step to do it.
        self._update_gauges()

    def _fail_step(self, seq: Sequence, exc: Exception) -> None:
        log.error("request %s failed in its step", seq.request_id, exc_info=exc)
        error = RequestFailed(
            f"request {seq.request_id} failed inside the model step ({type(exc).__name__})"
        )
        self._fail(seq, error)

    def _fail(self, seq: Sequence, error: LoraserveError) -> None:
        self._finish(seq, FinishReason.ERROR)
        self._emit_error(seq, error)

    def _emit_error(self, seq: Sequence, error: LoraserveError) -> None:
        self._flush_outputs()  # tokens it was already given leave first
        output = SequenceOutput(seq.request_id, [], "", [], None, FinishReason.ERROR, error)
        self._emit(seq, output)

    def _emit(self, seq: Sequence, output: SequenceOutput) -> None:
        if seq.sink is None:
            return
        try:
            seq.sink(output)
        except RuntimeError:  # the client's event loop is gone (server shutting down)
            log.debug("dropped output of %s: no receiver", seq.request_id)

    # -- state for the control RPCs, metrics and the residency publisher ------------------

    def stats(self) -> EngineStats:
        s = self.scheduler
        slots = s.slots.metrics()
        return EngineStats(
            waiting=s.num_waiting,
            running=s.num_running,
            kv_pages_free=s.pages.num_free,
            kv_pages_total=s.config.num_pages,
            slots_total=slots.max_loras,
            slots_used=slots.occupied,
            slot_refs=sum(s.slots.refs(key) for key, _ in s.slots.resident()),
        )

    def _update_gauges(self) -> None:
        s = self.scheduler
        self.metrics.queue_depth.set(s.num_waiting)
        self.metrics.running.set(s.num_running)
        self.metrics.kv_pages_used.set(s.config.num_pages - s.pages.num_free)
        self.metrics.slots_used.set(s.slots.metrics().occupied)
        s.residency.update_gauges()

    def loaded_adapters(self) -> list[LoadedAdapterInfo]:
        """Every adapter version on the GPU, in the host cache, or being fetched."""
        residency = self.residency
        slots = self.scheduler.slots
        found: dict[AdapterKey, LoadedAdapterInfo] = {}

        def info(key: AdapterKey, tier: str, slot: int, size: int) -> LoadedAdapterInfo:
            binding = residency.bindings[key]
            used = residency.last_used.get(key)
            return LoadedAdapterInfo(
                tenant=binding.tenant,
                name=binding.name,
                version=binding.version,
                tier=tier,
                slot=slot,
                rank=binding.rank,
                pinned=slots.is_pinned(key),
                last_used="" if used is None else _rfc3339(used),
                size_bytes=size,
                active_requests=slots.refs(key),
            )

        for key in residency.fetching():
            found[key] = info(key, "loading", -1, residency.bindings[key].size_bytes)
        for entry in residency.host_entries():
            found[entry.key] = info(entry.key, "host", -1, entry.size_bytes)
        for key, slot in slots.resident():
            size = found[key].size_bytes if key in found else residency.bindings[key].size_bytes
            found[key] = info(key, "gpu", slot, size)
        return sorted(found.values(), key=lambda a: (a.tenant, a.name, a.version))

    def residency_entries(self) -> list[ResidencyEntry]:
        """What the residency publisher writes to Redis."""
        return [
            ResidencyEntry(
                a.tenant, a.name, a.version, a.tier, None if a.slot < 0 else a.slot, a.pinned
            )
            for a in self.loaded_adapters()
            if a.tier in ("gpu", "host")
        ]

    def residency_token(self) -> tuple[int, ...]:
        """Changes whenever residency may have changed (cheap to poll every step)."""
        host = self.residency.host_cache.metrics()
        return (self.scheduler.residency_version, host.inserts, host.evictions, host.entries)

    @property
    def residency(self):
        return self.scheduler.residency

    def unload(self, key: AdapterKey) -> bool:
        return self.scheduler.unload(key)


def _sampled_rows(picked: list[tuple[Tensor, int]]) -> Tensor:
    """[B, V] stack of the picked logits rows. When they are all the rows of one run in
    order (every decode step) that is the run's logits as they are: no B row views and
    no copy."""
    logits = picked[0][0]
    if len(picked) == logits.shape[0] and all(
        run is logits and row == i for i, (run, row) in enumerate(picked)
    ):
        return logits
    return torch.stack([run[row] for run, row in picked])


def _adapter_label(seq: Sequence) -> str:
    return BASE_LABEL if seq.adapter is None else seq.adapter.name


def _rfc3339(unix_s: float) -> str:
    return (
        datetime.fromtimestamp(unix_s, UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )
