"""The summary table reads bench.lora_decode_overhead's JSON as that benchmark writes it
(kernel sets under "variants"), with the ceiling the LoRA bytes allow beside each case."""

from __future__ import annotations

import json
from pathlib import Path

from bench import summary


def _write(folder: Path, variants: dict) -> None:
    payload = {"layers": 8, "variants": variants}
    (folder / "lora_decode_overhead.json").write_text(json.dumps(payload))


def _by_target(folder: Path) -> dict[str, summary.Line]:
    return {line.target.strip(): line for line in summary.decode_lines(folder)}


def test_decode_overhead_lines_take_the_default_kernel_set(tmp_path: Path) -> None:
    row = {"batch": 64, "adapters": 32, "base_us": 100.0, "lora_us": 125.0,
           "floor_overhead": 0.125}  # fmt: skip
    serial = {**row, "lora_us": 200.0}
    _write(tmp_path, {
        "serial": {"decode": [serial], "moe": {"ratio": 0.5}},
        "new": {"decode": [row], "moe": {"ratio": 0.1}},
    })  # fmt: skip
    lines = _by_target(tmp_path)
    moe = lines["MoE LoRA cost ÷ base fused MoE, B=64, 8 adapters"]
    assert (moe.measured, moe.met) == ("0.1", True)
    step = lines["decode tok/s with 32 r16 adapters ÷ no LoRA, B=64 [8 layers]"]
    assert (step.measured, step.met) == ("0.800", False)
    ceiling = lines["ceiling from the LoRA bytes, B=64"]
    assert (ceiling.measured, ceiling.met) == ("0.889", None)
    assert lines["decode tok/s with 32 r16 adapters ÷ no LoRA, B=1 [8 layers]"].met is None
    # A file written before the step ÷ floor was recorded shows it as not measured.
    assert lines["decode step ÷ floor, B=64 (32 r16 adapters [8 layers])"].met is None


def test_decode_step_over_floor_with_adapters_is_judged_against_1_5(tmp_path: Path) -> None:
    """Issue 9's step ÷ floor counts the adapters' bytes; the bench records it per case."""
    rows = [
        {"batch": 1, "adapters": 1, "base_us": 10.0, "lora_us": 12.0,
         "lora_step_over_floor": 1.93},
        {"batch": 64, "adapters": 32, "base_us": 100.0, "lora_us": 120.0,
         "lora_step_over_floor": 1.34},
    ]  # fmt: skip
    _write(tmp_path, {"new": {"decode": rows, "moe": {"ratio": 0.1}}})
    lines = _by_target(tmp_path)
    one = lines["decode step ÷ floor, B=1 (1 r16 adapters [8 layers])"]
    assert (one.measured, one.met) == ("1.93", False)
    batch = lines["decode step ÷ floor, B=64 (32 r16 adapters [8 layers])"]
    assert (batch.measured, batch.met) == ("1.34", True)
    assert "decode step ÷ floor, B=256 (32 r16 adapters [8 layers])" not in lines


def test_decode_overhead_missing_is_shown_as_not_run(tmp_path: Path) -> None:
    lines = _by_target(tmp_path)
    assert lines["MoE LoRA cost ÷ base fused MoE, B=64, 8 adapters"].measured == "not run"
    assert lines["decode tok/s with 32 r16 adapters ÷ no LoRA, B=256"].measured == "not run"


def test_cold_ttft_estimate_takes_the_by_parts_fetch_not_the_legacy_one(tmp_path: Path) -> None:
    """The S3 part of the estimate is the replica's path (parts verified as they arrive);
    the "… whole" rows (a record without part digests) are shown but not summed."""
    stats = {"n": 2, "p99_ms": 0.0}
    cold = tmp_path / "cold.json"
    cold.write_text(json.dumps({"stats": {
        "s3 x8": {**stats, "p50_ms": 500.0},
        "s3 x8 whole": {**stats, "p50_ms": 400.0},
        "store FetchAdapter": {**stats, "p50_ms": 300.0},
    }}))  # fmt: skip
    online = {"cold": {"ttft_added": {"host-cold": {"p50_ms": 5.0}}}}
    (tmp_path / "serve_online.json").write_text(json.dumps(online))
    lines = {line.target: line for line in summary.cold_path_lines(cold, tmp_path)}
    estimate = lines["TTFT added by a cold adapter from S3, p50 estimate (ms)"]
    assert estimate.measured == "505" and estimate.met is False
    assert "s3 x8 whole → host p50 / p99 (ms, CPU machine)" in lines
