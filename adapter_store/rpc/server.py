"""Server lifecycle shared by both services: health, reflection, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger("loraserve.server")

# In-flight RPCs get this long to finish after SIGTERM before they are cancelled.
DEFAULT_GRACE_S = 10.0


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )


async def serve_forever(
    *,
    port: int,
    service_names: Sequence[str],
    register: Callable[[grpc.aio.Server], None],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    host: str = "[::]",
    credentials: grpc.ServerCredentials | None = None,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Run a grpc.aio server until SIGTERM/SIGINT, then drain and stop.

    `register` adds the service's servicers; health (`grpc.health.v1`) and reflection for
    `service_names` are added here. `ready` is called with the bound port once serving.
    """
    server = grpc.aio.server(
        interceptors=list(interceptors),
        options=[
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ],
    )
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [
            *service_names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    address = f"{host}:{port}"
    bound = (
        server.add_secure_port(address, credentials)
        if credentials is not None
        else server.add_insecure_port(address)
    )
    await server.start()
    for name in ("", *service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on port %d", ", ".join(service_names), bound)
    if ready is not None:
        ready(bound)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    log.info("shutting down: draining in-flight RPCs for up to %.0f s", grace_s)
    for name in ("", *service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace_s)
    if on_shutdown is not None:
        await on_shutdown()
    log.info("stopped")
