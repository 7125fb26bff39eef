"""The MoE-LoRA prefill bench on the CPU (interpreted, tiny expert shapes): the three ways
run, the epilogue's output equals the after-GEMM kernels', and the JSON holds every case."""

from __future__ import annotations

import json
from pathlib import Path

from bench import moe_lora_prefill


def test_in_gemm_matches_after_and_every_case_is_timed(tmp_path: Path) -> None:
    out = tmp_path / "moe_lora_prefill.json"
    moe_lora_prefill.main(["--out", str(out), "--smoke"])
    rows = json.loads(out.read_text())["rows"]
    assert [(row["tokens"], row["adapters"]) for row in rows] == [(40, 1), (40, 3)]
    for row in rows:
        assert row["max_rel_diff"] <= 1e-5, row  # fp32 on the CPU
        assert min(row["base_ms"], row["after_ms"], row["in_gemm_ms"]) > 0
    assert out.with_suffix(".png").exists()
