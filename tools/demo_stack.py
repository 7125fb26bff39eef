"""The demo's running stack: Redis, SeaweedFS, the adapter store and the inference service,
started detached under one state dir and recorded in `<state dir>/stack.json`, so that a
later `make demo` reuses it and `make down` stops it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from adapter_store.rpc.healthcheck import is_serving
from tools.stack import (
    RedisServer,
    SeaweedS3Server,
    Server,
    ServiceProcess,
    from_record,
    to_record,
)

STACK_FILE = "stack.json"
BUCKET = "loraserve-demo"
BASE_MODEL = "tiny"
# The one identity the demo's SeaweedFS accepts, given to it and to both services.
S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "loraserve-demo",
    "AWS_SECRET_ACCESS_KEY": "loraserve-demo",
    "AWS_DEFAULT_REGION": "us-east-1",
}
COMPONENTS = ("redis", "s3", "store", "inference")  # start order; stopped in reverse

Say = Callable[[str], None]


@dataclass
class DemoStack:
    state_dir: Path
    redis: RedisServer | None = None
    s3: SeaweedS3Server | None = None
    store: ServiceProcess | None = None
    inference: ServiceProcess | None = None

    def started(self) -> list[tuple[str, Server]]:
        return [(name, s) for name in COMPONENTS if (s := getattr(self, name)) is not None]

    def save(self) -> None:
        records = {name: to_record(server) for name, server in self.started()}
        (self.state_dir / STACK_FILE).write_text(json.dumps(records, indent=1) + "\n")

    def is_up(self) -> bool:
        """Every part recorded, its process running, and both services SERVING."""
        if len(self.started()) < len(COMPONENTS):
            return False
        if any(server.process.poll() is not None for _, server in self.started()):
            return False
        return is_serving(self.store.address) and is_serving(self.inference.address)

    def stop(self, say: Say) -> None:
        for name, server in reversed(self.started()):
            if server.process.poll() is None:
                say(f"stopping {name} (pid {server.process.pid})")
            server.stop()


def load(state_dir: Path) -> DemoStack | None:
    """The stack an earlier run recorded in `state_dir`, or None."""
    path = state_dir / STACK_FILE
    if not path.is_file():
        return None
    records = json.loads(path.read_text())
    classes = {"redis": RedisServer, "s3": SeaweedS3Server}
    stack = DemoStack(state_dir)
    for name, record in records.items():
        setattr(stack, name, from_record(classes.get(name, ServiceProcess), record))
    return stack


def start(state_dir: Path, model: str, say: Say) -> DemoStack:
    """Start all four parts detached, recording each as soon as it runs (so that `down`
    can clean up after a start that failed half way)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    stack = DemoStack(state_dir)
    logs = state_dir / "logs"

    say("starting Redis")
    stack.redis = RedisServer(state_dir / "redis", detached=True)
    _start_recorded(stack, stack.redis)
    say(f"  Redis      {stack.redis.url}")

    say("starting SeaweedFS (S3 gateway)")
    stack.s3 = SeaweedS3Server(state_dir / "s3", env=S3_CREDENTIALS, detached=True)
    _start_recorded(stack, stack.s3)
    say(f"  S3         {stack.s3.endpoint_url}")

    storage = [
        "--redis-url",
        stack.redis.url,
        "--s3-endpoint-url",
        stack.s3.endpoint_url,
        "--s3-bucket",
        BUCKET,
    ]
    say("starting the adapter store")
    stack.store = ServiceProcess("adapter_store", storage, logs, env=S3_CREDENTIALS, detached=True)
    _start_recorded(stack, stack.store)
    say(f"  store      {stack.store.address}")

    say(f"starting the inference service (model {model}, CPU, float32)")
    stack.inference = ServiceProcess(
        "inference_svc",
        ["--store", stack.store.address, "--model", model, "--base-model", BASE_MODEL]
        + ["--device", "cpu", "--dtype", "float32", "--max-loras", "4", *storage],
        logs,
        env=S3_CREDENTIALS,
        detached=True,
    )
    _start_recorded(stack, stack.inference)
    say(f"  inference  {stack.inference.address}")
    return stack


def _start_recorded(stack: DemoStack, server: Server) -> None:
    # The pid is recorded before the wait for readiness, so a server that never gets
    # ready is still stopped by `down`.
    server.start_process()
    stack.save()
    server.wait_ready()


def up(state_dir: Path, model: str, say: Say) -> DemoStack:
    """The running stack: the recorded one when all of it is up, else a fresh one after
    stopping whatever is left of the old."""
    previous = load(state_dir)
    if previous is not None and previous.is_up():
        say("reusing the stack that is already running")
        return previous
    if previous is not None or state_dir.exists():
        say("an earlier stack is not fully up: stopping what is left and starting afresh")
        down(state_dir, say)
    return start(state_dir, model, say)


def down(state_dir: Path, say: Say) -> bool:
    """Stop every recorded part and remove `state_dir`; False when there was nothing."""
    stack = load(state_dir)
    if stack is not None:
        stack.stop(say)
    if not state_dir.exists():
        return stack is not None
    shutil.rmtree(state_dir)
    return True
