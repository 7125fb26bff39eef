"""Domain errors that carry their gRPC status code.

Handlers raise these; one interceptor (`adapter_store.grpc_errors`) turns them into a
status with the message. The message is for a person: it names the key, field or shape that
is wrong, never a stack trace. Shared by both services.
"""

from __future__ import annotations

import grpc


class LoraserveError(Exception):
    """Base of all domain errors; `code` is the gRPC status the client sees."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(LoraserveError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(LoraserveError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(LoraserveError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(LoraserveError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(LoraserveError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(LoraserveError):
    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(LoraserveError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(LoraserveError):
    code = grpc.StatusCode.PERMISSION_DENIED


class DataLoss(LoraserveError):
    """Bytes that do not match their checksum (a corrupt or truncated transfer)."""

    code = grpc.StatusCode.DATA_LOSS
