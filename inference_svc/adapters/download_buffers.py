"""Host buffers that S3 downloads are read into, kept between fetches.

A fetch reads each ranged GET straight into its place in one buffer of the weights' size
(botocore's `readinto`), hashes and parses the bytes there (the host cache packs views of
them: inference_svc.adapters.s3_fetch.fetch_into), then hands the buffer back.
Reading each part into a fresh `bytes` object instead touched newly mapped pages on every
fetch: on the 2-core CI machine, per 553 MiB adapter, 100-141 k page faults and 0.36-0.56 s
of system time, against 12 k and 0.16 s into a buffer used before (download 1046-1248 ms
against 927-1025 ms; docs/benchmarks.md, thirty-fourth session). Idle buffers are kept up
to `keep_bytes` in all; a larger one is let go when its fetch ends.

Thread-safe: concurrent fetches each hold a buffer of their own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

# Buffers are sized in steps of this (or of the next power of two below it), so one buffer
# serves adapters of similar sizes.
GRANULE = 64 << 20


def buffer_size(nbytes: int) -> int:
    """The size of the buffer allocated for a download of `nbytes` (≥ 1)."""
    step = min(GRANULE, 1 << max(nbytes - 1, 0).bit_length())
    return -(-nbytes // step) * step


class DownloadBuffers:
    """A pool of reusable `bytearray`s; at most `keep_bytes` of them kept while idle."""

    def __init__(self, keep_bytes: int) -> None:
        if keep_bytes < 0:
            raise ValueError(f"keep_bytes must be >= 0, got {keep_bytes}")
        self.keep_bytes = keep_bytes
        self._idle: list[bytearray] = []
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(len(buffer) for buffer in self._idle)

    def acquire(self, nbytes: int) -> bytearray:
        """A buffer of at least `nbytes` that no one else holds: the smallest idle one that
        fits, else a new one (`buffer_size`)."""
        if nbytes < 1:
            raise ValueError(f"a download buffer holds >= 1 byte, asked for {nbytes}")
        with self._lock:
            fitting = [buffer for buffer in self._idle if len(buffer) >= nbytes]
            if fitting:
                chosen = min(fitting, key=len)
                self._idle.remove(chosen)
                return chosen
        return bytearray(buffer_size(nbytes))

    def release(self, buffer: bytearray) -> None:
        """Hand `buffer` back: kept for the next fetch while the idle ones, it included,
        stay within keep_bytes; the smaller ones are let go first to make room."""
        with self._lock:
            if any(idle is buffer for idle in self._idle):
                raise ValueError("download buffer released twice")
            if len(buffer) > self.keep_bytes:
                return
            self._idle.sort(key=len, reverse=True)
            while self._idle and sum(map(len, self._idle)) + len(buffer) > self.keep_bytes:
                self._idle.pop()
            self._idle.append(buffer)

    @contextmanager
    def lease(self, nbytes: int) -> Iterator[memoryview]:
        """`acquire`d for the block, as a view of exactly `nbytes`; released after it."""
        buffer = self.acquire(nbytes)
        try:
            yield memoryview(buffer)[:nbytes]
        finally:
            self.release(buffer)
