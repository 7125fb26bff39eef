"""Bytes that arrive in pieces (ranged GETs, stream messages), kept as the pieces (and
hashed as they come where the whole file's digest is what verifies them); read out by
range (adapter_store.safetensors_pieces) or joined once.

Why not a bytearray filled piece by piece and copied to bytes at the end: for a 553 MB
adapter that touches every page of two fresh allocations of the whole size, and the page
faults cost more than the download (S3 → host on the 2-core machine: ~0.3 s to allocate
and zero the buffer, 0.65-1.1 s for the copy, against 0.6 s of ranged GETs). Pieces of a few
MB reuse freed heap memory, and each piece is hashed while later ones are still arriving.
The S3 fetcher goes one step further: its ranged GETs land in a buffer it reuses across
fetches (inference_svc.adapters.download_buffers), handed here as one piece.
"""

from __future__ import annotations

import bisect
import hashlib


class BytePieces:
    """Pieces in order and their total size (each already verified by whoever
    appends it: `adapter_store.format.Manifest.part_sha256`)."""

    def __init__(self) -> None:
        self._pieces: list[bytes | memoryview] = []
        self._starts: list[int] = []  # each piece's offset in the whole
        self.size = 0

    def append(self, piece: bytes | memoryview) -> None:
        self._pieces.append(piece)
        self._starts.append(self.size)
        self.size += len(piece)

    def copy_out(self, offset: int, dest: memoryview) -> None:
        """dest[:] = whole[offset : offset + len(dest)], from the pieces that hold it."""
        if offset < 0 or offset + len(dest) > self.size:
            raise ValueError(f"bytes {offset}..{offset + len(dest)} are outside 0..{self.size}")
        index = bisect.bisect_right(self._starts, offset) - 1
        written = 0
        while written < len(dest):
            start = offset + written - self._starts[index]
            chunk = memoryview(self._pieces[index])[start : start + len(dest) - written]
            dest[written : written + len(chunk)] = chunk
            written += len(chunk)
            index += 1

    def join(self) -> bytes:
        """The whole, once; the pieces are let go."""
        whole = b"".join(self._pieces)
        self._pieces, self._starts = [], []
        return whole


class HashedPieces(BytePieces):
    """Pieces in arrival order, their running sha256 and total size."""

    def __init__(self) -> None:
        super().__init__()
        self._sha256 = hashlib.sha256()

    def append(self, piece: bytes | memoryview) -> None:
        self._sha256.update(piece)  # releases the GIL for large pieces
        super().append(piece)

    def hexdigest(self) -> str:
        return self._sha256.hexdigest()
