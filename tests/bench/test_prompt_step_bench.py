"""`bench.prompt_step` on the CPU: its prompt steps hold one prompt beside the decodes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench import prompt_step


def test_prompt_step_smoke(tmp_path: Path) -> None:
    out = tmp_path / "prompt_step.json"
    prompt_step.main(["--out", str(out), "--smoke", "--paths", "eager"])
    results = json.loads(out.read_text())
    meta, rows = results["meta"], results["rows"]
    assert [row["arm"] for row in rows] == ["lora", "base"]
    for row in rows:
        # One new prompt a step beside every running decode, and a decode-only step after.
        assert row["prompt_step_tokens"] == [meta["prompt_len"] + meta["decodes"]]
        assert len(row["decode_step_ms"]) == 1 and row["prompt_step_ms_min"] > 0
        assert row["path"] == ["eager"]
        assert list(row["prompt_step_ms_median_by_path"]) == ["eager"]
    assert meta["paths"] == ["eager"]
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", meta["revision"])  # via run_meta
    assert out.with_suffix(".png").stat().st_size > 0


def test_summary_takes_each_paths_median_apart() -> None:
    result = {
        "prompt_step_ms": [10.0, 20.0, 12.0, 22.0, 14.0],
        "path": ["graphs", "eager", "graphs", "eager", "graphs"],
        "decode_step_ms": [1.0] * 5,
        "profiled": {"graphs": {"gpu_busy_ms": 4.0, "gpu_events": 9}},
    }
    row = prompt_step.summary("lora", 0, result)
    assert row["prompt_step_ms_median_by_path"] == {"graphs": 12.0, "eager": 21.0}
    assert row["wall_over_busy_by_path"] == {"graphs": 3.0}
    assert row["prompt_step_ms_min"] == 10.0


def test_union_ms_counts_overlapping_spans_once() -> None:
    spans = [(0.0, 1000.0), (500.0, 1500.0), (3000.0, 3500.0), (3100.0, 3200.0)]
    assert prompt_step.union_ms(spans) == 2.0
