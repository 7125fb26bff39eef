"""Domain errors that carry their gRPC status code; the servicer layer maps them to statuses."""

from __future__ import annotations

import grpc


class LoraserveError(Exception):
    """Base error: the message is shown to the client, so it must say what to fix."""

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
