"""`python -m adapter_store.rpc.healthcheck HOST:PORT [CA_PEM]`: exit 0 when the server is
SERVING (CA_PEM: check over TLS, trusting that CA).

Used by compose healthchecks (the images have no grpc_health_probe binary).
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adapter_store.rpc.tls import sync_channel


def is_serving(address: str, timeout_s: float = 3.0, tls_ca: str | None = None) -> bool:
    with sync_channel(address, tls_ca) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


if __name__ == "__main__":
    sys.exit(0 if is_serving(sys.argv[1], tls_ca=sys.argv[2] if len(sys.argv) > 2 else None) else 1)
