"""Runs an `LLMEngine` on a dedicated thread and bridges it to asyncio.

The model step is CPU/GPU bound, so it never runs on the event loop. Everything that
touches engine state (new requests, aborts, control RPCs) is a callable put in the inbox
and run on the engine thread between steps; results come back through
`concurrent.futures.Future`s (`await loop.run(fn)`), streamed outputs through each
sequence's sink (`call_soon_threadsafe` into an `asyncio.Queue`).

The thread blocks on the inbox when there is nothing to do, and waits at most
`idle_wait_s` when requests wait only for adapters being fetched (a finished fetch wakes it
at once through `wake`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from adapter_store.errors import LoraserveError
from inference_svc.engine.engine import LLMEngine

log = logging.getLogger("loraserve.engine")

T = TypeVar("T")


class EngineFailure(LoraserveError):
    """The engine itself failed (a bug); running requests end with INTERNAL."""


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        idle_wait_s: float = 0.05,
        on_residency_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._on_residency_change = on_residency_change
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._residency_token: tuple[int, ...] = ()

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self.wake()
        self._thread.join(timeout_s)

    def wake(self) -> None:
        """Make an idle loop look at its work again (thread-safe)."""
        self._inbox.put(_nothing)

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread; the future gets its result or exception."""
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._inbox.put(run)
        return future

    async def run(self, fn: Callable[[], T]) -> T:
        """`call` from asyncio."""
        return await asyncio.wrap_future(self.call(fn))

    def _drain(self, timeout_s: float | None) -> None:
        """Run what is in the inbox; block up to `timeout_s` for the first item (None:
        until one arrives)."""
        try:
            item = self._inbox.get(timeout=timeout_s) if timeout_s != 0 else None
        except queue.Empty:
            return
        while True:
            if item is not None:
                item()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._drain(0 if self.engine.has_work() else None)
            if self._stopping.is_set():
                return
            try:
                tokens = self.engine.step()
            except Exception as exc:  # a scheduler bug: keep the server up
                log.exception("engine step failed; failing its requests")
                self.engine.fail_all(EngineFailure(f"engine failure ({type(exc).__name__})"))
                tokens = 0
            self._publish_residency()
            if tokens == 0 and self.engine.has_work():
                self._drain(self.idle_wait_s)

    def _publish_residency(self) -> None:
        token = self.engine.residency_token()
        if token != self._residency_token:
            self._residency_token = token
            self._on_residency_change()


def _nothing() -> None:
    return None
