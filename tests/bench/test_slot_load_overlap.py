"""The slot-load overlap benchmark runs its whole setup on the CPU (2 layers, 2 loads)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.slot_load_overlap import main


def test_slot_load_overlap_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "overlap.json"
    meta = main(
        ["--out", str(out), "--device", "cpu", "--layers", "2", "--loads", "3", "--reps", "2"]
    )
    written = json.loads(out.read_text())
    assert written["meta"] == meta
    assert [row["rep"] for row in written["rows"]] == [0, 1]
    # Every slot holds the same adapter once its load is done.
    assert meta["loaded_slots_equal"] is True
    assert meta["adapter_mib"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
