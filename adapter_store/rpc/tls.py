"""Optional TLS for both servers and their clients: PEM files in, gRPC credentials out.

Servers take `--tls-cert`/`--tls-key` (both or neither); clients take `--tls-ca`, the PEM of
the certificate authority (or the self-signed certificate itself) to trust. Without them,
plain TCP, for loopback and private networks.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import grpc

from adapter_store.errors import InvalidArgument
from adapter_store.rpc.settings import add_flag

ChannelOptions = Sequence[tuple[str, int | str]]


def _read_pem(path: str | Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise InvalidArgument(f"{what} {str(path)!r} cannot be read: {error}") from None
    if b"-----BEGIN " not in data:
        raise InvalidArgument(f"{what} {str(path)!r} is not a PEM file")
    return data


def server_credentials(
    cert_path: str | Path | None, key_path: str | Path | None
) -> grpc.ServerCredentials | None:
    """TLS credentials for a server, or None (plain TCP) when neither file is given."""
    if cert_path is None and key_path is None:
        return None
    if cert_path is None or key_path is None:
        raise InvalidArgument("TLS needs both --tls-cert and --tls-key (or neither)")
    pair = (_read_pem(key_path, "TLS key"), _read_pem(cert_path, "TLS certificate"))
    return grpc.ssl_server_credentials([pair])


def client_credentials(ca_path: str | Path) -> grpc.ChannelCredentials:
    """Credentials that trust the CA (or self-signed certificate) in `ca_path`."""
    return grpc.ssl_channel_credentials(root_certificates=_read_pem(ca_path, "TLS CA"))


def aio_channel(
    address: str, tls_ca: str | Path | None, options: ChannelOptions = ()
) -> grpc.aio.Channel:
    """An asyncio channel to `address`: TLS when `tls_ca` is given, else plain TCP."""
    if tls_ca is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, client_credentials(tls_ca), options=list(options))


def sync_channel(
    address: str, tls_ca: str | Path | None, options: ChannelOptions = ()
) -> grpc.Channel:
    """The blocking twin of `aio_channel` (health checks, scripts)."""
    if tls_ca is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, client_credentials(tls_ca), options=list(options))


def add_tls_server_flags(parser: argparse.ArgumentParser) -> None:
    """`--tls-cert` / `--tls-key` (env LORASERVE_TLS_CERT / LORASERVE_TLS_KEY)."""
    add_flag(parser, "--tls-cert", default=None, help="PEM certificate chain: serve TLS")
    add_flag(parser, "--tls-key", default=None, help="PEM private key of --tls-cert")
