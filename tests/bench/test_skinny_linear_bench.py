"""The few-row linear bench on the CPU (interpreted): every plan agrees with F.linear and
the JSON holds one row per (shape, rows): cuBLAS, the default and two swept plans."""

from __future__ import annotations

import json
from pathlib import Path

from bench import skinny_linear


def test_plans_agree_with_cublas_and_rows_are_written(tmp_path: Path) -> None:
    out = tmp_path / "skinny.json"
    skinny_linear.main(["--out", str(out), "--smoke"])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["rows"]) for r in rows] == [("tiny", 1), ("tiny", 5)]
    for row in rows:
        assert row["max_abs_error"] < 1e-4, row
        assert len(row["all_ms"]) == 4 and row["best"] in row["all_ms"]
    assert out.with_suffix(".png").exists()
