"""The prefill linear-LoRA bench on the CPU (interpreted, tiny widths): both placements of
the expand compute the same output, and the JSON holds one row per module."""

from __future__ import annotations

import json
from pathlib import Path

from bench import prefill_linear_lora


def test_expand_first_and_after_agree_for_every_module(tmp_path: Path) -> None:
    out = tmp_path / "prefill_linear_lora.json"
    prefill_linear_lora.main(["--out", str(out), "--smoke"])
    rows = json.loads(out.read_text())["rows"]
    assert [row["module"] for row in rows] == [m[0] for m in prefill_linear_lora.MODULES]
    for row in rows:
        assert row["max_rel_diff"] <= 1e-5, row  # fp32 on the CPU
        assert row["first_us"] > 0 and row["after_us"] > 0
    assert out.with_suffix(".png").exists()
