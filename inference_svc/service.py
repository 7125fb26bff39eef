"""The inference service's operations, independent of gRPC: resolve the adapter, tokenize,
hand the request to the engine thread, stream its outputs; the adapter control calls.

Generation ends in the engine the moment the caller stops listening (client cancellation or
deadline: the stream is closed and `abort` frees the request's pages and slot reference).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass

from adapter_store.errors import InvalidArgument, LoraserveError
from adapter_store.names import parse_ref
from adapter_store.tenant_limits import UNLIMITED, ConcurrencyGate
from inference_svc.adapters.caller import ANONYMOUS, Caller
from inference_svc.adapters.resolver import AdapterResolver
from inference_svc.adapters.tenants import CallerTenants
from inference_svc.engine.engine import EngineStats, LLMEngine, LoadedAdapterInfo
from inference_svc.engine.engine_loop import EngineLoop
from inference_svc.engine.scheduler import PrefetchTicket
from inference_svc.engine.sequence import (
    AdapterBinding,
    FinishReason,
    GenerationParams,
    Sequence,
    SequenceOutput,
)
from inference_svc.metrics import InferenceMetrics
from inference_svc.model.tokenizer import Tokenizer

log = logging.getLogger("loraserve.requests")


@dataclass(frozen=True)
class GenerateInput:
    request_id: str
    adapter_ref: str  # "" for the base model
    prompt: str
    prompt_token_ids: list[int]  # used when not empty
    params: GenerationParams
    caller: Caller = ANONYMOUS  # checked by the store (adapter lookup or WhoAmI)


@dataclass(frozen=True)
class PreparedRequest:
    input: GenerateInput
    prompt_token_ids: list[int]
    adapter: AdapterBinding | None
    tenant: str  # the caller's tenant (the store said so), for per-tenant limits

    @property
    def adapter_version(self) -> int:
        return 0 if self.adapter is None else self.adapter.version


class InferenceService:
    def __init__(
        self,
        engine: LLMEngine,
        loop: EngineLoop,
        resolver: AdapterResolver,
        tenants: CallerTenants,
        tokenizer: Tokenizer,
        vocab_size: int,
        metrics: InferenceMetrics,
        tenant_max_concurrent: int = UNLIMITED,
    ) -> None:
        self._engine = engine
        self._loop = loop
        self._resolver = resolver
        self._tenants = tenants
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._metrics = metrics
        # Per-tenant Generate streams on this replica, counted like the store's RPCs.
        self._tenant_gate = ConcurrencyGate()
        self._tenant_max_concurrent = tenant_max_concurrent

    # -- Generate -------------------------------------------------------------------------

    async def prepare(self, request: GenerateInput) -> PreparedRequest:
        """Resolve the adapter and tokenize; raises the error the client should get."""
        if request.prompt_token_ids:
            ids = list(request.prompt_token_ids)
            bad = [t for t in ids if not 0 <= t < self._vocab_size]
            if bad:
                raise InvalidArgument(
                    f"prompt_token_ids: {bad[:5]} outside the vocabulary [0, {self._vocab_size})"
                )
        else:
            ids = self._tokenizer.encode(request.prompt)
        if not ids:
            raise InvalidArgument("the prompt is empty (set prompt or prompt_token_ids)")
        if not request.adapter_ref:
            # No adapter lookup to authenticate the caller: ask the store who they are.
            tenant = await self._tenants.tenant_of(request.caller)
            return PreparedRequest(request, ids, None, tenant)
        adapter = await self._resolver.resolve(request.adapter_ref, request.caller)
        self._tenants.remember(request.caller, adapter.tenant)
        return PreparedRequest(request, ids, adapter, adapter.tenant)

    async def stream(self, prepared: PreparedRequest) -> AsyncIterator[SequenceOutput]:
        """Run the request; yields its outputs as the engine makes them. Raises the
        request's error (after admission: RESOURCE_EXHAUSTED, adapter load failures, …)."""
        with self._tenant_gate.admit(
            prepared.tenant, self._tenant_max_concurrent, "--tenant-max-concurrent"
        ):
            loop = asyncio.get_running_loop()
            outputs: asyncio.Queue[SequenceOutput] = asyncio.Queue()
            request = prepared.input
            seq = Sequence(
                request.request_id,
                prepared.prompt_token_ids,
                request.params,
                self._tokenizer,
                self._tokenizer.eos_token_ids,
                prepared.adapter,
                sink=lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out),
            )
            started = time.monotonic()
            try:
                await self._loop.run(lambda: self._engine.add_request(seq))
            except LoraserveError as error:
                self._metrics.rejected.labels(error.code.name).inc()
                raise
            ended: FinishReason | None = None
            generated, first_token_s = 0, None
            try:
                while True:
                    output = await outputs.get()
                    if output.error is not None:
                        ended = FinishReason.ERROR
                        raise output.error
                    if output.token_ids and first_token_s is None:
                        first_token_s = time.monotonic()
                    generated += len(output.token_ids)
                    ended = output.finish_reason
                    yield output
                    if ended is not None:
                        return
            finally:
                if ended is None:  # the caller went away: free the request's resources now
                    self._loop.call(lambda: self._engine.abort(request.request_id))
                reason = ended or FinishReason.CANCELLED
                self._log_request(prepared, reason, generated, started, first_token_s)

    @staticmethod
    def _log_request(
        prepared: PreparedRequest,
        reason: FinishReason,
        generated: int,
        started: float,
        first_token_s: float | None,
    ) -> None:
        now = time.monotonic()
        adapter = "-" if prepared.adapter is None else prepared.adapter.label
        ttft = "-" if first_token_s is None else f"{(first_token_s - started) * 1000:.1f}"
        log.info(
            "request id=%s adapter=%s prompt_tokens=%d generated_tokens=%d finish=%s "
            "ttft_ms=%s total_ms=%.1f",
            prepared.input.request_id,
            adapter,
            len(prepared.prompt_token_ids),
            generated,
            reason.value,
            ttft,
            (now - started) * 1000,
        )

    # -- adapter control ------------------------------------------------------------------

    async def load_adapter(
        self, ref: str, pin: bool, caller: Caller = ANONYMOUS
    ) -> tuple[LoadedAdapterInfo, float]:
        """Bring `ref` into a GPU slot (and pin it); returns where it is and the load ms."""
        adapter = await self._resolver.resolve(ref, caller)
        self._tenants.remember(caller, adapter.tenant)
        future: Future[float] = Future()
        ticket = PrefetchTicket(adapter, pin, future)
        await self._loop.run(lambda: self._engine.prefetch(ticket))
        try:
            seconds = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            raise
        loaded = await self._loop.run(self._engine.loaded_adapters)
        info = next(a for a in loaded if (a.tenant, a.name, a.version) == adapter.key)
        return info, seconds * 1000.0

    async def unload_adapter(self, ref: str, caller: Caller = ANONYMOUS) -> bool:
        """Unpin and drop the caller's tenant's `name@N`, or every version of `name`, from
        the GPU and host (also versions the store no longer has)."""
        parsed = parse_ref(ref)
        tenant = await self._tenants.tenant_of(caller)

        def unload() -> bool:
            keys = [
                (a.tenant, a.name, a.version)
                for a in self._engine.loaded_adapters()
                if (a.tenant, a.name) == (tenant, parsed.name)
                and (parsed.version is None or a.version == parsed.version)
            ]
            return any([self._engine.unload(key) for key in keys])

        return await self._loop.run(unload)

    async def list_loaded(
        self, caller: Caller = ANONYMOUS
    ) -> tuple[list[LoadedAdapterInfo], EngineStats]:
        """The caller's tenant's resident adapters, and the replica's slot counts."""
        tenant = await self._tenants.tenant_of(caller)
        loaded, stats = await self._loop.run(
            lambda: (self._engine.loaded_adapters(), self._engine.stats())
        )
        return [a for a in loaded if a.tenant == tenant], stats
