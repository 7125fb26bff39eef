"""Pieces kept apart, hashed as they arrive, joined once."""

from __future__ import annotations

import hashlib
import os

from adapter_store.byte_pieces import HashedPieces


def test_join_digest_and_size_are_those_of_the_whole() -> None:
    pieces_in = [os.urandom(n) for n in (0, 1, 4096, 3, 1 << 20, 17)]
    whole = b"".join(pieces_in)
    pieces = HashedPieces()
    for piece in pieces_in:
        pieces.append(piece)
    assert pieces.size == len(whole)
    assert pieces.hexdigest() == hashlib.sha256(whole).hexdigest()
    assert pieces.join() == whole


def test_nothing_appended_is_the_empty_string() -> None:
    pieces = HashedPieces()
    assert (pieces.size, pieces.hexdigest(), pieces.join()) == (
        0,
        hashlib.sha256(b"").hexdigest(),
        b"",
    )


def test_copy_out_reads_across_pieces_and_skips_empty_ones() -> None:
    pieces = HashedPieces()
    for piece in (b"", b"ab", b"", b"cde", b"f"):
        pieces.append(piece)
    for offset, length in ((0, 6), (1, 2), (2, 3), (5, 1), (3, 0)):
        dest = bytearray(length)
        pieces.copy_out(offset, memoryview(dest))
        assert bytes(dest) == b"abcdef"[offset : offset + length]
