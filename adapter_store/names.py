"""Validation of everything a client names: adapters, base models, tenants, refs, labels,
uploaded file names.

Validated names are the only client text that ever reaches a Redis key or an S3 key, and the
pattern admits no separator (`/`, `:`) of either, so no escaping is needed downstream.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from adapter_store.errors import InvalidArgument

MAX_NAME_LENGTH = 128
MAX_LABELS = 32
MAX_LABEL_LENGTH = 63
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_LABEL = re.compile(r"[A-Za-z0-9._-]+")
# PEFT folder files: a plain name, no directories, no hidden files.
_FILENAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")


def check_name(value: str, field: str) -> str:
    """Return `value` if it is a valid adapter/base-model/tenant name, else InvalidArgument."""
    if not value:
        raise InvalidArgument(f"{field} is empty")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidArgument(f"{field} is longer than {MAX_NAME_LENGTH} characters")
    if not _NAME.fullmatch(value) or ".." in value:
        raise InvalidArgument(
            f"{field} {value[:MAX_NAME_LENGTH]!r} may use only letters, digits and '-_.', "
            "must start with a letter or digit and may not contain '..'"
        )
    return value


@dataclass(frozen=True)
class AdapterRef:
    """`name` (latest version: `version is None`) or `name@N`."""

    name: str
    version: int | None = None

    def __str__(self) -> str:
        return self.name if self.version is None else f"{self.name}@{self.version}"


def parse_ref(ref: str) -> AdapterRef:
    """`"name"` → latest, `"name@N"` → version N (N ≥ 1)."""
    name, sep, version = ref.partition("@")
    check_name(name, "adapter ref name")
    if not sep:
        return AdapterRef(name)
    if not version.isdigit() or int(version) < 1 or len(version) > 18:
        raise InvalidArgument(f"adapter ref {ref[:160]!r}: version must be a positive integer")
    return AdapterRef(name, int(version))


def check_labels(labels: dict[str, str], field: str = "labels") -> dict[str, str]:
    """Labels are small `key=value` pairs of label-safe characters."""
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"{field}: at most {MAX_LABELS} labels, got {len(labels)}")
    for key, value in labels.items():
        for part, text in (("key", key), ("value", value)):
            if len(text) > MAX_LABEL_LENGTH or not _LABEL.fullmatch(text):
                raise InvalidArgument(
                    f"{field}: label {part} {text[:80]!r} must be 1-{MAX_LABEL_LENGTH} "
                    "letters, digits or '-_.'"
                )
    return dict(labels)


def check_filename(value: str) -> str:
    """A file of a PEFT folder: a plain name, never a path."""
    if not _FILENAME.fullmatch(value) or ".." in value:
        raise InvalidArgument(
            f"upload file name {value[:200]!r} must be a plain file name "
            "(letters, digits, '-_.', no directories)"
        )
    return value
