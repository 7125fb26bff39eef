"""The slot-load benchmark's setup and both load paths run on the CPU (2 layers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.lora_slot_load import SCENARIOS, main


def test_slot_load_bench_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "slot_load.json"
    main(
        ["--out", str(out), "--device", "cpu", "--layers", "2", "--reps", "1", "--pool-ranks", "16"]
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["scenario"], r["path"]) for r in rows] == [
        (scenario, path) for scenario in SCENARIOS for path in ("old", "new")
    ]
    assert all(r["equal_to_old"] for r in rows if r["path"] == "new")
    assert out.with_suffix(".png").stat().st_size > 0


def test_s3_host_load_bench_runs_against_seaweedfs(s3_server) -> None:
    pytest.importorskip("boto3")  # absent on the GPU machine
    from bench.s3_host_load import measure

    rows = measure(s3_server.endpoint_url, layers=2, repeats=1)
    assert [row["scenario"] for row in rows] == list(SCENARIOS)
    assert all(row["fetch_s_p50"] > 0 and row["insert_s_p50"] > 0 for row in rows)
    assert all(len(row["insert_first_touch_s"]) == len(row["insert_s"]) == 1 for row in rows)
    assert all(row["fetch_into_host_cache_s_p50"] > 0 for row in rows)
