"""A server recorded by one run is found again by the next, and a recycled pid is not
taken for it."""

from __future__ import annotations

import subprocess

from tools.stack import AdoptedProcess, ServiceProcess, from_record, start_ticks, to_record


def test_record_round_trip_and_stop(tmp_path) -> None:
    server = ServiceProcess("sleeper", ["--flag"], tmp_path, port=12345, env={"A": "1"})
    server.process = subprocess.Popen(["sleep", "60"])
    try:
        record = to_record(server)
        again = from_record(ServiceProcess, record)
        assert (again.module, again.args, again.workdir, again.port, again.env) == (
            "sleeper",
            ["--flag"],
            tmp_path,
            12345,
            {"A": "1"},
        )
        assert again.process.pid == server.process.pid
        assert again.process.poll() is None
        assert again.stop(grace_s=5) == 0
        assert server.process.wait(5) != 0  # it was signalled
        assert again.process.poll() is not None
    finally:
        server.process.kill()


def test_other_start_time_or_zombie_is_not_running() -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        started = start_ticks(child.pid)
        assert started is not None
        assert AdoptedProcess(child.pid, started).poll() is None
        assert AdoptedProcess(child.pid, started - 1).poll() == 0  # a recycled pid
        child.kill()
        zombie = AdoptedProcess(child.pid, started)  # killed, not yet reaped by its parent
        assert zombie.wait(5) == 0
    finally:
        child.kill()
        child.wait()
