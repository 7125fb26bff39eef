"""The store's gRPC failures as domain errors, so they reach our clients with a status code
and a message that says the store was the one that answered."""

from __future__ import annotations

import grpc

from adapter_store import errors
from adapter_store.errors import LoraserveError

_BY_CODE: dict[grpc.StatusCode, type[LoraserveError]] = {
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
}


def is_store_down(error: grpc.RpcError) -> bool:
    """Whether the store could not answer (as opposed to answering no)."""
    return error.code() in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    )


def from_store_error(error: grpc.RpcError, address: str, what: str) -> LoraserveError:
    """A domain error for a failed store call about `what` (e.g. "adapter 'x'")."""
    if is_store_down(error):
        return errors.Unavailable(
            f"the adapter store at {address} is unavailable ({error.code().name}: "
            f"{error.details()}); {what} cannot be resolved"
        )
    error_class = _BY_CODE.get(error.code(), errors.Unavailable)
    return error_class(f"{what}: {error.details()}")
