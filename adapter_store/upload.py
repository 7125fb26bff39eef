"""Receiving an upload: the header, then a PEFT folder's files in chunks, with the limits
enforced as the bytes arrive (a client cannot make the store read more than the limit)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from adapter_store.errors import InvalidArgument, ResourceExhausted
from adapter_store.format import DTYPES
from adapter_store.names import check_filename, check_labels, check_name

MiB = 1024 * 1024
MAX_DESCRIPTION_LENGTH = 4096


@dataclass(frozen=True)
class UploadLimits:
    max_total_bytes: int = 4096 * MiB
    max_files: int = 16

    def __post_init__(self) -> None:
        if self.max_total_bytes <= 0 or self.max_files <= 0:
            raise ValueError("upload limits must be positive")


@dataclass(frozen=True)
class UploadSpec:
    """What the header of an upload asks for; validated on construction."""

    name: str
    base_model: str
    description: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    dtype: str = ""  # "" keeps the dtype of the PEFT weights

    def __post_init__(self) -> None:
        check_name(self.name, "adapter name")
        check_name(self.base_model, "base_model")
        check_labels(self.labels)
        if len(self.description) > MAX_DESCRIPTION_LENGTH:
            raise InvalidArgument(f"description is longer than {MAX_DESCRIPTION_LENGTH} characters")
        if self.dtype and self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")


@dataclass(frozen=True)
class FilePiece:
    """One chunk of one file, in stream order."""

    filename: str
    data: bytes


async def collect_files(pieces: AsyncIterator[FilePiece], limits: UploadLimits) -> dict[str, bytes]:
    """Assemble the files of an upload stream: {filename: bytes}.

    Chunks of one file are contiguous (a new name closes the previous file). Raises
    ResourceExhausted the moment a limit is passed, before reading the rest of the stream.
    """
    # Each file's chunks as they came, joined once at the end (adapter_store.byte_pieces says why).
    files: dict[str, list[bytes]] = {}
    current: str | None = None
    total = 0
    async for piece in pieces:
        if piece.filename != current:
            check_filename(piece.filename)
            if piece.filename in files:
                raise InvalidArgument(
                    f"file {piece.filename!r} was sent twice (its chunks must be contiguous)"
                )
            if len(files) >= limits.max_files:
                raise ResourceExhausted(f"upload has more than {limits.max_files} files")
            files[piece.filename] = []
            current = piece.filename
        total += len(piece.data)
        if total > limits.max_total_bytes:
            raise ResourceExhausted(
                f"upload is larger than the limit of {limits.max_total_bytes} bytes"
            )
        files[current].append(piece.data)
    if not files:
        raise InvalidArgument("upload has no files (expected a PEFT adapter folder)")
    return {name: b"".join(chunks) for name, chunks in files.items()}
