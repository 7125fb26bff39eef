"""The MLA prefill bench on the CPU (interpreted, tiny heads): both ways agree with the
reference, and every case is timed."""

from __future__ import annotations

import json
from pathlib import Path

from bench import mla_prefill


def test_both_ways_match_the_reference_and_every_case_is_timed(tmp_path: Path) -> None:
    out = tmp_path / "mla_prefill.json"
    mla_prefill.main(["--out", str(out), "--smoke"])
    rows = json.loads(out.read_text())["rows"]
    assert [row["case"] for row in rows] == ["2 prompts", "chunk on prefix"]
    for row in rows:
        for way in mla_prefill.WAYS:
            assert row[f"{way}_max_rel_diff"] <= 1e-5, row  # fp32 on the CPU
            assert row[f"{way}_gpu_ms"] > 0 and row[f"{way}_host_ms"] > 0
    assert out.with_suffix(".png").exists()
