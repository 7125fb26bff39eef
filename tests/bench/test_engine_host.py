"""The engine host-time bench on the tiny model with the model run stubbed out: both cases
time decode steps, and the part outside the outputs' flush is a part of the step."""

from __future__ import annotations

import json
from pathlib import Path

from bench import engine_host


def test_decode_steps_are_timed_with_and_without_adapters(tmp_path: Path) -> None:
    out = tmp_path / "engine_host.json"
    engine_host.main(["--out", str(out), "--sequences", "6", "--new-tokens", "8", "--repeats", "1"])
    rows = json.loads(out.read_text())["rows"]
    assert [row["adapters"] for row in rows] == [0, 3]
    for row in rows:
        assert 0 < row["critical_median_ms"] < row["median_ms"]
