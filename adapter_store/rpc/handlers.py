"""One decorator for every servicer method: domain errors → gRPC status, one log line each.

Servicers stay thin (proto → domain call → proto); everything they raise that is a
`LoraserveError` reaches the client as its status code and message. Anything else is a bug:
it is logged with its traceback and the client gets INTERNAL with a short message, never the
traceback.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from adapter_store.errors import LoraserveError

log = logging.getLogger("loraserve.rpc")


def _peer_tenant(context: grpc.aio.ServicerContext) -> str:
    """The tenant an auth interceptor attached to the call, or '-' when auth is off."""
    for key, value in context.invocation_metadata() or ():
        if key == "x-loraserve-tenant":
            return value
    return "-"


def _log_line(method: str, context: Any, code: grpc.StatusCode, started: float, note: str) -> None:
    elapsed_ms = (time.perf_counter() - started) * 1000.0
    tenant = _peer_tenant(context) if context is not None else "-"
    log.info(
        "rpc method=%s status=%s ms=%.1f tenant=%s%s",
        method,
        code.name,
        elapsed_ms,
        tenant,
        f" {note}" if note else "",
    )


async def _abort(context: grpc.aio.ServicerContext, error: BaseException) -> grpc.StatusCode:
    if isinstance(error, LoraserveError):
        await context.abort(error.code, str(error))
    log.exception("unhandled error in RPC", exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}")
    raise AssertionError("unreachable: context.abort raises")


def _status_of(error: BaseException) -> grpc.StatusCode:
    return error.code if isinstance(error, LoraserveError) else grpc.StatusCode.INTERNAL


def rpc_method(func: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a unary or server-streaming async servicer method."""
    method = func.__name__

    if inspect.isasyncgenfunction(func):

        @functools.wraps(func)
        async def stream_wrapper(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                async for item in func(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            except Exception as error:  # noqa: BLE001 - mapped to a status below
                code = _status_of(error)
                _log_line(method, context, code, started, f"error={str(error)[:200]!r}")
                await _abort(context, error)
            finally:
                if code == grpc.StatusCode.OK:
                    _log_line(method, context, code, started, "")

        return stream_wrapper

    @functools.wraps(func)
    async def unary_wrapper(self: Any, request: Any, context: Any) -> Any:
        started = time.perf_counter()
        try:
            response = await func(self, request, context)
        except grpc.aio.AbortError:
            _log_line(method, context, context.code() or grpc.StatusCode.UNKNOWN, started, "")
            raise
        except Exception as error:  # noqa: BLE001 - mapped to a status below
            _log_line(method, context, _status_of(error), started, f"error={str(error)[:200]!r}")
            await _abort(context, error)
        _log_line(method, context, grpc.StatusCode.OK, started, "")
        return response

    return unary_wrapper
