"""The grouped-GEMM tile bench on the CPU (interpreted, tiny expert shapes): every plan
computes the same products as the model's own plan, timed first (with the LoRA epilogue
too), and the JSON holds one row per plan."""

from __future__ import annotations

import json
from pathlib import Path

from bench import grouped_gemm_tiles


def test_every_plan_matches_the_current_plan(tmp_path: Path) -> None:
    out = tmp_path / "tiles.json"
    grouped_gemm_tiles.main(["--out", str(out), "--smoke"])
    rows = json.loads(out.read_text())["rows"]
    # The model's plan at 4 tokens (16-row tiles) and three prefill plans × (gate_up, down).
    assert len(rows) == 4 * 2
    assert {row["block_m"] for row in rows} == {16, 64, 128}
    _assert_model_plan_first(rows)
    for row in rows:
        assert row["max_rel_diff_vs_current"] <= 1e-5, row  # fp32 on the CPU
        assert row["ms"] > 0 and row["tflops"] > 0
    assert out.with_suffix(".png").exists()


def test_lora_rows_time_every_plan_with_the_epilogue(tmp_path: Path) -> None:
    out = tmp_path / "tiles_lora.json"
    grouped_gemm_tiles.main(["--out", str(out), "--smoke", "--lora"])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 * 2
    for row in rows:
        assert row["lora_adapters"] == 3 and row["lora_ms"] > 0
        assert row["lora_max_rel_diff_vs_current"] <= 1e-5, row  # fp32 on the CPU
        assert row["lora_rel_delta"] > 1e-3, row  # the epilogue added the adapters' term
    # bf16 (the smoke's scheme) runs one plan with and without the epilogue.
    for gemm in ("gate_up", "down"):
        marked = [row["model_plan_with_lora"] for row in rows if row["gemm"] == gemm]
        assert marked == [True] + [False] * (len(marked) - 1), marked


def test_decode_plans_use_the_models_row_tile_and_report_bandwidth(tmp_path: Path) -> None:
    out = tmp_path / "tiles_decode.json"
    grouped_gemm_tiles.main(["--out", str(out), "--smoke", "--decode"])
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert len(rows) == 2 * 2  # two tile plans × (gate_up, down), the model's among them
    assert {row["block_m"] for row in rows} == {16}  # moe_block_m of 4 tokens
    _assert_model_plan_first(rows)
    assert result["meta"]["copy_gb_per_s"] > 0
    for row in rows:
        assert row["max_rel_diff_vs_current"] <= 1e-5, row
        assert row["weight_gb_per_s"] > 0 and row["fraction_of_copy_bw"] > 0


def _assert_model_plan_first(rows: list[dict]) -> None:
    """Each GEMM's rows start with the model's own plan, the one the others are timed
    against, and no other row is marked as it."""
    for gemm in ("gate_up", "down"):
        mine = [row for row in rows if row["gemm"] == gemm]
        assert mine[0]["model_plan"] and mine[0]["speedup_vs_current"] == 1.0, mine[0]
        assert not any(row["model_plan"] for row in mine[1:]), mine
