"""The expert-selection bench on the CPU (interpreted): both ways pick the same experts
for every router and the JSON holds one row per (router, token count)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import moe_routing


def test_both_ways_pick_the_same_experts(tmp_path: Path) -> None:
    out = tmp_path / "routing.json"
    moe_routing.main(["--out", str(out), "--smoke"])
    rows = json.loads(out.read_text())["rows"]
    assert [r["router"] for r in rows] == list(moe_routing.ROUTERS)
    for row in rows:
        assert row["same_experts"], row
        assert row["ref_ms"] > 0 and row["fused_ms"] > 0
    assert out.with_suffix(".png").exists()
