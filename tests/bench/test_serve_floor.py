"""The serving ratios' ceilings from the bytes floor (bench/serve_floor.py)."""

from __future__ import annotations

import json
import re

import pytest

from adapter_store.model_shapes import ModuleShape
from bench import summary
from bench.serve_floor import decode_floor, main, run_ceiling, targeted_shapes

SHAPES = {
    "attn.o": ModuleShape("attn.o", 10, (8,), None, (0, 1)),
    "moe.down": ModuleShape("moe.down", 4, (6,), 4, (1,)),
}


def test_run_ceiling_weighs_the_decode_floors_by_decode_share():
    assert run_ceiling(0.7, 0.2, 0.0) == pytest.approx(1 / (0.3 + 0.7 * 1.2))
    assert run_ceiling(0.5, 0.1, 0.1) == pytest.approx(1.0)
    assert run_ceiling(1.0, 0.25, 0.0) == pytest.approx(0.8)


def test_one_adapter_is_one_distinct_adapter_in_every_batch():
    # Per layer and adapter: rank 2 · (10 + 8) · 2 bytes = 72; two layers.
    distinct, floor = decode_floor(
        {"attn.o": SHAPES["attn.o"]}, 1000.0, 2, 2, 2, batch=16, adapters=1,
        popularity="zipf", draws=5,
    )  # fmt: skip
    assert distinct == 1.0 and floor == pytest.approx(144 / 1000)


def test_more_adapters_in_a_batch_read_more_bytes():
    few = decode_floor(SHAPES, 1e6, 4, 2, 2, 64, 2, "uniform", 20)
    many = decode_floor(SHAPES, 1e6, 4, 2, 2, 64, 1000, "uniform", 20)
    assert few[0] == pytest.approx(2.0) and many[0] > 40
    assert many[1] > 10 * few[1]


def test_adapters_without_routed_experts_leave_the_moe_modules_out():
    assert set(targeted_shapes(SHAPES, "all")) == {"attn.o", "moe.down"}
    assert set(targeted_shapes(SHAPES, "no-routed")) == {"attn.o"}


def test_the_v2_lite_counts_and_ceilings(tmp_path):
    """On the benchmark's model (built on the meta device): routed-expert adapters cost more
    than the rest, more distinct adapters cost more, and the ceilings are below 1."""
    out = tmp_path / "floor.json"
    main(["--out", str(out), "--draws", "3"])
    data = json.loads(out.read_text())
    floors = {(r["modules"], r["adapters"], r["popularity"]): r["floor_overhead"]
              for r in data["rows"]}  # fmt: skip
    assert floors[("all", 1000, "zipf")] > floors[("all", 8, "zipf")] > 0
    assert floors[("all", 32, "uniform")] > 5 * floors[("no-routed", 32, "uniform")] > 0
    for ceilings in data["meta"]["ceilings"].values():
        assert all(0.5 < value < 1 for value in ceilings.values())
    assert data["meta"]["command"] == f"python -m bench.serve_floor --out {out} --draws 3"
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", data["meta"]["revision"])
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_summary_shows_the_ceilings_beside_the_serving_goals(tmp_path):
    out = tmp_path / "floor.json"
    main(["--out", str(out), "--draws", "2"])
    ceilings = json.loads(out.read_text())["meta"]["ceilings"]
    lines = {line.target.strip(): line for line in summary.serving_ceiling_lines(out)}
    line = lines["ceiling from the LoRA bytes, N=32 uniform ÷ no LoRA, rank 16, adapters on all"]
    assert line.measured == f"{ceilings['all']['n32_uniform_vs_no_lora']:.3f}"
    assert line.met is None  # a bound, not a measurement
    assert (
        "ceiling from the LoRA bytes, N=1000 zipf ÷ N=8 zipf, rank 16, adapters on no-routed"
        in lines
    )
    missing = list(summary.serving_ceiling_lines(tmp_path / "absent.json"))
    assert [m.measured for m in missing] == ["not run"]
