"""The decode-overhead benchmark's per-case arithmetic: overhead, floors, step ÷ floor."""

from __future__ import annotations

import pytest

from bench.lora_decode_overhead import StepRow


def test_a_case_row_divides_the_lora_step_by_the_bytes_of_base_and_adapters() -> None:
    # 2 GB of base weights and 0.25 GB of adapters at 1 TB/s: a 2.25 ms floor, of which
    # the adapters' 0.25 ms.
    row = StepRow(batch=64, adapters=32, base_us=3000.0, lora_us=3750.0,
                  base_bytes=2e9, lora_bytes=0.25e9)  # fmt: skip
    bandwidth = 1e12
    assert row.overhead == pytest.approx(0.25)
    assert row.floor_overhead == pytest.approx(0.125)
    assert row.added_over_floor(bandwidth) == pytest.approx(3.0)
    assert row.lora_step_over_floor(bandwidth) == pytest.approx(3750 / 2250)
    recorded = row.as_dict(bandwidth)
    assert recorded["lora_step_over_floor"] == pytest.approx(3750 / 2250)
    assert recorded["added_over_floor"] == pytest.approx(3.0)
