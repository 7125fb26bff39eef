"""Background client traffic against a store while a test injects faults: each operation
runs in its own thread in a loop, answers go into a Ledger, anything other than an RPC
error (a wrong sha256, a crash in the test) stops the traffic and fails the test."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import grpc

from tests.reliability.conftest import Ledger, stub_of

Operation = Callable[[object, int], None]  # (stub, iteration) -> None; raises RpcError


class Traffic:
    def __init__(self, address: str, ledger: Ledger, operations: dict[str, Operation]) -> None:
        self._address = address
        self._ledger = ledger
        self._operations = operations
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.successes: Counter[str] = Counter()
        self.errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._loop, args=(name, op), daemon=True)
            for name, op in operations.items()
        ]

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        if self.errors:
            raise self.errors[0]

    def _loop(self, name: str, operation: Operation) -> None:
        iteration = 0
        with grpc.insecure_channel(self._address) as channel:
            stub = stub_of(channel)
            while not self._stop.is_set():
                iteration += 1
                try:
                    operation(stub, iteration)
                except grpc.RpcError as error:
                    self._ledger.fail(name, error)
                    time.sleep(0.2)  # a client backing off, not a busy loop
                    continue
                except BaseException as error:  # noqa: BLE001 - reported by __exit__
                    self.errors.append(error)
                    self._stop.set()
                    return
                with self._lock:
                    self.successes[name] += 1

    def total(self, name: str) -> int:
        with self._lock:
            return self.successes[name]

    def wait_for(self, name: str, more: int, timeout_s: float) -> bool:
        """Block until `name` succeeded `more` more times; False on timeout or failure."""
        target = self.total(name) + more
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.errors:
            if self.total(name) >= target:
                return True
            time.sleep(0.05)
        return False
